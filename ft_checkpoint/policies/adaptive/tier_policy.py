"""Both tiers' intervals from one plan: :class:`MultiLevelInterval`, the adaptive interval of a job with a fast tier.

It plans with each tier's measured save cost (its stall plus the slowdown of the steps while it was written)
and each failure class's learned rate (``classes``), minimising the expected waste of the multi-level model
(``multilevel``): the fast tier every ``T``, every ``k``-th save durable. It re-plans after every save and every
resume, and logs each change with the numbers behind it. The manager uses it when ``interval`` and
``fast_interval`` are both ``"adaptive"`` and a fast tier is configured; its two sides, :attr:`fast` and
:attr:`durable`, are the two tiers' save policies.

Example:
    >>> p = MultiLevelInterval(mtbf="6h")
    >>> p.observe_save("fast", cost=1.0, duration=2.0)
    >>> p.observe_save("durable", cost=300.0, duration=400.0)
    >>> round(p.fast.seconds), p.plan.every, round(p.durable.seconds / 3600, 1)   # 1 save in 76 durable: 3.9 h
    (185, 76, 3.9)
    >>> p.observe_history({"process crash": 10}, exposure=20 * 3600.0)   # 10 crashes in 20 h, all process crashes
    >>> round(p.fast.seconds), p.plan.every, round(p.durable.seconds / 3600, 1)
    (128, 191, 6.8)
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ft_checkpoint.policies.adaptive.classes import CLASSES, CRASH, NODE, ClassRates, class_counts
from ft_checkpoint.policies.adaptive.failures import LLAMA3_GPU_FAILURE_RATE, FailureModel, prior_mtbf
from ft_checkpoint.policies.adaptive.multilevel import TierPlan, plan_tiers
from ft_checkpoint.policies.adaptive.policy import COST_GUESS, FIRST_SAVE_BY
from ft_checkpoint.policies.policy import EveryInterval, SaveContext
from ft_checkpoint.units import human_seconds, parse_duration

log = logging.getLogger(__name__)

FAST, DURABLE = "fast", "durable"
FAST_COST_GUESS = 5.0
"""The fast tier's save cost (seconds) planned with until a save to the fast tier only has measured it: a few
seconds (a copy into host memory of a large state), and at most a tenth of the durable tier's."""
Duration = float | str | datetime.timedelta


class TierInterval(EveryInterval):
    """One tier's save policy in a :class:`MultiLevelInterval` (its interval is the plan's), fed that tier's costs.

    The durable side is due ``lead`` (half the fast interval) early: the manager saves it only together with
    a fast-tier save, so it comes with the first fast-tier save after that.
    """

    def __init__(self, owner: MultiLevelInterval, tier: str) -> None:
        super().__init__(1.0)
        self.owner, self.tier, self.lead = owner, tier, 0.0

    def should_save(self, ctx: SaveContext) -> bool:
        if ctx.save_in_flight or ctx.step == ctx.last_save_step:
            return False
        return ctx.last_save_time is None or ctx.now - ctx.last_save_time >= self.seconds - self.lead

    @property
    def cost(self) -> float | None:
        """This tier's measured save cost (smoothed), or None before its first save."""
        return self.owner.cost[self.tier]

    def observe_save(self, cost: float, durable: float) -> None:
        """A save of this tier: its cost to the training and its time until committed (seconds)."""
        self.owner.observe_save(self.tier, cost=cost, duration=durable)

    def __repr__(self) -> str:
        return f"TierInterval({self.tier}, {self.seconds:g}s)"


class MultiLevelInterval:
    """The plan for both tiers (see the module's docstring).

    Args:
        world_size, mtbf, gpu_failure_rate, min_interval, max_interval, restart, clock: as for
            :class:`~ft_checkpoint.policies.adaptive.policy.AdaptiveInterval` (``min_interval`` bounds both tiers'
            intervals, ``max_interval`` the durable tier's).
        survives: The failure classes a fast-tier step survives: a process crash, and with peer copies on
            another node, one node lost.
        planner: :func:`~ft_checkpoint.policies.adaptive.multilevel.plan_tiers` (the simulation passes a cached one).
    """

    def __init__(self, *, world_size: int = 1, mtbf: Duration | None = None, gpu_failure_rate: float | None = None,
                 min_interval: Duration | None = None, max_interval: Duration | None = None, restart: float = 0.0,
                 survives: Iterable[str] = (CRASH, NODE), clock: Callable[[], float] = time.time,
                 planner: Callable[..., TierPlan] = plan_tiers) -> None:
        if mtbf is not None:  # the user's figure: trusted to within a factor of 2 (as AdaptiveInterval does)
            model = FailureModel(prior_mtbf=parse_duration(mtbf), prior_spread=2.0)
        else:
            model = FailureModel(prior_mtbf=prior_mtbf(world_size, gpu_failure_rate or LLAMA3_GPU_FAILURE_RATE))
        self.rates = ClassRates(model)
        self.min_seconds = parse_duration(min_interval) if min_interval is not None else 0.0
        self.max_seconds = parse_duration(max_interval) if max_interval is not None else math.inf
        self.survives = frozenset(survives)
        self.restart, self.clock, self.planner = restart, clock, planner
        self.cost: dict[str, float | None] = {FAST: None, DURABLE: None}
        self.duration = {FAST: 0.0, DURABLE: 0.0}
        self.counts = {c: 0 for c in CLASSES}
        self.failures = 0
        """Failures of this job before the running attempt, of any class or none, and ``counts`` of known class."""
        self.past_exposure = 0.0
        self._attempt_start = clock()
        self._summaries: list[dict[str, Any]] | None = None
        self._lock = threading.Lock()
        self.fast, self.durable = TierInterval(self, FAST), TierInterval(self, DURABLE)
        self.plan, self.last_decision = self._decide()
        self._apply(self.plan)

    # -- what it learns from ---------------------------------------------------------------------
    def observe_save(self, tier: str, *, cost: float, duration: float) -> None:
        """A save of ``tier`` (``"fast"`` or ``"durable"``): its cost to the training and its time until committed."""
        old = self.cost[tier]
        self.cost[tier] = cost if old is None else 0.5 * old + 0.5 * cost
        self.duration[tier] = duration
        self._recompute()

    def observe_history(self, counts: Mapping[str, int], exposure: float, *, failures: int | None = None,
                        cost: float | None = None) -> None:
        """This job's failures of each class (``failures``: of any class or none; default: their sum) and its
        exposure (seconds) before the running attempt, and what a durable save cost it, when known."""
        if cost is not None and self.cost[DURABLE] is None:
            self.cost[DURABLE] = cost
        self.counts = {c: int(counts.get(c, 0)) for c in CLASSES}
        self.failures = max(sum(self.counts.values()), failures or 0)
        self.past_exposure, self._attempt_start = exposure, self.clock()
        self._recompute()

    def observe_journal(self, summaries: list[dict[str, Any]]) -> None:
        """:meth:`observe_history` from the journal's attempt summaries (``journal.attempt_summaries``)."""
        self._summaries = [dict(s) for s in summaries]
        counts, failures, exposure = class_counts(self._summaries)
        cost = next((s["save_cost"] for s in reversed(summaries) if s.get("save_cost") is not None), None)
        self.observe_history(counts, exposure, failures=failures, cost=cost)
        log.info("multi-level interval: %d failures in %.3g h of this job so far (%s; %d of no known class)", failures,
                 exposure / 3600, ", ".join(f"{c} {n}" for c, n in counts.items()), failures - sum(counts.values()))

    def observe_failure(self, found: str | None) -> None:
        """What the running attempt's resume found in the fast tier (the journal's ``failure_class``): the class of
        the failure before it, once the journal's summaries are known (rank 0)."""
        if self._summaries is None or len(self._summaries) < 2 or found is None:
            return
        self._summaries[-1]["failure_class"] = found
        self.counts, self.failures, _ = class_counts(self._summaries)
        self._recompute()

    # -- the plan --------------------------------------------------------------------------------
    def _decide(self) -> tuple[TierPlan, dict[str, float]]:
        c, d = self.cost[FAST], self.cost[DURABLE]
        d = COST_GUESS if d is None else d
        c = min(FAST_COST_GUESS, d / 10) if c is None else c
        exposure = self.past_exposure + (self.clock() - self._attempt_start)
        est = self.rates.model.estimate(self.failures, exposure)
        share = sum(v for cls, v in self.rates.shares_after(self.counts).items() if cls in self.survives)
        longest = self.max_seconds if self.cost[DURABLE] is not None else min(self.max_seconds, FIRST_SAVE_BY)
        plan = self.planner(fast_cost=c, durable_cost=d, fast_rate=share / est.mtbf, durable_rate=(1 - share) / est.mtbf,
                            restart=self.restart, spread=est.relative_uncertainty,
                            min_fast=max(self.min_seconds, self.duration[FAST]),
                            min_durable=max(self.min_seconds, self.duration[DURABLE]), max_durable=longest)
        fast_rate, durable_rate = share * est.rate, (1 - share) * est.rate  # the rates to expect
        decision = {"fast_interval_s": plan.fast_interval, "durable_interval_s": plan.durable_interval,
                    "durable_every": float(plan.every or math.inf), "fast_cost_s": c, "durable_cost_s": d,
                    "fast_mtbf_s": 1 / fast_rate if fast_rate else math.inf,
                    "durable_mtbf_s": 1 / durable_rate if durable_rate else math.inf,
                    "exposure_s": exposure, "rate_uncertainty": est.relative_uncertainty,
                    "expected_waste": plan.expected_waste,
                    "durable_alone_waste": plan.durable_alone}
        decision.update({f"failures_{cls.replace(' ', '_')}": float(n) for cls, n in self.counts.items()},
                        failures=float(self.failures))
        return plan, decision

    def _apply(self, plan: TierPlan) -> None:
        self.fast.seconds, self.durable.seconds = plan.fast_interval, plan.durable_interval
        self.durable.lead = plan.fast_interval / 2

    def _recompute(self) -> None:
        with self._lock:
            old = self.plan
            self.plan, self.last_decision = self._decide()
            moved = _moved(old.fast_interval, self.plan.fast_interval) or _moved(old.durable_interval,
                                                                                 self.plan.durable_interval)
            if moved and log.isEnabledFor(logging.INFO):
                log.info("%s", self.explain(old))
            self._apply(self.plan)

    def explain(self, old: TierPlan | None = None) -> str:
        """The log line of a change of plan (from ``old``), with the numbers behind it."""
        p, d = self.plan, self.last_decision
        fast, durable = _seconds(p.fast_interval), _seconds(p.durable_interval)
        if old is not None:
            fast, durable = f"{_seconds(old.fast_interval)} -> {fast}", f"{_seconds(old.durable_interval)} -> {durable}"
        guesses = [t for t in (FAST, DURABLE) if self.cost[t] is None]
        guessed = f" ({' and '.join(guesses)} guessed until a save measures it)" if guesses else ""
        counts = {side: ", ".join(f"{c} {self.counts[c]}" for c in CLASSES if (c in self.survives) == side)
                  for side in (True, False)}
        unknown = self.failures - sum(self.counts.values())
        of_no_class = f", {unknown} of no known class" if unknown else ""
        costs = f"save cost c={d['fast_cost_s']:.3g} s fast, d={d['durable_cost_s']:.3g} s durable{guessed}"
        rates = (f"failures the fast tier survives 1 per {d['fast_mtbf_s'] / 3600:.3g} h ({counts[True]}), the durable "
                 f"tier only 1 per {d['durable_mtbf_s'] / 3600:.3g} h ({counts[False]}{of_no_class}) in "
                 f"{d['exposure_s'] / 3600:.3g} h (rates +/-{100 * d['rate_uncertainty']:.0f}%)")
        return (f"tier intervals: fast {fast}, durable {durable} ({_one_in(p.every)}): {costs}; {rates}; expected waste "
                f"{100 * p.expected_waste:.2f}% (durable tier alone {100 * p.durable_alone:.2f}%)")

    def describe(self) -> str:
        """When saves come, in words (for the line a run prints at its start)."""
        p = self.plan
        return (f"multi-level adaptive intervals: the fast tier about every {human_seconds(p.fast_interval)}, "
                f"{_one_in(p.every)} (about every {human_seconds(p.durable_interval)})")

    def __repr__(self) -> str:
        return f"MultiLevelInterval(fast {self.fast.seconds:g}s, durable {self.durable.seconds:g}s)"


def multilevel_for(interval: Any, fast_interval: Any, fast: Any, **adaptive: Any) -> MultiLevelInterval | None:
    """The manager's :class:`MultiLevelInterval`, when ``interval`` and ``fast_interval`` are both ``"adaptive"`` and
    ``fast`` is a fast tier (its peer copies, ``fast.replicas``, decide whether it survives one node lost); else
    None. ``adaptive``: the adaptive interval's options.

    Example:
        >>> multilevel_for("adaptive", "30s", fast=object()) is None     # a fixed fast-tier interval: two policies
        True
    """
    if fast is None or interval != "adaptive" or fast_interval != "adaptive":
        return None
    return MultiLevelInterval(survives=(CRASH, NODE) if fast.replicas else (CRASH,), **adaptive)


def _moved(old: float, new: float) -> bool:
    return old != new and not (abs(new - old) <= 0.05 * old)


def _seconds(x: float | None) -> str:
    if x is None or math.isinf(x):
        return "never"
    return f"{x:.0f} s" if x >= 10 else f"{x:.2g} s"


def _one_in(k: int | None) -> str:
    """Which saves are durable, in words."""
    return "none durable" if k is None else "every save durable" if k == 1 else f"1 save in {k} durable"
