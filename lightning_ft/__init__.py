"""ft-checkpoint for PyTorch Lightning: one callback that saves asynchronously and resumes by itself.

Example:
    >>> import lightning.pytorch as pl
    >>> from lightning_ft import FaultTolerantCheckpoint
    >>> trainer = pl.Trainer(callbacks=[FaultTolerantCheckpoint("/tmp/ft-doc-run", interval=100)],
    ...                      logger=False, enable_progress_bar=False)
    >>> # trainer.fit(model) resumes from the newest good checkpoint in /tmp/ft-doc-run, if any
"""

from __future__ import annotations

from lightning_ft.callback import FaultTolerantCheckpoint

__all__ = ["FaultTolerantCheckpoint"]
