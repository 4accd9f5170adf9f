"""The plugin dataclass: checkpoint settings the Accelerate way, from arguments, env vars or a YAML file.

Like Accelerate's ``FullyShardedDataParallelPlugin`` (which falls back to ``FSDP_*``), every field
left at None is filled in ``__post_init__`` from ``FT_CHECKPOINT_<FIELD>`` env vars, then from the
YAML file named by ``FT_CHECKPOINT_CONFIG``. That is how ``accelerate launch`` passes settings to a
script without a code change::

    FT_CHECKPOINT_DIRPATH=s3://bucket/run FT_CHECKPOINT_INTERVAL=500 \\
        accelerate launch --multi_gpu --num_processes 2 train.py

Accelerate's own config file rejects unknown keys, so ours is a separate file (see
``examples/accelerate_ft.yaml``). Parsing and validation are the core's
(:meth:`ft_checkpoint.CheckpointConfig.from_env`); this class only gives them Accelerate's shape.

Example:
    >>> plugin = FaultTolerantCheckpointPlugin(dirpath="/tmp/ft-doc/run", interval=200)
    >>> plugin.interval, plugin.keep_last
    (200, 3)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ft_checkpoint import CheckpointConfig

# One field per core setting, each defaulting to None ("not given"): generated, so the plugin always
# offers exactly the settings of ``CheckpointConfig`` (documented there) and never drifts from it; a field the
# core keeps out of its repr (``signing_key``) stays out of the plugin's.
_Settings = dataclasses.make_dataclass(
    "_Settings", [(f.name, f.type if str(f.type).endswith("| None") else f"{f.type} | None",
                   dataclasses.field(default=None, repr=f.repr)) for f in dataclasses.fields(CheckpointConfig)],
    kw_only=True)

SETTINGS = tuple(f.name for f in dataclasses.fields(CheckpointConfig))
"""The names a plugin (and ``FaultTolerantCheckpoint(**config)``) accepts."""


@dataclasses.dataclass(kw_only=True)
class FaultTolerantCheckpointPlugin(_Settings):  # type: ignore[valid-type, misc]  # a generated base
    """Settings of :class:`~accelerate_ft.FaultTolerantCheckpoint`; None means "from env or file".

    Its fields are those of :class:`ft_checkpoint.CheckpointConfig`, each defaulting to None:
    ``dirpath``, ``interval``, ``keep_last``, ``storage_options``, ``async_save``, ... After
    construction every field holds its resolved value (explicit > ``FT_CHECKPOINT_<FIELD>`` env var
    > the file in ``FT_CHECKPOINT_CONFIG`` > default), and ``config`` the validated core config.

    Example:
        >>> import os
        >>> os.environ["FT_CHECKPOINT_DIRPATH"] = "/tmp/ft-doc/from-env"
        >>> FaultTolerantCheckpointPlugin().dirpath
        '/tmp/ft-doc/from-env'
        >>> FaultTolerantCheckpointPlugin(dirpath="/tmp/ft-doc/explicit").dirpath   # explicit wins
        '/tmp/ft-doc/explicit'
        >>> del os.environ["FT_CHECKPOINT_DIRPATH"]
    """

    config: CheckpointConfig = dataclasses.field(init=False, repr=False)
    """The resolved, validated core config."""

    def __post_init__(self) -> None:
        self.config = CheckpointConfig.from_env(**{name: getattr(self, name) for name in SETTINGS})
        for name in SETTINGS:
            setattr(self, name, getattr(self.config, name))

    def manager_kwargs(self) -> dict[str, Any]:
        """The resolved settings as keyword arguments of :class:`ft_checkpoint.CheckpointManager`."""
        return {name: getattr(self.config, name) for name in SETTINGS}
