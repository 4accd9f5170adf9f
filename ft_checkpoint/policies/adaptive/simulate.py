"""A discrete-event simulation of a long job under failures, comparing checkpoint-interval policies.

Each run does ``work`` seconds of useful compute. It computes for ``tau`` seconds, then checkpoints
(cost ``d``); a failure loses the work since the last checkpoint and costs a restart of ``R``.
Failures form a renewal process in wall time (exponential, or Weibull with a given shape and the same
mean), drawn from the seed alone, so every policy meets the same failures at the same times. Policies:

- ``fixed 15m`` / ``fixed 1h`` / ``fixed 3h``: a fixed interval;
- ``checkfreq``: CheckFreq's overhead-only rule (FAST '21): the shortest interval that hides the
  write, widened while the checkpoint overhead exceeds 5% (``tau = max(write, 20 d)``);
- ``oracle``: Daly's optimum with the true MTBF;
- ``ours``: :class:`~ft_checkpoint.policies.policy.AdaptiveInterval`, learning the MTBF from no history (prior:
  Llama 3's failure rate on ``world_size`` GPUs) and the cost from its first save (planned with
  ``COST_GUESS`` until then), told the cost after a save and the failures and exposure at each restart.

Waste is the fraction of wall time that is not useful work: over a whole run (``all``), until the
restart after the 5th failure (``before``: the same moment for every policy, since failures come in
wall time) and from then on (``after``). ``before`` is a short window whose waste depends much on
luck: it is averaged over ``early_seeds`` runs that stop there (3,000 by default: the standard error
of ours' ratio to a fixed interval is then about 0.5%).

Example:
    >>> r = simulate_scenario(mtbf=3600, cost=30, seeds=1, early_seeds=10, work_mtbfs=5)
    >>> sorted(r) == sorted(POLICIES) and 0 < r["oracle"]["all"] < r["fixed 3h"]["all"]
    True
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable, Iterator

from ft_checkpoint.policies.adaptive.interval import daly_interval
from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval

POLICIES = ("fixed 15m", "fixed 1h", "fixed 3h", "checkfreq", "oracle", "ours")
LEARNED_AFTER = 5
REVIEW_GROWTH = 1.1
"""Ours is re-evaluated after every failure and after the first save once the exposure grew by this
factor, not after every save as in a real job: its interval moves by under 5% in between, which
changes the waste by about 0.1%, and a run takes dozens of evaluations instead of thousands."""
GIVE_UP = 1000
"""A run not done after ``GIVE_UP`` times its work in wall time stops there (its waste is > 99.9%)."""


def failure_times(rng: random.Random, mtbf: float, shape: float | None = None) -> Iterator[float]:
    """Absolute failure times of a renewal process with mean gap ``mtbf`` (Weibull if ``shape``)."""
    t = 0.0
    scale = mtbf / math.gamma(1 + 1 / shape) if shape else 0.0
    while True:
        t += rng.weibullvariate(scale, shape) if shape else rng.expovariate(1 / mtbf)
        yield t


class _Fixed:
    review_at = math.inf

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def saved(self, now: float) -> None:
        pass

    def failed(self, now: float, failures: int) -> None:
        pass


class _Ours:
    """:class:`AdaptiveInterval` on simulated time. It keeps the cost it measured across restarts: a
    real job passes it to ``observe_history`` when it resumes."""

    def __init__(self, world_size: int, restart: float, cost: float) -> None:
        self.now, self.cost, self.review_at = 0.0, cost, 0.0
        self.policy = AdaptiveInterval(world_size=world_size, restart=restart, clock=lambda: self.now)

    @property
    def seconds(self) -> float:
        return self.policy.seconds

    def saved(self, now: float) -> None:
        self.now, self.review_at = now, now * REVIEW_GROWTH
        self.policy.observe_save(cost=self.cost, durable=self.cost)

    def failed(self, now: float, failures: int) -> None:
        self.now, self.review_at = now, now * REVIEW_GROWTH
        self.policy.observe_history(failures, now)


def _run(policy: _Fixed | _Ours, failures: Iterator[float], *, work: float, cost: float, restart: float,
         stop_when_learned: bool = False) -> dict[str, float]:
    """One run's waste fractions. It leaps over the whole segments between events: a failure, a
    save after which the policy is to be re-evaluated, the end of the work."""
    t = done = 0.0
    count, mark = 0, None
    next_failure = next(failures)
    while work - done > 1e-9 * work and t < GIVE_UP * work:
        step = min(policy.seconds, work - done)
        seg = step + cost
        to_review = max(1, math.ceil((policy.review_at - t) / seg)) if policy.review_at < math.inf else math.inf
        k = min(math.floor((next_failure - t) / seg), to_review, math.floor((work - done) / step * (1 + 1e-12)))
        if k > 0:
            t, done = t + k * seg, done + k * step
            if t >= policy.review_at:
                policy.saved(t)
            continue
        t, count = next_failure + restart, count + 1
        while next_failure < t:  # failures during the restart restart it again
            next_failure = next(failures)
            if next_failure < t:
                t, count = next_failure + restart, count + 1
        policy.failed(t, count)
        if count >= LEARNED_AFTER and mark is None:
            mark = (t, done)
            if stop_when_learned:
                break
    return waste_fractions(t, done, mark, count, only_before=stop_when_learned)


def waste_fractions(t: float, done: float, mark: tuple[float, float] | None, failures: int, *,
                    only_before: bool = False) -> dict[str, float]:
    """A run's waste fractions, ``all``, ``before`` and ``after`` ``mark`` (the time and work done at the restart after
    the 5th failure), from its wall time ``t`` and work ``done`` at the end.

    Example:
        >>> waste_fractions(100.0, 80.0, (50.0, 45.0), 7)
        {'all': 0.19999999999999996, 'before': 0.09999999999999998, 'after': 0.30000000000000004, 'failures': 7.0}
    """
    t_mark, done_mark = mark or (t, done)
    before = 1 - done_mark / t_mark if t_mark > 0 else 0.0
    if only_before:
        return {"before": before}
    after = 1 - (done - done_mark) / (t - t_mark) if t > t_mark else float("nan")
    return {"all": 1 - done / t, "before": before, "after": after, "failures": float(failures)}


def simulate_scenario(mtbf: float, cost: float, *, restart: float = 60.0, seeds: int = 20,
                      early_seeds: int = 3000, work_mtbfs: float = 50.0, shape: float | None = None,
                      world_size: int = 1024) -> dict[str, dict[str, float]]:
    """Mean waste fractions of every policy for one (MTBF, cost) scenario.

    ``all``, ``after`` (from the 5th failure on) and ``failures`` average ``seeds`` runs of
    ``work_mtbfs`` MTBFs of work; ``before`` (until the 5th failure) averages ``early_seeds`` runs
    that stop there.
    """
    def runs(name: str, n: int, early: bool) -> list[dict[str, float]]:
        out = []
        for seed in range(n):
            rng = random.Random(f"{seed}-{float(mtbf)}-{float(cost)}-{shape}")
            policy = _Ours(world_size, restart, cost) if name == "ours" else _Fixed(_fixed_interval(name, mtbf, cost))
            out.append(_run(policy, failure_times(rng, mtbf, shape), work=work_mtbfs * mtbf, cost=cost,
                            restart=restart, stop_when_learned=early))
        return out

    return mean_wastes(POLICIES, runs, seeds, early_seeds)


def mean_wastes(policies: Iterable[str], runs: Callable[[str, int, bool], list[dict[str, float]]], seeds: int,
                early_seeds: int) -> dict[str, dict[str, float]]:
    """Each policy's mean waste fractions: ``all``, ``after`` and ``failures`` of ``runs(name, seeds, False)``, and
    ``before`` of ``runs(name, early_seeds, True)`` (runs that stop at the 5th failure).

    Example:
        >>> mean_wastes(["a"], lambda name, n, early: [waste_fractions(100.0, 80.0, (50.0, 45.0), 7)] * n, 2, 3)
        {'a': {'all': 0.19999999999999996, 'after': 0.30000000000000004, 'failures': 7.0, 'before': 0.09999999999999998}}
    """
    totals = {}
    for name in policies:
        full, early = runs(name, seeds, False), runs(name, early_seeds, True)
        totals[name] = {k: statistics.fmean(r[k] for r in full) for k in ("all", "after", "failures")}
        totals[name]["before"] = statistics.fmean(r["before"] for r in early)
    return totals


def _fixed_interval(name: str, mtbf: float, cost: float) -> float:
    if name.startswith("fixed"):
        return {"15m": 900.0, "1h": 3600.0, "3h": 10800.0}[name.split()[1]]
    if name == "checkfreq":
        return max(cost, 20 * cost)
    if name == "oracle":
        return daly_interval(cost, mtbf)
    raise ValueError(f"unknown policy {name!r}")
