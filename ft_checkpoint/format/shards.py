"""Tensor shard files: a torch.distributed.checkpoint (DCP) storage writer and reader of our own.

DCP keeps doing what it is made for: planning which rank writes which tensor chunk (a replicated
tensor once, the work spread over ranks), the chunk metadata, and resharding on load. What this module
replaces is DCP's ``FileSystemWriter``/``Reader`` format, which serializes every tensor with
``torch.save`` (a zip record each, copied through Python) and pickles its metadata: here each staged
tensor's bytes go straight from the staging buffer to the file, in large writes, with the CRC-32C
computed over the same memory as it is written; a load reads each byte range straight into its target
tensor (``readinto``) and checks its CRC as it goes. No read-back at the commit, no second pass at
resume. The metadata is ``metadata.json``: plain data, strictly validated against the manifest before
anything is read (every file a plain name the manifest lists, every byte range inside its file and
disjoint from the others, the chunks of each tensor covering it exactly), then turned into DCP's
objects. Nothing is ever unpickled. See ``legacy`` for checkpoints in DCP's own format (format 1).

Files: ``__<rank>_<i>.distcp`` (``i`` < ``writers``: each rank's chunks spread over several files
written in parallel), each the concatenation of its chunks' raw bytes, no header; on local disk each
chunk starts on a page boundary (zero padding between), so that it can be written from its staging slot
with ``O_DIRECT``.

Example:
    >>> import torch
    >>> from ft_checkpoint.store.storage import Storage
    >>> s = Storage("memory://doc/shards")
    >>> w = ShardWriter(s, "step_000000000001", rank=0)
    >>> _ = torch.distributed.checkpoint.save({"w": torch.arange(4.0)}, storage_writer=w, no_dist=True)
    >>> sorted(w.files)
    ['__0_0.distcp', 'metadata.json']
    >>> w.files["__0_0.distcp"].size
    16
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, cast

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ft_checkpoint.errors import CheckpointCorruptError, SaveError
from ft_checkpoint.format import layout, tensor_metadata
from ft_checkpoint.progress import Progress
from ft_checkpoint.store import checksum
from ft_checkpoint.store.fence import Fence, write_fenced
from ft_checkpoint.store.storage import IO_SLICE, Storage, padded

log = logging.getLogger(__name__)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in tensor_metadata.ITEMSIZE
                                   if isinstance(getattr(torch, n, None), torch.dtype)}
"""The dtypes the format stores, by name (those whose bytes are plain memory), in this torch."""
Chunk = tensor_metadata.ChunkEntry
MAX_READERS = 4
"""A rank reads at most this many of a step's files at once at a resume."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``'float32'``; SaveError for a dtype the format does not store."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) != dtype:
        raise SaveError(f"tensors of dtype {dtype} cannot be saved (supported: {', '.join(DTYPES)})")
    return name


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable; keep ``t`` alive while using it)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def address_view(address: int, n: int) -> memoryview:
    """``n`` bytes of memory at ``address`` (of a tensor or arena that the caller keeps alive)."""
    return memoryview((ctypes.c_char * n).from_address(address)).cast("B") if n else memoryview(bytearray())


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor, copied only if it is not one already."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def narrow(t: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The box of ``t`` at ``offsets`` with ``sizes`` (a view)."""
    for dim, (o, n) in enumerate(zip(offsets, sizes)):
        if n != t.size(dim):
            t = t.narrow(dim, o, n)
    return t


# -- writing -----------------------------------------------------------------------------------
class Sink(Protocol):
    """Where a shard file's bytes are written: in this process, or by a writer process."""

    def write(self, rel: str, tensors: list[torch.Tensor], *, slots: bool, exclusive: bool = False) -> list[int]:
        """Write the tensors' bytes, in order, as the file ``rel``; one CRC-32C per tensor (of its bytes).
        With ``slots`` each tensor is a staging-arena slot, written whole (padded to pages, ``O_DIRECT``);
        ``exclusive``: created, never written over (see ``Storage.write_bytes``)."""

    def sync_dir(self, rel: str) -> None:
        """Make the directory entries in ``rel`` durable."""


class Slots(Protocol):
    """Host memory whose tensors start on page boundaries, each padded to whole pages (the save path's staging
    arena): a tensor it holds is written whole, with ``O_DIRECT``."""

    def contains(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of its page-aligned slots."""


class ThreadSink:
    """Writes in this process, on the calling thread, at the nice value ``priority`` (per thread, on Linux)."""

    def __init__(self, storage: Storage, priority: int = 0) -> None:
        self.storage, self.priority = storage, priority

    def write(self, rel: str, tensors: list[torch.Tensor], *, slots: bool = False, exclusive: bool = False) -> list[int]:
        set_thread_priority(self.priority)
        plain = [_plain(t) for t in tensors]  # kept alive while their bytes are written
        lengths = [t.numel() * t.element_size() for t in plain]
        views = [address_view(t.data_ptr(), padded(n)) for t, n in zip(plain, lengths)] if slots else \
            [byte_view(t) for t in plain]
        return self.storage.write_views(rel, views, lengths=lengths, direct=slots, exclusive=exclusive)

    def sync_dir(self, rel: str) -> None:
        self.storage.sync_dir(rel)


def set_thread_priority(nice: int) -> None:
    """Give the calling thread the nice value ``nice`` (Linux threads have their own); 0 changes nothing."""
    if nice and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) != nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)


class ShardWriter(StorageWriter):
    """DCP storage writer: each rank writes its chunks' raw bytes into ``writers`` files, with CRCs.

    Args:
        storage: The checkpoint directory.
        rel: The step directory (relative to the storage root).
        rank: This process's rank (names its files).
        writers: Files (and parallel writers) per rank.
        sinks: Where each file's bytes go (one per writer; default: this process).
        fence: The engine's checks that the job still holds the directory, around each file (see ``store.fence``);
            None: files are written as they come, over anything in their place.

    On the coordinator, after the save :attr:`files` holds ``{name: FileEntry}`` of every data file and
    of ``metadata.json``, for the manifest.
    """

    def __init__(self, storage: Storage, rel: str, *, rank: int, writers: int = 1,
                 sinks: list[Sink] | None = None, arena: Slots | None = None,
                 fence: Fence | None = None) -> None:
        super().__init__()
        self.storage, self.rel, self.rank, self.writers = storage, rel, rank, max(1, writers)
        self.fence = fence
        self.sinks: list[Sink] = sinks or [ThreadSink(storage)]
        self.arena = arena
        self.files: dict[str, layout.FileEntry] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.files = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                raise SaveError(f"{item.index.fqn}: only tensors go to shard files (other values go to the rank file)")
        bins = _bins(plan.items, self.writers)
        jobs = [(f"__{self.rank}_{i}.distcp", items, self.sinks[i % len(self.sinks)]) for i, items in enumerate(bins)]
        if len(jobs) <= 1:
            results = [self._write_file(name, items, sink, planner) for name, items, sink in jobs]
        else:
            results = _each_on_a_thread(lambda job: self._write_file(job[0], job[1], job[2], planner), jobs)
        if self.storage.is_local and jobs:
            jobs[0][2].sync_dir(self.rel)  # the files' directory entries are durable before the manifest
        future: Future[list[WriteResult]] = Future()
        future.set_result([r for per_file in results for r in per_file])
        return future

    def _write_file(self, name: str, items: list[Any], sink: Sink, planner: SavePlanner) -> list[WriteResult]:
        tensors = [cast(torch.Tensor, planner.resolve_data(item)) for item in items]  # tensors only (checked)
        # On local disk, tensors staged in the arena are written as whole page-aligned slots, with O_DIRECT:
        # no copy into the page cache. The zero padding between them is part of the file and of its CRC.
        slots = self.storage.is_local and self.arena is not None and all(self.arena.contains(t) for t in tensors)
        rel = f"{self.rel}/{name}"
        crcs = write_fenced(self.fence, rel, lambda exclusive: sink.write(rel, tensors, slots=slots, exclusive=exclusive))
        results, offset = [], 0
        for item, tensor, crc in zip(items, tensors, crcs):
            nbytes = tensor.numel() * tensor.element_size()
            chunk = item.tensor_data.chunk
            extent = padded(nbytes) if slots else nbytes
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=Written(
                Chunk(tuple(chunk.offsets), tuple(chunk.sizes), name, offset, nbytes, crc), offset + extent)))
            offset += extent
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        written = [r.storage_data for per_rank in results for r in per_rank]
        chunks = {r.index: r.storage_data.chunk for per_rank in results for r in per_rank}
        data = tensor_metadata.dump(_tensors(metadata, chunks))
        rel = f"{self.rel}/{layout.METADATA}"
        write_fenced(self.fence, rel, lambda exclusive: self.storage.write_bytes(rel, data, atomic=False,
                                                                                 exclusive=exclusive))
        self.files = _file_entries(written)
        self.files[layout.METADATA] = layout.FileEntry(size=len(data), checksum=layout.checksum([data]))


def _each_on_a_thread(fn: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
    """``[fn(job) for job in jobs]``, each job on a thread of its own; the first error is raised. Threads, not an
    executor: once the interpreter starts to exit, executors take no new work ("cannot schedule new futures after
    interpreter shutdown"), and a save settled then (a loop without ``with`` that raised) must still be written; where
    no thread can start then either (Python 3.12.0 and 3.12.1), the job runs on the calling thread."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(jobs[i])
        except BaseException as e:  # raised on the calling thread, below
            errors.append(e)

    started: list[threading.Thread] = []
    try:
        for i in range(len(jobs)):
            thread = threading.Thread(target=run, args=(i,), name=f"ft-checkpoint-shard-{i}")
            try:
                thread.start()
            except RuntimeError:  # "can't create new thread at interpreter shutdown" (Python 3.12.0 and 3.12.1)
                run(i)
                continue
            started.append(thread)
    finally:
        for thread in started:  # never return (or raise) while a job still writes
            thread.join()
    if errors:
        raise errors[0]
    return results


def _bins(items: list[Any], n: int) -> list[list[Any]]:
    """Items spread over at most ``n`` bins of about equal bytes (largest first into the lightest)."""
    if not items:
        return []
    bins: list[list[Any]] = [[] for _ in range(min(n, len(items)))]
    loads = [0] * len(bins)
    for item in sorted(items, key=lambda i: -(i.tensor_storage_size() or 0)):
        k = loads.index(min(loads))
        bins[k].append(item)
        loads[k] += item.tensor_storage_size() or 0
    return bins


def _tensors(metadata: Metadata, chunks: Mapping[MetadataIndex, Chunk]) -> dict[str, tensor_metadata.TensorEntry]:
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise SaveError(f"{fqn}: only tensors go to shard files")
        out[fqn] = tensor_metadata.TensorEntry(dtype=dtype_name(md.properties.dtype), size=tuple(md.size),
                                               chunks=tuple(chunks[MetadataIndex(fqn, c.offsets)] for c in md.chunks))
    return out


@dataclasses.dataclass(frozen=True)
class Written:
    """What writing one chunk produced: where it lies, and where the file ended after it (padding included)."""

    chunk: Chunk
    end: int


def _file_entries(written: Iterable[Written]) -> dict[str, layout.FileEntry]:
    """Size and CRC of each data file, combined from its chunks' CRCs and the zero padding around them (the
    file is their concatenation, each chunk maybe padded to whole pages): no byte is read back."""
    by_file: dict[str, list[Written]] = {}
    for w in written:
        by_file.setdefault(w.chunk.file, []).append(w)
    out = {}
    for name, parts in by_file.items():
        crc, size = 0, 0
        for w in sorted(parts, key=lambda w: w.chunk.offset):
            c = w.chunk
            crc = checksum.combine(checksum.combine(crc, checksum.zeros(c.offset - size), c.offset - size),
                                   c.crc32c, c.length)
            size = c.offset + c.length
            crc, size = checksum.combine(crc, checksum.zeros(w.end - size), w.end - size), w.end
        out[name] = layout.FileEntry(size=size, checksum=checksum.format_crc(crc))
    return out


# -- metadata.json -> DCP's objects --------------------------------------------------------------
def parse_metadata(data: bytes, manifest: layout.Manifest) -> Metadata:
    """DCP's metadata from ``metadata.json``, after :func:`ft_checkpoint.format.tensor_metadata.parse` checked it
    against the step's manifest.

    Raises:
        CheckpointCorruptError: naming the first thing that is wrong (a path, a range, a dtype, ...).
    """
    tensors = tensor_metadata.parse(data, tensor_metadata.data_files(manifest.files))
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, tensor_metadata.ChunkEntry] = {}
    for fqn, t in tensors.items():
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in t.chunks]
        state[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=DTYPES[t.dtype]), size=torch.Size(t.size),
                                           chunks=chunks)
        storage.update({MetadataIndex(fqn, c.offsets, i): c for i, c in enumerate(t.chunks)})
    return Metadata(state_dict_metadata=state, storage_data=storage)


# -- reading -----------------------------------------------------------------------------------
class ShardReader(StorageReader):
    """DCP storage reader: reads byte ranges straight into the target tensors and checks each range's CRC.

    Args:
        storage: The checkpoint directory.
        rel: The step directory.
        metadata: What :func:`parse_metadata` returned (already checked against the manifest).
        progress: Told how many bytes this rank reads, and each slice as it is read (a long resume shows it).
    """

    def __init__(self, storage: Storage, rel: str, metadata: Metadata, *, progress: Progress | None = None) -> None:
        super().__init__()
        self.storage, self.rel, self.metadata, self.progress = storage, rel, metadata, progress
        self.bytes_read = 0
        self._stored = {MetadataIndex(fqn, c.offsets): c.sizes for fqn, md in metadata.state_dict_metadata.items()
                        for c in getattr(md, "chunks", ())}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise CheckpointCorruptError(f"{item.storage_index.fqn}: only tensors are read from shard files")
            per_file.setdefault(self._chunk(item).file, []).append(item)
        jobs = [(f"{self.rel}/{name}", items) for name, items in sorted(per_file.items())]
        if self.progress is not None:
            self.progress.set_total(sum(self._chunk(item).length for item in plan.items))

        def read(job: tuple[str, list[ReadItem]]) -> None:
            self.storage.call("read", job[0], self._read_file, job[0], job[1], planner)

        if len(jobs) <= 1:
            list(map(read, jobs))
        else:  # the files a save wrote in parallel are read in parallel (each range's CRC overlaps another's read)
            with ThreadPoolExecutor(min(len(jobs), MAX_READERS), thread_name_prefix="ft-checkpoint-read") as pool:
                list(pool.map(read, jobs))
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _chunk(self, item: ReadItem) -> Chunk:
        return self.metadata.storage_data[item.storage_index]

    def _read_file(self, rel: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Read ``items`` from one file in offset order: each large chunk straight into its tensor; on an object
        store, runs of small chunks with one ranged get each (then copied: a few percent of the bytes)."""
        ordered = sorted(items, key=lambda i: self._chunk(i).offset)
        with self.storage.open_read(rel) as f:
            for run in ([[i] for i in ordered] if self.storage.is_local else _runs(ordered, self._chunk)):
                source = f if len(run) == 1 else _Span.read(f, self._chunk(run[0]).offset,
                                                            _end(self._chunk(run[-1])), rel)
                for item in run:
                    self._read_item(source, rel, item, planner)

    def _read_item(self, f: Any, rel: str, item: ReadItem, planner: LoadPlanner) -> None:
        chunk = self._chunk(item)
        md = cast(TensorStorageMetadata, self.metadata.state_dict_metadata[item.storage_index.fqn])  # checked
        stored = self._stored[item.storage_index]
        target = planner.resolve_tensor(item).detach()
        whole = list(item.lengths) == list(stored) and not any(item.storage_offsets)
        if whole and target.device.type == "cpu" and target.is_contiguous() and target.dtype == md.properties.dtype:
            buffer = target
        else:  # part of the chunk (resharding), or a target that cannot take the bytes as they are
            buffer = torch.empty(stored, dtype=md.properties.dtype)
        view = byte_view(buffer)
        if len(view) != chunk.length:
            raise CheckpointCorruptError(f"{rel}: chunk of {item.storage_index.fqn} has {chunk.length} bytes, "
                                         f"the tensor needs {len(view)}")
        f.seek(chunk.offset)
        crc = 0
        for start in range(0, len(view), IO_SLICE):
            piece = view[start:start + IO_SLICE]
            _read_exactly(f, piece, rel)
            crc = checksum.crc32c_of(piece, crc)
            if self.progress is not None:
                self.progress.update(len(piece))
        self.bytes_read += len(view)
        if crc != chunk.crc32c:
            raise CheckpointCorruptError(f"{self.storage.url_of(rel)}: bytes [{chunk.offset}, {chunk.offset + chunk.length}) "
                                         f"of {item.storage_index.fqn} do not match their checksum (corrupted)")
        if buffer is not target:
            target.copy_(narrow(buffer, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)


SMALL = 1 << 20
"""Chunks up to this size are read in runs from an object store (one ranged get per run)."""


def _end(chunk: Chunk) -> int:
    return chunk.offset + chunk.length


def _runs(items: list[ReadItem], chunk_of: Callable[[ReadItem], Chunk]) -> list[list[ReadItem]]:
    """``items`` (in offset order) grouped: each large chunk alone, consecutive small ones together (up to
    ``IO_SLICE`` bytes per run, gaps included)."""
    runs: list[list[ReadItem]] = []
    for item in items:
        chunk = chunk_of(item)
        last = runs[-1] if runs else None
        if chunk.length <= SMALL and last is not None and chunk_of(last[-1]).length <= SMALL \
                and _end(chunk) - chunk_of(last[0]).offset <= IO_SLICE:
            last.append(item)
        else:
            runs.append([item])
    return runs


class _Span:
    """Bytes ``[start, end)`` of a file, read with one ranged get, served as a file to ``_read_item``."""

    def __init__(self, data: bytearray, start: int) -> None:
        self.data, self.start, self.pos = memoryview(data), start, start

    @classmethod
    def read(cls, f: Any, start: int, end: int, rel: str) -> _Span:
        data = bytearray(end - start)
        f.seek(start)
        _read_exactly(f, memoryview(data), rel)
        return cls(data, start)

    def seek(self, pos: int) -> None:
        self.pos = pos

    def readinto(self, view: memoryview) -> int:
        piece = self.data[self.pos - self.start:self.pos - self.start + len(view)]
        view[:len(piece)] = piece
        self.pos += len(piece)
        return len(piece)


def _read_exactly(f: Any, view: memoryview, rel: str) -> None:
    while view:
        n = f.readinto(view)
        if not n:
            raise CheckpointCorruptError(f"{rel}: ends before the bytes the metadata lists (truncated)")
        view = view[n:]
