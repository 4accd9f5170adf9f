"""The run journal: what happened to this job, one small object per event.

Object stores cannot append, so each event is its own JSON object under
``<dirpath>/journal/<attempt>/<seq>-<event>.json``; an attempt is one start of the training process
(group). Events: ``attempt_start``, ``resume``, ``save_started``, ``commit``, ``save_failed``,
``preempted``, ``clean_end``. The adaptive interval learns the failure rate from it (a restart that did
not follow a ``clean_end`` or ``preempted`` is a failure), and the goodput report reads it.

Only rank 0 writes. A journal write that fails is logged and never stops training: the journal
describes checkpoints, it is not one.

Example:
    >>> from ft_checkpoint.store.storage import Storage
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
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from ft_checkpoint.errors import CheckpointCorruptError, StorageError
from ft_checkpoint.format.layout import JOURNAL_DIR
from ft_checkpoint.run.background import submit
from ft_checkpoint.store import jsonfile
from ft_checkpoint.store.storage import Storage

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
        self._note_fd: int | None = None
        self._rewrite = True
        """Whether the note may be rewritten in place (False once the file written was found swapped)."""
        self._note_lock = threading.Lock()
        self.save_cost: float | None = None
        """What a save last cost the training (seconds), carried in the progress note for the next attempt."""
        self.fast_step: int | None = None
        """The newest step this attempt committed to the fast tier, carried in the progress note: the next attempt
        tells a failure that lost every node's fast tier from one that came before any fast-tier save."""

    @property
    def notes_every_step(self) -> bool:
        """Whether :meth:`progress` notes every step before it returns (so the goodput report's count of
        recomputed steps is exact): on a local filesystem, where a note is one small write in place (cheap),
        or with ``progress_every == 0``.

        Example:
            >>> from ft_checkpoint.store.storage import Storage
            >>> Journal(Storage("memory://doc/notes")).notes_every_step, Journal(Storage("/tmp/ft-doc-notes")).notes_every_step
            (False, True)
        """
        return self.progress_every == 0 or self.storage.is_local

    def progress(self, step: int, *, force: bool = False) -> None:
        """Note the step reached: see :attr:`notes_every_step`; elsewhere at most every ``progress_every`` seconds,
        without blocking the caller.

        One object per attempt (``progress.json``), overwritten: how far an attempt got before it
        died, and so how much work its restart recomputed. A note asked for while the previous one is
        still being written is not dropped: the newest step is written right after it.
        """
        self._latest_step = step
        now = time.monotonic()
        if self.enabled and self.storage.is_local:
            self._note_in_place(step)
            return
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
        submit(self._writer, self._progress_loop)

    def _progress_loop(self) -> None:
        while True:
            self._write_progress(self._latest_step)
            with self._lock:
                if not self._progress_again:
                    self._progress_busy = False
                    return
                self._progress_again = False

    def _note(self, step: int | None) -> bytes:
        """The progress note, padded with spaces to :data:`NOTE_BYTES` (one size: a rewrite in place leaves no tail)."""
        body = json.dumps({"step": step, "time": time.time(), "attempt": self.attempt, "save_cost": self.save_cost,
                           "fast_step": self.fast_step})
        return body.ljust(NOTE_BYTES).encode()

    def _write_progress(self, step: int | None) -> None:
        cost = self.save_cost
        try:
            with self.storage.best_effort():
                self.storage.write_bytes(f"{JOURNAL_DIR}/{self.attempt}/{PROGRESS}", self._note(step))
            self._written_step, self._written_cost = step, cost
        except StorageError as e:
            log.warning("could not write journal progress: %s", e)

    def note_fast_step(self, step: int) -> None:
        """The fast tier committed ``step`` (the background writer): noted at once with the step reached, so that the
        next attempt tells a failure that lost every node's fast tier from one before any fast-tier save."""
        self.fast_step = step
        if self._latest_step is not None:
            self.progress(self._latest_step, force=True)

    def _note_in_place(self, step: int) -> None:
        """Local filesystem: the first note written whole (atomically), each later one over it with one ``pwrite``
        and no fsync: a few microseconds, and a killed process's last write stays in the page cache. (The training
        thread and, for a fast-tier commit, the writer thread write it: one at a time.)"""
        with self._note_lock:
            self._note_in_place_locked(step)

    def _note_in_place_locked(self, step: int) -> None:
        if self._note_fd is None:
            self._write_progress(step)
            try:  # swapped since for a FIFO, a link or a hard link: refused, and from now on written whole each time
                if self._rewrite:
                    self._note_fd = self.storage.open_to_rewrite(f"{JOURNAL_DIR}/{self.attempt}/{PROGRESS}")
            except CheckpointCorruptError as e:
                self._rewrite = False
                log.warning("the journal's progress note is written whole from now on: %s", e)
            except OSError:
                pass
            return
        note, cost = self._note(step), self.save_cost
        try:
            if len(note) != NOTE_BYTES or os.pwrite(self._note_fd, note, 0) != NOTE_BYTES:
                raise OSError(f"a progress note of {len(note)} bytes does not fit in place")
            self._written_step, self._written_cost = step, cost
        except OSError as e:
            log.warning("could not write journal progress: %s", e)
            self._close_note()

    def _close_note(self) -> None:
        if self._note_fd is not None:
            os.close(self._note_fd)
            self._note_fd = None

    def close(self) -> None:
        """Finish pending writes and note the last step reached."""
        self._writer.shutdown(wait=True)
        with self._note_lock:
            self._close_note()
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
            submit(self._writer, self._write_event, seq, event, body)
        else:
            self._write_event(seq, event, body)

    def _write_event(self, seq: int, event: str, body: dict[str, Any]) -> None:
        try:
            with self.storage.best_effort():  # while the store is down: one attempt (a lost note harms nothing)
                self.storage.write_bytes(f"{JOURNAL_DIR}/{self.attempt}/{seq:06d}-{event}.json",
                                         json.dumps(body, sort_keys=True).encode())
        except StorageError as e:
            log.warning("could not write journal event %s: %s", event, e)


ENDED_EVENTS = ("clean_end", "preempted")
PROGRESS = "progress.json"
NOTE_BYTES = 512
"""Size of a progress note (JSON padded with spaces): every note has it, so one can be rewritten in place."""
CLOCK_SLACK = 86400.0
"""How far (seconds) a journal time may lie before its attempt's start or after now before it is garbage."""
MAX_SAVE_COST = 86400.0
"""The largest save cost (seconds) taken from a progress note; more is garbage, not a measurement."""
_ATTEMPT_RE = re.compile(r"^(\d{8}T\d{6})\.(\d{6})Z-[0-9A-Za-z]+$", re.ASCII)
_EVENT_RE = re.compile(r"^\d{6,}-([a-z_]+)\.json$", re.ASCII)
_STEP_FIELDS = ("step", "last_step")
_SECONDS_FIELDS = ("stall", "seconds", "duration", "waited", "bytes")


def attempt_start_time(attempt: str) -> float:
    """The UTC start time encoded in an attempt id; ValueError if ``attempt`` is not one.

    Example:
        >>> attempt_start_time("20261129T000000.500000Z-abc123")
        1795910400.5
    """
    m = _ATTEMPT_RE.match(attempt)
    if not m:
        raise ValueError(f"{jsonfile.short(attempt)} is not an attempt id (like 20261129T000000.000000Z-abc123)")
    return calendar.timegm(time.strptime(m.group(1), "%Y%m%dT%H%M%S")) + int(m.group(2)) / 1e6


def started_before(storage: Storage, *, besides: str | None = None) -> bool:
    """Whether the journal in ``storage`` records a start of a job in this directory (other than the attempt
    ``besides``): an attempt directory named like one. One listing; nothing is read.

    Example:
        >>> from ft_checkpoint.store.storage import Storage
        >>> s = Storage("memory://doc/started")
        >>> Journal(s, attempt="20261129T000000.000000Z-abc123").record("attempt_start")
        >>> started_before(s), started_before(s, besides="20261129T000000.000000Z-abc123")
        (True, False)
    """
    return any(_ATTEMPT_RE.match(name) and name != besides for name in storage.listdir(JOURNAL_DIR))


def first_attempt(storage: Storage) -> str | None:
    """The oldest attempt the journal in ``storage`` records (None: none): it names this incarnation of the directory,
    since emptying it (``rm -rf``) removes it and the next start is a new oldest one. One listing; nothing is read.

    Example:
        >>> from ft_checkpoint.store.storage import Storage
        >>> s = Storage("memory://doc/first")
        >>> for attempt in ("20261129T000000.000000Z-abc123", "20261128T000000.000000Z-def456"):
        ...     Journal(s, attempt=attempt).record("attempt_start")
        >>> first_attempt(s)
        '20261128T000000.000000Z-def456'
    """
    return min((name for name in storage.listdir(JOURNAL_DIR) if _ATTEMPT_RE.match(name)), default=None)


def parse_event(data: bytes, *, attempt: str, now: float | None = None) -> dict[str, Any]:
    """One journal event of ``attempt``, strictly typed; ValueError naming what is wrong with it.

    Example:
        >>> parse_event(b'{"event": "commit", "time": "noon"}', attempt="20261129T000000.000000Z-abc123")
        Traceback (most recent call last):
        ValueError: time='noon': expected a finite number
    """
    event = jsonfile.load_object(data)
    jsonfile.get_str(event, "event")
    _check_time(event, attempt, now)
    if jsonfile.get_str(event, "attempt") != attempt:
        raise ValueError(f"attempt={jsonfile.short(event['attempt'])}: it lies in the journal of {attempt}")
    jsonfile.get_int(event, "seq", minimum=0)
    for key in _STEP_FIELDS:
        jsonfile.get_int(event, key, minimum=0, maximum=10**12 - 1, optional=True)
    for key in _SECONDS_FIELDS:
        jsonfile.get_number(event, key, minimum=0, optional=True)
    return event


def parse_progress(data: bytes, *, attempt: str, now: float | None = None) -> dict[str, Any]:
    """An attempt's progress note (``step``, ``time``, ``save_cost``); ValueError naming what is wrong."""
    note = jsonfile.load_object(data)
    _check_time(note, attempt, now)
    for key in ("step", "fast_step"):
        jsonfile.get_int(note, key, minimum=0, maximum=10**12 - 1, optional=True)
    cost = jsonfile.get_number(note, "save_cost", minimum=0, maximum=MAX_SAVE_COST, optional=True)
    if cost == 0:
        raise ValueError("save_cost=0: a save costs something; expected a measured number of seconds")
    return note


def _check_time(obj: dict[str, Any], attempt: str, now: float | None) -> float:
    """``obj["time"]``: a finite number within ``CLOCK_SLACK`` of the attempt's life."""
    t = cast(float, jsonfile.get_number(obj, "time"))  # not optional: never None
    start, now = attempt_start_time(attempt), time.time() if now is None else now
    if not start - CLOCK_SLACK <= t <= now + CLOCK_SLACK:
        raise ValueError(f"time={t!r} lies outside the attempt's life (it started at {start:.0f}, now is {now:.0f})")
    return t


class JournalReader:
    """Reads a journal once, skipping (with a warning naming the file) everything that does not parse.

    Each file is read at most once and warned about at most once, so one reader serves
    :meth:`summaries` and :meth:`events` (as the goodput report does).

    Example:
        >>> from ft_checkpoint.store.storage import Storage
        >>> s = Storage("memory://doc/reader")
        >>> Journal(s, attempt="20261129T000000.000000Z-abc123").record("attempt_start")
        >>> s.write_bytes("journal/20261129T000000.000000Z-abc123/000001-commit.json", b"[1]")
        >>> r = JournalReader(s)
        >>> [e["event"] for e in r.events()], r.skipped
        (['attempt_start'], ['memory://doc/reader/journal/20261129T000000.000000Z-abc123/000001-commit.json'])
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.now = time.time()
        self.skipped: list[str] = []
        """URLs of the files and attempt directories skipped as unreadable, in the order met."""
        self._parsed: dict[str, dict[str, Any] | None] = {}
        self._names: dict[str, list[str]] | None = None

    def attempts(self) -> dict[str, list[str]]:
        """Valid attempt ids, oldest first, each with its file names (sorted)."""
        if self._names is None:
            self._names = {}
            names = self.storage.listdir(JOURNAL_DIR)
            if names == [JOURNAL_DIR] and self._journal_is_no_directory():
                return self._names
            for attempt in names:
                where = f"{JOURNAL_DIR}/{attempt}"
                try:
                    if attempt_start_time(attempt) > self.now + CLOCK_SLACK:
                        raise ValueError("its start time lies in the future")
                    self._names[attempt] = self.storage.listdir(where)
                except (ValueError, StorageError) as e:
                    self._skip(where, e)
        return self._names

    def _journal_is_no_directory(self) -> bool:
        """Whether ``journal`` is a file (or a FIFO, a link, ...), which a listing gives as the one name ``journal``
        (as a folder ``journal/journal`` would): skipped with a warning naming it."""
        entry = self.storage.entries("").get(JOURNAL_DIR)
        if entry is None or entry.kind == "directory":
            return False
        kind = "a file" if entry.kind == "file" else "a link or special file"
        self._skip(JOURNAL_DIR, ValueError(f"it is not a directory ({kind})"))
        return True

    def events(self) -> list[dict[str, Any]]:
        """Every valid event of every attempt, in order (attempts by start time, events by sequence)."""
        out = []
        for attempt, names in self.attempts().items():
            out += [e for e in (self._event(attempt, n) for n in names if _EVENT_RE.match(n)) if e is not None]
        return sorted(out, key=lambda e: (e["attempt"], e["seq"]))

    def summaries(self) -> list[dict[str, Any]]:
        """Per attempt, oldest first: see :func:`attempt_summaries`."""
        out = []
        for attempt, names in self.attempts().items():
            events = [n for n in names if _EVENT_RE.match(n)]
            last = next((e for e in (self._event(attempt, n) for n in reversed(events)) if e is not None), None)
            if last is None:
                continue  # no readable event: nothing is known about this attempt
            progress = self._progress(attempt) if PROGRESS in names else None
            ended = any(m.group(1) in ENDED_EVENTS and self._event(attempt, n) is not None
                        for n in events if (m := _EVENT_RE.match(n)))
            end = max(last["time"], progress["time"]) if progress else last["time"]
            out.append({"attempt": attempt, "start": attempt_start_time(attempt), "end": end, "ended": ended,
                        "last_step": progress.get("step") if progress else None,
                        "save_cost": progress.get("save_cost") if progress else None,
                        "fast_step": progress.get("fast_step") if progress else None,
                        "failure_class": self._failure_class(attempt, events)})
        return out

    def _failure_class(self, attempt: str, names: list[str]) -> str | None:
        """What the attempt's resume found in the fast tier (its ``failure_class``), or None."""
        resume = next((n for n in names if (m := _EVENT_RE.match(n)) and m.group(1) == "resume"), None)
        event = self._event(attempt, resume) if resume is not None else None
        found = event.get("failure_class") if event is not None else None
        return found if isinstance(found, str) else None

    def _event(self, attempt: str, name: str) -> dict[str, Any] | None:
        return self._load(f"{JOURNAL_DIR}/{attempt}/{name}", lambda data: parse_event(data, attempt=attempt, now=self.now))

    def _progress(self, attempt: str) -> dict[str, Any] | None:
        return self._load(f"{JOURNAL_DIR}/{attempt}/{PROGRESS}",
                          lambda data: parse_progress(data, attempt=attempt, now=self.now))

    def _load(self, rel: str, parse: Any) -> dict[str, Any] | None:
        if rel not in self._parsed:
            try:
                self._parsed[rel] = parse(self.storage.read_control(rel, max_bytes=jsonfile.MAX_BYTES))
            except (ValueError, StorageError) as e:
                self._parsed[rel] = None
                self._skip(rel, e)
        return self._parsed[rel]

    def _skip(self, rel: str, reason: Exception) -> None:
        url = self.storage.url_of(rel)
        self.skipped.append(url)
        log.warning("skipping the unreadable journal entry %s: %s", url, reason)


def newest_recorded_step(storage: Storage) -> tuple[int, str] | None:
    """``(step, attempt)`` of the last ``commit`` or ``resume`` event of the newest attempt that has one: how far
    the run got, as far as its journal knows. Costs a listing per attempt, newest first, until one has such an
    event, and a read; an unreadable event is skipped with a warning (the one before it is read instead), and
    only regular files are read (a FIFO or a link named like an event is not: it could block or lead elsewhere).

    Example:
        >>> s = Storage("memory://doc/recorded")
        >>> Journal(s, attempt="20261129T000000.000000Z-abc123").record("commit", step=40)
        >>> Journal(s, attempt="20261129T010000.000000Z-def456").record("attempt_start")
        >>> newest_recorded_step(s)
        (40, '20261129T000000.000000Z-abc123')
    """
    reader = JournalReader(storage)
    attempts = [name for name, entry in storage.entries(JOURNAL_DIR).items() if entry.kind == "directory"]
    for attempt in sorted(attempts, reverse=True):  # attempt ids sort by start time
        try:
            if attempt_start_time(attempt) > reader.now + CLOCK_SLACK:
                continue
        except ValueError:
            continue
        names = [n for n, entry in storage.entries(f"{JOURNAL_DIR}/{attempt}").items() if entry.kind == "file"
                 and (m := _EVENT_RE.match(n)) and m.group(1) in ("commit", "resume")]
        for name in sorted(names, key=lambda n: int(n.split("-", 1)[0]), reverse=True):
            event = reader._event(attempt, name)
            if event is not None and event.get("step") is not None:
                return event["step"], attempt
    return None


def attempt_summaries(storage: Storage) -> list[dict[str, Any]]:
    """Per attempt, oldest first: ``attempt``, ``start``, ``end`` (time of its last sign of life),
    ``ended`` (cleanly or by an announced preemption), ``last_step`` (its last progress note, or
    None), ``save_cost`` (what a save cost it, if measured), ``fast_step`` (the newest step it committed to
    the fast tier, if noted) and ``failure_class`` (what its resume found in the fast tier, if recorded).
    Costs one listing and a few small
    reads per attempt. Files that do not parse, or whose fields have the wrong type or an impossible
    time, are skipped with a warning naming them (an attempt with no readable event is skipped)."""
    return JournalReader(storage).summaries()


def read_journal(storage: Storage) -> list[dict[str, Any]]:
    """Every event of every attempt, in order (attempts by start time, events by sequence); events that
    do not parse or are wrongly typed are skipped with a warning naming the file."""
    return JournalReader(storage).events()
