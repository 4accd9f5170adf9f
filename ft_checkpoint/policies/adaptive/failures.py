"""The failure rate of this job: a prior from published large-run data, updated from its own journal.

Failures are a Poisson process with rate ``lambda``. The prior on ``lambda`` is log-normal around the
prior MTBF with a spread of ``prior_spread`` (a factor: one standard deviation of ``log lambda`` is
``log(prior_spread)``): weakly informative, so a job's own failures dominate after a few of them.
After ``n`` failures in ``T`` seconds of exposure the likelihood is ``lambda^n e^(-lambda T)``: time
without a failure is evidence too (it rules out high rates), and one failure soon after the start is
strong evidence of a high one.

Two numbers come out of the posterior. The ``rate`` is its mean, the failure rate to expect from
now on given everything seen: what the checkpoint interval plans for (the expected loss of an interval
is, to first order, linear in the rate, so planning for the mean rate is the Bayes decision). Under a
wide prior it is well above the typical rate, since a job with no history may be one of the rare ones
that fail every few minutes; each hour survived rules more of those out. The ``mtbf`` is the most
probable MTBF (``1 / lambda`` at the posterior mode of ``log lambda``), with ``relative_uncertainty``
the posterior standard deviation of ``log lambda``. The mean is a ratio of two integrals, each by
Laplace's method (Tierney and Kadane, 1986): within 8% of exact quadrature, within 1% from the 3rd
failure on.

The default prior is Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs, scaled by this
job's world size (one GPU per rank). From the journal, every attempt that ended without a
``clean_end`` or ``preempted`` event and was followed by another attempt counts as a failure;
exposure is the time from each attempt's start to its last event (the running attempt: until now).

Example:
    >>> m = FailureModel(prior_mtbf=3600.0)
    >>> est = m.estimate(failures=20, exposure=20 * 600.0)
    >>> 500 < est.mtbf < 700, 500 < 1 / est.rate < 700, est.failures
    (True, True, 20)
    >>> est = FailureModel(prior_mtbf=3600.0).estimate(0, 0.0)        # no data: the prior ...
    >>> round(est.mtbf / 3600, 1), round(1 / est.rate / 60)             # ... whose mean rate is high
    (1.0, 4)
    >>> round(1 / FailureModel(prior_mtbf=3600.0).estimate(0, 3600.0).rate / 3600, 1)  # 1 h survived
    2.9
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ft_checkpoint.store.jsonfile import is_number

log = logging.getLogger(__name__)

LLAMA3_GPU_FAILURE_RATE = 419 / (54 * 86400 * 16384)
"""Unexpected interruptions per GPU-second in Llama 3's 54-day pre-training run (Meta, 2024)."""


def prior_mtbf(world_size: int, gpu_failure_rate: float = LLAMA3_GPU_FAILURE_RATE) -> float:
    """The prior MTBF in seconds of a job on ``world_size`` GPUs."""
    return 1.0 / (gpu_failure_rate * max(1, world_size))


@dataclasses.dataclass(frozen=True)
class MTBFEstimate:
    """An MTBF estimate in seconds, with the evidence behind it."""

    mtbf: float
    """The most probable MTBF: ``1 / lambda`` at the posterior mode of ``log lambda``."""
    failures: float
    """Failures seen (a fraction where a failure's class is uncertain: see ``classes``)."""
    exposure: float
    relative_uncertainty: float
    """Posterior standard deviation of ``log lambda`` (~ relative uncertainty of the rate)."""
    rate: float
    """The posterior mean of ``lambda``: failures per second to expect from now on."""


@dataclasses.dataclass(frozen=True)
class FailureModel:
    """Bayesian estimate of the failure rate from a log-normal prior and observed failures."""

    prior_mtbf: float
    prior_spread: float = 10.0

    def estimate(self, failures: float, exposure: float) -> MTBFEstimate:
        """The posterior estimate after ``failures`` in ``exposure`` seconds."""
        log_evidence, mode, curvature = self._laplace(failures, exposure)
        log_evidence_1, _, _ = self._laplace(failures + 1, exposure)  # the same integral times lambda
        return MTBFEstimate(math.exp(-mode), failures, exposure, 1 / math.sqrt(curvature),
                            math.exp(log_evidence_1 - log_evidence))

    def _laplace(self, n: float, exposure: float) -> tuple[float, float, float]:
        """Laplace's approximation of ``log of the integral of lambda^n e^(-lambda T) prior(log lambda)``:
        ``(value, mode, curvature)`` in ``x = log lambda``."""
        mu, var = -math.log(self.prior_mtbf), math.log(self.prior_spread) ** 2
        # The slope n - T e^x - (x - mu) / var falls with x; from a start at or right of its zero,
        # Newton's steps walk left to it without overshooting.
        x = mu + n * var
        if exposure > 0:
            x = min(x, max(mu, math.log(n / exposure) if n else mu))
        for _ in range(100):
            e = exposure * math.exp(x)
            step = (n - e - (x - mu) / var) / (e + 1 / var)
            x += step
            if abs(step) < 1e-10:
                break
        curvature = exposure * math.exp(x) + 1 / var
        return n * x - exposure * math.exp(x) - (x - mu) ** 2 / (2 * var) - math.log(curvature) / 2, x, curvature


def count_failures(attempts: Iterable[Mapping[str, Any]], now: float | None = None) -> tuple[int, float]:
    """``(failures, exposure seconds)`` from attempt summaries, oldest first.

    Each summary has ``start``, ``end`` (time of its last event) and ``ended`` (a clean end or an
    announced preemption was recorded); the last attempt is the running one, exposed until ``now``.
    A summary whose times are not finite numbers is skipped with a warning: it can only come from a
    garbled journal, and one infinite exposure would make the job look as if it never failed.

    Example:
        >>> count_failures([{"start": 0, "end": 50, "ended": False}, {"start": 60, "end": 60, "ended": False}], now=100)
        (1, 90.0)
    """
    attempts = list(attempts)
    failures, exposure = 0, 0.0
    for i, a in enumerate(attempts):
        running = i == len(attempts) - 1
        end = (time.time() if now is None else now) if running else a.get("end")
        if not (is_number(a.get("start")) and is_number(end)):
            log.warning("ignoring attempt %s in the failure count: start=%r, end=%r are not finite times",
                        a.get("attempt"), a.get("start"), end)
            continue
        exposure += max(0.0, end - a["start"])
        if not running and a.get("ended") is not True:
            failures += 1
    return failures, exposure
