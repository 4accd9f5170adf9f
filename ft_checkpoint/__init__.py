"""ft-checkpoint: fault-tolerant, asynchronous checkpointing for PyTorch training.

The public names are imported lazily, so ``import ft_checkpoint.store.storage`` (the CLI, tools) does not
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

from ft_checkpoint._version import __version__

_EXPORTS = {
    "CheckpointManager": "ft_checkpoint.manager",
    "CheckpointConfig": "ft_checkpoint.config",
    "SaveStats": "ft_checkpoint.save.engine",
    "SavePolicy": "ft_checkpoint.policies.policy",
    "EveryNSteps": "ft_checkpoint.policies.policy",
    "EveryInterval": "ft_checkpoint.policies.policy",
    "OnPreemption": "ft_checkpoint.policies.policy",
    "AnyOf": "ft_checkpoint.policies.policy",
    "DeepSpeedState": "ft_checkpoint.integrations.deepspeed",
    "check_step": "ft_checkpoint.format.layout",
    "read_journal": "ft_checkpoint.run.journal",
    "parse_duration": "ft_checkpoint.units",
    "FTCheckpointError": "ft_checkpoint.errors",
    "ConfigError": "ft_checkpoint.errors",
    "StorageError": "ft_checkpoint.errors",
    "CheckpointCorruptError": "ft_checkpoint.errors",
    "SaveError": "ft_checkpoint.errors",
    "LeaseError": "ft_checkpoint.errors",
    "StateMismatchError": "ft_checkpoint.errors",
    "Preempted": "ft_checkpoint.errors",
}
"""What users call, by name, and its module. Internals (``CheckpointEngine``, ``Storage``, ``Journal``, ``SaveContext``,
``Manifest``, ``apply_retention``, ...) are imported from their own modules."""
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from ft_checkpoint.config import CheckpointConfig
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
    from ft_checkpoint.format.layout import check_step
    from ft_checkpoint.integrations.deepspeed import DeepSpeedState
    from ft_checkpoint.manager import CheckpointManager
    from ft_checkpoint.policies.policy import AnyOf, EveryInterval, EveryNSteps, OnPreemption, SavePolicy
    from ft_checkpoint.run.journal import read_journal
    from ft_checkpoint.save.engine import SaveStats
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
