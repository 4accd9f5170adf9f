"""Frameworks whose objects save themselves as files of their own, which the core does not name.

A module here is named after the framework's top-level package (``deepspeed``) and offers
``is_participant(obj)`` and ``participant(obj, key=..., several=...)``: the manager finds it by the package of
an object's class in a state (see ``ft_checkpoint.state.integration_for``) and wraps that object in the
participant it returns (a files participant: ``stage_files`` at a save, ``load_files`` at a resume).

- ``deepspeed``: a DeepSpeed engine (``DeepSpeedState``), saved and loaded by DeepSpeed's own
  ``save_checkpoint``/``load_checkpoint`` through a checkpoint engine of ours; ``_deepspeed_internals``: the
  private DeepSpeed names relied on, in one place.

May import: every layer of the core; not ``tools`` or ``testing``. Nothing below imports this package.
"""
