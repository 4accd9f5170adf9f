"""Goodput of a job from its journal: where the wall-clock time went, per attempt and in total.

The wall time runs from the first attempt's start to the last attempt's last sign of life. It splits
into

- **restart gaps**: from an attempt's last sign of life to the next attempt's start (the process was
  dead, being rescheduled or starting up);
- **loading**: each resume's measured time to find, verify and load its checkpoint;
- **checkpoint stall**: what the training waited for saves (the ``stall`` of each ``save_started``);
- **recomputed work**: after an attempt ended, the next one resumed from step ``r``; whatever the
  attempt did after reaching step ``r`` is lost and done again. In steps: its last progress note
  (``last_step``, from ``progress.json``) minus ``r``. In seconds: from the moment it reached ``r`` (the
  ``save_started`` of step ``r``, or its own resume from ``r``) to its last sign of life;
- **useful training**: the rest.

``goodput = useful / wall``. The journal cannot know when a killed process died: the time between its
last sign of life and the kill counts as restart gap, and ``last_step`` is the last progress note. On a
local or shared filesystem every step is noted (one small write in place, see ``Journal.notes_every_step``):
the count is exact. On an object store a note is written at every save and at most every
``progress_interval`` (a config field, 10 s by default) in between, so after a failure it can trail the
step really reached by up to that much training time: the report then says "at least N" steps
(``recomputed_exact`` False) and how much training it may miss per failure (:attr:`GoodputReport.may_miss_s`);
with ``progress_interval=0`` every step is noted there too.

Example:
    >>> from ft_checkpoint.run.journal import Journal
    >>> from ft_checkpoint.store.storage import Storage
    >>> s = Storage("memory://doc/goodput")
    >>> j = Journal(s, attempt="20261129T000000.000000Z-aaaaaa")
    >>> j.record("attempt_start", world_size=1)
    >>> report = goodput_report(s)
    >>> len(report.attempts), report.failures
    (1, 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ft_checkpoint.run.journal import JournalReader
from ft_checkpoint.store.storage import Storage

CLEAN_END, PREEMPTED, FAILED, UNFINISHED = "clean_end", "preempted", "failed", "unfinished"


@dataclasses.dataclass
class AttemptReport:
    """One start of the training process and what its time was spent on."""

    attempt: str
    start: float
    end: float
    outcome: str
    """``clean_end``, ``preempted``, ``failed`` (ended without either and was restarted) or ``unfinished``
    (the last attempt without a clean end: still running, or died and was not restarted)."""
    resumed_from: int | None = None
    last_step: int | None = None
    stall_s: float = 0.0
    load_s: float = 0.0
    recomputed_steps: int | None = None
    """Steps the next attempt did again (None for the last attempt, or without a progress note)."""
    recomputed_s: float = 0.0
    recomputed_since: float | None = None
    """When the lost span began (this attempt reached the step the next one resumed from)."""
    recomputed_exact: bool = True
    """Whether ``recomputed_steps`` is exact (the attempt noted every step: ``progress_interval=0``) or a
    lower bound (its last progress note may trail the step it really reached)."""
    progress_interval: float | None = None
    """How often the attempt noted its progress (seconds; None if its journal does not say)."""
    gap_after_s: float | None = None
    saves: list[tuple[float, int | None]] = dataclasses.field(default_factory=list)
    """``(time, step)`` of each ``save_started``."""
    commits: list[tuple[float, int | None]] = dataclasses.field(default_factory=list)
    resumed_at: float | None = None

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def useful_s(self) -> float:
        return max(0.0, self.duration_s - self.load_s - self.stall_s - self.recomputed_s)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(duration_s=self.duration_s, useful_s=self.useful_s,
                 saves=[{"time": t, "step": s} for t, s in self.saves],
                 commits=[{"time": t, "step": s} for t, s in self.commits])
        return d


@dataclasses.dataclass
class GoodputReport:
    """Every attempt, oldest first, and the totals of the job."""

    url: str
    attempts: list[AttemptReport]
    skipped: list[str] = dataclasses.field(default_factory=list)
    """Journal files (URLs) skipped because they did not parse or were wrongly typed."""

    @property
    def wall_s(self) -> float:
        return max(0.0, self.attempts[-1].end - self.attempts[0].start) if self.attempts else 0.0

    @property
    def useful_s(self) -> float:
        return sum(a.useful_s for a in self.attempts)

    @property
    def stall_s(self) -> float:
        return sum(a.stall_s for a in self.attempts)

    @property
    def load_s(self) -> float:
        return sum(a.load_s for a in self.attempts)

    @property
    def recomputed_s(self) -> float:
        return sum(a.recomputed_s for a in self.attempts)

    @property
    def recomputed_steps(self) -> int:
        return sum(a.recomputed_steps or 0 for a in self.attempts)

    @property
    def recomputed_exact(self) -> bool:
        """Whether :attr:`recomputed_steps` is exact, not a lower bound."""
        return all(a.recomputed_exact for a in self.attempts if a.recomputed_steps is not None)

    @property
    def may_miss_s(self) -> float | None:
        """How much training per failure :attr:`recomputed_steps` may miss: the longest ``progress_interval``
        of a failed attempt whose count is a lower bound (0 when exact; None when an attempt's is unknown)."""
        inexact = [a.progress_interval for a in self.attempts if a.recomputed_steps is not None and not a.recomputed_exact]
        return None if None in inexact else max([0.0, *(x for x in inexact if x is not None)])

    @property
    def gap_s(self) -> float:
        return sum(a.gap_after_s or 0.0 for a in self.attempts)

    @property
    def failures(self) -> int:
        return sum(a.outcome == FAILED for a in self.attempts)

    @property
    def preemptions(self) -> int:
        return sum(a.outcome == PREEMPTED for a in self.attempts)

    @property
    def goodput(self) -> float | None:
        """Useful training time / wall time (None before any time has passed)."""
        return self.useful_s / self.wall_s if self.wall_s > 0 else None

    def totals(self) -> dict[str, Any]:
        names = ("wall_s", "useful_s", "stall_s", "load_s", "recomputed_s", "recomputed_steps", "recomputed_exact",
                 "may_miss_s", "gap_s", "failures", "preemptions", "goodput")
        return {"attempts": len(self.attempts), **{n: getattr(self, n) for n in names}}

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "total": self.totals(), "attempts": [a.to_dict() for a in self.attempts],
                "skipped": list(self.skipped)}


def goodput_report(storage: Storage) -> GoodputReport:
    """Read the journal of ``storage`` and account for every second of the job.

    Journal files that do not parse or are wrongly typed are skipped with a warning naming them
    (``skipped`` of the report lists them).

    Example:
        >>> goodput_report(Storage("memory://doc/no-journal")).attempts
        []
    """
    reader = JournalReader(storage)
    by_attempt: dict[str, list[dict[str, Any]]] = {}
    for event in reader.events():
        by_attempt.setdefault(event["attempt"], []).append(event)
    attempts = [_attempt(s, by_attempt.get(s["attempt"], [])) for s in reader.summaries()]
    for before, after in zip(attempts, attempts[1:], strict=False):
        _charge_restart(before, after)
    return GoodputReport(url=storage.url, attempts=attempts, skipped=reader.skipped)


def _attempt(summary: dict[str, Any], events: list[dict[str, Any]]) -> AttemptReport:
    """An attempt's own numbers, from its summary and its events."""
    kinds = {e["event"] for e in events}
    outcome = PREEMPTED if PREEMPTED in kinds else CLEAN_END if CLEAN_END in kinds else UNFINISHED
    a = AttemptReport(attempt=summary["attempt"], start=summary["start"], end=summary["end"], outcome=outcome,
                      last_step=summary.get("last_step"))
    for e in events:
        if e["event"] == "attempt_start" and isinstance(e.get("progress_interval"), (int, float)):
            a.progress_interval = float(e["progress_interval"])
        if e["event"] == "resume":
            a.resumed_from, a.resumed_at, a.load_s = e.get("step"), e["time"], float(e.get("seconds") or 0.0)
        elif e["event"] == "save_started":
            a.saves.append((e["time"], e.get("step")))
            a.stall_s += float(e.get("stall") or 0.0)
        elif e["event"] == "commit":
            a.commits.append((e["time"], e.get("step")))
    return a


def _charge_restart(before: AttemptReport, after: AttemptReport) -> None:
    """What the restart from ``before`` to ``after`` cost: the gap, and the work ``after`` redid."""
    if before.outcome == UNFINISHED:
        before.outcome = FAILED
    before.gap_after_s = max(0.0, after.start - before.end)
    resumed = after.resumed_from or 0
    if before.last_step is not None:
        before.recomputed_steps = max(0, before.last_step - resumed)
        before.recomputed_exact = before.outcome != FAILED or before.progress_interval == 0
    if before.recomputed_steps == 0:
        return
    reached = next((t for t, step in before.saves if step == resumed), None)
    if reached is None:
        reached = before.resumed_at if before.resumed_from == resumed and before.resumed_at is not None else before.start
    before.recomputed_since = reached
    before.recomputed_s = max(0.0, before.end - reached)


def plot_timeline(report: GoodputReport, path: str) -> None:
    """Draw the attempts on a time axis with saves, failures and recomputed spans; write a PNG.

    Raises:
        ImportError: matplotlib is missing, with the command that installs it.

    Example:
        >>> plot_timeline(GoodputReport("memory://x", []), "/tmp/timeline.png")  # doctest: +SKIP
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"--plot needs matplotlib ({e}). HINT: pip install 'ft-checkpoint[plot]'") from e
    t0 = report.attempts[0].start if report.attempts else 0.0
    scale, unit = (60.0, "min") if report.wall_s > 600 else (1.0, "s")

    def x(t: float) -> float:
        return (t - t0) / scale

    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.5 * len(report.attempts)))
    colors = {CLEAN_END: "tab:green", PREEMPTED: "tab:orange", FAILED: "tab:blue", UNFINISHED: "tab:blue"}
    for i, a in enumerate(report.attempts):
        ax.broken_barh([(x(a.start), a.duration_s / scale)], (i - 0.3, 0.6), color=colors[a.outcome], alpha=0.6)
        if a.recomputed_since is not None:
            ax.broken_barh([(x(a.recomputed_since), a.recomputed_s / scale)], (i - 0.3, 0.6), color="tab:red",
                           alpha=0.7, hatch="//")
        if a.gap_after_s:
            ax.broken_barh([(x(a.end), a.gap_after_s / scale)], (i - 0.1, 0.2), color="lightgrey")
        ax.plot([x(t) for t, _ in a.saves], [i + 0.38] * len(a.saves), "v", color="k", markersize=4)
        if a.outcome == FAILED:
            ax.plot([x(a.end)], [i], "X", color="tab:red", markersize=10)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color="tab:blue", alpha=0.6, label="attempt"),
                        Patch(color="tab:red", alpha=0.7, hatch="//", label="recomputed after a failure"),
                        Patch(color="lightgrey", label="restart gap")], loc="lower center", ncol=3, frameon=False)
    ax.set_yticks(range(len(report.attempts)), [f"{i + 1}: {a.outcome}" for i, a in enumerate(report.attempts)])
    ax.invert_yaxis()
    goodput = f"{100 * report.goodput:.1f}%" if report.goodput is not None else "n/a"
    ax.set(xlabel=f"time since the first start ({unit})",
           title=f"goodput {goodput}: red = recomputed, v = save, X = failure")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path)
    plt.close(fig)
