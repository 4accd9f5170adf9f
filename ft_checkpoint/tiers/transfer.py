"""Step folders sent between ranks over a gloo process group of their own, in chunks, checked as received.

This copies each rank's fast-tier files to its peer after a save (replication), and gives a rank whose
node lost its fast tier the files another node holds (at a resume). What is sent is one step directory of
one rank's folder: first a header (the sender's manifest, and how many bytes follow), then the files, in
name order, as one stream cut into chunks of :data:`CHUNK` bytes. Every pair's sends and receives run at
once, round by round (a rank posts all its sends and receives of a round, then waits for them), so a ring
cannot deadlock. Each received file's size and CRC-32C must match the sender's manifest, and the manifest
is written last: a copy exists only once every byte of it checked. A failure (a file the sender cannot
read, bytes that do not match) never ends the exchange early, which would leave the partner waiting: the
rounds run to their end, and the failure is raised then.

Example (a rank sending to itself, in one process):
    >>> import tempfile, torch
    >>> from ft_checkpoint.tiers.write import write_rank_step
    >>> a, b = Storage(tempfile.mkdtemp(), fsync=False), Storage(tempfile.mkdtemp(), fsync=False)
    >>> _ = write_rank_step(a, 7, {"w": torch.arange(5.0)}, b"rank file", rank=0, world_size=1, save="a1b2")
    >>> stream = Outgoing(a, 7); copy = Incoming(b, 7, stream.header)
    >>> for start in range(0, stream.total, 4):
    ...     chunk = bytearray(min(4, stream.total - start)); stream.fill(memoryview(chunk)); copy.drain(memoryview(chunk))
    >>> copy.finish(); layout.check_step(b, 7).ok
    True
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from ft_checkpoint.errors import CheckpointCorruptError, StorageError
from ft_checkpoint.format import layout
from ft_checkpoint.format.shards import _read_exactly, byte_view
from ft_checkpoint.store import checksum
from ft_checkpoint.store.storage import Storage

log = logging.getLogger(__name__)
CHUNK = 32 << 20
"""Bytes per message: large enough to amortize a round, small enough for two buffers per pair."""


class Outgoing:
    """One step directory of ``storage`` as a stream: the header, then its files' bytes in name order."""

    def __init__(self, storage: Storage, step: int) -> None:
        self.storage, self.rel = storage, layout.step_dir(step)
        self.problems: list[str] = []
        try:
            self.header = storage.read_bytes(f"{self.rel}/{layout.MANIFEST}")
            manifest = layout.Manifest.from_json(self.header, where=storage.url_of(self.rel))
        except (StorageError, CheckpointCorruptError) as e:  # nothing is sent: the receiver learns it from the header
            self.header, self.files, self.problems = b"", [], [f"{storage.url_of(self.rel)}: {e}"]
        else:
            self.files = [(name, e.size) for name, e in sorted(manifest.files.items())]
        self.total = sum(size for _, size in self.files)
        self._index, self._left = -1, 0
        self._f: Any = None
        self._open = contextlib.ExitStack()

    def fill(self, view: memoryview) -> None:
        """The next ``len(view)`` bytes of the stream (zeros where a file cannot be read: the receiver's check fails)."""
        while view:
            if self._left == 0:
                self._next_file()
                continue
            n = min(len(view), self._left)
            try:
                _read_exactly(self._f, view[:n], self.files[self._index][0])
            except (OSError, ValueError) as e:
                view[:n] = bytes(n)
                self._fail(f"{self.files[self._index][0]}: {type(e).__name__}: {e}")
            view, self._left = view[n:], self._left - n

    def _next_file(self) -> None:
        self.close()
        self._index += 1
        name, self._left = self.files[self._index]  # an IndexError here would be a bug: the sizes say how much to read
        try:  # as the durable tier reads a step: no link followed, no FIFO waited on, the size the manifest lists
            self._f = self._open.enter_context(self.storage.open_read(f"{self.rel}/{name}", size=self._left))
        except (OSError, StorageError, CheckpointCorruptError) as e:
            self._fail(f"{name}: {type(e).__name__}: {e}")

    def _fail(self, problem: str) -> None:
        self.problems.append(f"{self.storage.url_of(self.rel)}/{problem}")
        self.close()
        self._f = _Zeros()

    def close(self) -> None:
        self._open.close()
        self._f = None


class _Zeros:
    """What is read from a file that cannot be: zeros (the receiver's CRC check then fails)."""

    def readinto(self, view: memoryview) -> int:
        view[:] = bytes(len(view))
        return len(view)

    def close(self) -> None:
        pass


class Incoming:
    """Where a stream sent by :class:`Outgoing` becomes a copy of the step in ``storage``, checked as it arrives."""

    def __init__(self, storage: Storage, step: int, header: bytes, *, sender: str = "the sender") -> None:
        self.storage, self.step, self.rel = storage, step, layout.step_dir(step)
        self.header, self.problems = header, []
        self.files: list[tuple[str, layout.FileEntry]] = []
        if not header:
            self.problems.append(f"{sender} had no step {step} to send")
        else:
            try:
                manifest = layout.Manifest.from_json(header, where=f"the manifest from {sender}")
                if manifest.step != step:
                    raise CheckpointCorruptError(f"{sender} sent step {manifest.step}, not {step}")
                self.files = sorted(manifest.files.items())
            except CheckpointCorruptError as e:
                self.problems.append(str(e))
        layout.delete_step(storage, step, before_write=True)  # what an earlier copy left (a link: itself, not its target)
        self._index, self._left, self._crc = -1, 0, 0
        self._f: Any = None
        self._open = contextlib.ExitStack()

    def drain(self, view: memoryview) -> None:
        """Take the next ``len(view)`` bytes of the stream."""
        while view:
            if self._left == 0:
                self._next_file()
                continue
            n = min(len(view), self._left)
            piece = view[:n]
            if self._f is not None:
                self._f.write(piece)
            self._crc = checksum.crc32c_of(piece, self._crc)
            view, self._left = view[n:], self._left - n
            if self._left == 0:
                self._end_file()

    def _next_file(self) -> None:
        self._index += 1
        if self._index >= len(self.files):  # more bytes than the manifest lists: keep nothing
            raise CheckpointCorruptError(f"step {self.step}: the sender sent more bytes than its manifest lists")
        name, entry = self.files[self._index]
        self._left, self._crc = entry.size, 0
        # as the durable tier writes a step: a new file, no link followed on its way or in its place
        self._f = self._open.enter_context(self.storage.open_write(f"{self.rel}/{name}"))
        if entry.size == 0:
            self._end_file()

    def _end_file(self) -> None:
        name, entry = self.files[self._index]
        self._open.close()
        self._f = None
        if checksum.format_crc(self._crc) != entry.checksum:
            self.problems.append(f"{name}: the bytes received do not match the sender's checksum (corrupted)")

    def finish(self) -> None:
        """Write the manifest if every file arrived and checked, else delete what arrived; CheckpointCorruptError
        naming the problems."""
        while not self.problems and self._index + 1 < len(self.files) and self.files[self._index + 1][1].size == 0:
            self._next_file()  # empty files at the end of the stream
        if self._index + 1 < len(self.files) or self._left:
            self.problems.append("the stream ended before every file the manifest lists")
        if self.problems:
            self._open.close()
            layout.delete_step(self.storage, self.step)
            raise CheckpointCorruptError(f"copy of step {self.step} into {self.storage.url}: {'; '.join(self.problems[:3])}")
        self.storage.write_bytes(f"{self.rel}/{layout.MANIFEST}", self.header)


def exchange(group: Any, sends: list[tuple[int, Storage, int]], receives: list[tuple[int, Storage, int]], *,
             chunk: int | None = None) -> int:
    """Send ``(dst rank, folder, step)`` and receive ``(src rank, folder, step)`` step directories at once, over
    ``group`` (collective for the ranks named: each send needs its receive on the other side), in messages of
    ``chunk`` bytes (default :data:`CHUNK`, read at each call; each sender's size goes in its header). Returns the
    bytes received. Raises CheckpointCorruptError after the last round if a copy received here is not whole and
    checked (a file this rank could not send is only logged: its receiver finds the bytes wrong and raises there)."""
    size = chunk or CHUNK
    outgoing = [Outgoing(storage, step) for _, storage, step in sends]
    sizes = _swap(group, [(dst, torch.tensor([len(o.header), o.total, size], dtype=torch.int64)) for (dst, _, _), o in
                          zip(sends, outgoing)], [(src, torch.zeros(3, dtype=torch.int64)) for src, _, _ in receives])
    headers = _swap(group, [(dst, _bytes(o.header)) for (dst, _, _), o in zip(sends, outgoing) if o.header],
                    [(src, torch.empty(int(n[0]), dtype=torch.uint8)) for (src, _, _), n in zip(receives, sizes) if n[0]])
    texts = iter(headers)
    incoming = [Incoming(storage, step, bytes(next(texts).numpy()) if n[0] else b"", sender=f"rank {src}")
                for (src, storage, step), n in zip(receives, sizes)]
    streams = [(dst, o, o.total, size) for (dst, _, _), o in zip(sends, outgoing)]
    copies = [(src, copy, int(n[1]), max(1, int(n[2]))) for (src, _, _), copy, n in zip(receives, incoming, sizes)]
    received = _rounds(group, streams, copies)
    for problem in (p for o in outgoing for p in o.problems):
        log.warning("sent zeros for what could not be read: %s", problem)
    problems = []
    for copy in incoming:
        try:
            copy.finish()
        except CheckpointCorruptError as e:
            problems.append(str(e))
    if problems:
        raise CheckpointCorruptError("; ".join(problems[:3]))
    return received


def _rounds(group: Any, streams: list[tuple[int, Outgoing, int, int]], copies: list[tuple[int, Incoming, int, int]]
            ) -> int:
    """Every pair's chunks, round by round (``(peer, stream, total bytes, chunk size)`` each way), two buffers per
    pair: while round k's messages are on the wire, round k+1's chunks are read and round k-1's written and
    checked. A copy that failed goes on taking (and dropping) its chunks, so that its sender is never left waiting."""
    out_buffers = [[torch.empty(min(chunk, total), dtype=torch.uint8) for _ in range(2)] for _, _, total, chunk in streams]
    in_buffers = [[torch.empty(min(chunk, total), dtype=torch.uint8) for _ in range(2)] for _, _, total, chunk in copies]
    rounds = max([-(-total // chunk) for _, _, total, chunk in streams + copies], default=0)
    _fill(streams, out_buffers, 0)
    received = 0
    landed: list[tuple[int, torch.Tensor, Incoming]] = []
    for k in range(rounds):
        posted = [(dst, view) for (dst, _, total, chunk), bufs in zip(streams, out_buffers)
                  if (view := _piece(bufs, k, total, chunk)) is not None]
        arriving = [(src, view, copy) for (src, copy, total, chunk), bufs in zip(copies, in_buffers)
                    if (view := _piece(bufs, k, total, chunk)) is not None]
        works = _post(group, posted, [(src, view) for src, view, _ in arriving])
        _fill(streams, out_buffers, k + 1)  # while round k is on the wire
        received += _take(landed)
        for work in works:
            work.wait()
        landed = arriving
    received += _take(landed)
    for _, stream, _, _ in streams:
        stream.close()
    return received


def _piece(buffers: list[torch.Tensor], k: int, total: int, chunk: int) -> torch.Tensor | None:
    """Round ``k``'s part of a pair's buffers (they alternate), or None once the pair is done."""
    n = min(chunk, total - k * chunk)
    return buffers[k % 2][:n] if n > 0 else None


def _fill(streams: list[tuple[int, Outgoing, int, int]], buffers: list[list[torch.Tensor]], k: int) -> None:
    """Read round ``k``'s chunk of every stream into its buffer."""
    for (_, stream, total, chunk), bufs in zip(streams, buffers):
        view = _piece(bufs, k, total, chunk)
        if view is not None:
            stream.fill(byte_view(view))


def _take(landed: list[tuple[int, torch.Tensor, Incoming]]) -> int:
    """Write and check what a round received; its bytes."""
    for _, view, copy in landed:
        if not copy.problems:
            _drain(copy, view)
    return sum(view.numel() for _, view, _ in landed)


def _drain(copy: Incoming, view: torch.Tensor) -> None:
    try:
        copy.drain(byte_view(view))
    except (OSError, CheckpointCorruptError) as e:
        copy.problems.append(f"{type(e).__name__}: {e}")


def _swap(group: Any, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
    """Post every send and receive, then wait for all of them; the receive buffers, filled."""
    for work in _post(group, sends, receives):
        work.wait()
    return [t for _, t in receives]


def _post(group: Any, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> list[Any]:
    """Post every send and receive (without waiting); their works."""
    works = [dist.isend(t, dst, group=group) for dst, t in sends] + [dist.irecv(t, src, group=group) for src, t in receives]
    return [w for w in works if w is not None]


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)

