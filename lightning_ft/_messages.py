"""What the callback tells the user through Lightning's rank-zero channel: the start of a fit (fresh or
resumed, when the next save is due), a resumed run that had finished, a fit that saved nothing, a resume on
another number of ranks.

Example:
    >>> from ft_checkpoint import CheckpointManager
    >>> with CheckpointManager("memory://doc/messages", interval=50, announce=False) as manager:
    ...     next_save(manager, 120, first=False)
    'next save at step 150 (every 50 steps)'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ft_checkpoint.policies import interval
from ft_checkpoint.units import human_seconds, plural
from lightning_ft import _lightning_internals as internals

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ft_checkpoint import CheckpointManager

PREFIX = "FaultTolerantCheckpoint: "


def announce_start(trainer: pl.Trainer, manager: CheckpointManager, *, resumed: bool, resumed_from: int | None) -> None:
    """Where training starts (resumed, fresh, or at ``fit(ckpt_path=...)``'s step), when the next save is due, and the
    fast tier (if any) and when it saves."""
    if resumed:
        where = (f"resuming from step {trainer.global_step} (epoch {trainer.current_epoch}, "
                 f"{plural(internals.batches_done_in_epoch(trainer), 'batch', 'batches')} of it done; {manager.loaded})")
    elif resumed_from is None and trainer.ckpt_path is None:
        where = f"no checkpoint in {manager.storage.url} yet: starting fresh"
    else:
        where = f"training starts at step {trainer.global_step}"
    fast = f"; {manager.fast.describe()}: {interval.describe_policy(manager.fast.policy)}" if manager.fast else ""
    rank_zero_info(f"{PREFIX}{where}; {next_save(manager, trainer.global_step, first=not resumed)}{fast}")


def announce_finished(trainer: pl.Trainer, manager: CheckpointManager) -> None:
    """A fit that resumed a run which had reached its end (``max_epochs``/``max_steps``): it trains no step."""
    rank_zero_info(f"{PREFIX}resuming from step {trainer.global_step} ({manager.loaded}): the run had reached its "
                   f"end, so this fit trains no step")


def announce_no_save(trainer: pl.Trainer, manager: CheckpointManager, *, seconds: float,
                     resumed_from: int | None) -> None:
    """A fit that ended without a save: say so, where the newest checkpoint is, and when saves would come."""
    newest = f"the newest checkpoint is still step {resumed_from}" if resumed_from is not None else \
        f"there is no checkpoint in {manager.storage.url}"
    rank_zero_info(f"{PREFIX}this fit saved no checkpoint in its {human_seconds(seconds)} ({newest}); "
                   f"{next_save(manager, trainer.global_step, first=False)}")


def next_save(manager: CheckpointManager, step: int, *, first: bool) -> str:
    """When ``manager``'s policy saves next after ``step``, in words (for the adaptive interval: as planned now)."""
    return interval.next_save(manager.policy, manager.metrics(), step, first=first)


def warn_world_size(trainer: pl.Trainer, saved: int | None, skip: int) -> None:
    """Warn when the checkpoint was saved by another number of ranks: the data position is not exact."""
    if saved is None or saved == trainer.world_size:
        return
    rank_zero_warn(
        f"{PREFIX}resuming from step {trainer.global_step}, saved by {_ranks(saved)}, on "
        f"{_ranks(trainer.world_size)}. Exact: the model, optimizer and LR scheduler states, the step and epoch "
        f"counters, callback and datamodule state. Not exact: the data of epoch {trainer.current_epoch}: it "
        f"continues after batch {skip} of the {trainer.num_training_batches} each rank now gets per epoch, so "
        f"some of this epoch's samples are trained on twice and others not at all; later epochs are complete "
        f"but split and ordered differently than on {_ranks(saved)}; rank r continues with the RNG states "
        f"saved by rank r mod {saved}; the global batch size changes with the rank count. HINT: restart on "
        f"{_ranks(saved)} to resume exactly")


def warn_accumulation(trainer: pl.Trainer, saved: int | None) -> None:
    """Warn when the checkpoint was saved with another ``accumulate_grad_batches`` (None: an older checkpoint)."""
    if saved is not None and saved != trainer.accumulate_grad_batches:
        rank_zero_warn(
            f"{PREFIX}resuming from step {trainer.global_step}, saved with accumulate_grad_batches={saved}, in a run "
            f"with accumulate_grad_batches={trainer.accumulate_grad_batches}: the model, optimizer and counters are "
            f"exact, but from here each step takes another number of batches, so the steps per epoch, step-interval "
            f"LR schedules and max_steps cover other data than in the run that saved (not exact). HINT: restart with "
            f"accumulate_grad_batches={saved} to resume exactly")


def warn_cycled_loaders(trainer: pl.Trainer, loaders: list[Any]) -> None:
    """Warn about train ``loaders`` that started over inside the batches a resume skipped (``CombinedLoader`` mode
    ``max_size_cycle``) and drew their new order from the torch RNG: it was not the state the uninterrupted run drew
    it from."""
    if loaders:
        rank_zero_warn(
            f"{PREFIX}{len(loaders)} of the train loaders started over inside the {internals.batches_done_in_epoch(trainer)} "
            f"batches of epoch {trainer.current_epoch} done before the resume (CombinedLoader mode 'max_size_cycle'), "
            f"drawing their new order from the torch RNG: not from the state the uninterrupted run drew it from, so "
            f"their batches differ for the rest of this epoch (not exact). HINT: give each such DataLoader its own "
            f"generator=torch.Generator().manual_seed(s): it is restored exactly")


def warn_stateful_loaders_with_workers(trainer: pl.Trainer) -> None:
    """Warn when train loaders that restore their own position (torchdata's ``StatefulDataLoader``) have workers:
    each worker's random state is not restored with it."""
    if any(getattr(dl, "num_workers", 0) > 0 for dl in internals.train_loaders(trainer)):
        rank_zero_warn(
            f"{PREFIX}the train loader restores its own position (state_dict/load_state_dict: Lightning resumes it), "
            f"but not its workers' random state: random numbers drawn in Dataset.__getitem__ (augmentation) differ "
            f"from an uninterrupted run's for the rest of epoch {trainer.current_epoch} (not exact). HINT: a plain "
            f"torch DataLoader is resumed exactly, its workers included")


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"
