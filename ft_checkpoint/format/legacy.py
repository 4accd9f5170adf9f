"""Reading format-1 steps: DCP's own shard format, with a pickled ``.metadata`` (written by ft-checkpoint 0.1.0).

New saves never write this format (see ``shards``); it is read so that checkpoints written before keep
loading. Two things make it safe to read from a directory someone else can write:

- ``.metadata`` is a pickle. :class:`SafeUnpickler` resolves only the exact ``(module, name)`` pairs
  that DCP's metadata consists of, and refuses any dotted name (with pickle protocol 4 a name such as
  ``os.system`` can be looked up *through* an allowed module);
- the metadata it yields is then checked like ``metadata.json``, field by field (each of the type it
  must have), and rebuilt from the checked values: only tensor entries (DCP would load a non-tensor entry
  with ``torch.load(weights_only=False)``), every ``relative_path`` a plain file name the manifest lists,
  every byte range inside its file and disjoint from the others, the chunks of each tensor covering it
  exactly, no chunk claiming more bytes than its record holds. Each record is then read by DCP with
  ``torch.load(weights_only=True)``.

Checksums of format-1 files are whole-file SHA-256, verified before the load (one extra read).

Example:
    >>> import io, pickle
    >>> try:
    ...     SafeUnpickler(io.BytesIO(pickle.dumps(print))).load()
    ... except CheckpointCorruptError as e:
    ...     print(e)
    .metadata refers to builtins.print, which checkpoint metadata never does; refusing to load it
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ft_checkpoint.errors import CheckpointCorruptError
from ft_checkpoint.format import layout, shards, tensor_metadata
from ft_checkpoint.format._dcp_internals import STORAGE_INFO_NAME, FsspecFileSystem, FsspecReader, StorageInfo
from ft_checkpoint.store.jsonfile import is_int
from ft_checkpoint.store.storage import Storage

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"), (_DCP, "BytesStorageMetadata"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    (_DCP, "_MEM_FORMAT_ENCODING"), STORAGE_INFO_NAME,
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
} | {("torch", name) for name in shards.DTYPES}
"""Exactly the classes and functions DCP's metadata pickles refer to (dtypes by name)."""


class SafeUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, resolving only the exact names in :data:`_ALLOWED`.

    Nothing in torch offers a restricted loader for DCP metadata (DCP reads it with plain
    ``pickle.load``), so this allowlist is written here.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED and "." not in name:
            return super().find_class(module, name)
        raise CheckpointCorruptError(f"{METADATA} refers to {module}.{name}, which checkpoint metadata never does; "
                                     "refusing to load it")


def load_metadata(data: bytes) -> Metadata:
    """Unpickle ``.metadata`` through the allowlist; CheckpointCorruptError for anything else."""
    try:
        metadata = SafeUnpickler(io.BytesIO(data)).load()
    except CheckpointCorruptError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError, RuntimeError) as e:
        raise CheckpointCorruptError(f"{METADATA} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def parse_metadata(data: bytes, manifest: layout.Manifest) -> Metadata:
    """The metadata of a format-1 step, rebuilt from its fields once each is checked (see the module
    docstring): unpickled objects of the allowed classes may hold anything in any field, so none of them is
    passed on. CheckpointCorruptError if a field is wrong."""
    metadata = load_metadata(data)
    state, stored = _fields(metadata, "state_dict_metadata", "storage_data")
    if not isinstance(state, dict) or not isinstance(stored, dict):
        raise CheckpointCorruptError(f"{METADATA}: malformed (state_dict_metadata and storage_data must be dicts)")
    sizes = tensor_metadata.data_files(manifest.files)
    records = dict(_record(index, info, sizes) for index, info in stored.items())
    tensor_metadata.check_ranges(tensor_metadata.ChunkEntry((), (), r.relative_path, r.offset, r.length, 0)
                                 for r in records.values())
    tensors = {fqn: _tensor(fqn, md, records) for fqn, md in state.items()}
    return Metadata(state_dict_metadata=dict(tensors), storage_data=records)


def _fields(obj: Any, *names: str) -> tuple[Any, ...]:
    """The values of ``obj``'s fields (None where one is missing): an unpickled object may lack any."""
    return tuple(getattr(obj, name, None) for name in names)


def _tensor(fqn: Any, md: Any, records: dict[MetadataIndex, StorageInfo]) -> TensorStorageMetadata:
    """A checked tensor entry: a dtype the format stores, a size torch can hold, chunks that cover it exactly,
    each with a record that holds at least the bytes the chunk claims (so what a load allocates is bounded by
    the bytes the manifest lists)."""
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{METADATA}: {str(fqn)[:80]!r}: {what}")

    if not isinstance(fqn, str) or not isinstance(md, TensorStorageMetadata):
        raise bad("not a tensor entry; refusing it (this engine only ever wrote tensors there)")
    properties, size, chunks = _fields(md, "properties", "size", "chunks")
    dtype = getattr(properties, "dtype", None) if isinstance(properties, TensorProperties) else None
    if not isinstance(dtype, torch.dtype) or dtype not in shards.DTYPES.values():
        raise bad("properties must be TensorProperties with a dtype the format stores")
    if not tensor_metadata.int_list(size) or not tensor_metadata.fits_torch(size, dtype.itemsize):
        raise bad("size must be a list of integers >= 0 that torch can hold (at most 2**63 bytes)")
    if not isinstance(chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in chunks):
        raise bad("chunks must be a list of chunk entries")
    boxes = []
    for c in chunks:
        offsets, sizes = _fields(c, "offsets", "sizes")
        if not tensor_metadata.int_list(offsets, len(size)) or not tensor_metadata.int_list(sizes, len(size)) \
                or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise bad("a chunk lies outside the tensor")
        record = records.get(MetadataIndex(fqn, offsets))
        if record is None:
            raise bad(f"the chunk at {list(offsets)} has no storage entry")
        claimed = math.prod(sizes) * dtype.itemsize
        if claimed > record.length:
            raise bad(f"the chunk at {list(offsets)} claims {claimed} bytes, but its record holds only {record.length}")
        boxes.append((torch.Size(offsets), torch.Size(sizes)))
    tensor_metadata.check_cover(size, boxes, bad)
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(size),
                                 chunks=[ChunkStorageMetadata(offsets=o, sizes=n) for o, n in boxes])


def _record(index: Any, info: Any, sizes: dict[str, int]) -> tuple[MetadataIndex, StorageInfo]:
    """A checked storage entry: where one chunk's record lies, inside a data file the manifest lists."""
    fqn, offset = _fields(index, "fqn", "offset")
    if not isinstance(index, MetadataIndex) or not isinstance(info, StorageInfo) or not isinstance(fqn, str) \
            or not tensor_metadata.int_list(offset):
        raise CheckpointCorruptError(f"{METADATA}: malformed storage entry")
    path, start, length, transforms = _fields(info, "relative_path", "offset", "length", "transform_descriptors")
    if not isinstance(path, str) or path not in sizes:
        raise CheckpointCorruptError(f"{METADATA}: {fqn[:80]!r} is stored in {str(path)[:80]!r} (relative_path), which "
                                     "is not a data file listed in the manifest; refusing it")
    if not (is_int(start) and is_int(length) and 0 <= start and 0 <= length and start + length <= sizes[path]) \
            or not (transforms is None or isinstance(transforms, (list, tuple)) and not transforms):
        raise CheckpointCorruptError(f"{METADATA}: the bytes of {fqn[:80]!r} lie outside {path} (offset, length)")
    return MetadataIndex(fqn, offset), StorageInfo(path, start, length)


class _StorageAdapter(FsspecFileSystem):
    """DCP's fsspec adapter on our storage's filesystem instance: each open retried on transient errors, and on
    local disk made as every read of a step's file is (``Storage.open_read``: no link, no FIFO waited on), since
    the shard may have been swapped since its checksum pass."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.storage = storage
        self.fs: Any = storage.fs

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        path = os.fspath(path)
        prefix = self.storage.url_of("") + "/"
        if self.storage.is_local and mode == "rb" and path.startswith(prefix):
            with self.storage.open_read(path[len(prefix):]) as stream:
                yield stream
            return
        with self.storage.retrying("open", path, self.fs.open, path, mode, **self.storage.read_options) as stream:
            yield stream


class LegacyReader(FsspecReader):
    """DCP's fsspec reader for a format-1 step, given metadata already checked by :func:`parse_metadata`."""

    def __init__(self, storage: Storage, rel: str, metadata: Metadata) -> None:
        super().__init__(storage.url_of(rel), **storage.storage_options)
        self.fs = _StorageAdapter(storage)  # type: ignore[assignment]  # DCP types it as its own FileSystem
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise CheckpointCorruptError(f"{item.storage_index.fqn}: only tensors are read from shard files")
        return super().read_data(plan, planner)


def is_legacy(manifest: layout.Manifest) -> bool:
    """Whether the step is in format 1."""
    return manifest.format_version == 1

