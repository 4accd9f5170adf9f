"""The failure rate of this job: a prior from published large-run data, updated from its own journal.

Failures are a Poisson process with rate ``lambda``. The prior on ``lambda`` is log-normal around the
prior MTBF with a spread of ``prior_spread`` (a factor: one standard deviation of ``log lambda`` is
``log(prior_spread)``): weakly informative, so a job's own failures dominate after a few of them,
while a job that has not failed yet keeps the prior. After ``n`` failures in ``T`` seconds of exposure
the likelihood is ``lambda^n e^(-lambda T)``; the posterior is evaluated on a grid of ``log lambda``;
the estimate is ``exp(-E[log lambda])`` and its uncertainty the posterior standard deviation of
``log lambda`` (about the relative uncertainty of the rate).

The default prior is Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs, scaled by this
job's world size (one GPU per rank). From the journal, every attempt that ended without a
``clean_end`` or ``preempted`` event and was followed by another attempt counts as a failure;
exposure is the time from each attempt's start to its last event (the running attempt: until now).

Example:
    >>> m = FailureModel(prior_mtbf=3600.0)
    >>> est = m.estimate(failures=20, exposure=20 * 600.0)
    >>> 500 < est.mtbf < 700, est.failures
    (True, 20)
    >>> round(FailureModel(prior_mtbf=3600.0).estimate(0, 0.0).mtbf / 3600, 1)   # no data: the prior
    1.0
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

LLAMA3_GPU_FAILURE_RATE = 419 / (54 * 86400 * 16384)
"""Unexpected interruptions per GPU-second in Llama 3's 54-day pre-training run (Meta, 2024)."""

_GRID = 1201
_GRID_SIGMAS = 6.0


def prior_mtbf(world_size: int, gpu_failure_rate: float = LLAMA3_GPU_FAILURE_RATE) -> float:
    """The prior MTBF in seconds of a job on ``world_size`` GPUs."""
    return 1.0 / (gpu_failure_rate * max(1, world_size))


@dataclasses.dataclass(frozen=True)
class MTBFEstimate:
    """An MTBF estimate in seconds, with the evidence behind it."""

    mtbf: float
    failures: int
    exposure: float
    relative_uncertainty: float
    """Posterior standard deviation of ``log lambda`` (~ relative uncertainty of the rate)."""


@dataclasses.dataclass(frozen=True)
class FailureModel:
    """Bayesian estimate of the MTBF from a log-normal prior and observed failures."""

    prior_mtbf: float
    prior_spread: float = 10.0

    def posterior(self, failures: int, exposure: float, points: int = _GRID) -> tuple[list[float], list[float]]:
        """``(log_rates, weights)``: the posterior of ``log lambda`` on a grid, weights summing to 1."""
        mu, sigma = -math.log(self.prior_mtbf), math.log(self.prior_spread)
        # Centre the grid between prior and data so that neither falls off its edge.
        centre = mu if failures == 0 else (mu + math.log(failures / max(exposure, 1e-9))) / 2
        half = _GRID_SIGMAS * sigma + abs(centre - mu)
        xs = [centre - half + 2 * half * i / (points - 1) for i in range(points)]
        logp = [failures * x - math.exp(x) * exposure - (x - mu) ** 2 / (2 * sigma**2) for x in xs]
        top = max(logp)
        weights = [math.exp(v - top) for v in logp]
        total = sum(weights)
        return xs, [w / total for w in weights]

    def estimate(self, failures: int, exposure: float) -> MTBFEstimate:
        """The posterior estimate after ``failures`` in ``exposure`` seconds."""
        xs, ws = self.posterior(failures, exposure)
        mean = sum(w * x for w, x in zip(ws, xs))
        var = sum(w * (x - mean) ** 2 for w, x in zip(ws, xs))
        return MTBFEstimate(math.exp(-mean), failures, exposure, math.sqrt(var))


def count_failures(attempts: Iterable[Mapping[str, Any]], now: float | None = None) -> tuple[int, float]:
    """``(failures, exposure seconds)`` from attempt summaries, oldest first.

    Each summary has ``start``, ``end`` (time of its last event) and ``ended`` (a clean end or an
    announced preemption was recorded); the last attempt is the running one, exposed until ``now``.
    """
    attempts = list(attempts)
    failures, exposure = 0, 0.0
    for i, a in enumerate(attempts):
        running = i == len(attempts) - 1
        end = (time.time() if now is None else now) if running else a["end"]
        exposure += max(0.0, end - a["start"])
        if not running and not a["ended"]:
            failures += 1
    return failures, exposure
