"""FaultTolerantCheckpoint: asynchronous, verified checkpoints and automatic resume for Lightning.

One callback; ``trainer.fit`` then resumes by itself after a crash, a preemption or a requeue::

    trainer = L.Trainer(callbacks=[FaultTolerantCheckpoint("gs://bucket/run-7", interval=500)])
    trainer.fit(model, datamodule)   # no ckpt_path: newest committed, verified checkpoint, or fresh

What is saved is what ``trainer.save_checkpoint`` saves (model, optimizers, LR schedulers, precision
plugin, loops, other callbacks, datamodule), plus each rank's RNG states and what it takes to put a
plain ``DataLoader`` back at the next batch of the interrupted epoch. Under ``DeepSpeedStrategy`` the
engine saves the model and optimizer as DeepSpeed's own files (``ft_checkpoint.integrations.deepspeed``), as
Lightning's DeepSpeed checkpoints do. When and where to save, the write, the commit and the resume
checks are the core's (:class:`ft_checkpoint.CheckpointManager`).

Example:
    >>> from lightning_ft import FaultTolerantCheckpoint
    >>> cb = FaultTolerantCheckpoint("/tmp/ft-doc-run", interval=100, keep_last=2)
    >>> cb.dirpath
    '/tmp/ft-doc-run'
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ft_checkpoint import CheckpointConfig, CheckpointManager, ConfigError, FTCheckpointError, SavePolicy, SaveStats
from ft_checkpoint.config import DEFAULT_SUBDIR, check_names, given
from ft_checkpoint.errors import Preempted
from ft_checkpoint.format import layout
from ft_checkpoint.format.signing import Signer
from ft_checkpoint.run.journal import started_before
from ft_checkpoint.save.pending_gradients import PendingGradients
from ft_checkpoint.save.snapshot import settle_all as settle_snapshots
from ft_checkpoint.state import set_rng_state
from ft_checkpoint.store.storage import Storage
from lightning_ft import _lightning_internals as internals
from lightning_ft import _messages as messages
from lightning_ft._data import EpochStart, draws_from_torch_rng
from lightning_ft._on_exception import SafePoints, run_within
from lightning_ft._snapshot import Snapshots
from lightning_ft._state import FROZEN, METRICS, check_model_tensors, from_core, restore_frozen

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

PREFIX = "ft_checkpoint/"
"""Prefix of the metrics logged through the trainer's loggers (the same as accelerate_ft's)."""


def check_strategy(strategy: Strategy) -> None:
    """Raise ConfigError unless ``strategy`` is one this callback supports: single device, DDP or DeepSpeed.

    Example:
        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> check_strategy(DDPStrategy())
    """
    if isinstance(strategy, DeepSpeedStrategy):
        if strategy.load_full_weights and strategy.zero_stage_3:
            raise ConfigError(
                "DeepSpeedStrategy(load_full_weights=True) restores ZeRO-3 weights from one consolidated file, while "
                "FaultTolerantCheckpoint resumes from DeepSpeed's own files. HINT: leave load_full_weights off")
        return
    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        return
    raise ConfigError(
        f"FaultTolerantCheckpoint supports single-device, DDP and DeepSpeed training, not {type(strategy).__name__}: "
        "FSDP and ModelParallel need GPUs and are not tested yet. HINT: use strategy='ddp' or DeepSpeedStrategy, or "
        "Lightning's ModelCheckpoint for this run")


class _Lazy(Mapping[str, Any]):
    """A state dict built on first use: ``maybe_save`` reads its state only when it saves."""

    def __init__(self, build: Callable[[], dict[str, Any]]) -> None:
        self._build = build
        self._state: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self._build()
        return self._state

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _restarts(trainer: pl.Trainer) -> bool:
    """Whether ``trainer``'s fit is a restart of a job that ran in the directory of one of its
    FaultTolerantCheckpoints (see :meth:`FaultTolerantCheckpoint._ran_before`)."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    return any(cb._ran_before(trainer) for cb in callbacks if isinstance(cb, FaultTolerantCheckpoint))


class FaultTolerantCheckpoint(Checkpoint):
    """Save training asynchronously through ft-checkpoint and resume ``fit`` from the newest good checkpoint.

    Args:
        dirpath: Local path or fsspec URL (``gs://bucket/run``, ``s3://...``). Default:
            ``FT_CHECKPOINT_DIRPATH`` or the config file, else ``<trainer.default_root_dir>/ft_checkpoints``
            (on several nodes, give a shared path).
        save_on_exception: When training raises (an error, Ctrl-C, a SIGTERM not in ``preemption_signals``),
            also save the state of the last completed step before the exception propagates, unless the
            exception interrupted that step's optimizer update. Under DDP every rank must raise after the same
            step (as on such a SIGTERM, which Lightning turns into an exception on all ranks at the same
            batch); otherwise nothing is saved.
        drain_timeout: Seconds to wait, after an exception, for a save in flight to commit.
        policy: A :class:`ft_checkpoint.SavePolicy` instead of the one ``interval`` names.
        interval: ...and every other keyword: the fields of :class:`ft_checkpoint.CheckpointConfig`, with their
            types (``interval``: steps, ``"30m"`` or ``"adaptive"``; ``keep_last``, ``keep_every_n_steps``,
            ``storage_options``, ``async_save``, ``final_save``, ``save_rng_state``, ``retries``, ...), so
            that LightningCLI's YAML (``init_args``), ``--print_config`` and IDEs see them. None (the
            default): from the ``FT_CHECKPOINT_<FIELD>`` env var, else the YAML file in
            ``FT_CHECKPOINT_CONFIG``, else the config's default.

    The step of a checkpoint is ``trainer.global_step``. A save the policy asks for on the last batch of an
    epoch or right before validation happens one batch later (resuming there would skip the epoch end or
    the validation). An explicit ``trainer.fit(ckpt_path=...)`` wins over the automatic resume. This
    callback replaces Lightning's default ``ModelCheckpoint``; add one yourself to keep best-k files.
    ``Trainer(enable_checkpointing=False)`` is accepted when this is the only checkpoint callback.

    A clean end of ``fit`` saves its last step unless it is saved already (``final_save``): the final
    weights are in the directory, and a restart of the finished run resumes at its end and trains no step.
    Under LightningCLI, a restart that resumes lets ``SaveConfigCallback`` write its ``config.yaml`` again
    (it refuses an existing one otherwise, which stopped every restart before it could resume).

    What the user needs to see goes through Lightning's rank-zero info channel: where checkpoints go,
    the step a fit resumes from, when the next save is due. A resume on another number of ranks than
    the checkpoint's warns: the data position in the resumed epoch is not exact then.

    Preemption: SIGTERM and SIGUSR1 (``preemption_signals``) only raise a flag. At the next batch end
    a resume can start after, every rank agrees, that step is saved and committed, the journal records
    the preemption, a ``sbatch --requeue`` job is requeued, and the process exits with code 0
    (:class:`ft_checkpoint.errors.Preempted`). Handlers installed before ``fit`` still run. Because this
    callback's SIGUSR1 handler is in place first, Lightning's SLURM auto-requeue handler (which saves
    inside the signal handler) is not installed. Lightning's own SIGTERM handler is left out of the chain
    it installs (the handlers it chains still run), single process or DDP: its exit at the end of the batch
    (or validation batch) saved nothing at a batch a resume cannot start after (one a validation follows,
    the last of an epoch) or during a validation, and under DDP its broadcast inside the signal handler
    desynchronised the ranks when one rank alone, or one rank twice, got the signal. The fit goes on to the
    next batch a resume can start after, and saves there (``trainer.received_sigterm`` stays False).

    Example:
        >>> cb = FaultTolerantCheckpoint("memory://doc/cb", interval=50, save_on_exception=True)
        >>> cb.save_on_exception, cb.resumed_from
        (True, None)
    """

    best_model_path = ""
    """Always empty: this callback keeps the newest checkpoints, not the best (``ckpt_path="best"`` needs
    a ``ModelCheckpoint(monitor=...)``)."""

    def __init__(self, dirpath: str | None = None, *, save_on_exception: bool = False,
                 drain_timeout: float = 300.0, policy: SavePolicy | None = None,
                 interval: int | datetime.timedelta | str | None = None,
                 min_interval: float | str | datetime.timedelta | None = None,
                 max_interval: float | str | datetime.timedelta | None = None,
                 mtbf: float | str | datetime.timedelta | None = None, gpu_failure_rate: float | None = None,
                 keep_last: int | None = None, keep_every_n_steps: int | None = None,
                 storage_options: dict[str, Any] | None = None, async_save: bool | None = None,
                 final_save: bool | None = None, save_rng_state: bool | None = None,
                 verify_checksums: bool | None = None, retries: int | None = None,
                 progress_interval: float | str | datetime.timedelta | None = None, force_takeover: bool | None = None,
                 on_save_error: str | None = None, preemption_signals: tuple[str, ...] | list[str] | str | None = None,
                 requeue: bool | None = None, end_time_margin: float | str | datetime.timedelta | None = None,
                 preemption_exit_code: int | None = None, writer: str | None = None, writer_priority: int | None = None,
                 writers: int | None = None, lazy_snapshot: bool | None = None, signing_key: str | None = None,
                 signing_key_file: str | None = None,
                 run_name: str | None = None, fast_dirpath: str | None = None,
                 fast_interval: int | datetime.timedelta | str | None = None, fast_replicas: int | None = None,
                 node_id: str | None = None, **misspelled: Any) -> None:
        super().__init__()
        check_names(misspelled)
        config = {k: v for k, v in given(locals()).items() if k != "dirpath"}
        CheckpointConfig.from_env(dirpath=dirpath, **config)  # a bad value fails here, not at fit time
        internals.allow_without_lightning_checkpointing(FaultTolerantCheckpoint)
        internals.let_lightning_cli_restart(_restarts)
        self.dirpath = os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath  # a pathlib.Path too
        self.save_on_exception = save_on_exception
        self.drain_timeout = drain_timeout
        self.policy = policy
        self.config = config
        self.manager: CheckpointManager | None = None
        """The core manager of the current fit (created in ``setup``)."""
        self.saves: list[SaveStats] = []
        """Every save this callback started in the current fit (the core's stats; ``committed`` once durable)."""
        self.stalls: list[float] = []
        """Seconds each of those saves blocked training (taking Lightning's state dict, then staging)."""
        self.resumed_from: int | None = None
        """The step the last fit resumed from, or None."""
        self._snapshots = Snapshots()
        self._safe = SafePoints(drain_timeout)
        self._reset()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath)

    def _reset(self) -> None:
        self._resume: dict[str, Any] | None = None
        self._epoch_start: EpochStart | None = None
        self._started = time.monotonic()
        self._last_step: int | None = None
        self._pending = False
        self._undo_warning: Any = None
        self._metrics_restored = False  # whether the resume put back the torchmetrics states
        self._resumed_skip: int | None = None
        """In the epoch a resume landed in (until its end): how many of its batches were done before it."""
        self._unreported: list[SaveStats] = []
        self._active = False
        self._held_gradients: PendingGradients | None = None
        self._batch_ended = False  # a training batch ended: save (if due) after the module's own hook

    # -- lifecycle -----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        internals.check_version()
        check_strategy(trainer.strategy)
        self._reset()
        self.resumed_from = None
        self.saves, self.stalls = [], []
        # Run last: RNG drawn by other callbacks in a batch is then part of the saved state, and
        # trainer.checkpoint_callback stays the user's ModelCheckpoint if there is one.
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]  # type: ignore[attr-defined]
        dirpath, default = self._resolve_dirpath(trainer)
        self.manager = CheckpointManager(dirpath, policy=self.policy, announce=False, **self.config)
        rank_zero_info(f"FaultTolerantCheckpoint: checkpoints go to {self.manager.storage.url}"
                       + (f" (no dirpath given: <default_root_dir>/{DEFAULT_SUBDIR})" if default else ""))
        self._active = True
        self._started = time.monotonic()
        if self.save_on_exception:
            self._safe.setup(trainer)
        internals.intercept_resume(trainer, lambda ckpt_path: self._load(trainer, ckpt_path))
        internals.before_first_iterator(trainer, lambda: self._capture_epoch_start(trainer))
        internals.after_module_batch_end(trainer, lambda: self._after_batch(trainer))
        if "SIGTERM" in self.manager.watcher.signals:
            internals.leave_out_sigterm_handler(trainer)  # the watcher's notice ends the fit, not Lightning's handler

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # manual optimization: several optimizers, stepped at their own rates
        self._held_gradients = PendingGradients(trainer.optimizers, quiet=not trainer.is_global_zero)
        if self.save_on_exception:  # DeepSpeed's ZeRO optimizers have no step hooks: see on_before_optimizer_step
            self._safe.watch_optimizers(trainer.optimizers)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.save_on_exception and not hasattr(optimizer, "register_step_pre_hook"):
            self._safe.optimizer_step()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.manager is not None
        self._last_step = trainer.global_step
        resume, self._resume = self._resume, None
        if resume is not None:
            self._continue_epoch(trainer, resume)
        elif trainer.ckpt_path:
            self.manager.check_continues_from(trainer.global_step, why=f"fit(ckpt_path={str(trainer.ckpt_path)!r}) "
                                              f"continues from step {trainer.global_step}")
        messages.announce_start(trainer, self.manager, resumed=resume is not None, resumed_from=self.resumed_from)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        settle_snapshots()  # weight averaging swaps weights in through .data, which no version counter sees

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        settle_snapshots()
        if self._resumed_skip is not None:  # the end of the epoch a resume landed in (a Checkpoint: runs after the
            skip, self._resumed_skip = self._resumed_skip, None  # module's own hook, before Lightning's schedulers)
            internals.let_plateau_schedulers_step(trainer)
            names = internals.epoch_metrics_of_batches(trainer, metric_objects=not self._metrics_restored)
            if skip and names and trainer.is_global_zero:
                log.warning("the epoch-level training metrics %s of epoch %d are aggregated over the batches since the "
                            "resume only (Lightning keeps no state of them in a checkpoint; the first %d batches are "
                            "left out): they differ from an uninterrupted run's, and what monitors them at this "
                            "epoch's end (ReduceLROnPlateau, EarlyStopping, ModelCheckpoint) may decide otherwise. "
                            "HINT: monitor a validation metric", ", ".join(names), trainer.current_epoch, skip)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > 0:  # this epoch's iterator is created right after this hook
            self._capture_epoch_start(trainer)

    def _capture_epoch_start(self, trainer: pl.Trainer) -> None:
        """Remember what the epoch's iterator is about to draw its order and worker seeds from."""
        self._epoch_start = EpochStart.capture(internals.train_loaders(trainer))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._undo_warning is not None:
            self._undo_warning()
            self._undo_warning = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # the module's own on_train_batch_end runs after every callback's, and what it does (an EMA update, random
        # draws) belongs to this batch: the batch is saved right after it (internals.after_module_batch_end)
        self._batch_ended = True

    def _after_batch(self, trainer: pl.Trainer) -> None:
        """The end of a training batch, after the LightningModule's ``on_train_batch_end``: save if due."""
        if not self._batch_ended:  # the evaluation loop's batch
            return
        self._batch_ended = False
        assert self.manager is not None
        self._report_commits(trainer)
        step = trainer.global_step
        if step == self._last_step:  # accumulating gradients: not a step boundary
            return
        self._last_step = step
        # an optimizer that holds gradients for a later step (a GAN's accumulating generator): no point to resume from
        hold = self._held_gradients is not None and self._held_gradients.withhold()
        resumable = self._resumable(trainer)
        if self.save_on_exception:
            self._safe.remember(trainer, step if resumable and not hold else None, self._epoch_start)
        if resumable and self._pending:  # a save asked for at an earlier batch, where a resume could not start
            if self.manager.groups.any_rank(hold) and not self.manager.preempted:  # a notice does not wait
                return
            self._pending = False
            self.manager.note_step(step)
            self._save(trainer, step, lambda: self._snapshots.take(trainer, self._epoch_start))
            if self.manager.preempted:
                self.manager.stop_for_preemption()
        elif resumable:  # a preemption notice makes this the final save, then exits (Preempted)
            self._save(trainer, step, lambda: self._snapshots.take(trainer, self._epoch_start), if_due=True, hold=hold)
        else:  # a save agreed on here comes at the next batch a resume can start after, with the tiers agreed on here
            self.manager.note_step(step)
            if not self._pending and self.manager.agree_to_save(step):
                self._pending = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The clean end of ``fit``: save its last step unless it is saved already (``final_save``), then close."""
        if self._active:
            assert self.manager is not None
            self._save_last(trainer, self._epoch_start)
            if not self.saves:
                messages.announce_no_save(trainer, self.manager, seconds=time.monotonic() - self._started,
                                          resumed_from=self.resumed_from)
        self._close(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            internals.release_resume(trainer)
            if self._active and self._resume is not None:  # resumed, yet the fit loop never started: finished
                assert self.manager is not None
                self._save_last(trainer, self._resume["epoch_start"])  # a step resumed from the fast tier only
                messages.announce_finished(trainer, self.manager)
            self._close(trainer)

    def _save_last(self, trainer: pl.Trainer, epoch_start: EpochStart | None) -> None:
        """Save the step the fit ends at to the durable tier, unless it is there already (``final_save``): a fit that
        trained, or one that resumed its finished run from the fast tier (a crash after the last step's fast save),
        whose clean end would delete the only copy of its last step."""
        assert self.manager is not None
        step = trainer.global_step
        if self.manager.config.final_save and step > 0 and not self.manager.has_saved(step):
            self._save(trainer, step, lambda: self._snapshots.take(trainer, epoch_start))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Drain (and with ``save_on_exception`` save) off the training thread, for at most ``drain_timeout``.

        Other ranks may never reach this hook, so nothing here may wait for them without a deadline.
        """
        internals.release_resume(trainer)
        self._safe.remove_hooks()
        if self._held_gradients is not None:
            self._held_gradients.close()
        if not self._active or isinstance(exception, Preempted):  # after the final save of a preemption
            self._active = False
            return
        self._active = False
        save = self.save_on_exception and not isinstance(exception, FTCheckpointError)
        run_within(self.drain_timeout, lambda: self._drain_after(trainer, exception, save))

    # -- resuming ------------------------------------------------------------------------------
    def _ran_before(self, trainer: pl.Trainer) -> bool:
        """Whether a job ran in this callback's directory before this fit: its journal records a start, or it holds
        a committed step (verified, with a signing key). Asked before this callback's ``setup`` (Lightning sets up
        checkpoint callbacks last). A job killed before its first durable save has no step there but does restart
        (from its fast tier, or from scratch)."""
        dirpath, _ = self._resolve_dirpath(trainer)
        config = CheckpointConfig.from_env(**self.config)
        storage = Storage(dirpath, config.storage_options, retries=config.retries)
        return started_before(storage) or bool(layout.committed_steps(storage,
                                                                      signer=Signer.from_config(config, storage.url)))

    def _resolve_dirpath(self, trainer: pl.Trainer) -> tuple[str, bool]:
        """The checkpoint directory, and whether it is the default one under ``default_root_dir``."""
        dirpath = self.dirpath or CheckpointConfig.from_env(**self.config).dirpath
        if dirpath is None:
            return os.path.join(trainer.default_root_dir, DEFAULT_SUBDIR), True
        return dirpath, False

    def _load(self, trainer: pl.Trainer, ckpt_path: Any) -> dict[str, Any] | None:
        """Called by Lightning's restore: the checkpoint dict to resume from, or None.

        Under DeepSpeed Lightning restores after ``strategy.setup`` (``restore_checkpoint_after_setup``), so
        the engine exists here and loads its own files; the dict returned lacks ``state_dict`` and
        ``optimizer_states``, as Lightning's own DeepSpeed checkpoints do.
        """
        assert self.manager is not None
        if ckpt_path:
            if self.manager.rank == 0:
                log.info("fit(ckpt_path=%r) was given: resuming from it, not from the newest checkpoint in %s",
                         str(ckpt_path), self.manager.storage.url)
            return None
        state: dict[str, Any] = {"lightning": {}, "loader": {}, **self._snapshots.engine_state(trainer)}
        step = self.manager.resume(state, restore_rng=False, check=check_model_tensors)  # RNG: once the data is back
        if step is None:
            return None
        self.resumed_from = step
        loader = from_core(state["loader"])
        checkpoint = from_core(state["lightning"])
        self._resume = {"rng": self.manager.resumed_rng, "metrics": checkpoint.pop(METRICS, None),
                        "frozen": checkpoint.pop(FROZEN, None),
                        "epoch_start": EpochStart.from_state(loader), "world_size": loader.get("world_size"),
                        "accumulate_grad_batches": loader.get("accumulate_grad_batches")}
        return checkpoint

    def _continue_epoch(self, trainer: pl.Trainer, resume: dict[str, Any]) -> None:
        """Put the data where the interrupted epoch stopped, then the RNG where the saved step left it."""
        start: EpochStart | None = resume["epoch_start"]
        self._epoch_start = start
        self._metrics_restored = resume["metrics"] is not None
        internals.restore_metric_states(trainer.lightning_module, resume["metrics"])
        self._restore_frozen(trainer, resume["frozen"])
        skip = internals.batches_done_in_epoch(trainer)
        messages.warn_world_size(trainer, resume["world_size"], skip)
        messages.warn_accumulation(trainer, resume["accumulate_grad_batches"])
        self._resumed_skip = skip
        if 0 < skip:
            internals.restart_epoch_start_callbacks(trainer)
            if not self._metrics_restored and (metrics := internals.metric_states(trainer.lightning_module)):
                if trainer.is_global_zero:
                    log.warning("the torchmetrics metrics %s start empty in resumed epoch %d: this step holds no state "
                                "of them (saved after an exception, or by an older version), so their values for this "
                                "epoch cover the batches since the resume only", ", ".join(sorted(metrics)),
                                trainer.current_epoch)
        if 0 < skip < trainer.num_training_batches and internals.loaders_restore_themselves(trainer):
            messages.warn_stateful_loaders_with_workers(trainer)
        elif 0 < skip < trainer.num_training_batches:
            loaders = internals.train_loaders(trainer)
            if start is not None and internals.replay_epoch(trainer, lambda: start.restore(loaders), skip):
                self._undo_warning = internals.silence_midepoch_warning()
                messages.warn_cycled_loaders(trainer, [dl for dl in internals.cycled_loaders(trainer)
                                                       if draws_from_torch_rng(dl)])
            elif trainer.is_global_zero:
                log.warning("cannot put this train dataloader back at batch %d of the epoch (it has no length, or "
                            "training_step takes the iterator): the epoch restarts from its first batch while "
                            "Lightning keeps counting from batch %d, so this epoch runs %d batches longer than in an "
                            "uninterrupted run (its first %d batches are trained on twice). HINT: use a map-style "
                            "dataset, or a loader with state_dict()/load_state_dict()", skip, skip, skip, skip)
        if resume["rng"] is not None:
            set_rng_state(resume["rng"])

    @staticmethod
    def _restore_frozen(trainer: pl.Trainer, frozen: list[str] | None) -> None:
        """Which parameters require grad, as at the saved step (None: saved by an older version)."""
        changed = None if frozen is None else restore_frozen(trainer.lightning_module, frozen)
        if changed:
            rank_zero_info(f"FaultTolerantCheckpoint: {len(changed)} parameters (un)frozen as at the saved step (a "
                           f"callback such as BackboneFinetuning changed them during training): {', '.join(changed[:5])}"
                           + (", ..." if len(changed) > 5 else ""))

    # -- saving --------------------------------------------------------------------------------
    @staticmethod
    def _resumable(trainer: pl.Trainer) -> bool:
        """Whether a resume can start right after the current batch (the same answer on every rank)."""
        return not (trainer.should_stop or internals.is_last_batch(trainer) or internals.validation_follows(trainer))

    def _save(self, trainer: pl.Trainer, step: int, snapshot: Callable[[], dict[str, Any]], *,
              if_due: bool = False, hold: bool = False) -> None:
        """Save ``snapshot()`` as ``step`` (with ``if_due``: only if the policy says so and no rank ``hold``s; the
        snapshot is then taken only when it does). Logs the stall and the interval."""
        assert self.manager is not None
        t0 = time.perf_counter()
        metadata = {"lightning_epoch": trainer.current_epoch, "batches_done": internals.batches_done_in_epoch(trainer)}
        if if_due:
            if not self.manager.maybe_save(step, _Lazy(snapshot), epoch=trainer.current_epoch, metadata=metadata,
                                           hold=hold):
                return
        else:
            self.manager.save(step, snapshot(), epoch=trainer.current_epoch, metadata=metadata)
        self.stalls.append(time.perf_counter() - t0)
        assert self.manager.last_save is not None
        self.saves.append(self.manager.last_save)
        if self.manager.last_save.durable:  # a fast-tier save reports no time to durable
            self._unreported.append(self.manager.last_save)
        self._log(trainer, {k: v for k, v in self.manager.metrics().items() if k not in ("durable_s", "bytes")})

    def _report_commits(self, trainer: pl.Trainer) -> None:
        """Log time to durable and bytes of the saves that committed since the last call."""
        done = [s for s in self._unreported if s.committed]
        self._unreported = [s for s in self._unreported if not s.committed]
        for stats in done:
            self._log(trainer, {"durable_s": stats.duration, "bytes": stats.bytes, "saved_step": stats.step})

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float | int | None]) -> None:
        if not trainer.is_global_zero:
            return
        values = {PREFIX + k: float(v) for k, v in metrics.items() if v is not None}
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)

    def _close(self, trainer: pl.Trainer) -> None:
        """Drain the save in flight (its error, if any, is raised here) and release the writer."""
        self._safe.remove_hooks()
        if self._held_gradients is not None:
            self._held_gradients.close()
        if self._active:
            self._active = False
            assert self.manager is not None
            self.manager.close()
            self._report_commits(trainer)

    def _drain_after(self, trainer: pl.Trainer, exception: BaseException, save: bool) -> None:
        assert self.manager is not None
        try:
            if save:
                self._save_safe_point(trainer, exception)
        except Exception:
            log.exception("save_on_exception: the save failed; the last committed checkpoint is intact")
        try:
            if self.manager.preemption_requested:  # a notice came, then an exception before a step boundary of ours
                self.manager.stop_for_preemption()
        except Preempted:
            return  # journaled (and requeued); Lightning's own exit is already under way
        except Exception as e:
            log.error("the final save of the preemption failed (%s: %s); the last committed checkpoint is intact",
                      type(e).__name__, e)
        self.manager.close_after(exception)  # one line if the save in flight failed too, or a peer rank is gone

    # -- save on exception ---------------------------------------------------------------------
    def _save_safe_point(self, trainer: pl.Trainer, exception: BaseException) -> None:
        safe = self._safe.agreed(exception)
        if safe is None:
            return
        step = safe.step
        if any(s.step == step for s in self.saves):
            return  # saved already
        set_rng_state(safe.rng)  # the manager saves the RNG as of the call
        self._save(trainer, step, lambda: self._snapshots.take(trainer, safe.epoch_start, loops=safe.loops))
        if trainer.is_global_zero:
            log.info("save_on_exception: saving step %d after the %s", step, type(exception).__name__)
