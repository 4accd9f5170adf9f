"""A writer process: writes shard files from the shared staging arena, outside the training process.

A writer thread in the training process competes with training for the GIL as well as for the CPU.
With ``writer="process"`` the bytes are written, and their CRCs computed, by a child process that maps
the staging arena (a ``memfd``, see ``staging``) and reads nothing else from the parent: each request
names a file and the arena ranges to write into it, in order; the answer is one CRC-32C per range.
The child runs at the priority ``writer_priority`` (a nice value), which works for a process where it
does not for a thread that holds the GIL.

The child is a fresh, isolated interpreter (:func:`command`), not a fork or a ``multiprocessing`` spawn:
those would import the training script again. It imports only what the training imports, from the
training's own ``sys.path``: never a module that happens to lie in the working directory. It never
imports torch. It
exits when its parent's pipe closes, so a killed training process leaves no writer behind. Requests
and answers are length-prefixed pickles on the child's stdin and stdout (both ends are ours).

Example:
    >>> import mmap, os
    >>> from ft_checkpoint.store.checksum import crc32c_of
    >>> from ft_checkpoint.store.storage import Storage
    >>> fd = os.memfd_create("doc"); os.ftruncate(fd, 8); m = mmap.mmap(fd, 8); m[:] = b"abcdefgh"
    >>> w = WriterProcess(Storage("memory://doc/writer"), fd, 8)   # memory:// is per process: nothing visible here
    >>> w.write("step_000000000001/__0_0.distcp", [(0, 3), (3, 5)]) == [crc32c_of(b"abc"), crc32c_of(b"defgh")]
    True
    >>> w.close()
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import IO, Any

from ft_checkpoint.errors import SaveError, StorageError, StorageExistsError
from ft_checkpoint.store.storage import DIRECT_ALIGN, Storage, is_transient

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<Q")


def command() -> list[str]:
    """How the writer process is started: an isolated interpreter (``-I``: no working directory or script
    directory on its import path, no user site-packages, no ``PYTHON*`` variables) given this process's
    ``sys.path``, so that it imports the modules the training imports, from where the training imports them.

    Example:
        >>> command()[1:3]
        ['-I', '-c']
    """
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where this ft_checkpoint lies
    path = [p for p in sys.path if isinstance(p, str)]
    path += [here] if here not in path else []
    start = f"import sys; sys.path[:] = {path!r}; from ft_checkpoint.save.writer_process import main; main()"
    return [sys.executable, "-I", "-c", start]


def send(f: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def recv(f: IO[bytes]) -> Any:
    """The next message, or None when the other end closed."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    data = f.read(_HEADER.unpack(head)[0])
    return pickle.loads(data)


class WriterProcess:
    """The parent's handle on one writer process, bound to one arena.

    Args:
        storage: The checkpoint directory (the child opens its own filesystem from its URL and options).
        arena_fd: The ``memfd`` of the staging arena (passed to the child).
        arena_size: Its size in bytes.
        priority: The child's nice value (0: as the parent; 19: only idle CPU).
    """

    def __init__(self, storage: Storage, arena_fd: int, arena_size: int, *, priority: int = 0) -> None:
        self.proc = subprocess.Popen(command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=[arena_fd])
        self._lock = threading.Lock()
        self._request("init", storage.url, storage.storage_options, storage.retries, arena_fd, arena_size, priority)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def write(self, rel: str, ranges: list[tuple[int, int]], *, lengths: list[int] | None = None,
              direct: bool = False, exclusive: bool = False) -> list[int]:
        """Write the arena's byte ``ranges`` (offset, length), in order, as the file ``rel``; their CRC-32Cs
        (of their first ``lengths`` bytes, if given). ``direct``: ``O_DIRECT`` (aligned ranges); ``exclusive``:
        created, never written over (StorageExistsError: see ``Storage.write_bytes``)."""
        return self._request("write", rel, ranges, lengths, direct, exclusive)

    def sync_dir(self, rel: str) -> None:
        self._request("sync_dir", rel)

    def _request(self, *msg: Any) -> Any:
        with self._lock:
            try:
                assert self.proc.stdin is not None and self.proc.stdout is not None
                send(self.proc.stdin, msg)
                answer = recv(self.proc.stdout)
            except (BrokenPipeError, OSError) as e:
                answer = None
                log.debug("writer process pipe: %s", e)
        if answer is None:
            raise WriterDied(f"the writer process (pid {self.proc.pid}) died (exit code {self.proc.poll()}); "
                             "a new one starts at the next save")
        if answer[0] == "error":
            _, kind, message, transient = answer
            cause = ConnectionError(message) if transient else None
            error = StorageExistsError if kind == StorageExistsError.__name__ else StorageError
            raise error(f"writer process: {kind}: {message}") from cause
        return answer[1]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Stop the child (it exits when its stdin closes)."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WriterDied(SaveError):
    """The writer process is gone (killed, crashed): what it was asked to write was not written."""


class ProcessSink:
    """A :class:`~ft_checkpoint.format.shards.Sink` that has a writer process write tensors staged in its arena.

    A tensor outside the arena (or not contiguous) cannot be named to the child: its file is written in
    this process instead (``fallback``); so is every file once the child died (killed by the OOM killer or
    an operator): the bytes are still staged, and a dead helper process is no reason to lose a save. The
    engine starts a new child at the next save.
    """

    def __init__(self, process: WriterProcess, arena_base: int, arena_size: int, fallback: Any) -> None:
        self.process, self.base, self.size, self.fallback = process, arena_base, arena_size, fallback

    def write(self, rel: str, tensors: list[Any], *, slots: bool = False, exclusive: bool = False) -> list[int]:
        ranges, lengths = [], []
        for t in tensors:
            offset, n = t.data_ptr() - self.base, t.numel() * t.element_size()
            extent = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN if slots else n
            if t.device.type != "cpu" or not t.is_contiguous() or not 0 <= offset <= offset + extent <= self.size:
                return self.fallback.write(rel, tensors, slots=slots, exclusive=exclusive)
            ranges.append((offset, extent))
            lengths.append(n)
        try:
            return self.process.write(rel, ranges, lengths=lengths, direct=slots, exclusive=exclusive)
        except WriterDied as e:
            log.warning("%s; this save writes %s in the training process instead", e, rel)
            return self.fallback.write(rel, tensors, slots=slots, exclusive=exclusive)

    def sync_dir(self, rel: str) -> None:
        try:
            self.process.sync_dir(rel)
        except WriterDied:
            self.fallback.sync_dir(rel)


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    msg = recv(inp)
    if msg is None or msg[0] != "init":
        return
    _, url, options, retries, fd, size, priority = msg
    if priority:
        os.setpriority(os.PRIO_PROCESS, 0, priority)
    storage = Storage(url, options, retries=retries)
    arena = memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    send(out, ("ok", None))
    while (msg := recv(inp)) is not None:
        try:
            if msg[0] == "write":
                _, rel, ranges, lengths, direct, exclusive = msg
                result: Any = storage.write_views(rel, [arena[o:o + n] for o, n in ranges], lengths=lengths,
                                                  direct=direct, exclusive=exclusive)
            else:
                storage.sync_dir(msg[1])
                result = None
            send(out, ("ok", result))
        except Exception as e:
            send(out, ("error", type(e).__name__, str(e), is_transient(e)))


def main() -> None:
    """The child's entry point: serve requests on stdin/stdout until stdin closes."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="ft-checkpoint writer: %(message)s")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers goes to the parent's pipe
    _serve(inp, out)


if __name__ == "__main__":
    main()
