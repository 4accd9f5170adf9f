"""The load path: find the newest step that checks, and read it into the state.

- ``resume``: which step (newest committed and verified, every rank agreeing; a step that fails is skipped,
  loudly, for the one before);
- ``loading``: ``StepLoader``, a step's files verified and read straight into the state's tensors.

May import: ``state``, ``policies``, ``run``, ``config``, ``format``, ``store`` and below; not ``save`` (side by side).
"""
