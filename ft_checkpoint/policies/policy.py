"""Save policies: small objects that answer "save now?" from a :class:`SaveContext`.

Combine them with ``|`` (save when any says so). A policy whose answer depends on anything but the
step (time, measured costs) is not ``deterministic``: the manager then lets rank 0 decide and
broadcasts its answer, so every rank saves the same step.

Example:
    >>> p = EveryNSteps(100) | OnPreemption()
    >>> p.should_save(SaveContext(step=200)), p.should_save(SaveContext(step=201))
    (True, False)
    >>> p.should_save(SaveContext(step=201, preempted=True))
    True
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any, Protocol, runtime_checkable

from ft_checkpoint.units import parse_duration

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveContext:
    """What a policy may look at. Times are ``time.monotonic()`` seconds."""

    step: int
    now: float = 0.0
    last_save_step: int | None = None
    last_save_time: float | None = None
    last_stall: float | None = None
    """Seconds the last save blocked the training (staging, plus waiting for the one before)."""
    last_duration: float | None = None
    """Seconds from the last save's start until it was committed."""
    save_in_flight: bool = False
    preempted: bool = False


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether to save at a step boundary."""

    deterministic: bool

    def should_save(self, ctx: SaveContext) -> bool:
        """True to save now."""
        ...


class _Combinable:
    deterministic = True

    def __or__(self, other: SavePolicy) -> AnyOf:
        return AnyOf(self, other)  # type: ignore[arg-type]


class AnyOf(_Combinable):
    """Save when any of ``policies`` says so."""

    def __init__(self, *policies: SavePolicy) -> None:
        self.policies = tuple(policies)
        self.deterministic = all(p.deterministic for p in self.policies)

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


class EveryNSteps(_Combinable):
    """Save at every step that is a multiple of ``n`` (the same steps on every rank and every restart)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n={n}: must be >= 1")
        self.n = n

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step > 0 and ctx.step % self.n == 0 and ctx.step != ctx.last_save_step

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryInterval(_Combinable):
    """Save when ``interval`` (seconds, timedelta or ``"30m"``) has passed since the last save started.

    Never while a save is in flight: the next one waits for a step boundary after it committed.
    """

    deterministic = False

    def __init__(self, interval: float | datetime.timedelta | str) -> None:
        self.seconds = parse_duration(interval)
        if self.seconds <= 0:
            raise ValueError(f"interval={interval!r}: must be positive")

    def should_save(self, ctx: SaveContext) -> bool:
        if ctx.save_in_flight or ctx.step == ctx.last_save_step:
            return False
        return ctx.last_save_time is None or ctx.now - ctx.last_save_time >= self.seconds

    def __repr__(self) -> str:
        return f"EveryInterval({self.seconds:g}s)"


class OnPreemption(_Combinable):
    """Save when a preemption was announced (a signal, a job end time)."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.preempted and ctx.step != ctx.last_save_step

    def __repr__(self) -> str:
        return "OnPreemption()"


def find_policy(policy: Any, kind: type) -> Any:
    """The first policy of type ``kind`` in ``policy`` (which may be an :class:`AnyOf`), or None.

    Example:
        >>> find_policy(EveryNSteps(5) | OnPreemption(), EveryNSteps)
        EveryNSteps(5)
    """
    if isinstance(policy, kind):
        return policy
    for p in getattr(policy, "policies", ()):
        if (found := find_policy(p, kind)) is not None:
            return found
    return None
