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


def policy_from_interval(interval: int | datetime.timedelta | str, **adaptive: Any) -> SavePolicy:
    """The policy for a config's ``interval`` (always combined with :class:`OnPreemption`).

    ``adaptive`` holds :class:`AdaptiveInterval`'s options, used when ``interval == "adaptive"``.

    Example:
        >>> policy_from_interval(500)
        EveryNSteps(500) | OnPreemption()
    """
    if isinstance(interval, int):
        return EveryNSteps(interval) | OnPreemption()
    if interval == "adaptive":
        from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval  # it builds on EveryInterval, defined here

        return AdaptiveInterval(**adaptive) | OnPreemption()
    return EveryInterval(interval) | OnPreemption()


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


def describe_policy(policy: SavePolicy) -> str:
    """When saves come, in words, for the line a run prints at its start.

    Example:
        >>> describe_policy(policy_from_interval("30m"))
        'a save every 30 min'
    """
    from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval
    from ft_checkpoint.units import every, human_seconds

    adaptive = find_policy(policy, AdaptiveInterval)
    if adaptive is not None:
        d = adaptive.last_decision
        return (f"adaptive interval: the first save comes about {human_seconds(d['interval_s'])} in (save cost "
                f"{'guessed' if adaptive.cost is None else 'measured'} {d['cost_s']:.3g} s, MTBF "
                f"{human_seconds(d['mtbf_s'])}); a run that fails sooner has nothing to resume from (a clean end "
                "and a preemption notice save). HINT: set interval= (steps or a duration) to choose")
    fixed = find_policy(policy, EveryNSteps) or find_policy(policy, EveryInterval)
    if isinstance(fixed, EveryNSteps):
        return f"a save {every(fixed.n, 'step')}"
    if isinstance(fixed, EveryInterval):
        return f"a save every {human_seconds(fixed.seconds)}"
    return f"saves when {policy!r} says so"


def policy_metrics(policy: SavePolicy) -> dict[str, float]:
    """The interval figures worth logging: the adaptive policy's last decision, or the fixed interval.

    Example:
        >>> policy_metrics(policy_from_interval(100))
        {'interval_steps': 100.0}
    """
    from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval

    adaptive = find_policy(policy, AdaptiveInterval)
    if adaptive is not None:
        return dict(adaptive.last_decision)
    fixed = find_policy(policy, EveryInterval) or find_policy(policy, EveryNSteps)
    if isinstance(fixed, EveryInterval):
        return {"interval_s": fixed.seconds}
    return {"interval_steps": float(fixed.n)} if fixed is not None else {}
