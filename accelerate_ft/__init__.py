"""accelerate-ft: fault-tolerant, asynchronous checkpoints for Hugging Face Accelerate training loops.

One object adds them to a loop, on top of the ``ft_checkpoint`` core: it resumes at construction and
saves in the background at optimizer-step boundaries.

Example:
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from accelerate_ft import FaultTolerantCheckpoint
    >>> acc = Accelerator(cpu=True)
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    >>> with FaultTolerantCheckpoint(acc, "memory://doc/package", interval=1) as ft:
    ...     for epoch in ft.epochs(1):
    ...         for x in ft.batches(loader):
    ...             acc.backward(model(x).sum()); opt.step(); opt.zero_grad()
    >>> ft.global_step
    2
"""

from __future__ import annotations

from accelerate_ft.checkpoint import FaultTolerantCheckpoint
from accelerate_ft.plugin import FaultTolerantCheckpointPlugin

__all__ = ["FaultTolerantCheckpoint", "FaultTolerantCheckpointPlugin"]
