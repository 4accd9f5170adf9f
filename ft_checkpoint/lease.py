"""One writer per checkpoint directory: a lease with the owner's identity and a heartbeat.

Two jobs saving into the same ``dirpath`` would delete each other's steps (retention) and interleave
their journals. The first job writes ``lease.json`` (host, pid, attempt, job id, heartbeat) and
refreshes the heartbeat from a background thread. Another job refuses to start, with an error that
names the owner, unless the lease can be taken over:

- the owner is a previous attempt of the same job (same ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID`` or
  ``FT_CHECKPOINT_RUN_ID``): a restart after a failure;
- the owner ran on this host and its process is gone (a crashed run started again by hand), or it
  is this very process (an earlier manager that could not release the lease);
- its heartbeat is older than ``timeout``: a crashed run elsewhere;
- the user forces it (``force_takeover=True``).

Object stores offer no atomic compare-and-swap here, so after writing its lease a job reads it back
and gives up if another job's lease replaced it.

Example:
    >>> from ft_checkpoint.storage import Storage
    >>> s = Storage("memory://doc/lease")
    >>> a = Lease(s, attempt="a"); a.acquire()
    >>> a.owner["host"] = "elsewhere"; a._write()   # as if a job on another host held it
    >>> try:
    ...     Lease(s, attempt="b").acquire()
    ... except LeaseError as e:
    ...     print("refused:", "another job is writing checkpoints" in str(e))
    refused: True
    >>> a.release()
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

from ft_checkpoint.errors import LeaseError, StorageError, StorageNotFoundError
from ft_checkpoint.storage import Storage

log = logging.getLogger(__name__)
LEASE = "lease.json"
_JOB_ENV = ("FT_CHECKPOINT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def job_id() -> str | None:
    """This job's identity across restarts, from the launcher's environment (None if unknown)."""
    for name in _JOB_ENV:
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """The lease of one attempt on one directory."""

    def __init__(self, storage: Storage, *, attempt: str, timeout: float = 120.0, refresh: float = 20.0) -> None:
        self.storage = storage
        self.timeout = timeout
        self.refresh = refresh
        self.owner = {"attempt": attempt, "host": socket.gethostname(), "pid": os.getpid(), "job": job_id()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, *, force: bool = False) -> None:
        """Take the lease, or raise LeaseError naming the job that holds it."""
        current = self._read()
        if current is not None and not force:
            reason = self._why_not(current)
            if reason:
                raise LeaseError(reason)
        if current is not None:
            log.info("taking over the checkpoint lease of %s", _describe(current))
        self._write()
        if (self._read() or {}).get("attempt") != self.owner["attempt"]:
            raise LeaseError(f"another job took the checkpoint lease of {self.storage.url} at the same moment; "
                             "HINT: give each job its own dirpath")
        self._thread = threading.Thread(target=self._beat, name="ft-checkpoint-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if (self._read() or {}).get("attempt") == self.owner["attempt"]:
                self.storage.delete_file(LEASE)
        except StorageError as e:
            log.warning("could not release the checkpoint lease: %s", e)

    def _why_not(self, current: dict[str, Any]) -> str | None:
        age = time.time() - float(current.get("heartbeat", 0))
        if current.get("attempt") == self.owner["attempt"] or age > self.timeout:
            return None
        if current.get("job") and current.get("job") == self.owner["job"]:
            return None
        if current.get("host") == self.owner["host"]:
            pid = int(current.get("pid", -1))
            if pid == self.owner["pid"] or not _pid_alive(pid):  # this very process, or a dead one
                return None
        return (f"another job is writing checkpoints to {self.storage.url}: {_describe(current)}, last heartbeat "
                f"{age:.0f} s ago. Two writers would delete each other's checkpoints. HINT: give this job its own "
                f"dirpath, or wait for that job to end (its lease expires {self.timeout:.0f} s after its last "
                "heartbeat), or pass force_takeover=True (FT_CHECKPOINT_FORCE_TAKEOVER=1) if it is dead")

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.storage.read_bytes(LEASE))
        except StorageNotFoundError:
            return None
        except ValueError:
            log.warning("ignoring an unreadable %s in %s", LEASE, self.storage.url)
            return None

    def _write(self) -> None:
        self.storage.write_bytes(LEASE, json.dumps({**self.owner, "heartbeat": time.time()}).encode())

    def _beat(self) -> None:
        while not self._stop.wait(self.refresh):
            try:
                self._write()
            except StorageError as e:
                log.warning("could not refresh the checkpoint lease: %s", e)


def _describe(lease: dict[str, Any]) -> str:
    job = f", job {lease['job']}" if lease.get("job") else ""
    return f"host {lease.get('host')} pid {lease.get('pid')} (attempt {lease.get('attempt')}{job})"
