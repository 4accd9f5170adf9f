"""One rank's part of a step, written into its fast-tier folder from the staged copy the durable save uses.

The part is what a single-process checkpoint of the rank's local state holds: the tensors (a DTensor as its
local shard: a view of the staged buffer, no copy), its rank file (the non-tensor state and RNG), and a
manifest with every file's size and CRC-32C, written last. Under DDP each rank's part is the whole state,
under FSDP2 its shards; the manifest's metadata says which rank of how many wrote it and where each shard
lies, so a resume takes it only into the same world size and sharding, and which save wrote it (every rank's
part of one save carries the same: a resume never mixes the parts of two saves of the same step).

Example:
    >>> import io, tempfile, torch
    >>> rank_file = io.BytesIO(); torch.save({"skeleton": {"w": None}, "per_rank": {}}, rank_file)
    >>> s = Storage(tempfile.mkdtemp(), fsync=False)
    >>> m = write_rank_step(s, 5, {"w": torch.arange(3.0)}, rank_file.getvalue(), rank=1, world_size=2, save="a1b2")
    >>> sorted(m.files), m.metadata["fast_tier"]["rank"]
    (['__0_0.distcp', 'metadata.json', 'rank_00000.pt'], 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ft_checkpoint.errors import SaveError
from ft_checkpoint.format import layout, shards
from ft_checkpoint.format.signing import Signer
from ft_checkpoint.save.engine import FileWriter, versions, write_own_files
from ft_checkpoint.save.staging import _is_dtensor
from ft_checkpoint.store import retry
from ft_checkpoint.store.storage import Storage


def local_part(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list[list[int]]]]:
    """``(this rank's tensors, where each DTensor's shard lies)``: a DTensor becomes its local tensor (a view, no
    copy), and its global size and the offsets of its shard are noted (``[size, offsets]``), for :func:`sharding_of`
    to compare at a resume.

    Example:
        >>> local_part({"w": torch.ones(2)})[1]
        {}
    """
    local, where = {}, {}
    for key, t in tensors.items():
        if _is_dtensor(t):
            chunk = t.__create_chunk_list__()[0]  # type: ignore[attr-defined]  # DCP's protocol: this rank's one shard
            where[key] = [list(t.shape), list(chunk.offsets)]
            local[key] = t.to_local()  # type: ignore[attr-defined]
        else:
            local[key] = t
    return local, where


def write_rank_step(storage: Storage, step: int, tensors: Mapping[str, torch.Tensor], rank_file: bytes, *, rank: int,
                    world_size: int, save: str, node: str = "", sharding: dict[str, Any] | None = None,
                    writers: int = 1, fields: dict[str, Any] | None = None, signer: Signer | None = None,
                    files: Mapping[str, FileWriter] | None = None) -> layout.Manifest:
    """Write rank ``rank``'s part of ``step`` (plain tensors: see :func:`local_part`) and commit it with its manifest.

    ``files``: the state's own files of this rank's part (a DeepSpeed engine's), each written by its writer.

    ``fields`` are the durable manifest's (epoch, metadata); with a ``signer`` the manifest is signed as a durable
    one is (the same key and run: a resume checks it the same way). What an interrupted write of the step left is
    deleted first. Buffered writes (no ``O_DIRECT``): a resume reads the files back from the page cache. A write that
    fails raises an ``Exception`` (DCP's own, a ``BaseException``, becomes a SaveError naming the error inside it).
    """
    rel = layout.step_dir(step)
    if not layout.delete_step(storage, step, before_write=True):
        raise SaveError(f"{storage.url_of(rel)} could not be cleared before the save (see the warning above)")
    writer = shards.ShardWriter(storage, rel, rank=0, writers=writers)
    try:
        dcp.save(dict(tensors), storage_writer=writer, no_dist=True)
    except CheckpointException as e:  # DCP's exception is a BaseException: make it one callers catch
        raise SaveError(f"{storage.url_of(rel)} not written: {'; '.join(map(retry.describe, retry.failures(e)))}") from e
    name = layout.rank_file(0)
    storage.write_bytes(f"{rel}/{name}", rank_file, atomic=False)
    entries = {**writer.files, **write_own_files(storage, rel, files or {}),
               name: layout.FileEntry(size=len(rank_file), checksum=layout.checksum([rank_file]))}
    fields = dict(fields or {})
    own = {"rank": rank, "world_size": world_size, "save": save, "node": node, "sharding": sharding or {}}
    fields["metadata"] = {**(fields.get("metadata") or {}), layout.FAST_TIER: own}
    manifest = layout.Manifest(step=step, world_size=1, files=entries, versions=versions(), **fields)
    if signer is not None:
        manifest = signer.sign(manifest)
    storage.write_bytes(f"{rel}/{layout.MANIFEST}", manifest.to_json())
    return manifest
