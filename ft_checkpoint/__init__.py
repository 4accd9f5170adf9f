"""ft-checkpoint: fault-tolerant, asynchronous checkpointing for PyTorch training.

The public names are imported lazily, so ``import ft_checkpoint.storage`` (the CLI, tools) does not
import torch.

Example:
    >>> from ft_checkpoint import CheckpointManager
    >>> ckpt = CheckpointManager("memory://doc/init", interval=100)
    >>> ckpt.resume({}) is None
    True
    >>> ckpt.close()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointConfig": "ft_checkpoint.config",
    "parse_duration": "ft_checkpoint.units",
    "CheckpointManager": "ft_checkpoint.manager",
    "CheckpointEngine": "ft_checkpoint.engine",
    "SaveStats": "ft_checkpoint.engine",
    "Storage": "ft_checkpoint.storage",
    "SaveContext": "ft_checkpoint.policy",
    "SavePolicy": "ft_checkpoint.policy",
    "EveryNSteps": "ft_checkpoint.policy",
    "EveryInterval": "ft_checkpoint.policy",
    "OnPreemption": "ft_checkpoint.policy",
    "AnyOf": "ft_checkpoint.policy",
    "Manifest": "ft_checkpoint.layout",
    "Journal": "ft_checkpoint.journal",
    "read_journal": "ft_checkpoint.journal",
    "check_step": "ft_checkpoint.layout",
    "apply_retention": "ft_checkpoint.retention",
    "FTCheckpointError": "ft_checkpoint.errors",
    "ConfigError": "ft_checkpoint.errors",
    "StorageError": "ft_checkpoint.errors",
    "CheckpointCorruptError": "ft_checkpoint.errors",
    "SaveError": "ft_checkpoint.errors",
    "LeaseError": "ft_checkpoint.errors",
    "StateMismatchError": "ft_checkpoint.errors",
    "Preempted": "ft_checkpoint.errors",
    "DeepSpeedState": "ft_checkpoint.deepspeed",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from ft_checkpoint.config import CheckpointConfig
    from ft_checkpoint.deepspeed import DeepSpeedState
    from ft_checkpoint.engine import CheckpointEngine, SaveStats
    from ft_checkpoint.errors import (
        CheckpointCorruptError,
        ConfigError,
        FTCheckpointError,
        LeaseError,
        Preempted,
        SaveError,
        StateMismatchError,
        StorageError,
    )
    from ft_checkpoint.journal import Journal, read_journal
    from ft_checkpoint.layout import Manifest, check_step
    from ft_checkpoint.manager import CheckpointManager
    from ft_checkpoint.policy import AnyOf, EveryInterval, EveryNSteps, OnPreemption, SaveContext, SavePolicy
    from ft_checkpoint.retention import apply_retention
    from ft_checkpoint.storage import Storage
    from ft_checkpoint.units import parse_duration


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ft_checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
