"""One writer per checkpoint directory: a lease with the owner's identity and a heartbeat.

Two jobs saving into the same ``dirpath`` would delete each other's steps (retention) and interleave
their journals. The first job writes ``lease.json`` (attempt, host, pid, process space, job id,
launcher restart counters, whether it holds ``lease.lock``, heartbeat) and refreshes the heartbeat from a
background thread.

**Takeover.** Another job refuses to start, with an error that names the owner, unless:

- the lease is this attempt's own, or this very process's (an earlier manager that could not release it);
- the owner ran on this host and its process is gone (a crashed run started again); on local disk, in any PID
  namespace of this kernel: the owner held a lock on ``lease.lock`` while it lived, and the lock is free
  (``owner_lock``: a container restarted in place takes the lease over at once);

  "this process" and "this host" mean the same host name *and* the same process space (:func:`process_space`:
  the kernel's boot id and the PID namespace): a container recreated under its old host name (a Kubernetes
  pod of a StatefulSet, ``docker restart``) has a new PID namespace, where the old owner's pid names another
  process or none, and its own pid is often the old one's (1): the old owner, maybe alive on a node cut off,
  is judged like one on another host (its heartbeat, the launcher's restart counters). So is a process space
  that one side cannot tell (``/proc`` not mounted). A lease of an earlier version records no process space:
  there the host name alone decides whether its process is gone, as it did, but it is never this process's own;
- its heartbeat is older than ``timeout``: a crashed or hung job elsewhere;
- its heartbeat lies more than :data:`CLOCK_SKEW` (60 s) in the future: a wrong clock or a forged lease
  (a lease of year 2100 would otherwise be a lock forever);
- the owner is an earlier start of the same launcher job (``FT_CHECKPOINT_RUN_ID``,
  ``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID``) and the launcher counts this start as a later restart
  (``SLURM_RESTART_COUNT``, then ``TORCHELASTIC_RESTART_COUNT``, higher than recorded): a launcher
  restarts a job only after its old process group is gone. An equal job id alone proves nothing, and a
  placeholder never counts as an id: ``torchrun`` without ``--rdzv-id`` sets ``TORCHELASTIC_RUN_ID=none``
  for every job;
- the user forces it (``force_takeover=True``).

**Fencing.** A job whose heartbeat went stale (a hung process, a storage outage) may have been taken
over. Its heartbeat thread checks that the lease is still its own before every refresh; if it is not,
the thread stops, :attr:`Lease.lost` becomes True and a warning is logged once, and
:meth:`Lease.check_owned` raises :class:`LeaseError`: the job must stop saving and deleting. How the
check is made depends on the store:

- S3: every write is conditional on the ETag of this attempt's previous write (``If-Match``; a new lease
  is created with ``If-None-Match: *``). A takeover between the check and the write makes the write
  fail instead of overwriting the new owner: no race.
- local disk, ``memory://``, GCS and the rest: read, compare the attempt, write. A takeover that lands
  in the milliseconds between the read and the write is overwritten; the new owner then finds the old
  owner's lease at its own next check (its next heartbeat, or the check before its next commit) and
  stops, so one of the two keeps writing. (GCS could fence with ``ifGenerationMatch``, but gcsfs
  2026.10 passes no precondition but ``ifGenerationMatch=0`` on writes.) On local disk and GCS a lease
  where there was none is created, never written over one (the complete file hard-linked to its name;
  ``ifGenerationMatch=0``): of two jobs starting at once on an empty directory, exactly one gets it and the other
  is refused at once. A create refused because this job's own earlier try landed (its answer lost, the try
  repeated) is found to be this job's when the lease is read back, and taken.

:meth:`Lease.release` removes ``lease.json`` only if it still names this attempt (read, compare, delete
on every store), and never after the lease was lost.

**Garbage.** A ``lease.json`` that is not a JSON object, has fields of the wrong type or a heartbeat that
is not a finite number, is larger than ``jsonfile.MAX_BYTES`` (1 MiB), or is no regular file at all (a
FIFO, a directory, a symbolic link: never opened for reading, never followed) is never a crash and never
blocks a read: a warning names the file and what is wrong. Such a lease blocks like a live owner's while
the file is recent (modified within ``timeout``): it may be the lease of a live job of another version, or
a live owner's write read half-done on a file system without atomic writes. Once the file is older than
``timeout`` (or modified more than :data:`CLOCK_SKEW` in the future) nobody is refreshing it, and it is
taken over. ``force_takeover=True`` takes it at once (a directory in its place is moved aside, never
deleted); where the store reports no modification time, only that does. Refusals are always a
:class:`LeaseError` with a HINT.

Example:
    >>> from ft_checkpoint.store.storage import Storage
    >>> s = Storage("memory://doc/lease")
    >>> a = Lease(s, attempt="a")
    >>> a.owner["host"] = "elsewhere"   # as if a job on another host held it
    >>> a.acquire()
    >>> try:
    ...     Lease(s, attempt="b").acquire()
    ... except LeaseError as e:
    ...     print("refused:", "another job is writing checkpoints" in str(e))
    refused: True
    >>> a.check_owned(); a.lost
    False
    >>> a.release()
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

from ft_checkpoint.errors import (
    CheckpointCorruptError,
    LeaseError,
    StorageError,
    StorageExistsError,
    StorageNotFoundError,
)
from ft_checkpoint.run.owner_lock import LOCK, OwnerLock
from ft_checkpoint.store import jsonfile
from ft_checkpoint.store.storage import Entry, Storage

log = logging.getLogger(__name__)
LEASE = "lease.json"
_JOB_ENV = ("FT_CHECKPOINT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
_RESTART_ENV = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
"""Launcher restart counters, outermost launcher first (Slurm requeues torchrun, not the reverse)."""
PLACEHOLDER_IDS = frozenset({"", "none", "null", "nil", "undefined", "unknown", "default", "n/a", "-", "0"})
"""Values of a job id variable that identify no job (torchrun's default ``--rdzv-id`` is ``none``)."""
CLOCK_SKEW = 60.0
"""Seconds a heartbeat or a modification time may lie ahead of this host's clock (the clocks of two hosts differ):
further in the future, the lease is stale, taken over like one whose heartbeat is older than the timeout."""
_MAX_PID = 2**31 - 1
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})


def job_id() -> str | None:
    """This job's identity across restarts, from the launcher's environment (None if unknown).

    Example:
        >>> os.environ["TORCHELASTIC_RUN_ID"] = "none"     # torchrun without --rdzv-id: no identity
        >>> job_id() is None or not job_id().startswith("TORCHELASTIC_RUN_ID")
        True
        >>> del os.environ["TORCHELASTIC_RUN_ID"]
    """
    for name in _JOB_ENV:
        value = os.environ.get(name, "")
        if not is_placeholder(value):
            return f"{name}={value}"
    return None


def is_placeholder(value: str) -> bool:
    """Whether a job id value identifies no job (``none``, empty, ...)."""
    return value.strip().lower() in PLACEHOLDER_IDS


def launcher_restarts() -> dict[str, int]:
    """The launcher's restart counters of this start (``SLURM_RESTART_COUNT``, ``TORCHELASTIC_RESTART_COUNT``)."""
    env = {name: os.environ.get(name, "").strip() for name in _RESTART_ENV}
    return {name: int(v) for name, v in env.items() if v.isascii() and v.isdigit() and len(v) < 10}


def _later_restart(mine: dict[str, int], theirs: dict[str, int]) -> bool:
    """Whether the launcher counts ``mine`` as a later restart than ``theirs`` (counters both know)."""
    common = [name for name in _RESTART_ENV if name in mine and name in theirs]
    return bool(common) and tuple(mine[n] for n in common) > tuple(theirs[n] for n in common)


def process_space() -> str | None:
    """The processes this one sees by pid: the kernel's boot id and this process's PID namespace (Linux), or
    None where ``/proc`` does not tell. A pid recorded by a process of another space names another process or
    none here.

    Example:
        >>> space = process_space()
        >>> space is None or space == process_space()
        True
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read(64).decode("ascii", "replace").strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parse_lease(data: bytes) -> dict[str, Any]:
    """The owner recorded in a ``lease.json``; ValueError naming what is wrong with it. A heartbeat from the
    future parses: :class:`Lease` judges it (see :data:`CLOCK_SKEW`).

    Example:
        >>> parse_lease(b'{"attempt": "a", "host": "h", "pid": "x", "heartbeat": 0}')
        Traceback (most recent call last):
        ValueError: pid='x': expected an integer
    """
    obj = jsonfile.load_object(data)
    record: dict[str, Any] = {"attempt": jsonfile.get_str(obj, "attempt"), "host": jsonfile.get_str(obj, "host"),
              "pid": jsonfile.get_int(obj, "pid", minimum=1, maximum=_MAX_PID),
              "space": _space(obj), "legacy": "space" not in obj and "pids" not in obj,
              "job": jsonfile.get_str(obj, "job", optional=True), "restarts": _parse_restarts(obj.get("restarts")),
              "lock": obj.get("lock") is True,
              "heartbeat": jsonfile.get_number(obj, "heartbeat")}
    if record["job"] is not None and is_placeholder(record["job"].partition("=")[2]):
        record["job"] = None  # written by a version that took "none" for an id
    return record


def _space(obj: dict[str, Any]) -> str | None:
    """The owner's process space: ``space``, or ``pids``, its name in development builds before 0.2 (such an owner
    is judged by its process space too, never as a lease of an earlier version: the host name alone)."""
    return jsonfile.get_str(obj, "space" if "space" in obj else "pids", optional=True)


def _parse_restarts(value: Any) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(k in _RESTART_ENV and jsonfile.is_int(v) for k, v in value.items()):
        raise ValueError(f"restarts={jsonfile.short(value)}: expected an object of launcher restart counters")
    return dict(value)


@dataclasses.dataclass(frozen=True)
class _Seen:
    """What ``lease.json`` held when read."""

    exists: bool
    record: dict[str, Any] | None = None
    """The owner, when the file parsed."""
    problem: str | None = None
    """Why the file did not parse."""
    etag: str | None = None
    """The object's ETag (S3 only)."""


class Lease:
    """The lease of one attempt on one directory.

    Args:
        storage: The checkpoint directory.
        attempt: This attempt's id (the journal's).
        timeout: A heartbeat older than this (seconds) is stale: its job may be taken over.
        refresh: Seconds between heartbeats; well below ``timeout``.
    """

    def __init__(self, storage: Storage, *, attempt: str, timeout: float = 120.0, refresh: float = 20.0) -> None:
        if not (jsonfile.is_number(timeout) and timeout >= 0 and jsonfile.is_number(refresh) and refresh > 0):
            raise ValueError(f"lease timeout={timeout!r}, refresh={refresh!r}: expected finite seconds, refresh > 0")
        self.storage = storage
        self.timeout = float(timeout)
        self.refresh = float(refresh)
        self.owner: dict[str, Any] = {"attempt": attempt, "host": socket.gethostname(), "pid": os.getpid(),
                                      "space": process_space(), "job": job_id(), "restarts": launcher_restarts(),
                                      "lock": False}
        self._owner_lock = OwnerLock(storage)
        """Held from before this job claims the lease until after it releases it (local disk): see ``owner_lock``."""
        protocols = {storage.fs.protocol} if isinstance(storage.fs.protocol, str) else set(storage.fs.protocol)
        self.fencing = "etag" if protocols & {"s3", "s3a"} else "read-compare-write"
        """How a heartbeat makes sure it overwrites only its own lease (see the module docstring)."""
        self._etag: str | None = None
        self._lost: str | None = None
        self._confirmed = -math.inf
        """When (``time.monotonic``) this process last saw the lease as this attempt's own."""
        self._quiet_until = -math.inf
        """Until when (``time.monotonic``) the owner taken over may still write on its last sight of the lease."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.storage.url_of(LEASE)

    @property
    def lost(self) -> bool:
        """Another job took this lease over: this one must stop writing to the directory."""
        return self._lost is not None

    # -- public --------------------------------------------------------------------------------
    def acquire(self, *, force: bool = False) -> None:
        """Take the lease, or raise LeaseError naming the job that holds it."""
        self.owner["lock"] = self._owner_lock.try_hold()  # before the read: then a free lock proves its owner gone
        try:
            self._acquire(force)
        except BaseException:
            self._owner_lock.release()
            self.owner["lock"] = False
            raise

    def _acquire(self, force: bool) -> None:
        seen = self._read()
        if seen.exists and not force:
            reason = self._takeover_reason(seen)
            if reason is None:
                raise LeaseError(self._refusal(seen))
            log.info("taking over the checkpoint lease %s: %s", self.url, reason)
        elif seen.exists:
            log.warning("taking over the checkpoint lease %s by force (held by %s)", self.url, _describe(seen))
        self._claim(seen)
        since = time.monotonic()
        if not self._mine(self._read()):
            raise LeaseError(f"another job took the checkpoint lease {self.url} at the same moment. HINT: give "
                             "each job its own dirpath")
        self._confirmed = since
        if seen.exists and not self._owner_gone(seen):
            self._quiet_until = time.monotonic() + self.recent
        self._thread = threading.Thread(target=self._beat, name="ft-checkpoint-lease", daemon=True)
        self._thread.start()

    def check_owned(self) -> None:
        """Raise LeaseError if another job took this lease over (reads ``lease.json``); sets :attr:`lost`.

        Call it before each commit and each deletion: a job that lost its lease must stop writing.

        Raises:
            LeaseError: the lease is another job's now, or was removed, or this attempt never held it.
            StorageError: ``lease.json`` could not be read.
        """
        if self._thread is None:
            raise LeaseError(f"this job never acquired the checkpoint lease {self.url}. HINT: call acquire() first")
        self.check_now()

    @property
    def recent(self) -> float:
        """Seconds a sight of the lease as this attempt's own stays good for :meth:`check_recent`: well below the
        real time another job waits before a takeover (``timeout``, less :data:`CLOCK_SKEW` of clocks apart)."""
        return min(2 * self.refresh, max(self.timeout - CLOCK_SKEW, 0.0) / 2)

    def vouched(self, since: float) -> None:
        """The job's rank 0 found the lease its own at ``since`` (``time.monotonic()`` here) or later: good for
        :attr:`recent` seconds from ``since`` here too, on any rank. ``since`` must come before rank 0's check (taken
        before a collective rank 0 waited for before it checked), never when this rank learned of it: a rank that stood
        still before it joined that collective (SIGSTOP, a VM paused) learns of the check late, maybe after a takeover.

        Example:
            >>> from ft_checkpoint.store.storage import Storage
            >>> lease = Lease(Storage("memory://doc/vouched"), attempt="a")
            >>> lease.vouched(time.monotonic() - 2 * lease.recent)   # a check from long ago vouches for nothing now
            >>> try:
            ...     lease.check_recent()                             # so lease.json is read: nobody's
            ... except LeaseError as e:
            ...     print("lost:", "lease.json was removed" in str(e))
            lost: True
        """
        self._confirmed = max(self._confirmed, since)

    def check_recent(self) -> None:
        """Raise LeaseError unless the lease was seen as this attempt's own within :attr:`recent` seconds; reads
        ``lease.json`` only when it was not. Any rank calls it before each file a save writes: a process that
        stood still (SIGSTOP, a VM paused, a storage call hung) for longer than a takeover waits may find
        another job writing the same step, and must not write over that job's files.

        Raises:
            LeaseError: the lease is another job's now, or was removed.
            StorageError: ``lease.json`` could not be read.
        """
        if self._lost is None and time.monotonic() - self._confirmed > self.recent:
            self._confirm()
        if self._lost is not None:
            raise LeaseError(self._lost)

    def wait_out_previous_owner(self) -> None:
        """Before this job's first write into a step directory: wait until the owner it took over, unless that one
        is known to be gone, can no longer write on the strength of its last sight of the lease (:attr:`recent`
        seconds after the takeover). A launcher restart or a forced takeover does not wait for a stale heartbeat:
        the old process may still be alive (a node that stood still), and would write its files, checked against a
        sight of the lease from before the takeover, into the step this job commits. At once when nothing was
        taken over, when the owner ran on this host and its process is gone, and from the second save on.

        Example:
            >>> from ft_checkpoint.store.storage import Storage
            >>> lease = Lease(Storage("memory://doc/quiet"), attempt="a")
            >>> lease.acquire()                          # nobody's lease was taken over: nothing to wait for
            >>> lease.wait_out_previous_owner(); lease.release()
        """
        left = self._quiet_until - time.monotonic()
        if left > 0:
            log.warning("waiting %.0f s before this job's first save: the job whose checkpoint lease it took over "
                        "may still be alive, and may write for that long on its last sight of the lease", left)
            time.sleep(left)

    def _owner_gone(self, seen: _Seen) -> bool:
        """Whether the owner of ``seen`` is known to write no more (see :meth:`_gone_reason`)."""
        return seen.record is not None and self._gone_reason(seen.record) is not None

    def check_now(self) -> None:
        """Raise LeaseError unless ``lease.json`` names this attempt now (always reads it): any rank, when a file its
        save creates is there already (see ``store.fence``), before it deletes that file.

        Raises:
            LeaseError: the lease is another job's now, or was removed.
            StorageError: ``lease.json`` could not be read.
        """
        if self._lost is None:
            self._confirm()
        if self._lost is not None:
            raise LeaseError(self._lost)

    def _confirm(self) -> None:
        """Read the lease: note that it was still ours when the read began (never when it returned: a process that
        stood still inside the read, its answer received, would date the sight at its waking), or lose it."""
        since = time.monotonic()
        seen = self._read()
        if self._mine(seen):
            self._confirmed = max(self._confirmed, since)
        else:
            self._lose(seen)

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours; then drop the lock on ``lease.lock``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._lost is None and self._thread is not None:
                self._remove()
        finally:
            self._owner_lock.release()  # after the lease is gone: this process writes no more

    def _remove(self) -> None:
        try:
            with self.storage.best_effort():  # while the store is down: one attempt (a stale lease is taken over)
                if self._mine(self._read()):
                    self.storage.delete_file(LEASE)
        except StorageError as e:
            log.warning("could not release the checkpoint lease: %s", e)

    # -- deciding ------------------------------------------------------------------------------
    def _same_space(self, record: dict[str, Any]) -> bool:
        """Whether the pid in an owner ``record`` names a process this one sees (the module docstring): the same host
        and the same :func:`process_space`, known on both sides (the host alone for a lease of an earlier version)."""
        if record["host"] != self.owner["host"]:
            return False
        if record.get("legacy"):  # a lease of an earlier version records no process space: the host name, as it did
            return True
        theirs, mine = record.get("space"), self.owner["space"]  # None: that process could not tell (no /proc)
        return theirs is not None and mine is not None and theirs == mine

    def _this_process(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` was written by this very process (an earlier manager): never a lease of an earlier
        version, which this process, that records its process space, did not write."""
        return not record.get("legacy") and self._same_space(record) and record["pid"] == self.owner["pid"]

    def _mine(self, seen: _Seen) -> bool:
        return seen.record is not None and seen.record["attempt"] == self.owner["attempt"]

    def _takeover_reason(self, seen: _Seen) -> str | None:
        """Why the lease in ``seen`` may be taken over without force, or None if it may not."""
        if seen.record is None:
            age = self._file_age()
            if age is not None and age < -CLOCK_SKEW:
                return f"unreadable, and its modification time {_from_the_future(age)}"
            return None if age is None or age <= self.timeout else f"unreadable and not rewritten for {age:.0f} s"
        current, me = seen.record, self.owner
        age = time.time() - current["heartbeat"]
        gone = self._gone_reason(current)
        if gone is not None:
            return gone
        if age > self.timeout:
            return f"its heartbeat is {age:.0f} s old"
        if age < -CLOCK_SKEW:
            return f"its heartbeat {_from_the_future(age)}"
        if me["job"] is not None and current["job"] == me["job"] and _later_restart(me["restarts"], current["restarts"]):
            return f"the launcher restarted job {me['job']} ({me['restarts']} after {current['restarts']})"
        return None

    def _gone_reason(self, current: dict[str, Any]) -> str | None:
        """Why the owner ``current`` is known to write no more: this attempt, this process, or a process of this host
        (and process space) that is gone; None if it may still be alive."""
        me = self.owner
        if current["attempt"] == me["attempt"]:
            return "it is this attempt's own"
        if self._this_process(current):
            return "it is this process's own"
        if self._same_space(current) and not _pid_alive(current["pid"]):
            return f"its process {current['pid']} on this host is gone"
        if current.get("lock") and self.owner["lock"] and self._same_kernel(current):
            return f"its process {current['pid']} on this host is gone: the lock on {LOCK} it held while it lived is free"
        return None

    def _same_kernel(self, record: dict[str, Any]) -> bool:
        """Whether the owner ``record`` ran on this host's kernel as it runs now (the same boot id), in any PID
        namespace: a lock it held there is one this process sees."""
        theirs, mine = record.get("space"), self.owner["space"]
        return (record["host"] == self.owner["host"] and theirs is not None and mine is not None
                and theirs.partition("/")[0] == mine.partition("/")[0])

    def _refusal(self, seen: _Seen) -> str:
        force = "pass force_takeover=True (FT_CHECKPOINT_FORCE_TAKEOVER=1) if it is dead"
        if seen.record is None:
            age = self._file_age()
            when = "at an unknown time" if age is None else _ago(age)
            return (f"{self.url} is unreadable ({seen.problem}) and was written {when}: another job may be "
                    f"writing checkpoints to {self.storage.url}. HINT: if no other job uses this directory, "
                    f"{force}" + ("" if age is None else f"; it is taken over by itself once it is older than "
                                                         f"{self.timeout:.0f} s"))
        age = time.time() - seen.record["heartbeat"]
        return (f"another job is writing checkpoints to {self.storage.url}: {_describe(seen)}"
                f"{self._elsewhere(seen.record)}, last heartbeat "
                f"{_ago(age)}. Two writers would delete each other's checkpoints. HINT: give this job its own "
                f"dirpath, or wait for that job to end (its lease expires {self.timeout:.0f} s after its last "
                f"heartbeat), or {force}")

    def _elsewhere(self, record: dict[str, Any]) -> str:
        """Where the owner ``record`` runs, when its host name is this one's but its pid names no process here."""
        if self._same_space(record) or record["host"] != self.owner["host"]:
            return ""
        if record.get("lock") and self._same_kernel(record) and self._owner_lock.busy:
            return f" in another PID namespace (a container or pod of the same host name), alive: it holds {LOCK}"
        if record["space"] is not None and self.owner["space"] is not None:
            return " in another PID namespace (a container or pod of the same host name: its process cannot be seen from here)"
        return (" in a PID namespace that cannot be compared with this one's (/proc not mounted, or its boot_id "
                "unreadable, here or there: its process cannot be told alive from here)")

    def _lose(self, seen: _Seen) -> None:
        """Record (once) that the lease is no longer ours, and say so."""
        with self._lock:
            if self._lost is not None:
                return
            now = "was removed" if not seen.exists else f"now holds {_describe(seen)}"
            holder = seen.record
            if holder is not None and self._this_process(holder):
                self._lost = (
                    f"this manager lost the checkpoint lease of {self.storage.url}: another CheckpointManager in this "
                    "process took the directory over (a second manager on the same dirpath: a notebook cell run "
                    "again, say). This one stops saving and deleting there. HINT: close() the first manager (or make "
                    "it in a 'with' block) before making another on the same dirpath")
                log.warning("%s", self._lost)
                return
            self._lost = (
                f"this job lost the checkpoint lease of {self.storage.url}: {LEASE} {now}. Another job took the "
                "directory over, most likely because this job's heartbeat was not refreshed for "
                f"{self.timeout:.0f} s (a hung process or a storage outage). This job stops saving and deleting "
                "there: two writers would delete each other's checkpoints. HINT: give each job its own dirpath; "
                "restart this one only once the other has ended (or with force_takeover=True if it is dead)")
        log.warning("%s", self._lost)

    # -- heartbeat -----------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self.refresh):
            try:
                if not self._refresh():
                    return
            except StorageError as e:
                log.warning("could not refresh the checkpoint lease %s: %s", self.url, e)
            except Exception:  # never let the heartbeat die silently
                log.warning("could not refresh the checkpoint lease %s", self.url, exc_info=True)

    def _refresh(self) -> bool:
        """One heartbeat, written only over this attempt's own lease; False once the lease is lost. A sight of the
        lease as ours dates from before the request that showed it (see :meth:`_confirm`)."""
        if self._owner_lock.busy and self._owner_lock.try_hold():  # the previous owner let it go after our start
            self.owner["lock"] = True  # held before the lease says so
        since = time.monotonic()
        if self._etag is not None:
            try:
                self._put(if_match=self._etag)
                self._confirmed = max(self._confirmed, since)
                return True
            except _Changed:
                pass  # someone else wrote, or our own retried write landed: look
        seen = self._read()
        if not self._mine(seen):
            self._lose(seen)
            return False
        if self._etag is not None and seen.etag is not None:
            self._etag = seen.etag  # the retried write of ours had landed: fence on it
            self._confirmed = max(self._confirmed, since)
            return True
        self._put()
        self._confirmed = max(self._confirmed, since)
        return True

    # -- storage -------------------------------------------------------------------------------
    def _body(self) -> bytes:
        return json.dumps({**self.owner, "heartbeat": time.time()}).encode()

    def _claim(self, seen: _Seen) -> None:
        """Write our lease over ``seen``: on S3 only if the object is still what was read."""
        if seen.exists and seen.record is None:
            self._make_way()
        try:
            if self.fencing == "etag" and seen.etag is not None:
                self._put(if_match=seen.etag)
            else:  # a lease where there was none is created: of two jobs starting at once, one gets it
                self._put(if_none_match=self.fencing == "etag" or not seen.exists)
        except _Changed:
            landed = self._read()  # refused because our own earlier try landed (its answer lost, then retried)?
            if not self._mine(landed):
                raise LeaseError(f"{self.url} changed while this job was taking it over: another job started at the "
                                 "same moment. HINT: give each job its own dirpath") from None
            if self.fencing == "etag":
                self._etag = landed.etag  # the heartbeats write on the condition of our write that landed

    def _make_way(self) -> None:
        """A directory named ``lease.json`` cannot be written over: move it aside (it is not ours to delete).
        Anything else in its place (a FIFO, a symbolic link) is replaced by the write itself, never followed."""
        if self.storage.entries("").get(LEASE, Entry("file", 0)).kind == "directory":
            aside = f"{LEASE}.{uuid.uuid4().hex[:8]}.not-a-lease"
            self.storage.rename(LEASE, aside)
            log.warning("moved the directory %s aside to %s: the lease must be a file", self.url,
                        self.storage.url_of(aside))

    def _put(self, *, if_match: str | None = None, if_none_match: bool = False) -> None:
        """Write our lease; with a condition (S3), raise _Changed if it does not hold."""
        if self.fencing != "etag":  # a takeover may replace it at once: the CRC compared is our upload's (_check_stored)
            try:
                if if_none_match:  # local disk: refused if it exists (a hard link); elsewhere a plain write
                    self.storage.create_new(LEASE, self._body())
                else:
                    self.storage.write_bytes(LEASE, self._body())
            except StorageExistsError:
                raise _Changed() from None
            return
        cond = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"} if if_none_match else {}
        path = self.storage.path(LEASE)
        try:
            out = self.storage.retrying("write", self.url, self.storage.fs.pipe_file, path, self._body(), **cond)
        except Exception as e:
            if cond and (_precondition_failed(e) or _not_found(e)):
                raise _Changed() from e
            raise StorageError(f"write {self.url}: {type(e).__name__}: {e}") from e
        etag = out.get("ETag") if isinstance(out, dict) else None
        if etag is None:  # a store that gives no ETag: fence by reading, as elsewhere
            self.fencing = "read-compare-write"
        self._etag = etag

    def _read(self) -> _Seen:
        """What ``lease.json`` holds now; a file that does not parse is logged and described, never raised."""
        etag = None
        try:
            if self.fencing == "etag":
                self.storage.fs.invalidate_cache(self.storage.path(LEASE))
                etag = self.storage.retrying("check", self.url, self.storage.fs.info, self.storage.path(LEASE))["ETag"]
            data = self.storage.read_control(LEASE, max_bytes=jsonfile.MAX_BYTES)  # never a FIFO, a link, a directory
        except StorageNotFoundError:
            return _Seen(exists=False)
        except CheckpointCorruptError as e:
            return self._unreadable(e, etag)
        except StorageError:
            raise
        except Exception as e:
            if _not_found(e):
                return _Seen(exists=False)
            raise StorageError(f"read {self.url}: {type(e).__name__}: {e}") from e
        try:
            record = parse_lease(data)
        except ValueError as e:
            return self._unreadable(e, etag)
        return _Seen(exists=True, record=record, etag=etag)

    def _unreadable(self, problem: ValueError, etag: str | None) -> _Seen:
        log.warning("the checkpoint lease %s is unreadable: %s", self.url, problem)
        return _Seen(exists=True, problem=str(problem), etag=etag)

    def _file_age(self) -> float | None:
        """Seconds since ``lease.json`` was last written, from the store's modification time (None if unknown;
        negative if it lies in the future); on local disk that of the name itself, never of a link's target."""
        path = self.storage.path(LEASE)
        try:
            if self.storage.is_local:
                return time.time() - os.lstat(path).st_mtime
            modified = self.storage.fs.modified(path)
        except Exception:  # not implemented by this filesystem, or gone
            return None
        if not isinstance(modified, datetime.datetime):
            return None
        if modified.tzinfo is None:
            modified = modified.replace(tzinfo=datetime.timezone.utc)
        age = time.time() - modified.timestamp()
        return age if math.isfinite(age) else None


def _ago(age: float) -> str:
    """``'12 s ago'``, or for a time ahead of this host's clock (within :data:`CLOCK_SKEW`) ``'12 s in the future'``."""
    return f"{age:.0f} s ago" if age >= 0 else f"{-age:.0f} s in the future (clock skew between hosts)"


def _from_the_future(age: float) -> str:
    return (f"lies {-age:.0f} s in the future, beyond the clock-skew tolerance of {CLOCK_SKEW:.0f} s: stale (a wrong "
            "clock or a forged lease; no live job refreshes a lease from the future)")


class _Changed(Exception):
    """A conditional write found the object changed (or gone) since this attempt last saw it."""


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _precondition_failed(e: BaseException) -> bool:
    """Whether ``e`` says an S3 ``If-Match``/``If-None-Match`` did not hold (412, or 409 on a race)."""
    for c in _chain(e):
        if isinstance(c, FileExistsError):
            return True
        response = getattr(c, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if error.get("Code") in _PRECONDITION_CODES or status in (409, 412):
                return True
    return False


def _not_found(e: BaseException) -> bool:
    return any(isinstance(c, FileNotFoundError) for c in _chain(e))


def _describe(seen: _Seen) -> str:
    if seen.record is None:
        return f"something unreadable ({seen.problem})"
    lease = seen.record
    job = f", job {lease['job']}" if lease.get("job") else ""
    return f"host {lease['host']} pid {lease['pid']} (attempt {lease['attempt']}{job})"
