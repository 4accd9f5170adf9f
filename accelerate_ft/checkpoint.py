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

import difflib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from accelerate_ft import _accelerate_internals as internals
from accelerate_ft import data
from accelerate_ft.plugin import SETTINGS, FaultTolerantCheckpointPlugin
from accelerate_ft.state import accelerator_state
from ft_checkpoint import CheckpointManager, ConfigError, SavePolicy, SaveStats
from ft_checkpoint.state import rng_state

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFIX = "ft_checkpoint/"


class FaultTolerantCheckpoint:
    """Checkpoint everything an ``Accelerator`` prepared, asynchronously, and resume exactly after a failure.

    Create it on every rank after ``accelerator.prepare(...)``; it resumes at once from the newest
    verified checkpoint, if any. One line on stderr (main process) says where checkpoints go, what was
    resumed and when the first save is due. It saves models, optimizers
    (through DCP's state-dict helpers, so FSDP shards stay sharded; under DDP the buffers are rank
    0's; under the DeepSpeed plugin each engine saves itself, see ``ft_checkpoint.deepspeed``),
    schedulers, the grad scaler, objects passed to ``accelerator.register_for_checkpointing``,
    each rank's RNG states, the data position and its own counters.

    Saves happen only right after an optimizer step: at the sync points of ``accelerator.accumulate``,
    and in a loop that accumulates by hand (``if step % accum == 0: optimizer.step()``) after the
    batches whose ``optimizer.step()`` ran; so a checkpoint never needs half-accumulated gradients.
    ``with`` or :meth:`close` ends it; without either it closes when the interpreter exits (journaled
    as a clean end unless an exception ended the program).

    Args:
        accelerator: The ``Accelerator`` that prepared the training objects.
        dirpath: Local path or fsspec URL (``s3://bucket/run``); else ``FT_CHECKPOINT_DIRPATH`` or the
            YAML file named by ``FT_CHECKPOINT_CONFIG``.
        plugin: A :class:`FaultTolerantCheckpointPlugin` instead of ``dirpath`` and ``**config``.
        policy: A core ``SavePolicy`` replacing the one ``interval`` names.
        **config: Any ``CheckpointConfig`` field: ``interval`` (optimizer steps or ``"30m"``),
            ``keep_last``, ``storage_options``, ``async_save``, ...

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
                 **config: Any) -> None:
        if plugin is not None and (dirpath is not None or config):
            raise ConfigError("pass either plugin= or dirpath/config arguments, not both. "
                              "HINT: put every setting in the plugin")
        _check_config_names(config)
        self.plugin = plugin or FaultTolerantCheckpointPlugin(dirpath=dirpath, **config)
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
        self._saves_to_report: list[SaveStats] = []
        self.state = accelerator_state(accelerator)
        self.state["progress"] = _Progress(self)
        self.manager = CheckpointManager(policy=policy, **self.plugin.manager_kwargs())
        self._stepped = False
        self._step_hooks = [opt.register_step_post_hook(self._optimizer_stepped)
                            for opt in internals.optimizers(accelerator) if hasattr(opt, "register_step_post_hook")]
        self._closed = False
        self.resumed_from: int | None = self.manager.resume(self.state)
        """The global step resumed from, or None on a fresh start."""
        if self.resumed_from is not None:
            self._rng_after_resume = rng_state()
            if self.manager.rank == 0:
                log.info("resumed at global step %d: epoch %d, %d of its batches done", self.global_step, self.epoch,
                         self._batches_done)

    # -- the loop ------------------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to run: ``range(num_epochs)`` from the resumed epoch on.

        When the last epoch is done, waits until the last save committed (so that a following
        ``accelerator.end_training()`` cannot end the process group under a save in flight).

        Example:
            >>> for epoch in ft.epochs(3):   # doctest: +SKIP
            ...     for batch in ft.batches(train_loader): ...
        """
        while self.epoch < num_epochs:
            epoch = self.epoch
            yield epoch
            if self.epoch == epoch:  # batches() did not run to the end (a break, or not called)
                self._start_next_epoch()
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

        Example:
            >>> for batch in ft.batches(train_loader):   # doctest: +SKIP
            ...     with accelerator.accumulate(model):
            ...         accelerator.backward(model(batch)); optimizer.step(); optimizer.zero_grad()
        """
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
            self._stepped = False
            yield index, batch
            self._batches_done = index + 1
            self._after_batch()
        self._start_next_epoch()

    @property
    def batches_done(self) -> int:
        """Batches of the current epoch consumed so far (after a resume, including the skipped ones)."""
        return self._batches_done

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait until the last save committed (re-raising a background error), then release the writer."""
        self._release()
        self.manager.close()
        self._report_commits()

    def __enter__(self) -> FaultTolerantCheckpoint:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._release()
        self.manager.__exit__(exc_type, *exc)
        if exc_type is None:
            self._report_commits()

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
        prefetched = self._prefetched if self.plugin.save_rng_state else []  # save_rng_state=False: no RNG restored
        self._reader = data.EpochReader(loader, self._batches_done, resume_rng=resume_rng, prefetched=prefetched,
                                        replay_in_workers=replay_in_workers, epoch=self.epoch)
        self._prefetched = []
        return self._reader

    def _start_next_epoch(self) -> None:
        self.epoch += 1
        self._batches_done = 0
        self._epoch_start = None
        self._reader = None

    def _optimizer_stepped(self, *_: Any) -> None:
        self._stepped = True

    def _after_batch(self) -> None:
        if not self.accelerator.sync_gradients:
            return  # mid-accumulation: the partial gradients are not saved, so never save here
        if self._step_hooks and not self._stepped:
            return  # accumulating by hand (no optimizer step in this batch): not a step boundary either
        self.global_step += 1
        self._report_commits()
        metadata = {"epoch": self.epoch, "batches_done": self._batches_done}
        if self.manager.maybe_save(self.global_step, self.state, epoch=self.epoch, metadata=metadata):
            assert self.manager.last_save is not None
            if self.manager.last_save.durable:  # a fast-tier save reports no time to durable
                self._saves_to_report.append(self.manager.last_save)
            started = self.manager.metrics()  # this save's stall and the current interval
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
                "accumulation_step": acc.step, "gradient_accumulation_steps": acc.gradient_accumulation_steps,
                "num_processes": acc.num_processes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hook, acc = self.hook, self.hook.accelerator
        hook.global_step, hook.epoch = state["global_step"], state["epoch"]
        hook._batches_done, hook._epoch_start = state["batches_done"], state["epoch_start"]
        hook._prefetched = state.get("prefetched_rng", [])  # absent in checkpoints saved by 0.1.0
        acc.step = state["accumulation_step"]
        for name, now in (("num_processes", acc.num_processes),
                          ("gradient_accumulation_steps", acc.gradient_accumulation_steps)):
            if state[name] != now:
                log.warning("the checkpoint was saved with %s=%s, this run has %s: model and optimizer are "
                            "restored, but the data position of the resumed epoch is not exact", name, state[name], now)


def _check_config_names(config: dict[str, Any]) -> None:
    for name in config:
        if name not in SETTINGS:
            close = difflib.get_close_matches(name, SETTINGS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known settings: {', '.join(SETTINGS)}"
            raise ConfigError(f"FaultTolerantCheckpoint got an unknown setting {name!r}. HINT: {hint}")
