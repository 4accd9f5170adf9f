"""The adaptive interval as a save policy: Daly's optimum from the measured save cost and the learned MTBF.

Example:
    >>> p = AdaptiveInterval(mtbf="6h")
    >>> p.observe_save(cost=300.0, durable=400.0)
    >>> round(p.seconds / 60)     # Daly: 57 min for d = 5 min, M = 6 h (a little less: M is uncertain)
    50
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from collections.abc import Callable

from ft_checkpoint.policies.adaptive.failures import LLAMA3_GPU_FAILURE_RATE, FailureModel, count_failures, prior_mtbf
from ft_checkpoint.policies.adaptive.interval import daly_interval, expected_waste
from ft_checkpoint.policies.policy import EveryInterval
from ft_checkpoint.units import parse_duration

log = logging.getLogger(__name__)

COST_GUESS = 60.0
"""The save cost (seconds) the adaptive policy plans with until a save has measured it: one minute, the
middle of the range seen in practice (seconds for small models, minutes for large ones). The first
save then comes at Daly's optimum for that cost, not at once: a save right after the start would
protect almost nothing, and for a costly state that is minutes of training lost to a mere probe.
(The storage path is checked at the start anyway: the lease is written and read back there.)"""
FIRST_SAVE_BY = 1800.0
"""The latest the first save comes (seconds), while the cost is a guess: a small job's prior MTBF is
months (one GPU at Llama 3's rate: years), and with a guessed minute its interval would be hours, where
a measured cost of a tenth of a second gives half an hour; no job should run hours without a checkpoint
only to learn that its saves are cheap."""


class AdaptiveInterval(EveryInterval):
    """Save at the interval that minimises expected wasted time, from measured cost and learned MTBF.

    The cost ``d`` of a save is what the training lost to it (the stall plus the slowdown of steps while
    the write ran), smoothed over recent saves; until the first save has measured it, the interval plans
    for ``COST_GUESS`` (and is at most ``FIRST_SAVE_BY``). The failure rate comes from a prior
    (``mtbf``, or a per-GPU failure rate times ``world_size``; default: Llama 3's rate) updated with
    this job's own failures and exposure (see ``failures``); a prior given as ``mtbf`` is trusted to
    within a factor of 2, the published default to within a factor of 10. The interval is Daly's optimum
    for the failure rate to expect now, the posterior mean (the Bayes decision: an interval's expected
    loss is, to first order, linear in the rate). While the prior is wide and the job young that rate is
    well above the typical one, so the interval is shorter; it lengthens with every hour survived and
    converges to Daly's optimum as failures accumulate. Never shorter than a save takes to become
    durable or than ``min_interval``, never longer than ``max_interval``. Re-evaluated after every save
    and every resume (the running attempt's exposure read from ``clock``); each change is logged with
    its reasons.

    Example:
        >>> p = AdaptiveInterval(mtbf="6h")
        >>> p.observe_save(cost=300.0, durable=400.0)
        >>> round(p.seconds / 60)     # Daly: 57 min for d = 5 min, M = 6 h (a little less: M is uncertain)
        50
        >>> p.observe_history(failures=10, exposure=60 * 3600.0)     # resumed after 10 failures in 60 h
        >>> round(p.seconds / 60)     # the data agree with the prior: Daly's 57 min
        57
    """

    def __init__(self, *, world_size: int = 1, mtbf: float | str | datetime.timedelta | None = None,
                 gpu_failure_rate: float | None = None, min_interval: float | str | datetime.timedelta | None = None,
                 max_interval: float | str | datetime.timedelta | None = None, restart: float = 0.0,
                 clock: Callable[[], float] = time.time) -> None:
        if mtbf is not None:  # the user's own figure: trusted to within a factor of 2
            self.model = FailureModel(prior_mtbf=parse_duration(mtbf), prior_spread=2.0)
        else:  # published data from another job: a factor of 10
            self.model = FailureModel(prior_mtbf=prior_mtbf(world_size, gpu_failure_rate or LLAMA3_GPU_FAILURE_RATE))
        self.min_seconds = parse_duration(min_interval) if min_interval is not None else 0.0
        self.max_seconds = parse_duration(max_interval) if max_interval is not None else math.inf
        self.restart = restart
        self.clock = clock
        self.cost: float | None = None
        self.durable = 0.0
        self.failures, self.past_exposure = 0, 0.0
        self._attempt_start = clock()
        self._lock = threading.Lock()
        self.last_decision = self._decide()
        self.seconds = self.last_decision["interval_s"]

    def observe_history(self, failures: int, exposure: float, cost: float | None = None) -> None:
        """This job's failures and exposure (seconds) before the running attempt (from the journal),
        and what a save cost it, when known (then this attempt needs no probe save to measure it)."""
        if cost is not None and self.cost is None:
            self.cost = cost
        self.failures, self.past_exposure = failures, exposure
        self._attempt_start = self.clock()
        self._recompute()

    def observe_journal(self, summaries: list[dict]) -> None:
        """:meth:`observe_history` from the journal's attempt summaries (``journal.attempt_summaries``): the
        failures and exposure they count, the newest save cost they recorded."""
        failures, exposure = count_failures(summaries)
        cost = next((s["save_cost"] for s in reversed(summaries) if s.get("save_cost") is not None), None)
        self.observe_history(failures, exposure, cost=cost)  # a known cost replaces the guess
        est = self.model.estimate(failures, exposure)
        log.info("adaptive interval: %d failures in %.3g h of this job so far; MTBF estimate %.3g h (+/-%.0f%%)",
                 failures, exposure / 3600, est.mtbf / 3600, 100 * est.relative_uncertainty)

    def observe_save(self, cost: float, durable: float) -> None:
        """One save's measured cost to the training and its time until durable (seconds)."""
        self.cost = cost if self.cost is None else 0.5 * self.cost + 0.5 * cost
        self.durable = durable
        self._recompute()

    def _clamp(self, seconds: float, durable: float) -> float:
        return min(self.max_seconds, max(seconds, self.min_seconds, durable))

    def _decide(self) -> dict[str, float]:
        """Daly's interval for the cost (measured, else ``COST_GUESS``) and the MTBF to expect now."""
        cost = COST_GUESS if self.cost is None else self.cost
        exposure = self.past_exposure + (self.clock() - self._attempt_start)
        est = self.model.estimate(self.failures, exposure)
        mtbf = 1 / est.rate  # the MTBF to plan for
        planned = daly_interval(cost, mtbf)
        if self.cost is None:
            planned = min(planned, FIRST_SAVE_BY)
        interval = self._clamp(planned, self.durable)
        return {"interval_s": interval, "cost_s": cost, "mtbf_s": mtbf, "failures": float(est.failures),
                "exposure_s": exposure, "expected_waste": expected_waste(interval, cost, mtbf, self.restart),
                "most_likely_mtbf_s": est.mtbf, "relative_uncertainty": est.relative_uncertainty}

    def _recompute(self) -> None:
        with self._lock:
            d = self.last_decision = self._decide()
            if abs(d["interval_s"] - self.seconds) > 0.05 * self.seconds:
                guessed = "" if self.cost is not None else " (a guess until a save measures it)"
                log.info("checkpoint interval %s s -> %s s: save cost d=%.2f s%s, MTBF M=%.3g h (%d failures "
                         "in %.3g h; most likely %.3g h +/-%.0f%%), expected waste %.2f%%", _seconds(self.seconds),
                         _seconds(d["interval_s"]), d["cost_s"], guessed, d["mtbf_s"] / 3600, d["failures"],
                         d["exposure_s"] / 3600, d["most_likely_mtbf_s"] / 3600, 100 * d["relative_uncertainty"],
                         100 * d["expected_waste"])
            self.seconds = d["interval_s"]

    def __repr__(self) -> str:
        return f"AdaptiveInterval({self.seconds:g}s)"


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"
