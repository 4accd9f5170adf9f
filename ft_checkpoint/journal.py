"""The run journal: what happened to this job, one small object per event.

Object stores cannot append, so each event is its own JSON object under
``<dirpath>/journal/<attempt>/<seq>-<event>.json``; an attempt is one start of the training process
(group). Events: ``attempt_start``, ``resume``, ``save_started``, ``commit``, ``save_failed``,
``preempted``, ``clean_end``. The adaptive interval learns the failure rate from it (a restart that did
not follow a ``clean_end`` or ``preempted`` is a failure), and the goodput report reads it.

Only rank 0 writes. A journal write that fails is logged and never stops training: the journal
describes checkpoints, it is not one.

Example:
    >>> from ft_checkpoint.storage import Storage
    >>> s = Storage("memory://doc/journal")
    >>> j = Journal(s, attempt="20261129T000000.000000Z-abc123")
    >>> j.record("attempt_start", world_size=1)
    >>> [e["event"] for e in read_journal(s)]
    ['attempt_start']
"""

from __future__ import annotations

import calendar
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ft_checkpoint.errors import StorageError
from ft_checkpoint.layout import JOURNAL_DIR
from ft_checkpoint.storage import Storage

log = logging.getLogger(__name__)

_RESTART_ENV = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def new_attempt_id() -> str:
    """A sortable, unique attempt id: UTC start time (microseconds) plus a random suffix."""
    now = time.time()
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now % 1 * 1e6):06d}Z-{uuid.uuid4().hex[:6]}"


def launcher_env() -> dict[str, str]:
    """The launcher variables that tell restarts apart (Slurm, torchrun)."""
    return {k: os.environ[k] for k in _RESTART_ENV if k in os.environ}


class Journal:
    """Writes this attempt's events (a no-op unless ``enabled``)."""

    def __init__(self, storage: Storage, *, attempt: str | None = None, enabled: bool = True,
                 progress_every: float = 10.0) -> None:
        self.storage = storage
        self.attempt = attempt or new_attempt_id()
        self.enabled = enabled
        self.progress_every = progress_every
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._progress_at = -math.inf
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-checkpoint-journal")
        self._progress_busy = self._progress_again = False
        self._latest_step: int | None = None
        self._written_step: int | None = None
        self._written_cost: float | None = None
        self.save_cost: float | None = None
        """What a save last cost the training (seconds), carried in the progress note for the next attempt."""

    def progress(self, step: int, *, force: bool = False) -> None:
        """Note the step reached, at most every ``progress_every`` seconds, without blocking the caller.

        One object per attempt (``progress.json``), overwritten: how far an attempt got before it
        died, and so how much work its restart recomputed. A note asked for while the previous one is
        still being written is not dropped: the newest step is written right after it. With
        ``progress_every == 0`` every note is written before this returns.
        """
        self._latest_step = step
        now = time.monotonic()
        if not self.enabled or (not force and now - self._progress_at < self.progress_every):
            return
        if self.progress_every == 0:  # every step, written before the step goes on: an exact report
            self._write_progress(step)
            return
        self._progress_at = now
        with self._lock:
            if self._progress_busy:
                self._progress_again = True
                return
            self._progress_busy = True
        self._writer.submit(self._progress_loop)

    def _progress_loop(self) -> None:
        while True:
            self._write_progress(self._latest_step)
            with self._lock:
                if not self._progress_again:
                    self._progress_busy = False
                    return
                self._progress_again = False

    def _write_progress(self, step: int | None) -> None:
        cost = self.save_cost
        body = json.dumps({"step": step, "time": time.time(), "attempt": self.attempt, "save_cost": cost}).encode()
        try:
            self.storage.write_bytes(f"{JOURNAL_DIR}/{self.attempt}/{PROGRESS}", body)
            self._written_step, self._written_cost = step, cost
        except StorageError as e:
            log.warning("could not write journal progress: %s", e)

    def close(self) -> None:
        """Finish pending writes and note the last step reached."""
        self._writer.shutdown(wait=True)
        if self.enabled and self._latest_step is not None and (
                self._latest_step != self._written_step or self.save_cost != self._written_cost):
            self._write_progress(self._latest_step)

    def record(self, event: str, *, background: bool = False, **fields: Any) -> None:
        """Write one event with the wall-clock time; storage errors are logged, not raised.

        ``background`` writes it from the journal's own thread, so a failing storage cannot stall the
        caller (used for failure events); :meth:`close` waits for it.
        """
        if not self.enabled:
            return
        with self._lock:
            seq = next(self._seq)
        body = {"event": event, "time": time.time(), "attempt": self.attempt, "seq": seq, **fields}
        if event == "attempt_start":
            body.update(host=socket.gethostname(), pid=os.getpid(), env=launcher_env())
        if background:
            self._writer.submit(self._write_event, seq, event, body)
        else:
            self._write_event(seq, event, body)

    def _write_event(self, seq: int, event: str, body: dict[str, Any]) -> None:
        try:
            self.storage.write_bytes(f"{JOURNAL_DIR}/{self.attempt}/{seq:06d}-{event}.json",
                                     json.dumps(body, sort_keys=True).encode())
        except StorageError as e:
            log.warning("could not write journal event %s: %s", event, e)


ENDED_EVENTS = ("clean_end", "preempted")
PROGRESS = "progress.json"


def attempt_start_time(attempt: str) -> float:
    """The UTC start time encoded in an attempt id."""
    stamp, micro = attempt.split("-", 1)[0].rstrip("Z").split(".")
    return calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%S")) + int(micro) / 1e6


def attempt_summaries(storage: Storage) -> list[dict[str, Any]]:
    """Per attempt, oldest first: ``attempt``, ``start``, ``end`` (time of its last sign of life),
    ``ended`` (cleanly or by an announced preemption), ``last_step`` (its last progress note, or
    None) and ``save_cost`` (what a save cost it, if measured). Costs one listing and at most two
    small reads per attempt."""
    out = []
    for attempt in storage.listdir(JOURNAL_DIR):
        names = storage.listdir(f"{JOURNAL_DIR}/{attempt}")
        events = [n for n in names if n.endswith(".json") and n != PROGRESS]
        if not events:
            continue
        try:
            start = attempt_start_time(attempt)
            end = json.loads(storage.read_bytes(f"{JOURNAL_DIR}/{attempt}/{events[-1]}"))["time"]
            progress = json.loads(storage.read_bytes(f"{JOURNAL_DIR}/{attempt}/{PROGRESS}")) if PROGRESS in names else {}
        except (ValueError, KeyError, StorageError) as e:
            log.warning("skipping unreadable journal attempt %s: %s", attempt, e)
            continue
        ended = any(n.split("-", 1)[-1][:-5] in ENDED_EVENTS for n in events)
        out.append({"attempt": attempt, "start": start, "end": max(end, progress.get("time", end)),
                    "ended": ended, "last_step": progress.get("step"), "save_cost": progress.get("save_cost")})
    return out


def read_journal(storage: Storage) -> list[dict[str, Any]]:
    """Every event of every attempt, in order (attempts by start time, events by sequence)."""
    events = []
    for attempt in storage.listdir(JOURNAL_DIR):
        for name in storage.listdir(f"{JOURNAL_DIR}/{attempt}"):
            if not name.endswith(".json") or name == PROGRESS:
                continue
            try:
                events.append(json.loads(storage.read_bytes(f"{JOURNAL_DIR}/{attempt}/{name}")))
            except (ValueError, StorageError) as e:
                log.warning("skipping unreadable journal event %s/%s: %s", attempt, name, e)
    return sorted(events, key=lambda e: (e.get("attempt", ""), e.get("seq", 0)))
