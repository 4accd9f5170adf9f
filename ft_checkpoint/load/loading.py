"""Loading a checked step: its small files read and checked, then its tensors read into the state.

A step is loaded in two parts, so that a resume can skip it before touching the state (see ``resume``):
:meth:`StepLoader.open_step` reads and checks the tensor metadata and this rank's state file;
:meth:`StepLoader.load` reads the tensors into the state through DCP (resharding as needed), each byte
checked against its chunk's CRC as it is read. :func:`load_state` puts one opened step into a user's
state dict: tensors in place, ``load_state_dict`` for stateful values, files participants their files.

Example:
    >>> import torch
    >>> from ft_checkpoint.run.dist import Groups
    >>> from ft_checkpoint.save.engine import CheckpointEngine
    >>> from ft_checkpoint.store.storage import Storage
    >>> eng = CheckpointEngine(Storage("memory://doc/loading"), Groups())
    >>> _ = eng.save(10, {"w": torch.arange(3.0)}); _ = eng.wait(); eng.close()
    >>> loader = StepLoader(eng.storage, Groups())
    >>> opened = loader.open_step(layout.read_manifest(eng.storage, 10))
    >>> loader.load(opened, {"w": torch.zeros(3)})[0]["w"]
    tensor([0., 1., 2.])
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ft_checkpoint.errors import CheckpointCorruptError, StateMismatchError, StorageError
from ft_checkpoint.format import layout, legacy, shards
from ft_checkpoint.progress import Progress
from ft_checkpoint.run.dist import Groups
from ft_checkpoint.state import (
    Participants,
    StepFiles,
    load_tree_into,
    merge_tree,
    none_keys,
    parse_rank_file,
    split_tree,
    to_tree,
)
from ft_checkpoint.store import checksum, retry
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.units import human_bytes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class OpenedStep:
    """A step whose small files were read and checked, ready to load: see :meth:`StepLoader.open_step`."""

    manifest: layout.Manifest
    metadata: Metadata
    rank_state: dict[str, Any]
    touches: bool = False
    """Whether a :meth:`StepLoader.load` of it began filling tensors of the state in place."""


class StepLoader:
    """Reads checked steps of one directory into a state (see the module's docstring)."""

    def __init__(self, storage: Storage, groups: Groups) -> None:
        self.storage = storage
        self.groups = groups

    def open_step(self, manifest: layout.Manifest) -> OpenedStep:
        """Read and check the small files of a step whose manifest checked: the tensor metadata (JSON, or
        format 1's pickle through the allowlist) and this rank's state file, each against its checksum.

        Raises:
            CheckpointCorruptError: before anything is loaded into the training state.
        """
        step = manifest.step
        if legacy.is_legacy(manifest):
            metadata = legacy.parse_metadata(self.read_file(manifest, legacy.METADATA), manifest)
        else:
            metadata = shards.parse_metadata(self.read_file(manifest, layout.METADATA), manifest)
        name = self._rank_file_name(manifest)
        data = self.read_file(manifest, name)
        rank_state = parse_rank_file(data, name, f"{self.storage.url_of(layout.step_dir(step))}/{name}")
        return OpenedStep(manifest=manifest, metadata=metadata, rank_state=rank_state)

    def read_file(self, manifest: layout.Manifest, name: str) -> bytes:
        """A file of a step, checked against its size and checksum in the manifest (CheckpointCorruptError)."""
        entry = manifest.files.get(name)
        if entry is None:
            raise CheckpointCorruptError(f"the manifest lists no {name}")
        rel = f"{layout.step_dir(manifest.step)}/{name}"
        try:
            data = self.storage.read_bytes(rel, size=entry.size)
        except StorageError as e:
            if isinstance(e.__cause__, MemoryError):  # not an outage: retrying the step would fail the same way
                raise CheckpointCorruptError(f"{name}: its {human_bytes(entry.size)} do not fit in this process's "
                                             "memory; refusing the step") from e
            raise
        if len(data) != entry.size or not checksum.matches(entry.checksum, [data]):
            raise CheckpointCorruptError(f"{name}: does not match its checksum (corrupted)")
        return data

    def _rank_file_name(self, manifest: layout.Manifest) -> str:
        name = layout.rank_file(self.groups.rank)
        if self.groups.rank >= manifest.world_size:
            name = layout.rank_file(self.groups.rank % manifest.world_size)
            log.warning("step %d was saved by %d ranks; rank %d takes the non-tensor state of %s",
                        manifest.step, manifest.world_size, self.groups.rank, name)
        return name

    def load(self, opened: OpenedStep, tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load an opened step: ``(saved tree, this rank's per_rank state)``. Collective.

        Every tensor of ``tree`` (the current state) must come from the step (a strict load); each is
        filled in place (DTensors are resharded by DCP). A saved tensor the state lacks is read into a new
        CPU tensor. All this is checked before anything is allocated or read. Every byte read is checked
        against its chunk's CRC (format 1: the files were checked before).

        Raises:
            StateMismatchError: a saved tensor has another shape or dtype than the state's, or the state has a
                tensor the step never had (nothing loaded).
            CheckpointCorruptError: the metadata leaves out a tensor the step's own state file records, the
                tensors the state lacks would not fit in this machine's memory (nothing loaded); bytes that do
                not match their checksum, or a file that ends early.
            StorageError: the storage failed (after retries).
        """
        step = opened.manifest.step
        current = split_tree(tree)[0]
        targets = self._targets(opened.metadata, current, none_keys(opened.rank_state["skeleton"]))
        opened.touches = any(current.get(k) is t for k, t in targets.items())
        rel = layout.step_dir(step)
        def read() -> None:
            with Progress(f"loading step {step}", enabled=self.groups.rank == 0) as progress:
                reader = (legacy.LegacyReader(self.storage, rel, opened.metadata) if legacy.is_legacy(opened.manifest)
                          else shards.ShardReader(self.storage, rel, opened.metadata, progress=progress))
                dcp.load(targets, storage_reader=reader, process_group=self.groups.writer,
                         no_dist=not self.groups.distributed)

        try:
            retry.retrying(self.storage, "loading", step)(read)
        except CheckpointException as e:  # a BaseException: make it one callers can catch
            error = CheckpointCorruptError if retry.corrupt(e) or not retry.transient(e) else StorageError
            raise error(f"loading step {step} from {self.storage.url} failed: {retry.describe(e)}") from e
        rank_state = opened.rank_state
        return merge_tree(rank_state["skeleton"], targets), rank_state["per_rank"]

    @staticmethod
    def _targets(metadata: Metadata, current: Mapping[str, torch.Tensor],
                 recorded: set[str]) -> dict[str, torch.Tensor]:
        """What DCP loads into: the state's own tensors, and new ones for the saved tensors it lacks. Checked
        first: every tensor of the state is in the step (``recorded``: where the step's own state file says a
        tensor or a None was), with its shape and dtype; the new ones fit in this machine's memory."""
        saved = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
        _check_complete([k for k in current if k not in saved], recorded)
        mismatched = [f"{key}: saved {list(md.size)} {md.properties.dtype}, the state has {list(have.shape)} {have.dtype}"
                      for key, md in saved.items() if (have := current.get(key)) is not None
                      and (tuple(have.shape) != tuple(md.size) or have.dtype != md.properties.dtype)]
        if mismatched:
            raise StateMismatchError("the checkpoint's tensors do not fit the state: " + _first(mismatched))
        fresh = {k: md for k, md in saved.items() if k not in current}
        _check_memory(sum(math.prod(md.size) * md.properties.dtype.itemsize for md in fresh.values()))
        return {**{k: current[k] for k in saved if k in current},
                **{k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in fresh.items()}}


def _first(items: list[str], n: int = 5) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


def _check_complete(missing: list[str], recorded: set[str]) -> None:
    """Raise unless no tensor of the state is ``missing`` from the step: CheckpointCorruptError if the step's
    state file records one where the metadata has none (the metadata was cut), else StateMismatchError (the
    state gained a tensor since the save: the step is kept, an older one is tried)."""
    cut = [k for k in missing if k in recorded]
    if cut:
        raise CheckpointCorruptError(
            f"the tensor metadata lists no tensor {_first(cut)}, which the step's state file records: loading it "
            "would leave those tensors at their current values")
    if missing:
        raise StateMismatchError(
            f"the state has tensors the checkpoint does not: {_first(missing)}. HINT: pass the same state (keys, "
            "shapes, dtypes) as the run that saved")


def _check_memory(nbytes: int) -> None:
    """CheckpointCorruptError if the tensors a load allocates (``nbytes``) exceed this machine's memory: no
    training that ran here saved them (a size forged over a sparse file, say), and allocating would fail."""
    memory = physical_memory()
    if memory is not None and nbytes > memory:
        raise CheckpointCorruptError(
            f"the step's tensors that the state lacks would take {human_bytes(nbytes)}, more than this machine's "
            f"memory ({human_bytes(memory)}); refusing to allocate them")


def physical_memory() -> int | None:
    """This machine's memory in bytes, or None where the OS does not say.

    Example:
        >>> physical_memory() > 0
        True
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def load_state(loader: StepLoader, opened: OpenedStep, state: dict[str, Any], *, participants: Participants,
               per_rank: dict[str, Any] | None = None,
               check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Load one opened step into ``state`` in place (and ``per_rank``); returns what the rank file held for this
    rank (``{"rng": ..., "state": ...}``). ``check(saved_tree)`` may raise StateMismatchError (the step does not
    fit) or CheckpointCorruptError (it is corrupt) to reject the step before anything but tensors was loaded.
    A key saved but not in ``state`` is warned about, not loaded."""
    plain, parts = participants.split(state)
    tree, ranked = loader.load(opened, to_tree(plain))
    if check is not None:
        check(tree)
    ranked = {"rng": ranked.get("rng"), "state": ranked.get("state")}  # 0.1's rank files hold only "rng"
    rank = loader.groups.rank
    if per_rank is not None:
        if ranked.get("state") is None:
            raise StateMismatchError("the checkpoint has no per-rank state, but per_rank= was passed. "
                                     "HINT: pass the same per_rank keys to resume() as to save()")
        _warn_unused(load_tree_into(per_rank, ranked["state"]), "per_rank", rank)
    _warn_unused(load_tree_into(plain, tree), "state", rank)
    state.update(plain)  # values replaced (not loaded in place) go back into the caller's dict
    manifest = opened.manifest
    for key, participant in parts.items():
        opened.touches = True  # from here on a failure may leave the participant half loaded
        participant.load_files(StepFiles(
            read=lambda name: loader.read_file(manifest, name), names=frozenset(manifest.files),
            metadata=manifest.metadata.get(key), step=manifest.step, world_size=manifest.world_size))
    return ranked


def _warn_unused(keys: list[str], what: str, rank: int) -> None:
    if keys and rank == 0:
        log.warning("the checkpoint also holds %s keys %s, which the %s passed to resume() does not have: they "
                    "were not loaded anywhere", what, keys[:10], what)
