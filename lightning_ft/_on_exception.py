"""``save_on_exception``: remember the last batch end a resume could start after, and after an exception
save it if every rank can (agreed with a deadline: other ranks may never reach the exception hook).

Example:
    >>> safe = SafePoints(drain_timeout=5.0)
    >>> safe.agreed(ValueError("boom")) is None   # no batch end remembered yet
    True
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ft_checkpoint.state import rng_state
from lightning_ft import _lightning_internals as internals
from lightning_ft._data import EpochStart

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

AGREE_TIMEOUT = 30.0
"""Seconds ranks wait for each other to agree on a save after an exception (``save_on_exception``, DDP)."""


@dataclasses.dataclass
class SafePoint:
    """The end of the last batch a resume could start after."""

    step: int
    loops: dict[str, Any]
    rng: dict[str, Any]
    epoch_start: EpochStart | None


class SafePoints:
    """The safe point of the current fit, and whether an optimizer step began since (then it is not safe)."""

    def __init__(self, drain_timeout: float) -> None:
        self.drain_timeout = drain_timeout
        self.point: SafePoint | None = None
        self._stepped = False
        self._hooks: list[Any] = []
        self._group: Any = None

    def setup(self, trainer: pl.Trainer) -> None:
        """At fit setup: under DDP, a gloo group to agree in after an exception, with a deadline."""
        self.point, self._stepped = None, False
        if trainer.world_size > 1 and dist.is_initialized():
            timeout = datetime.timedelta(seconds=min(self.drain_timeout, AGREE_TIMEOUT))
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def watch_optimizers(self, optimizers: list[Any]) -> None:
        """Note every optimizer step (DeepSpeed's ZeRO optimizers have no step hooks: the callback calls
        :meth:`optimizer_step` from ``on_before_optimizer_step`` for them)."""
        self._hooks = [opt.register_step_pre_hook(self.optimizer_step) for opt in optimizers
                       if hasattr(opt, "register_step_pre_hook")]

    def optimizer_step(self, *_: Any) -> None:
        self._stepped = True

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def remember(self, trainer: pl.Trainer, step: int | None, epoch_start: EpochStart | None) -> None:
        """At a step's batch end: ``step`` is safe (None: a resume could not start after this batch)."""
        self._stepped = False
        self.point = None if step is None else SafePoint(
            step=step, loops=copy.deepcopy(internals.loops_state(trainer)), rng=rng_state(), epoch_start=epoch_start)

    def agreed(self, exception: BaseException) -> SafePoint | None:
        """After ``exception``: the safe point every rank has (the same step, no optimizer step since), or None
        (with a warning saying why nothing is saved)."""
        point = self.point
        step = self._agree(point.step if point is not None and not self._stepped else None)
        if step is None or point is None:
            log.warning("save_on_exception: not saving after the %s: it came inside an optimizer step, at a batch a "
                        "resume cannot start after, or not on every rank at the same step; the last committed "
                        "checkpoint stays the newest", type(exception).__name__)
            return None
        return point

    def _agree(self, step: int | None) -> int | None:
        """``step`` if every rank can save that same step, else None. Under DDP, waits :data:`AGREE_TIMEOUT` at most."""
        if self._group is None:
            return step
        steps: list[Any] = [None] * dist.get_world_size(self._group)
        try:
            dist.all_gather_object(steps, step, group=self._group)
        except RuntimeError as e:
            log.warning("save_on_exception: not every rank reached the exception within %.0f s (%s)",
                        min(self.drain_timeout, AGREE_TIMEOUT), e)
            return None
        return step if len(set(steps)) == 1 else None


def run_within(timeout: float, fn: Callable[[], None]) -> None:
    """Run ``fn`` on a helper thread; stop waiting for it after ``timeout`` s (a peer rank may be gone)."""
    worker = threading.Thread(target=fn, name="lightning-ft-drain", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        log.warning("the checkpoint save in flight did not commit within %.0f s after the exception; giving "
                    "up on it. The last committed checkpoint is intact", timeout)
