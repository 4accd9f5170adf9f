"""A local filesystem that misbehaves on purpose: transient errors, latency spikes, a permanent outage.

For tests and the chaos benchmark: import this module (it registers the ``faulty`` protocol with fsspec, in
this process only), point a checkpoint directory at ``faulty:///some/local/path`` and pass the faults as
storage options. Every storage call (opening a file to read or write it, a
listing, a delete) may fail with a ``ConnectionResetError`` (a transient error, retried by the
storage layer) at ``transient_rate``, sleep ``latency`` seconds at ``latency_rate``, or, with
``outage=True``, always fail with ``ConnectionRefusedError``. ``refuse_reads`` (``fnmatch`` patterns of file
names) makes every read of a matching file fail with ``PermissionError``: a test that a resume took its data
from elsewhere (the fast tier) asserts it so. ``reads`` lists every file opened for reading, in order: a test
counts what a start reads.

Example:
    >>> from ft_checkpoint.store.storage import Storage
    >>> s = Storage("faulty:///tmp/ft-doc-faults", {"transient_rate": 0.3, "seed": 1}, retries=10, backoff=0.001)
    >>> s.write_bytes("x", b"still written")
    >>> s.read_bytes("x")
    b'still written'
"""

from __future__ import annotations

import fnmatch
import posixpath
import random
import threading
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


class FaultyFileSystem(LocalFileSystem):
    """Local disk with injected faults (see the module docstring)."""

    protocol = "faulty"
    root_marker = "/"

    def __init__(self, transient_rate: float = 0.0, latency: float = 0.0, latency_rate: float = 0.0,
                 outage: bool = False, seed: int | None = None, refuse_reads: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.transient_rate, self.latency, self.latency_rate, self.outage = transient_rate, latency, latency_rate, outage
        self.refuse_reads = list(refuse_reads or [])
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected = 0
        self.reads: list[str] = []
        """Every path opened for reading, in order."""

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("faulty://"):
            path = path[len("faulty://"):]
        return LocalFileSystem._strip_protocol(path)

    def _fault(self, what: str) -> None:
        if self.outage:
            raise ConnectionRefusedError(f"injected outage: {what}")
        with self._lock:
            fail = self._rng.random() < self.transient_rate
            slow = self._rng.random() < self.latency_rate
            self.injected += fail
        if slow:
            time.sleep(self.latency)
        if fail:
            raise ConnectionResetError(f"injected transient error: {what}")

    def _open(self, path: Any, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        self._fault(f"open {path}")
        name = posixpath.basename(str(path))
        if "r" in mode and any(fnmatch.fnmatchcase(name, pattern) for pattern in self.refuse_reads):
            raise PermissionError(f"refused by the test (refuse_reads): reading {path}")
        if "r" in mode:
            with self._lock:
                self.reads.append(self._strip_protocol(path))
        return super()._open(path, mode, *args, **kwargs)

    def pipe_file(self, path: Any, value: bytes, *args: Any, **kwargs: Any) -> None:
        self.makedirs(self._parent(path), exist_ok=True)  # its open may fail, as every open
        return super().pipe_file(path, value, *args, **kwargs)

    def ls(self, path: Any, detail: bool = False, **kwargs: Any) -> Any:
        self._fault(f"list {path}")
        return super().ls(path, detail=detail, **kwargs)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._fault(f"delete {path}")
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: Any) -> None:
        self._fault(f"delete {path}")
        return super().rm_file(path)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
