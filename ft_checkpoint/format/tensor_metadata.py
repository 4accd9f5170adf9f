"""``metadata.json``: where each tensor chunk of a step lies, as plain data, and the checks that make it safe.

Written by rank 0 at the commit (see ``shards``), listed and checksummed in the manifest. Reading it
never unpickles anything and never imports torch (``ft-checkpoint inspect`` uses it as it is). Before
anything is loaded, :func:`parse` checks it against the step's data files as the manifest lists them:

- every dtype is one of :data:`ITEMSIZE`, every size a list of at most :data:`MAX_DIMS` integers that
  torch can hold (:func:`fits_torch`: ``torch.empty`` raises on an extent past 2**63 bytes, even empty);
- every chunk lies inside its tensor, and the chunks of a tensor cover it exactly (no gap would leave
  part of a tensor at its fresh-init values, no overlap), checked in O(n log n) time and O(n) memory
  for n chunks (:func:`check_cover`);
- every chunk's file is a data file the manifest lists, its byte range lies inside that file and
  matches the chunk's size, and no two chunks share bytes: so the elements of every tensor are bounded
  by the bytes the manifest lists.

Example:
    >>> doc = {"format": FORMAT, "version": 1, "tensors": {"w": {"dtype": "float32", "size": [2, 2], "chunks": [
    ...     {"offsets": [0, 0], "sizes": [2, 2], "file": "__0_0.distcp", "offset": 0, "length": 16, "crc32c": "00000000"}]}}}
    >>> parse(json.dumps(doc).encode(), {"__0_0.distcp": 16})["w"].chunks[0].length
    16
    >>> doc["tensors"]["w"]["chunks"][0]["sizes"] = [1, 2]         # half the tensor would keep its old values
    >>> try:
    ...     parse(json.dumps(doc).encode(), {"__0_0.distcp": 16})
    ... except CheckpointCorruptError as e:
    ...     print(str(e)[:60])
    metadata.json: tensor 'w': chunk length 16 does not match it
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

from ft_checkpoint.errors import CheckpointCorruptError
from ft_checkpoint.store import checksum
from ft_checkpoint.store.jsonfile import is_int

NAME = "metadata.json"
FORMAT = "ft-checkpoint-tensors"
MAX_DIMS = 64
"""At most this many dimensions per tensor."""
MAX_EXTENT = 2**63 - 1
"""The most bytes a size may span (its dimensions' product, an empty one counted as 1): torch computes
sizes and strides in signed 64-bit integers and refuses more, even for a tensor with no element."""
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4,
            "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8,
            "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
            "float8_e8m0fnu": 1}
"""The dtypes the format stores (their bytes are plain memory), by torch's name, and their sizes."""


@dataclasses.dataclass(frozen=True)
class ChunkEntry:
    """One stored chunk of a tensor: the box it covers and where its bytes lie, with their CRC-32C."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor: dtype name, size, chunks."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * ITEMSIZE[self.dtype]


def dump(tensors: dict[str, TensorEntry]) -> bytes:
    """The JSON bytes of ``metadata.json``."""
    doc = {"format": FORMAT, "version": 1, "tensors": {
        fqn: {"dtype": t.dtype, "size": list(t.size), "chunks": [
            {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "offset": c.offset,
             "length": c.length, "crc32c": f"{c.crc32c:08x}"} for c in t.chunks]}
        for fqn, t in tensors.items()}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def parse(data: bytes, files: dict[str, int]) -> dict[str, TensorEntry]:
    """The tensors of ``metadata.json``, checked against ``files`` (the step's data files and their sizes,
    as the manifest lists them).

    Raises:
        CheckpointCorruptError: naming the first thing that is wrong.
    """
    try:
        doc = json.loads(data, parse_constant=_refuse)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{NAME}: not valid JSON ({type(e).__name__}: {e})") from e
    if not isinstance(doc, dict) or set(doc) != {"format", "version", "tensors"} or doc["format"] != FORMAT \
            or doc["version"] != 1 or not isinstance(doc["tensors"], dict):
        raise CheckpointCorruptError(f"{NAME}: not ft-checkpoint tensor metadata (version 1)")
    tensors = {fqn: _tensor(fqn, entry, files) for fqn, entry in doc["tensors"].items()}
    check_ranges(c for t in tensors.values() for c in t.chunks)
    return tensors


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def int_list(v: Any, n: int | None = None) -> bool:
    """A list of at most :data:`MAX_DIMS` ints >= 0 (of length ``n`` if given)."""
    return (isinstance(v, (list, tuple)) and (n is None or len(v) == n) and len(v) <= MAX_DIMS
            and all(is_int(x) and x >= 0 for x in v))


def fits_torch(size: Iterable[int], itemsize: int) -> bool:
    """Whether torch can make a tensor of ``size`` (dimensions >= 0): see :data:`MAX_EXTENT`.

    Example:
        >>> fits_torch([1024, 1024], 4), fits_torch([0, 2**64], 4), fits_torch([2**62, 2**62, 0], 1)
        (True, False, False)
    """
    return math.prod(max(d, 1) for d in size) * itemsize <= MAX_EXTENT


def _tensor(fqn: Any, entry: Any, files: dict[str, int]) -> TensorEntry:
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{NAME}: tensor {str(fqn)[:80]!r}: {what}")

    if not isinstance(fqn, str) or not isinstance(entry, dict) or set(entry) != {"dtype", "size", "chunks"}:
        raise bad("malformed entry")
    if not isinstance(entry["dtype"], str) or entry["dtype"] not in ITEMSIZE:
        raise bad(f"dtype {str(entry['dtype'])[:40]!r} is not one this format stores")
    if not int_list(entry["size"]) or not isinstance(entry["chunks"], list):
        raise bad("size must be a list of integers >= 0 and chunks a list")
    size = tuple(entry["size"])
    if not fits_torch(size, ITEMSIZE[entry["dtype"]]):
        raise bad(f"size {list(size)} is too large for a tensor (more than 2**63 bytes)")
    chunks = tuple(_chunk(c, size, ITEMSIZE[entry["dtype"]], files, bad) for c in entry["chunks"])
    check_cover(size, [(c.offsets, c.sizes) for c in chunks], bad)
    return TensorEntry(dtype=entry["dtype"], size=size, chunks=chunks)


def _chunk(c: Any, shape: tuple[int, ...], itemsize: int, files: dict[str, int],
           bad: Callable[[str], CheckpointCorruptError]) -> ChunkEntry:
    if not isinstance(c, dict) or set(c) != {"offsets", "sizes", "file", "offset", "length", "crc32c"}:
        raise bad("malformed chunk")
    if not int_list(c["offsets"], len(shape)) or not int_list(c["sizes"], len(shape)):
        raise bad(f"chunk offsets and sizes must be lists of {len(shape)} integers >= 0")
    if any(o + n > d for o, n, d in zip(c["offsets"], c["sizes"], shape)):
        raise bad(f"a chunk at {c['offsets']} of sizes {c['sizes']} lies outside the tensor's size {list(shape)}")
    if not isinstance(c["file"], str) or c["file"] not in files:
        raise bad(f"chunk file {str(c['file'])[:80]!r} is not a data file listed in the manifest")
    if not is_int(c["offset"]) or not is_int(c["length"]) or c["offset"] < 0:
        raise bad("chunk offset and length must be integers >= 0")
    if c["length"] != math.prod(c["sizes"]) * itemsize:
        raise bad(f"chunk length {c['length']} does not match its sizes {c['sizes']}")
    if c["offset"] + c["length"] > files[c["file"]]:
        raise bad(f"chunk bytes [{c['offset']}, {c['offset'] + c['length']}) lie outside {c['file']} "
                  f"({files[c['file']]} bytes)")
    if not isinstance(c["crc32c"], str) or not checksum.is_valid("crc32c:" + c["crc32c"]):
        raise bad("chunk crc32c must be 8 hex digits")
    return ChunkEntry(tuple(c["offsets"]), tuple(c["sizes"]), c["file"], c["offset"], c["length"], int(c["crc32c"], 16))


def check_cover(shape: Iterable[int], boxes: list[tuple[Any, Any]], bad: Callable[[str], Exception]) -> None:
    """Raise ``bad(...)`` unless the boxes ``(offsets, sizes)``, each inside a tensor of ``shape``, tile it
    exactly: no gap (a part left at its current values), no overlap.

    The boxes are split into slabs along the first dimension in which they differ from the whole, and each
    slab likewise along a later dimension: DCP's chunks (one per shard of a DTensor, a grid) always split
    so. Each box is looked at once per dimension it splits, so n boxes take O(n log n) time and O(n)
    memory. An exact cover that is not a grid of slabs is refused too: DCP never writes one.

    Example:
        >>> check_cover([4, 2], [([0, 0], [2, 2]), ([2, 0], [2, 1]), ([2, 1], [2, 1])], ValueError)
        >>> check_cover([4], [([0], [2]), ([1], [3])], ValueError)
        Traceback (most recent call last):
        ValueError: chunks overlap, or do not form the grid DCP writes (at [1])
    """
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return
    work = [([(tuple(o), tuple(n)) for o, n in boxes if math.prod(n) > 0], 0)]
    while work:
        group, dim = work.pop()
        split = next((d for d in range(dim, len(shape)) if any(b[0][d] or b[1][d] != shape[d] for b in group)), None)
        if split is not None:
            work.extend((slab, split + 1) for slab in _slabs(group, split, shape[split], bad))
        elif not group:
            raise bad(_GAP)
        elif len(group) > 1:
            raise bad(f"chunks overlap (at {list(group[1][0])})")


_GAP = "its chunks do not cover the whole tensor (part of it would keep its current values)"


def _slabs(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], dim: int, extent: int,
           bad: Callable[[str], Exception]) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The boxes grouped by their interval along ``dim``; the intervals must tile ``[0, extent)``."""
    slabs: dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for box in boxes:
        slabs.setdefault((box[0][dim], box[1][dim]), []).append(box)
    end = 0
    for start, size in sorted(slabs):
        if start != end:
            raise bad(_GAP if start > end else
                      f"chunks overlap, or do not form the grid DCP writes (at {list(slabs[start, size][0][0])})")
        end = start + size
    if end != extent:
        raise bad(_GAP)
    return list(slabs.values())


def check_ranges(chunks: Iterable[Any]) -> None:
    """Raise CheckpointCorruptError if two chunks (with ``file``, ``offset``, ``length``) share bytes of a file."""
    by_file: dict[str, list[Any]] = {}
    for c in chunks:
        if c.length:  # an empty chunk (an empty shard of an unevenly sharded tensor) holds no bytes
            by_file.setdefault(c.file, []).append(c)
    for name, parts in by_file.items():
        end = 0
        for c in sorted(parts, key=lambda c: c.offset):
            if c.offset < end:
                raise CheckpointCorruptError(f"{NAME}: two chunks share bytes of {name} (at {c.offset})")
            end = c.offset + c.length


def data_files(files: dict[str, Any]) -> dict[str, int]:
    """The tensor data files among a manifest's ``files`` (name -> entry with ``size``): the ``.distcp`` files.

    Example:
        >>> from types import SimpleNamespace as E
        >>> data_files({"__0_0.distcp": E(size=8), "metadata.json": E(size=9), "rank_00000.pt": E(size=3)})
        {'__0_0.distcp': 8}
    """
    return {name: e.size for name, e in files.items() if is_data_file(name)}


def is_data_file(name: str) -> bool:
    """Whether ``name`` is a tensor data file's (a ``.distcp`` file)."""
    return name.endswith(".distcp")
