"""The hung-writer fence: a save's files written only while the job holds the directory, never over another's.

A job that stood still (SIGSTOP, a long GC pause, a VM paused) may have been taken over meanwhile, and the new owner
may be saving the same step. Two checks keep the old job from writing over the new owner's files:

- before each file, ``check()`` (the lease seen as the job's own recently, else read again): a job that lost the
  directory stops at its next file;
- each file is created, never replaced: on local disk with ``O_EXCL`` (the manifest is renamed into the directory the
  save made, see ``Storage.write_bytes``), on S3 with ``If-None-Match: *``, on GCS with ``ifGenerationMatch=0``
  (``Storage.exclusive_creates``). A job that
  woke after the new owner wrote a file (an upload already on its way when it froze, which completes when it wakes; or
  a file it starts because its last sight of the lease looked recent: an old owner taken over twice) is refused. (A
  rank that stood still before it joined the save never counts rank 0's check of the lease as a sight newer than the
  moment it joined: see ``SaveListener.writable_confirmed``.) Whoever meets a file already there reads the lease
  (``confirm()``): the job that lost it stops there (LeaseError); the owner deletes what it found (the late file of
  the job it took over, landed after its clear of the step, or an earlier try of its own write that landed before a
  retry) and writes once more, with a warning.

A late file of a name the new owner does not write (a rank of a larger job) finds nothing there and lands beside
the new owner's files: the step is then refused for a file its manifest does not list. On a store without exclusive
creates (``memory://``, Azure, ...) an upload in flight may still land over the new owner's file (README, the lease
paragraph).

Example:
    >>> from ft_checkpoint.store.storage import Storage
    >>> s = Storage("memory://doc/fence")
    >>> fence = Fence(s, check=lambda: None, confirm=lambda: None)
    >>> fence.write("step/a.bin", lambda exclusive: s.write_bytes("step/a.bin", b"1", exclusive=exclusive))
    >>> s.read_bytes("step/a.bin")
    b'1'
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TypeVar

from ft_checkpoint.errors import StorageExistsError
from ft_checkpoint.store.storage import Storage

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Fence:
    """The checks around each file a save creates in a step directory (see the module's docstring).

    Args:
        storage: The checkpoint directory.
        check: Before each file; raises (LeaseError) once the job no longer holds the directory. Cheap: it reads the
            lease only if the job has not seen it as its own for a while.
        confirm: When a file to be created is there already; reads the lease, and raises unless it is the job's.
    """

    storage: Storage
    check: Callable[[], None]
    confirm: Callable[[], None]

    def write(self, rel: str, write: Callable[[bool], T]) -> T:
        """``write(True)``, which creates ``rel`` exclusively, after :attr:`check`; if ``rel`` was there already,
        :attr:`confirm`, delete it and ``write(True)`` once more (a second StorageExistsError is raised)."""
        self.check()
        try:
            return write(True)
        except StorageExistsError:
            self.confirm()  # LeaseError here if this job is the one that lost the directory
        log.warning("%s was there already when this job created it: the upload of a job that lost this directory, "
                    "completed late, or an earlier try of this write; deleted, and written again", self.storage.url_of(rel))
        self.storage.delete_file(rel)
        return write(True)


def write_fenced(fence: Fence | None, rel: str, write: Callable[[bool], T]) -> T:
    """``fence.write(rel, write)``; without a fence (no lease to hold), ``write(False)``: a plain write.

    Example:
        >>> write_fenced(None, "a.bin", lambda exclusive: exclusive)
        False
    """
    return write(False) if fence is None else fence.write(rel, write)
