"""Failure classes: which tier each of a job's restarts needed, and each class's rate, learned from its journal.

At every resume the fast tier looks at what each node's folder still holds and the journal's ``resume`` event
records it (``failure_class``): a **process crash** (every node's own folder survived), **one node lost** (one
node's folder is gone: the peer copies on the next node are needed), or **more** (several nodes' folders are
gone, or the job came back with another world size: only the durable tier serves). No fast-tier mark on any
node (``no fast-tier step``) is "more" if the failed attempt had committed a fast-tier step (its progress note
says so), and unknown otherwise; so is every failure of a job without a fast tier. An unknown failure is split
among the classes in proportion to the known ones (and the prior shares).

Each class's rate is the job's failure rate times the class's share of the failures, both learned. The job's
rate is learned as today (see ``failures``: a log-normal prior, the job's exposure, a Poisson likelihood; every
failure counts, of any class or none). The shares have a Dirichlet prior, updated by the failures whose class
is known; the two posteriors are independent (a Poisson number of failures, each of a class at random), so a
class's expected rate is the product of the two posterior means. A crash thus raises the rate to expect of
every class (a job that fails often fails often in every way) and moves the shares towards crashes.
The prior shares are DLRover's (Ant Group, 2024): about three quarters of faults recover by restarting the
processes; the quarter left is split 4 to 1 between one node lost and more (a guess). Their weight is
``SHARE_WEIGHT`` failures: a few failures of the job's own outweigh them.

Example:
    >>> summaries = [{"start": 0, "end": 3600, "ended": False},
    ...              {"start": 3700, "end": 7200, "ended": False, "failure_class": CRASH},
    ...              {"start": 7300, "end": 7300, "ended": False, "failure_class": NODE}]
    >>> counts, failures, exposure = class_counts(summaries, now=7300)
    >>> counts[CRASH], counts[NODE], counts[MORE], failures, exposure
    (1, 1, 0, 2, 7100.0)
    >>> rates = ClassRates(FailureModel(prior_mtbf=10 * 3600.0)).estimate(counts, failures, exposure)
    >>> rates[CRASH] > rates[NODE] > rates[MORE]
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ft_checkpoint.policies.adaptive.failures import FailureModel, count_failures

CRASH, NODE, MORE = "process crash", "one node lost", "more"
CLASSES = (CRASH, NODE, MORE)
NO_FAST_STEP = "no fast-tier step"
"""What a resume records when no node's fast tier holds a committed step (nothing to tell the class from)."""
PRIOR_SHARES = {CRASH: 0.75, NODE: 0.20, MORE: 0.05}


def class_of(failed: Mapping[str, Any], next_attempt: Mapping[str, Any]) -> str | None:
    """The class of the failure that ended the attempt ``failed``, from what ``next_attempt``'s resume found
    (its ``failure_class``); None if unknown.

    Example:
        >>> class_of({"fast_step": 40}, {"failure_class": NO_FAST_STEP}), class_of({}, {"failure_class": NO_FAST_STEP})
        ('more', None)
    """
    found = next_attempt.get("failure_class")
    if found == NO_FAST_STEP:
        return MORE if failed.get("fast_step") is not None else None
    return found if found in CLASSES else None


def class_counts(summaries: Iterable[Mapping[str, Any]], now: float | None = None
                 ) -> tuple[dict[str, int], int, float]:
    """``({class: failures of that class}, failures, exposure seconds)`` from the journal's attempt summaries,
    oldest first (``failures`` of any class or none, as ``failures.count_failures`` counts them)."""
    summaries = list(summaries)
    total, exposure = count_failures(summaries, now=now)
    known = {c: 0 for c in CLASSES}
    for failed, after in zip(summaries, summaries[1:]):
        cls = class_of(failed, after) if failed.get("ended") is not True else None
        if cls is not None:
            known[cls] += 1
    return known, max(total, sum(known.values())), exposure


@dataclasses.dataclass(frozen=True)
class ClassRates:
    """The job's failure rate (a :class:`~ft_checkpoint.policies.adaptive.failures.FailureModel`) and each class's share."""

    model: FailureModel
    shares: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(PRIOR_SHARES))
    weight: float = 2.0
    """How many failures the prior shares weigh (the Dirichlet prior's concentration)."""

    def shares_after(self, counts: Mapping[str, float]) -> dict[str, float]:
        """Each class's expected share of the failures after ``counts`` failures of known class.

        Example:
            >>> round(ClassRates(FailureModel(prior_mtbf=3600.0)).shares_after({NODE: 8})[NODE], 2)
            0.84
        """
        known = sum(counts.get(c, 0) for c in CLASSES)
        return {c: (self.weight * self.shares[c] + counts.get(c, 0)) / (self.weight + known) for c in CLASSES}

    def estimate(self, counts: Mapping[str, float], failures: float, exposure: float) -> dict[str, float]:
        """Each class's expected rate (per second) after ``failures`` in ``exposure`` seconds, ``counts`` of them of
        known class.

        Example:
            >>> r = ClassRates(FailureModel(prior_mtbf=3600.0, prior_spread=2.0))
            >>> rates = r.estimate({CRASH: 8, NODE: 2}, 10, 10 * 3600.0)
            >>> round(3600 * sum(rates.values()), 2), round(rates[CRASH] / sum(rates.values()), 2)
            (1.01, 0.79)
        """
        rate = self.model.estimate(failures, exposure).rate
        return {c: rate * share for c, share in self.shares_after(counts).items()}
