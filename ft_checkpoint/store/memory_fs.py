"""fsspec's ``memory://`` filesystem, made safe for several threads.

fsspec keeps every ``memory://`` file in one dict shared by all instances, and its ``ls`` walks that dict
while a file's size is looked up by name: a file deleted or created by another thread in between fails the
listing (``KeyError``, or ``dictionary changed size during iteration``). Our engine lists a step directory
while its retention thread deletes old steps and its writer threads create files, so every method that
reads or changes the dict runs here under one lock (the dict is process-wide, so the lock is too).
The files are the same dict as plain ``memory://``: a test that looks with ``fsspec.filesystem("memory")``
sees them. Each open for reading gets a file of its own, with its own position (fsspec hands every reader
the one file object of the store, so two threads reading the same file moved each other's position).

Example:
    >>> fs = LockedMemoryFileSystem(skip_instance_cache=True)
    >>> fs.pipe_file("/doc/locked/a", b"1"); fs.ls("/doc/locked", detail=False)
    ['/doc/locked/a']
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

__all__ = ["LockedMemoryFile", "LockedMemoryFileSystem"]

_LOCK = threading.RLock()

# Every method of MemoryFileSystem that reads or changes its store (and ``_open``, below).
_STORE_METHODS = ("ls", "find", "info", "exists", "isfile", "mkdir", "makedirs", "rmdir", "pipe_file",
                  "cat_file", "cp_file", "_rm", "rm", "modified", "created")


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            return method(*args, **kwargs)
    return run


class LockedMemoryFile(MemoryFile):
    """A file of the store whose writes take the lock too: a listing reads every file's size, and a
    ``BytesIO`` refuses to grow while its size is being read through a buffer."""


class LockedMemoryFileSystem(MemoryFileSystem):
    """``memory://`` with every access to the shared store under one process-wide lock."""

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        with _LOCK:  # opening for writing puts the file in the store
            f = super()._open(path, mode, *args, **kwargs)
            if mode == "rb":  # fsspec hands every reader the store's own file: one position for all
                return _reader(f)
            if type(f) is MemoryFile:
                f.__class__ = LockedMemoryFile
            return f


def _reader(stored: MemoryFile) -> MemoryFile:
    """A file of its own to read ``stored`` with: its own position, over the same bytes (``BytesIO`` shares them
    until one of the two is written, which a reader never does)."""
    f = MemoryFile(stored.fs, stored.path, stored.getvalue())
    f.created, f.modified = stored.created, stored.modified
    return f


for _name in _STORE_METHODS:
    setattr(LockedMemoryFileSystem, _name, _locked(getattr(MemoryFileSystem, _name)))
for _name in ("write", "writelines", "truncate"):
    setattr(LockedMemoryFile, _name, _locked(getattr(MemoryFile, _name)))
