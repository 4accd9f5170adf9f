"""Reading format-1 steps: DCP's own shard format, with a pickled ``.metadata`` (written by ft-checkpoint 0.1.0).

New saves never write this format (see ``shards``); it is read so that checkpoints written before keep
loading. Two things make it safe to read from a directory someone else can write:

- ``.metadata`` is a pickle. :class:`SafeUnpickler` resolves only the exact ``(module, name)`` pairs
  that DCP's metadata consists of, and refuses any dotted name (with pickle protocol 4 a name such as
  ``os.system`` can be looked up *through* an allowed module);
- the metadata it yields is then checked like ``metadata.json``: only tensor entries (DCP would load a
  non-tensor entry with ``torch.load(weights_only=False)``), every ``relative_path`` a plain file name the
  manifest lists, every byte range inside its file and disjoint from the others, the chunks of each
  tensor covering it exactly. Each record is then read by DCP with ``torch.load(weights_only=True)``.

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
import os
import pickle
from collections.abc import Iterator
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ft_checkpoint import layout, shards, tensor_metadata
from ft_checkpoint._dcp_internals import STORAGE_INFO_NAME, FsspecFileSystem, FsspecReader, StorageInfo
from ft_checkpoint.errors import CheckpointCorruptError
from ft_checkpoint.storage import Storage

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
    """The checked metadata of a format-1 step (see the module docstring); CheckpointCorruptError if not."""
    metadata = load_metadata(data)
    sizes = tensor_metadata.data_files(manifest.files)
    state = metadata.state_dict_metadata
    storage = metadata.storage_data
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise CheckpointCorruptError(f"{METADATA}: malformed")
    for fqn, md in state.items():
        def bad(what: str, fqn: Any = fqn) -> CheckpointCorruptError:
            return CheckpointCorruptError(f"{METADATA}: {str(fqn)[:80]!r}: {what}")

        if not isinstance(fqn, str) or not isinstance(md, TensorStorageMetadata):
            raise bad("not a tensor entry; refusing it (this engine only ever wrote tensors there)")
        if md.properties.dtype not in shards.DTYPES.values() or not tensor_metadata.int_list(list(md.size)):
            raise bad("bad dtype or size")
        boxes = [(list(c.offsets), list(c.sizes)) for c in md.chunks]
        for offsets, sizes_ in boxes:
            if not tensor_metadata.int_list(offsets, len(md.size)) or not tensor_metadata.int_list(sizes_, len(md.size)) or any(
                    o + n > d for o, n, d in zip(offsets, sizes_, md.size)):
                raise bad("a chunk lies outside the tensor")
        tensor_metadata.check_cover(list(md.size), boxes, bad)
    ranges = []
    for index, info in storage.items():
        _check_storage_info(index, info, sizes)
        ranges.append(tensor_metadata.ChunkEntry((), (), info.relative_path, info.offset, info.length, 0))
    tensor_metadata.check_ranges(ranges)
    needed = {MetadataIndex(fqn, c.offsets) for fqn, md in state.items() for c in cast(TensorStorageMetadata, md).chunks}
    if needed - set(storage):
        raise CheckpointCorruptError(f"{METADATA}: a chunk has no storage entry")
    return metadata


def _check_storage_info(index: Any, info: Any, sizes: dict[str, int]) -> None:
    if not isinstance(index, MetadataIndex) or not isinstance(info, StorageInfo):
        raise CheckpointCorruptError(f"{METADATA}: malformed storage entry")
    if info.relative_path not in sizes:
        raise CheckpointCorruptError(f"{METADATA}: {str(index.fqn)[:80]!r} is stored in {str(info.relative_path)[:80]!r}, "
                                     "which is not a data file listed in the manifest; refusing it")
    if not (tensor_metadata.is_int(info.offset) and tensor_metadata.is_int(info.length) and info.offset >= 0 and info.length >= 0
            and info.offset + info.length <= sizes[info.relative_path]) or info.transform_descriptors:
        raise CheckpointCorruptError(f"{METADATA}: the bytes of {str(index.fqn)[:80]!r} lie outside "
                                     f"{info.relative_path}")


class _StorageAdapter(FsspecFileSystem):
    """DCP's fsspec adapter on our storage's filesystem instance: each open retried on transient errors."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.storage = storage
        self.fs: Any = storage.fs

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        path = os.fspath(path)
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

