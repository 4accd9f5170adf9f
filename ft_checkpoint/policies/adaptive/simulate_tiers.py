"""A discrete-event simulation of a long job with a fast tier and a durable tier, under failures of two classes.

Each run does ``work`` seconds of useful compute: ``T`` seconds, then a save to the fast tier (cost ``c``);
every ``k``-th save goes to the durable tier instead (cost ``d``). Failures come in wall time as in
``simulate`` (exponential, or Weibull with the same mean), each a process crash with probability ``crash``
(the share of the mix), else a node lost, drawn from the seed alone so that every policy meets the same
failures at the same times. The fast tier has no peer copies here: a process crash loses the work since the
newest step of either tier, a node lost the work since the newest durable step (with peer copies a node
lost counts with the crashes, and "more" takes its place: the same table). Each failure costs a restart of
``R`` (a failure during it restarts it; a node lost then rolls back to the durable step). The durable save
comes ``k`` saves after the last one, counted across restarts (the manager counts the time since the durable
step, carried over a resume from the fast tier). Policies:

- ``1m+1h``, ...: fixed intervals (:data:`FIXED`), the durable one a multiple of the fast one (Megatron's
  ``non_persistent_save_interval`` beside ``save_interval``, Orbax's per-tier intervals);
- ``durable alone``: one tier, every failure to the durable tier, at Daly's optimum for the true total rate;
- ``fast alone``: the fast tier only, at Daly's optimum for the true crash rate (a node lost loses the run);
- ``oracle``: the multi-level plan (:func:`~ft_checkpoint.policies.adaptive.multilevel.plan_tiers`) with true rates;
- ``ours``: :class:`~ft_checkpoint.policies.adaptive.tier_policy.MultiLevelInterval` learning from no history (the prior
  of a ``world_size``-GPU job at Llama 3's rate, DLRover's shares), each tier's cost from its first save,
  told each failure's class and the exposure at every restart, and re-planned as in ``simulate``.

Waste is measured as in ``simulate``: ``all``, ``before`` the restart after the 5th failure (over
``early_seeds`` runs that stop there) and ``after`` it.

Example:
    >>> r = simulate_tiers(mtbf=3600, fast_cost=1, durable_cost=60, crash=0.75, seeds=1, early_seeds=5, work_mtbfs=5)
    >>> r["oracle"]["all"] < r["durable alone"]["all"]
    True
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator

from ft_checkpoint.policies.adaptive.classes import CRASH, NODE
from ft_checkpoint.policies.adaptive.interval import daly_interval
from ft_checkpoint.policies.adaptive.multilevel import TierPlan, plan_tiers
from ft_checkpoint.policies.adaptive.simulate import (
    GIVE_UP,
    LEARNED_AFTER,
    REVIEW_GROWTH,
    failure_times,
    mean_wastes,
    waste_fractions,
)
from ft_checkpoint.policies.adaptive.tier_policy import DURABLE, FAST, MultiLevelInterval

FIXED = {"1m+1h": (60.0, 3600.0), "1m+3h": (60.0, 10800.0), "10m+1h": (600.0, 3600.0), "10m+3h": (600.0, 10800.0)}
"""Fixed two-tier schedules: the fast and the durable tier's intervals (seconds), as jobs configure them (the fast
tier every minute to every few minutes, the durable tier every hour to every few hours)."""
POLICIES = (*FIXED, "durable alone", "fast alone", "oracle", "ours")
RATE_GRID, SPREAD_GRID = 0.01, 0.05
"""Ours, in the simulation, plans with each rate rounded to a relative step of 1% and their uncertainty (the standard
deviation of their log) to 0.05 (its plans are cached, thousands of runs meeting the same few failures): the
intervals move by 0.5% at most, the waste by far less."""


class _Plan:
    """A fixed plan: ``fast_interval`` and ``every``."""

    review_at = math.inf

    def __init__(self, fast_interval: float, every: int | None) -> None:
        self.fast_interval, self.every = fast_interval, every

    def saved(self, now: float, tier: str) -> None:
        pass

    def failed(self, now: float, counts: dict[str, int]) -> None:
        pass


class _Ours:
    """:class:`MultiLevelInterval` on simulated time (it keeps the costs it measured across restarts)."""

    def __init__(self, world_size: int, restart: float, fast_cost: float, durable_cost: float) -> None:
        self.now, self.review_at = 0.0, 0.0
        self.costs = {FAST: fast_cost, DURABLE: durable_cost}
        self.policy = MultiLevelInterval(world_size=world_size, restart=restart, survives=(CRASH,),
                                         clock=lambda: self.now, planner=_cached_plan)

    @property
    def fast_interval(self) -> float:
        return self.policy.plan.fast_interval

    @property
    def every(self) -> int | None:
        return self.policy.plan.every

    def saved(self, now: float, tier: str) -> None:
        """A save of ``tier``: the first one measures its cost; later ones re-plan once the exposure grew."""
        if self.policy.cost[tier] is None or now >= self.review_at:
            self.now, self.review_at = now, now * REVIEW_GROWTH
            self.policy.observe_save(tier, cost=self.costs[tier], duration=self.costs[tier])

    def failed(self, now: float, counts: dict[str, int]) -> None:
        self.now, self.review_at = now, now * REVIEW_GROWTH
        self.policy.observe_history(counts, now)


def _cached_plan(*, fast_rate: float, durable_rate: float, spread: float, **costs: float) -> TierPlan:
    return _plan_on_grid(_grid(fast_rate), _grid(durable_rate), round(spread / SPREAD_GRID), tuple(sorted(costs.items())))


def _grid(rate: float) -> int:
    return round(math.log(rate) / RATE_GRID) if rate > 0 else -(10**9)


@functools.lru_cache(maxsize=100_000)
def _plan_on_grid(fast: int, durable: int, spread: int, costs: tuple[tuple[str, float], ...]) -> TierPlan:
    rate = lambda g: math.exp(g * RATE_GRID) if g > -(10**9) else 0.0  # noqa: E731
    return plan_tiers(fast_rate=rate(fast), durable_rate=rate(durable), spread=spread * SPREAD_GRID, **dict(costs))


def failures(rng: random.Random, mtbf: float, crash: float, shape: float | None = None) -> Iterator[tuple[float, str]]:
    """``(time, class)`` of each failure: a renewal process of mean gap ``mtbf``, a crash with chance ``crash``."""
    classes = random.Random(rng.random())
    for t in failure_times(rng, mtbf, shape):
        yield t, CRASH if classes.random() < crash else NODE


def _run(policy: _Plan | _Ours, events: Iterator[tuple[float, str]], *, work: float, fast_cost: float,
         durable_cost: float, restart: float, stop_when_learned: bool = False) -> dict[str, float]:
    """One run's waste fractions; it leaps over runs of fast-tier segments between events."""
    t = done = durable_done = 0.0
    since_durable, count, mark = 0, 0, None
    counts = {CRASH: 0, NODE: 0}
    next_failure, cls = next(events)
    while work - done > 1e-9 * work and t < GIVE_UP * work:
        step = min(policy.fast_interval, work - done)
        every = policy.every
        if every is not None and since_durable + 1 >= every:  # the durable segment, one at a time
            if t + step + durable_cost <= next_failure:
                t, done, since_durable = t + step + durable_cost, done + step, 0
                durable_done = done
                policy.saved(t, DURABLE)
                continue
        else:
            seg = step + fast_cost
            to_review = max(1, math.ceil((policy.review_at - t) / seg)) if policy.review_at < math.inf else math.inf
            to_durable = every - 1 - since_durable if every is not None else math.inf
            k = int(min(math.floor((next_failure - t) / seg), to_review, to_durable,
                        math.floor((work - done) / step * (1 + 1e-12))))
            if k > 0:
                t, done, since_durable = t + k * seg, done + k * step, since_durable + k
                if t >= policy.review_at:
                    policy.saved(t, FAST)
                continue
        t, count, lost_node = next_failure + restart, count + 1, cls == NODE
        counts[cls] += 1
        next_failure, cls = next(events)
        while next_failure < t:  # failures during the restart restart it again
            t, count, lost_node = next_failure + restart, count + 1, lost_node or cls == NODE
            counts[cls] += 1
            next_failure, cls = next(events)
        if lost_node:
            done, since_durable = durable_done, 0
        policy.failed(t, dict(counts))
        if count >= LEARNED_AFTER and mark is None:
            mark = (t, done)
            if stop_when_learned:
                break
    return waste_fractions(t, done, mark, count, only_before=stop_when_learned)


def simulate_tiers(mtbf: float, fast_cost: float, durable_cost: float, crash: float, *, restart: float = 60.0,
                   seeds: int = 20, early_seeds: int = 1000, work_mtbfs: float = 50.0, shape: float | None = None,
                   world_size: int = 1024) -> dict[str, dict[str, float]]:
    """Mean waste fractions of every policy for one cell (see the module's docstring)."""
    rates = {"fast_rate": crash / mtbf, "durable_rate": (1 - crash) / mtbf}
    costs = {"fast_cost": fast_cost, "durable_cost": durable_cost, "restart": restart}

    def make(name: str) -> _Plan | _Ours:
        if name == "ours":
            return _Ours(world_size, restart, fast_cost, durable_cost)
        if name == "oracle":
            p = plan_tiers(**rates, **costs)
            return _Plan(p.fast_interval, p.every)
        if name == "durable alone":
            return _Plan(daly_interval(durable_cost, mtbf), 1)
        if name == "fast alone":
            return _Plan(daly_interval(fast_cost, mtbf / crash) if crash else mtbf, None)
        fast, durable = FIXED[name]
        return _Plan(fast, max(1, round(durable / fast)))

    def runs(name: str, n: int, early: bool) -> list[dict[str, float]]:
        return [_run(make(name), failures(random.Random(f"{seed}-{float(mtbf)}-{crash}-{shape}"), mtbf, crash, shape),
                     work=work_mtbfs * mtbf, fast_cost=fast_cost, durable_cost=durable_cost, restart=restart,
                     stop_when_learned=early) for seed in range(n)]

    return mean_wastes(POLICIES, runs, seeds, early_seeds)
