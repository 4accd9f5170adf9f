"""The save interval in the user's words: the policy an ``interval`` setting makes, and what a run says of it
(the start line, the Lightning callback's "next save" line, the figures it logs): one description for all.

Example:
    >>> policy = policy_from_interval(50)
    >>> describe_policy(policy), next_save(policy, policy_metrics(policy), 120, first=False)
    ('a save every 50 steps', 'next save at step 150 (every 50 steps)')
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval
from ft_checkpoint.policies.policy import EveryInterval, EveryNSteps, OnPreemption, SavePolicy, find_policy
from ft_checkpoint.units import every, human_seconds

SHORT_RUNS = "a run that fails sooner has nothing to resume from"
"""What the adaptive interval's first save, planned minutes or hours away, means for a short run."""


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
        return AdaptiveInterval(**adaptive) | OnPreemption()
    return EveryInterval(interval) | OnPreemption()


def describe_policy(policy: SavePolicy) -> str:
    """When saves come, in words, for the line a run prints at its start.

    Example:
        >>> describe_policy(policy_from_interval("30m"))
        'a save every 30 min'
    """
    adaptive = find_policy(policy, AdaptiveInterval)
    if adaptive is not None:
        return (f"adaptive interval: the first save comes about {human_seconds(adaptive.last_decision['interval_s'])} "
                f"in ({_planned_for(adaptive)}); {SHORT_RUNS} (a clean end and a preemption notice save). HINT: set "
                "interval= (steps or a duration) to choose")
    fixed = find_policy(policy, EveryNSteps) or find_policy(policy, EveryInterval)
    if isinstance(fixed, EveryNSteps):
        return f"a save {every(fixed.n, 'step')}"
    if isinstance(fixed, EveryInterval):
        return f"a save every {human_seconds(fixed.seconds)}"
    return f"saves when {policy!r} says so"


def next_save(policy: SavePolicy, metrics: Mapping[str, float], step: int, *, first: bool) -> str:
    """When ``policy`` saves next after ``step``, in words; ``metrics``: the manager's (a plan of two tiers puts
    its durable interval there).

    Example:
        >>> next_save(policy_from_interval("10m"), {"interval_s": 600.0}, 7, first=True)
        'first save due in 10 min (every 10 min)'
    """
    which = "first save" if first else "next save"
    if "interval_steps" in metrics:
        n = int(metrics["interval_steps"])
        return f"{which} at step {(step // n + 1) * n} ({every(n, 'step')})"
    adaptive = find_policy(policy, AdaptiveInterval)
    if adaptive is not None:
        return (f"{which} due in about {human_seconds(metrics['interval_s'])} (adaptive interval, {_planned_for(adaptive)}; "
                f"{SHORT_RUNS}: pass interval=<steps> or a duration such as '10m' for short runs)")
    if "interval_s" in metrics:
        period = human_seconds(metrics["interval_s"])
        return f"{which} due in {period} (every {period})"
    return f"saves when {policy!r} says so"


def policy_metrics(policy: SavePolicy) -> dict[str, float]:
    """The interval figures worth logging: the adaptive policy's last decision, or the fixed interval.

    Example:
        >>> policy_metrics(policy_from_interval(100))
        {'interval_steps': 100.0}
    """
    adaptive = find_policy(policy, AdaptiveInterval)
    if adaptive is not None:
        return dict(adaptive.last_decision)
    fixed = find_policy(policy, EveryInterval) or find_policy(policy, EveryNSteps)
    if isinstance(fixed, EveryInterval):
        return {"interval_s": fixed.seconds}
    return {"interval_steps": float(fixed.n)} if fixed is not None else {}


def _planned_for(adaptive: AdaptiveInterval) -> str:
    """The figures the adaptive interval's plan rests on, with the save cost said to be a guess until measured."""
    d = adaptive.last_decision
    guess = " (a guess until a save measures it)" if adaptive.cost is None else ""
    return f"planned for a save cost of {human_seconds(d['cost_s'])}{guess} and an MTBF of {human_seconds(d['mtbf_s'])}"
