"""What the callback saves at a step: Lightning's own checkpoint dict translated for the core, where the
epoch's data order came from, the world size, and under ``DeepSpeedStrategy`` the engine (which saves model
and optimizer as DeepSpeed's own files, as Lightning's DeepSpeed checkpoints do).

Example:
    >>> Snapshots().engine_state(type("T", (), {"strategy": None})())   # not DeepSpeed: no engine part
    {}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_ft import _lightning_internals as internals
from lightning_ft._data import EpochStart
from lightning_ft._state import FROZEN, METRICS, frozen_parameters, rank0_buffers, to_core

if TYPE_CHECKING:
    import lightning.pytorch as pl


class Snapshots:
    """Takes the state to save; keeps one DeepSpeed wrapper per engine (it reuses its staging buffers)."""

    def __init__(self) -> None:
        self._deepspeed: Any = None

    def take(self, trainer: pl.Trainer, epoch_start: EpochStart | None,
             loops: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state to save: Lightning's checkpoint dict (``loops`` replaces its loop state: a safe point's),
        what the epoch's data order came from, the world size, and the engine part (see :meth:`engine_state`)."""
        checkpoint = internals.dump_checkpoint(trainer)
        if loops is not None:
            checkpoint["loops"] = loops
        metrics = internals.metric_states(trainer.lightning_module) if loops is None else {}
        if metrics:  # not at a safe point (an exception's save): the metrics counted batches after it
            checkpoint[METRICS] = metrics
        checkpoint[FROZEN] = frozen_parameters(trainer.lightning_module)
        engine = self.engine_state(trainer)
        if engine:  # the engine saves model and optimizer itself, as in Lightning's own DeepSpeed checkpoints
            checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        elif isinstance(trainer.strategy, DDPStrategy) and trainer.world_size > 1:
            checkpoint["state_dict"] = rank0_buffers(checkpoint["state_dict"], trainer.lightning_module)
        loader = epoch_start.to_state() if epoch_start is not None else {}
        loader.update(world_size=trainer.world_size, accumulate_grad_batches=trainer.accumulate_grad_batches)
        return {"lightning": to_core(checkpoint), "loader": loader, **engine}

    def engine_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Under DeepSpeed ``{"deepspeed": DeepSpeedState(engine)}``, else ``{}``. The engine exists once
        ``strategy.setup`` ran."""
        strategy = trainer.strategy
        if not isinstance(strategy, DeepSpeedStrategy):
            return {}
        engine = strategy.deepspeed_engine
        if self._deepspeed is None or self._deepspeed.engine is not engine:
            from ft_checkpoint.integrations.deepspeed import DeepSpeedState

            self._deepspeed = DeepSpeedState(engine, load_module_strict=trainer.lightning_module.strict_loading,
                                             load_lr_scheduler_states=False,  # Lightning restores its schedulers
                                             exclude_frozen_parameters=strategy.exclude_frozen_parameters)
        return {"deepspeed": self._deepspeed}
