"""Proof that a lease's owner on this machine is gone, in any PID namespace: a lock it holds while it lives.

A lease names its owner's host, pid and process space (the kernel's boot id and the PID namespace). A container
restarted in place, or a pod recreated under its name on the same node, has a new PID namespace, where the old
owner's pid names another process or none: without more, such a job must wait out the old heartbeat (2 min) and
then 30 s more (see ``lease``). On local disk the owner also holds ``flock`` on ``lease.lock`` in the checkpoint
directory, from before it writes ``lease.json`` until after it removes it, and says so in the lease (``"lock":
true``); the kernel drops the lock when the process ends, however it ends (SIGKILL, the OOM killer, its container
killed). So a job on the same kernel (the same boot id) that takes the lock at once knows that such an owner is
gone, whatever its PID namespace: it takes the lease over without waiting, as it does when an owner's pid is gone
in its own namespace.

What does not prove it: a lease without ``"lock": true`` (an earlier version's, or an owner that found the lock
held); another kernel (a pod moved to another node, a network filesystem: a lock there may be dropped while its
owner lives, cut off); a ``lease.lock`` that is no regular file (a link, a FIFO, a directory: never followed,
never waited on) or a filesystem without locks. There the lease is judged as before. A process this one forks
(a DataLoader worker) closes its copy of the descriptor, so it does not keep the lock of a parent that died.

Example:
    >>> import tempfile
    >>> from ft_checkpoint.store.storage import Storage
    >>> storage = Storage(tempfile.mkdtemp())
    >>> mine, theirs = OwnerLock(storage), OwnerLock(storage)
    >>> mine.try_hold(), theirs.try_hold()   # one process at a time (one open file, in fact)
    (True, False)
    >>> mine.release(); theirs.try_hold()
    True
    >>> theirs.release()
"""

from __future__ import annotations

import errno
import logging
import os
import stat

try:
    import fcntl
except ImportError:  # Windows: no flock, so no proof (the lease is judged by its heartbeat)
    fcntl = None  # type: ignore[assignment]

from ft_checkpoint.store import nofollow
from ft_checkpoint.store.storage import Storage

log = logging.getLogger(__name__)
LOCK = "lease.lock"
_OPEN = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Read-only (a lock needs no more), never through a link, never waiting on a FIFO, not inherited by a program run."""
_held: set[int] = set()
"""The descriptors this process holds a lock with: a forked child closes its copies (see :func:`_close_in_child`)."""


class OwnerLock:
    """``flock`` on ``lease.lock`` in a local checkpoint directory, held by the lease's owner while it lives."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._fd: int | None = None
        self.busy = False
        """The last :meth:`try_hold` found the lock held by another process (worth trying again later)."""
        self._pid = os.getpid()
        """The process that holds ``_fd``: a forked child has closed its copy, and never unlocks the parent's."""

    @property
    def held(self) -> bool:
        """Whether this process holds the lock."""
        return self._fd is not None and self._pid == os.getpid()

    def try_hold(self) -> bool:
        """Take the lock without waiting; True if this process holds it now (or did already). False where another
        process holds it, the store is not local disk, or ``lease.lock`` cannot be locked (a warning says why)."""
        if self.held:
            return True
        self._fd, self.busy = None, False  # _fd: a forked child's copy of its parent's lock, closed at the fork
        if not self.storage.is_local or fcntl is None:
            return False
        try:
            with nofollow.open_directory(self.storage.path(""), "", create=True) as directory:
                fd = os.open(LOCK, _OPEN, 0o644, dir_fd=directory)
        except OSError as e:
            kind = "a symbolic link" if e.errno == errno.ELOOP else f"{type(e).__name__}: {e}"
            log.warning("cannot lock %s (%s): a restarted job in another PID namespace will wait out this job's "
                        "heartbeat. HINT: remove it", self.storage.url_of(LOCK), kind)
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.warning("%s is no regular file: not locked (a restarted job in another PID namespace will wait "
                            "out this job's heartbeat). HINT: remove it", self.storage.url_of(LOCK))
                return False
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self.busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
            if not self.busy:
                log.debug("cannot lock %s: %s", self.storage.url_of(LOCK), e)  # ENOLCK, EOPNOTSUPP: no locks there
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._pid = fd, os.getpid()
        _held.add(fd)
        return True

    def release(self) -> None:
        """Drop the lock and close it; nothing if this process does not hold it."""
        if not self.held:
            self._fd = None
            return
        fd, self._fd = self._fd, None
        assert fd is not None
        _held.discard(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _close_in_child() -> None:
    """In a forked child: close the copies of the descriptors the parent locks with, without unlocking (the lock
    belongs to the open file, which the parent still holds), so the lock ends with the parent."""
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
