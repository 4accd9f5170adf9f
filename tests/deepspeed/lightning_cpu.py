"""Lightning's DeepSpeedStrategy on CPU ranks, for tests only (Lightning refuses DeepSpeed without CUDA).

Three changes, all here: ``DeepSpeedStrategy.setup_environment`` delegates to ``DDPStrategy``'s (skipping
the CUDA check), ``_validate_device_index_selection`` (which wants device indices 0..n-1) does nothing,
and the strategy is built with ``parallel_devices=[cpu:0] * n`` and gloo. ``test_lightning.py::
test_the_cpu_bypass_still_matches_lightning`` fails, naming this module, when Lightning changes what is bypassed.

Example:
    >>> strategy = cpu_deepspeed_strategy(stage=2, devices=2)   # doctest: +SKIP
    >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies import deepspeed as lightning_deepspeed

CUDA_CHECK = "The DeepSpeed strategy is only supported on CUDA GPUs"
"""What ``DeepSpeedStrategy.setup_environment`` raises on CPU (the check bypassed)."""


def _setup_environment(self: DeepSpeedStrategy) -> None:
    DDPStrategy.setup_environment(self)


def allow_cpu() -> None:
    """Patch Lightning (in this process) so that DeepSpeedStrategy runs on CPU ranks."""
    DeepSpeedStrategy.setup_environment = _setup_environment  # type: ignore[method-assign]
    lightning_deepspeed._validate_device_index_selection = lambda parallel_devices: None


def cpu_deepspeed_strategy(stage: int, devices: int, **kwargs: Any) -> DeepSpeedStrategy:
    """``DeepSpeedStrategy(stage=...)`` on ``devices`` CPU ranks (gloo), with Lightning patched by :func:`allow_cpu`."""
    allow_cpu()
    return DeepSpeedStrategy(stage=stage, parallel_devices=[torch.device("cpu", 0)] * devices,
                             process_group_backend="gloo", **kwargs)
