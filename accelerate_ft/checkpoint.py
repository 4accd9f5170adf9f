"""``FaultTolerantCheckpoint``: asynchronous checkpoints and exact resume for an Accelerate training loop.

Accelerate has no callbacks, so the hook owns the loop's step boundaries through two iterators:
``epochs()`` starts at the resumed epoch, ``batches()`` skips the batches the resumed epoch already
consumed and, after each optimizer step (a gradient-accumulation sync point), asks the core
:class:`ft_checkpoint.CheckpointManager` whether to save. Policy, storage, commit and retention are
the core's; this module only translates the loop.

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

from ft_checkpoint import CheckpointManager, ConfigError, SaveStats, SavePolicy
from ft_checkpoint.state import rng_state, set_rng_state

from accelerate_ft import data
from accelerate_ft.plugin import SETTINGS, FaultTolerantCheckpointPlugin
from accelerate_ft.state import accelerator_state

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFIX = "ft_checkpoint/"


class FaultTolerantCheckpoint:
    """Checkpoint everything an ``Accelerator`` prepared, asynchronously, and resume exactly after a failure.

    Create it on every rank after ``accelerator.prepare(...)``; it resumes at once from the newest
    verified checkpoint, if any. It saves models, optimizers (through DCP's state-dict helpers, so
    FSDP shards stay sharded), schedulers, the grad scaler, objects passed to
    ``accelerator.register_for_checkpointing``, each rank's RNG states, the data position and its own
    counters.

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
        self._saves_to_report: list[SaveStats] = []
        self.state = accelerator_state(accelerator)
        self.state["progress"] = _Progress(self)
        self.manager = CheckpointManager(policy=policy, **self.plugin.manager_kwargs())
        self.resumed_from: int | None = self.manager.resume(self.state)
        """The global step resumed from, or None on a fresh start."""
        if self.resumed_from is not None:
            self._rng_after_resume = rng_state()
            if self.manager.rank == 0:
                log.info("resumed at global step %d: epoch %d, skipping its first %d batches",
                         self.global_step, self.epoch, self._batches_done)

    # -- the loop ------------------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to run: ``range(num_epochs)`` from the resumed epoch on.

        Example:
            >>> for epoch in ft.epochs(3):   # doctest: +SKIP
            ...     for batch in ft.batches(train_loader): ...
        """
        while self.epoch < num_epochs:
            epoch = self.epoch
            yield epoch
            if self.epoch == epoch:  # batches() did not run to the end (a break, or not called)
                self._start_next_epoch()

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """The batches of the current epoch still to train on; saves after optimizer steps.

        Sets the sampler's epoch, skips (without loading them) the batches the resumed epoch already
        consumed, with the shuffle order of the interrupted run. After each batch whose optimizer step
        ran (``accelerator.sync_gradients``), counts a global step and lets the policy decide to save.
        Inside ``accelerator.accumulate``, saves therefore never fall in the middle of an accumulation.

        Example:
            >>> for batch in ft.batches(train_loader):   # doctest: +SKIP
            ...     with accelerator.accumulate(model):
            ...         accelerator.backward(model(batch)); optimizer.step(); optimizer.zero_grad()
        """
        data.set_epoch(loader, self.epoch)
        skip = self._batches_done
        if self._rng_after_resume is not None and self._epoch_start is not None:
            data.restore_epoch_start(loader, self._epoch_start)
        elif self._rng_after_resume is not None:
            log.warning("the checkpoint has no shuffle state for epoch %d: the resumed epoch may see another order",
                        self.epoch)
        else:
            self._epoch_start = data.capture_epoch_start(loader)
        for index, batch in enumerate(data.remaining(self.accelerator, loader, skip), start=skip):
            self._finish_resume()
            yield batch
            self._batches_done = index + 1
            self._after_batch()
        self._finish_resume()
        self._start_next_epoch()

    @property
    def batches_done(self) -> int:
        """Batches of the current epoch consumed so far (after a resume, including the skipped ones)."""
        return self._batches_done

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait until the last save committed (re-raising a background error), then release the writer."""
        self.manager.close()
        self._report_commits()

    def __enter__(self) -> FaultTolerantCheckpoint:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.manager.__exit__(exc_type, *exc)
        if exc_type is None:
            self._report_commits()

    # -- internals -----------------------------------------------------------------------------
    def _finish_resume(self) -> None:
        """After the resumed iterator drew its seeds: put back the RNG states the checkpoint restored."""
        if self._rng_after_resume is not None:
            set_rng_state(self._rng_after_resume)
            self._rng_after_resume = None

    def _start_next_epoch(self) -> None:
        self.epoch += 1
        self._batches_done = 0
        self._epoch_start = None

    def _after_batch(self) -> None:
        if not self.accelerator.sync_gradients:
            return  # mid-accumulation: the partial gradients are not saved, so never save here
        self.global_step += 1
        self._report_commits()
        metadata = {"epoch": self.epoch, "batches_done": self._batches_done}
        if self.manager.maybe_save(self.global_step, self.state, epoch=self.epoch, metadata=metadata):
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


class _Progress:
    """The hook's counters and the data position, as a state the manager saves with the rest."""

    def __init__(self, hook: FaultTolerantCheckpoint) -> None:
        self.hook = hook

    def state_dict(self) -> dict[str, Any]:
        acc = self.hook.accelerator
        return {"global_step": self.hook.global_step, "epoch": self.hook.epoch,
                "batches_done": self.hook._batches_done, "epoch_start": self.hook._epoch_start,
                "accumulation_step": acc.step, "gradient_accumulation_steps": acc.gradient_accumulation_steps,
                "num_processes": acc.num_processes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hook, acc = self.hook, self.hook.accelerator
        hook.global_step, hook.epoch = state["global_step"], state["epoch"]
        hook._batches_done, hook._epoch_start = state["batches_done"], state["epoch_start"]
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
