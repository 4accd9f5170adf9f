"""``FaultTolerantCheckpoint``: asynchronous checkpoints and exact resume for an Accelerate training loop.

Accelerate has no callbacks, so the hook owns the loop's step boundaries through two iterators:
``epochs()`` starts at the resumed epoch, ``batches()`` (or ``enumerate()``) skips the batches the
resumed epoch already consumed and, after each optimizer step, asks the core
:class:`ft_checkpoint.CheckpointManager` whether to save. Policy, storage, commit and retention are
the core's; the data position is :mod:`accelerate_ft.data`'s; this module only translates the loop.

Example:
    >>> import torch
    >>> from accelerate import Accelerator
    >>> acc = Accelerator(cpu=True)
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loader = torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=4, shuffle=True)
    >>> model, opt, loader = acc.prepare(model, opt, loader)
    >>> with FaultTolerantCheckpoint(acc, "memory://doc/accelerate", interval=2) as ft:
    ...     for epoch in ft.epochs(2):
    ...         for x in ft.batches(loader):
    ...             with acc.accumulate(model):
    ...                 acc.backward(model(x).pow(2).mean()); opt.step(); opt.zero_grad()
    >>> ft.global_step, ft.manager.latest()
    (8, 8)
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from accelerate_ft import _accelerate_internals as internals
from accelerate_ft import data
from accelerate_ft.plugin import FaultTolerantCheckpointPlugin
from accelerate_ft.state import accelerator_state
from ft_checkpoint import CheckpointManager, ConfigError, SavePolicy, SaveStats
from ft_checkpoint.config import DEFAULT_SUBDIR, check_names, given
from ft_checkpoint.save.pending_gradients import PendingGradients
from ft_checkpoint.save.snapshot import settle_all as settle_snapshots
from ft_checkpoint.state import rng_state
from ft_checkpoint.units import plural

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFIX = "ft_checkpoint/"


class FaultTolerantCheckpoint:
    """Checkpoint everything an ``Accelerator`` prepared, asynchronously, and resume exactly after a failure.

    Create it on every rank after ``accelerator.prepare(...)``; it resumes at once from the newest
    verified checkpoint, if any. One line on stderr (main process) says where checkpoints go, what was
    resumed (the step, and the epoch and batch it continues at) and when the first save is due. It saves models, optimizers
    (through DCP's state-dict helpers, so FSDP shards stay sharded; under DDP the buffers are rank
    0's; under the DeepSpeed plugin each engine saves itself, see ``ft_checkpoint.integrations.deepspeed``),
    schedulers, the grad scaler, objects passed to ``accelerator.register_for_checkpointing``,
    each rank's RNG states, the data position and its own counters.

    Saves happen only right after an optimizer step: at the sync points of ``accelerator.accumulate``,
    and in a loop that accumulates by hand (``if step % accum == 0: optimizer.step()``) after the
    batches whose ``optimizer.step()`` ran; so a checkpoint never needs half-accumulated gradients.
    When :meth:`epochs` ends (and at the end of a ``with`` block or :meth:`close`), the last step is saved
    unless it is already (``final_save``): a restart of the finished run resumes at its end and trains no
    step. ``with`` or :meth:`close` ends it; without either it closes when the interpreter exits (journaled
    as a clean end unless an exception ended the program). After an exception (a peer rank that died
    included) it closes with one log line, never a traceback of its own.

    Args:
        accelerator: The ``Accelerator`` that prepared the training objects.
        dirpath: Local path or fsspec URL (``s3://bucket/run``); else ``FT_CHECKPOINT_DIRPATH``, the
            YAML file named by ``FT_CHECKPOINT_CONFIG``, or ``<accelerator.project_dir>/ft_checkpoints``
            when the accelerator has a ``project_dir``.
        plugin: A :class:`FaultTolerantCheckpointPlugin` instead of ``dirpath`` and the settings.
        policy: A core ``SavePolicy`` replacing the one ``interval`` names.
        interval: ...and every other keyword: the fields of :class:`ft_checkpoint.CheckpointConfig`, with their
            types (``interval``: optimizer steps, ``"30m"`` or ``"adaptive"``; ``keep_last``, ``storage_options``,
            ``async_save``, ``final_save``, ...). None (the default): from ``FT_CHECKPOINT_<FIELD>``, the file,
            else the config's default.

    Example:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> acc = Accelerator(cpu=True)
        >>> model = acc.prepare(torch.nn.Linear(2, 2))
        >>> ft = FaultTolerantCheckpoint(acc, "memory://doc/accelerate-init", interval=100)
        >>> ft.resumed_from is None, ft.global_step
        (True, 0)
        >>> ft.close()
    """

    def __init__(self, accelerator: Accelerator, dirpath: str | None = None, *,
                 plugin: FaultTolerantCheckpointPlugin | None = None, policy: SavePolicy | None = None,
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
        check_names(misspelled)
        if isinstance(accelerator, (str, os.PathLike)):
            raise ConfigError(f"FaultTolerantCheckpoint's first argument is the Accelerator; got {accelerator!r}. "
                              f"HINT: FaultTolerantCheckpoint(accelerator, {os.fspath(accelerator)!r}, ...)")
        config = given(locals())
        if plugin is not None and config:
            raise ConfigError("pass either plugin= or dirpath/config arguments, not both. "
                              "HINT: put every setting in the plugin")
        self.plugin = plugin or FaultTolerantCheckpointPlugin(**config)
        self.accelerator = accelerator
        self.global_step = 0
        """Optimizer steps done (gradient-accumulation sync points), including those before a resume."""
        self.epoch = 0
        """The current epoch (the resumed one after a resume)."""
        self._batches_done = 0
        self._epoch_start: dict[str, str] | None = None
        self._rng_after_resume: dict[str, Any] | None = None
        self._prefetched: list[dict[str, Any]] = []
        self._reader: data.EpochReader | None = None
        self._in_batch: int | None = None  # the index of the batch the loop is in (its iterator suspended), or None
        self._epoch_batches: int | None = None  # the batches of the current epoch's loader (None: it has no len)
        self._saved_epoch_batches: int | None = None  # on a resume, those of the run that saved
        self._saves_to_report: list[SaveStats] = []
        self.state = accelerator_state(accelerator)
        self.state["progress"] = _Progress(self)
        self.manager = CheckpointManager(policy=policy, announce=False, **self._manager_kwargs())
        self._stepped = False
        self._accumulates_by_hand = False
        """Whether a batch without an optimizer step was seen (here or in the run that saved)."""
        self._step_hooks = [opt.register_step_post_hook(self._optimizer_stepped)
                            for opt in internals.optimizers(accelerator) if hasattr(opt, "register_step_post_hook")]
        self._held_gradients = PendingGradients(internals.optimizers(accelerator), quiet=not accelerator.is_main_process)
        self._closed = False
        self.resumed_from: int | None = self.manager.resume(self.state)
        """The global step resumed from, or None on a fresh start."""
        if self.resumed_from is not None:
            self._rng_after_resume = rng_state()
        if self.manager.rank == 0:  # the one line a start gets (the manager's own is off)
            position = f"epoch {self.epoch}, {plural(self._batches_done, 'batch', 'batches')} of it done"
            print(f"ft-checkpoint: {self.manager.describe_start(position)}", file=sys.stderr, flush=True)

    def _manager_kwargs(self) -> dict[str, Any]:
        """The plugin's settings; without a dirpath anywhere, ``<accelerator.project_dir>/ft_checkpoints``."""
        kwargs = self.plugin.manager_kwargs()
        project_dir = getattr(self.accelerator, "project_dir", None)
        if kwargs["dirpath"] is None and project_dir:
            kwargs["dirpath"] = os.path.join(project_dir, DEFAULT_SUBDIR)
        elif kwargs["dirpath"] is None:
            raise ConfigError("FaultTolerantCheckpoint has no dirpath. HINT: pass one, set FT_CHECKPOINT_DIRPATH, put "
                              "it in the YAML file named by FT_CHECKPOINT_CONFIG, or create the Accelerator with "
                              "project_dir=... (checkpoints then go to <project_dir>/ft_checkpoints)")
        return kwargs

    # -- the loop ------------------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to run: ``range(num_epochs)`` from the resumed epoch on.

        When the last epoch is done, saves the last step unless it is saved already (``final_save``), and
        waits until the last save committed (so that a following ``accelerator.end_training()`` cannot end
        the process group under a save in flight).

        Example:
            >>> for epoch in ft.epochs(3):   # doctest: +SKIP
            ...     for batch in ft.batches(train_loader): ...
        """
        while self.epoch < num_epochs:
            epoch = self.epoch
            yield epoch
            if self.epoch == epoch:  # batches() did not run to the end (a break, an iterator kept, not called)
                self._leave_epoch()
        self._save_final()
        self.manager.wait()
        self._report_commits()

    def batches(self, loader: Iterable[T], *, replay_in_workers: bool = True) -> Iterator[T]:
        """The batches of the current epoch still to train on; saves after optimizer steps.

        Sets the sampler's epoch; after a resume, skips the batches the resumed epoch already consumed
        (by index, without loading them), with the shuffle order and the random numbers
        ``Dataset.__getitem__`` drew in the interrupted run. After each batch whose optimizer step ran,
        counts a global step and lets the policy decide to save.

        Args:
            loader: The prepared DataLoader (or any iterable of batches).
            replay_in_workers: With ``num_workers > 0``, a resumed epoch loads its consumed batches again
                in the workers and drops them, so each worker's random state (random augmentation)
                continues exactly; this costs their loading time. False skips them by index: faster,
                exact only if ``__getitem__`` draws no random numbers.

        A loop that steps its optimizer on some batches only, by an index (``if step % accum == 0``), takes
        the index from :meth:`enumerate`: after a resume in the middle of an epoch, a warning says so.

        Example:
            >>> for batch in ft.batches(train_loader):   # doctest: +SKIP
            ...     with accelerator.accumulate(model):
            ...         accelerator.backward(model(batch)); optimizer.step(); optimizer.zero_grad()
        """
        self._warn_if_an_index_restarts()
        for _, batch in self.enumerate(loader, replay_in_workers=replay_in_workers):
            yield batch

    def enumerate(self, loader: Iterable[T], *, replay_in_workers: bool = True) -> Iterator[tuple[int, T]]:
        """Like :meth:`batches`, with each batch's index in the epoch, which continues after a resume.

        Use it where the loop's logic depends on the index (``enumerate(ft.batches(loader))`` would
        count from 0 again in a resumed epoch and shift which batches step).

        Example:
            >>> for step, batch in ft.enumerate(train_loader):   # doctest: +SKIP
            ...     accelerator.backward(model(batch).loss / accum)
            ...     if step % accum == 0:
            ...         optimizer.step(); optimizer.zero_grad()
        """
        reader = self._open_epoch(loader, replay_in_workers)
        for index, batch in reader:
            self._stepped, self._in_batch = False, index
            try:
                yield index, batch
            except GeneratorExit:  # the loop broke out (or returned) after this batch
                if self._reader is reader:  # not yet counted by _leave_epoch (an iterator closed after its epoch)
                    self._count_step(index)
                    settle_snapshots()
                raise
            if self._reader is not reader:
                return  # its epoch was left (_leave_epoch) while this iterator was kept: it has no more batches
            self._in_batch = None
            self._batches_done = index + 1
            self._after_batch()
        settle_snapshots()  # an epoch's end: EMA weights swapped in for validation through .data (no version counter)
        self._start_next_epoch()

    @property
    def batches_done(self) -> int:
        """Batches of the current epoch consumed so far (after a resume, including the skipped ones)."""
        return self._batches_done

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Save the last step unless it is saved already (``final_save``), wait until the last save committed
        (re-raising a background error), then release the writer."""
        self._release()
        try:
            self._save_final()
        finally:
            self.manager.close(final=False)
        self._report_commits()

    def __enter__(self) -> FaultTolerantCheckpoint:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, *_: Any) -> None:
        if exc is None:
            self.close()
            return
        self._release()
        self.manager.close_after(exc)

    # -- internals -----------------------------------------------------------------------------
    def _open_epoch(self, loader: Iterable[Any], replay_in_workers: bool) -> data.EpochReader:
        """Set the epoch, put back (on a resume) or note (otherwise) its start, and read it from the position."""
        data.set_epoch(loader, self.epoch)
        resume_rng, self._rng_after_resume = self._rng_after_resume, None
        if resume_rng is not None and self._epoch_start is not None:
            data.restore_epoch_start(loader, self._epoch_start)
        elif resume_rng is not None:
            log.warning("the checkpoint has no shuffle state for epoch %d: the resumed epoch may see another order",
                        self.epoch)
        else:
            self._epoch_start = data.capture_epoch_start(loader)
        self._epoch_batches = data.batches_per_epoch(loader)
        if resume_rng is not None:
            self._warn_if_the_epoch_changed_length()
        prefetched = self._prefetched if self.plugin.save_rng_state else []  # save_rng_state=False: no RNG restored
        self._reader = data.EpochReader(loader, self._batches_done, resume_rng=resume_rng, prefetched=prefetched,
                                        replay_in_workers=replay_in_workers, epoch=self.epoch)
        self._prefetched = []
        return self._reader

    def _warn_if_the_epoch_changed_length(self) -> None:
        """A resume whose loader has another number of batches than the run that saved (another batch size, another
        dataset: a restart after ``find_executable_batch_size`` chose a smaller batch): its position is off."""
        saved, now = self._saved_epoch_batches, self._epoch_batches
        inside = 0 < self._batches_done < (saved or 0)  # a resume on an epoch's end starts the next one whole
        if inside and now is not None and saved != now and self.manager.rank == 0:
            log.warning("the checkpoint's epoch had %d batches per process, this run's loader has %d (another batch "
                        "size or dataset): model and optimizer are restored, but epoch %d resumes after batch %d of "
                        "%d, which is not where the saved run was in its data", saved, now, self.epoch,
                        self._batches_done, now)

    def _warn_if_an_index_restarts(self) -> None:
        """In an epoch resumed mid-way by a loop that accumulates by hand: ``enumerate(ft.batches(loader))`` would
        count from 0 again, so other batches would step the optimizer than in the uninterrupted run."""
        if self._rng_after_resume is None or not self._batches_done or not self._accumulates_by_hand:
            return
        if self.manager.rank == 0:
            log.warning("epoch %d resumes at batch %d, and this loop steps the optimizer on some batches only "
                        "(accumulation by hand): an index from enumerate(ft.batches(loader)) starts at 0 again, so "
                        "other batches step than in the uninterrupted run and the result differs. HINT: for step, "
                        "batch in ft.enumerate(loader) continues the index at %d", self.epoch, self._batches_done,
                        self._batches_done)

    def _leave_epoch(self) -> None:
        """The epoch ends before its last batch: a ``break`` (its iterator already closed), or an iterator the loop
        keeps in a variable (``it = ft.batches(loader)``; ``next(it)``), which is closed only when the next epoch's
        replaces it. The batch it is in is counted now, so the next epoch starts at its first batch."""
        if self._in_batch is not None:
            self._count_step(self._in_batch)
        self._start_next_epoch()

    def _start_next_epoch(self) -> None:
        self.epoch += 1
        self._batches_done = 0
        self._epoch_start = None
        self._reader = None

    def _optimizer_stepped(self, *_: Any) -> None:
        self._stepped = True

    def _save_final(self) -> None:
        """The clean end of the loop: save the step reached unless it is saved already (``final_save``)."""
        if self.manager.closed or not self.manager.config.final_save or not self.global_step \
                or self.manager.has_saved(self.global_step):
            return
        metadata = {"epoch": self.epoch, "batches_done": self._batches_done}
        self._started(self.manager.save(self.global_step, self.state, epoch=self.epoch, metadata=metadata))

    def _count_step(self, index: int) -> None:
        """The loop left during batch ``index`` (a ``break``): count it if its optimizer step ran, so that the
        counters match the weights a final save writes; no save here."""
        self._in_batch = None
        self._held_gradients.forget_steps()  # no boundary: the next one looks at the steps of its own batch
        if self.accelerator.sync_gradients and self._step_hooks and self._stepped:
            self._batches_done = index + 1
            self.global_step += 1

    def _after_batch(self) -> None:
        if not self.accelerator.sync_gradients:
            return  # mid-accumulation: the partial gradients are not saved, so never save here
        if self._step_hooks and not self._stepped:
            self._accumulates_by_hand = True
            return  # accumulating by hand (no optimizer step in this batch): not a step boundary either
        self.global_step += 1
        self._report_commits()
        metadata = {"epoch": self.epoch, "batches_done": self._batches_done}
        hold = self._held_gradients.withhold()  # an optimizer holds gradients for a later step (a GAN's generator)
        if self.manager.maybe_save(self.global_step, self.state, epoch=self.epoch, metadata=metadata, hold=hold):
            self._started(self.manager.last_save)

    def _started(self, stats: SaveStats | None) -> None:
        """Log a save that started (its stall and the current interval); its commit is logged later."""
        if stats is None:
            return
        if stats.durable:  # a fast-tier save reports no time to durable
            self._saves_to_report.append(stats)
        started = self.manager.metrics()
        self._log({k: v for k, v in started.items() if k not in ("durable_s", "bytes")})

    def _report_commits(self) -> None:
        """Log time to durable and bytes of the saves that committed since the last call."""
        for stats in [s for s in self._saves_to_report if s.committed]:
            self._saves_to_report.remove(stats)
            self._log({"durable_s": stats.duration, "bytes": stats.bytes, "saved_step": stats.step})

    def _log(self, values: dict[str, Any]) -> None:
        values = {PREFIX + k: v for k, v in values.items() if v is not None}
        if values and self.accelerator.trackers:
            self.accelerator.log(values, step=self.global_step)

    def _release(self) -> None:
        """What only this hook holds: its optimizer step hooks (the manager closes itself at exit)."""
        if self._closed:
            return
        self._closed = True
        for handle in self._step_hooks:
            handle.remove()
        self._held_gradients.close()


class _Progress:
    """The hook's counters and the data position, as a state the manager saves with the rest."""

    def __init__(self, hook: FaultTolerantCheckpoint) -> None:
        self.hook = hook

    def state_dict(self) -> dict[str, Any]:
        hook, acc = self.hook, self.hook.accelerator
        reader = hook._reader
        return {"global_step": hook.global_step, "epoch": hook.epoch,
                "batches_done": hook._batches_done, "epoch_start": hook._epoch_start,
                "prefetched_rng": reader.prefetched(hook._batches_done) if reader is not None else [],
                "accumulates_by_hand": hook._accumulates_by_hand,
                "accumulation_step": acc.step, "gradient_accumulation_steps": acc.gradient_accumulation_steps,
                "num_processes": acc.num_processes, "epoch_batches": hook._epoch_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hook, acc = self.hook, self.hook.accelerator
        hook.global_step, hook.epoch = state["global_step"], state["epoch"]
        hook._batches_done, hook._epoch_start = state["batches_done"], state["epoch_start"]
        hook._prefetched = state.get("prefetched_rng", [])  # absent in checkpoints saved by 0.1.0
        hook._accumulates_by_hand = state.get("accumulates_by_hand", False)  # absent in older checkpoints
        hook._saved_epoch_batches = state.get("epoch_batches")  # absent in older checkpoints
        acc.step = state["accumulation_step"]
        for name, now in (("num_processes", acc.num_processes),
                          ("gradient_accumulation_steps", acc.gradient_accumulation_steps)):
            if state[name] != now:
                log.warning("the checkpoint was saved with %s=%s, this run has %s: model and optimizer are "
                            "restored, but the data position of the resumed epoch is not exact", name, state[name], now)

