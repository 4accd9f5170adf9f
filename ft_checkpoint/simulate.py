"""A discrete-event simulation of a long job under failures, comparing checkpoint-interval policies.

Each run does ``work`` seconds of useful compute. It computes for ``tau`` seconds, then checkpoints
(cost ``d``); a failure loses the work since the last checkpoint and costs a restart of ``R``.
Failures form a renewal process in wall time (exponential, or Weibull with a given shape and the same
mean), drawn once per seed so every policy meets the same failures. Policies:

- ``fixed 15m`` / ``fixed 1h`` / ``fixed 3h``: a fixed interval;
- ``checkfreq``: CheckFreq's overhead-only rule (FAST '21): the shortest interval that hides the
  write, widened while the checkpoint overhead exceeds 5% (``tau = max(write, 20 d)``);
- ``oracle``: Daly's optimum with the true MTBF;
- ``ours``: :class:`~ft_checkpoint.policy.AdaptiveInterval`, learning the MTBF from no history (prior:
  Llama 3's failure rate on ``world_size`` GPUs) and the cost from its first save.

Waste is the fraction of wall time that is not useful work, reported over the whole run, before the
5th failure and from it on.

Example:
    >>> r = simulate_scenario(mtbf=3600, cost=30, seeds=1, work_mtbfs=5)
    >>> sorted(r) == sorted(POLICIES) and 0 < r["oracle"]["all"] < r["fixed 3h"]["all"]
    True
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator

from ft_checkpoint.interval import daly_interval
from ft_checkpoint.policy import AdaptiveInterval

POLICIES = ("fixed 15m", "fixed 1h", "fixed 3h", "checkfreq", "oracle", "ours")
LEARNED_AFTER = 5


def failure_times(rng: random.Random, mtbf: float, shape: float | None = None) -> Iterator[float]:
    """Absolute failure times of a renewal process with mean gap ``mtbf`` (Weibull if ``shape``)."""
    t = 0.0
    scale = mtbf / math.gamma(1 + 1 / shape) if shape else 0.0
    while True:
        t += rng.weibullvariate(scale, shape) if shape else rng.expovariate(1 / mtbf)
        yield t


class _Ours:
    """The adaptive policy driven by simulated time: relearns after each failure and as exposure grows."""

    def __init__(self, world_size: int, restart: float) -> None:
        self.policy = AdaptiveInterval(world_size=world_size, restart=restart)
        self.failures, self.learned_at = 0, 0.0

    def interval(self, now: float) -> float:
        if self.policy.cost is not None and now > 2 * self.learned_at:
            self.learn(now)
        return self.policy.seconds

    def learn(self, now: float) -> None:
        self.policy.observe_history(self.failures, now)
        self.learned_at = now

    def checkpointed(self, cost: float, now: float) -> None:
        if self.policy.cost is None:
            self.policy.observe_history(self.failures, now)
            self.policy.observe_save(cost=cost, durable=cost)
            self.learned_at = now

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.policy.cost is not None:
            self.learn(now)


def _run(interval: Callable[[float], float], on_checkpoint: Callable[[float], None],
         on_failure: Callable[[float], None], failures: Iterator[float], *, work: float, cost: float,
         restart: float, stop_when_learned: bool = False) -> dict[str, float]:
    t = done = 0.0
    marks: dict[str, tuple[float, float]] = {}
    count = 0
    next_failure = next(failures)
    while done < work:
        seg = min(interval(t), work - done)
        end = t + seg + cost
        if end <= next_failure:
            t, done = end, done + seg
            on_checkpoint(t)
            continue
        t = next_failure + restart
        count += 1
        while next_failure < t:  # failures during the restart restart it again
            next_failure = next(failures)
            if next_failure < t:
                t, count = next_failure + restart, count + 1
        on_failure(t)
        if count >= LEARNED_AFTER and "learned" not in marks:
            marks["learned"] = (t, done)
            if stop_when_learned:
                return {"before": 1 - done / t}
    t_mark, done_mark = marks.get("learned", (t, done))
    before = 1 - done_mark / t_mark if t_mark > 0 else 0.0
    after = 1 - (work - done_mark) / (t - t_mark) if t > t_mark else float("nan")
    return {"all": 1 - work / t, "before": before, "after": after, "failures": float(count)}


def simulate_scenario(mtbf: float, cost: float, *, restart: float = 60.0, seeds: int = 3,
                      work_mtbfs: float = 50.0, shape: float | None = None, world_size: int = 1024,
                      early_seeds: int | None = None) -> dict[str, dict[str, float]]:
    """Mean waste fractions of every policy for one (MTBF, cost) scenario.

    ``all`` and ``after`` (from the 5th failure on) average ``seeds`` runs of ``work_mtbfs`` MTBFs
    of work; ``before`` (until the 5th failure) averages ``early_seeds`` runs (default ``10 * seeds``)
    that stop there, since that short window needs many runs to average out luck.
    """
    work = work_mtbfs * mtbf
    totals: dict[str, dict[str, float]] = {p: {} for p in POLICIES}
    early_seeds = early_seeds or 10 * seeds
    for seed in range(max(seeds, early_seeds)):
        for name in POLICIES:
            for early in (False, True):
                if seed >= (early_seeds if early else seeds):
                    continue
                result = _simulate_one(name, seed, mtbf, cost, restart, work, shape, world_size, early)
                n = early_seeds if early else seeds
                for k, v in result.items():
                    if early == (k == "before"):
                        totals[name][k] = totals[name].get(k, 0.0) + v / n
    return totals


def _simulate_one(name: str, seed: int, mtbf: float, cost: float, restart: float, work: float,
                  shape: float | None, world_size: int, early: bool) -> dict[str, float]:
    rng = random.Random(f"{seed}-{float(mtbf)}-{float(cost)}-{shape}")
    ours = _Ours(world_size, restart) if name == "ours" else None
    fixed = _fixed_interval(name, mtbf, cost)
    return _run(
        ours.interval if ours else (lambda now: fixed),
        (lambda now: ours.checkpointed(cost, now)) if ours else (lambda now: None),
        ours.failed if ours else (lambda now: None),
        failure_times(rng, mtbf, shape), work=work, cost=cost, restart=restart, stop_when_learned=early)


def _fixed_interval(name: str, mtbf: float, cost: float) -> float:
    if name.startswith("fixed"):
        return {"15m": 900.0, "1h": 3600.0, "3h": 10800.0}[name.split()[1]]
    if name == "checkfreq":
        return max(cost, 20 * cost)
    if name == "oracle":
        return daly_interval(cost, mtbf)
    return 0.0
