"""What a checkpoint directory holds and whether it is intact: the data behind ``ft-checkpoint ls``,
``verify``, ``inspect`` and ``gc``.

Everything here reads, except :func:`apply_gc`. Unlike a resume, nothing is quarantined: a corrupt
step is reported, not renamed. Only :func:`inspect_step` needs torch (to read DCP's ``.metadata``,
with the same allowlist unpickler a resume uses; no tensor data is ever loaded).

A step is one of:

- ``committed``: its ``manifest.json`` is valid and every file it lists has the listed size (``ls``
  checks sizes; ``verify`` also checksums);
- ``partial``: no manifest, an interrupted save (or one still being written);
- ``corrupt``: a manifest that is invalid, or lists a file that is missing or has the wrong size, or a
  directory that also holds a file the manifest does not list, or one that a resume already quarantined
  (``manifest.json.skipped``).

Example:
    >>> from ft_checkpoint.storage import Storage
    >>> s = Storage("memory://doc/catalog")
    >>> s.write_bytes("step_000000000010/a.bin", b"weights")
    >>> listing = list_checkpoints(s)
    >>> [(i.step, i.status) for i in listing.steps], listing.resume_step
    ([(10, 'partial')], None)
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ft_checkpoint import layout
from ft_checkpoint.errors import CheckpointCorruptError, StorageNotFoundError
from ft_checkpoint.resume import SKIPPED_SUFFIX, UNLISTED, read_manifest, verify_step
from ft_checkpoint.retention import delete_step, list_steps, plan_deletions
from ft_checkpoint.storage import Storage

COMMITTED, PARTIAL, CORRUPT = "committed", "partial", "corrupt"
OnBytes = Callable[[int], None]
"""Called with the number of bytes just read (drives a progress bar)."""


@dataclasses.dataclass
class StepInfo:
    """One step directory, as ``ls`` shows it."""

    step: int
    status: str
    bytes: int
    files: int
    time: float | None = None
    world_size: int | None = None
    epoch: int | None = None
    reason: str | None = None
    """Why the step is partial or corrupt."""
    manifest: bool = False
    """Whether ``manifest.json`` is there (a resume tries such a step; a quarantined one it does not)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Listing:
    """Every step directory, oldest first, and the step a resume would pick (sizes checked)."""

    url: str
    steps: list[StepInfo]
    resume_step: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "resume_step": self.resume_step, "steps": [s.to_dict() for s in self.steps]}


def require_directory(storage: Storage) -> None:
    """Raise StorageNotFoundError, saying what to check, when the directory does not exist."""
    if not storage.exists(""):
        raise StorageNotFoundError(
            f"{storage.url} does not exist. HINT: check the path or URL, and for a bucket the storage "
            "options (FT_CHECKPOINT_STORAGE_OPTIONS, a JSON object)")


def describe_step(storage: Storage, step: int) -> StepInfo:
    """The status, size and manifest fields of one step directory (sizes checked, no checksums).

    Example:
        >>> from ft_checkpoint.storage import Storage
        >>> describe_step(Storage("memory://doc/describe"), 5).reason
        'no manifest.json: an interrupted save, or one still being written'
    """
    sizes = storage.sizes(layout.step_dir(step))
    info = StepInfo(step=step, status=PARTIAL, bytes=sum(sizes.values()), files=len(sizes))
    if layout.MANIFEST in sizes:
        try:
            manifest = verify_step(storage, step, checksums=False)
        except CheckpointCorruptError as e:
            info.status, info.reason, info.manifest = CORRUPT, str(e), True
            return info
        return StepInfo(step=step, status=COMMITTED, bytes=manifest.total_bytes, files=len(manifest.files),
                        time=manifest.time, world_size=manifest.world_size, epoch=manifest.epoch, manifest=True)
    if layout.MANIFEST + SKIPPED_SUFFIX in sizes:
        info.status, info.reason = CORRUPT, _QUARANTINED
    else:
        info.reason = "no manifest.json: an interrupted save, or one still being written"
    return info


_QUARANTINED = "quarantined: a resume found it corrupt and renamed its manifest to manifest.json.skipped"


def list_checkpoints(storage: Storage) -> Listing:
    """Every step directory with its status, and the newest committed step (what a resume would try).

    Example:
        >>> from ft_checkpoint.storage import Storage
        >>> list_checkpoints(Storage("memory://doc/empty-listing")).steps
        []
    """
    infos = [describe_step(storage, step) for step in sorted(list_steps(storage))]
    committed = [i.step for i in infos if i.status == COMMITTED]
    return Listing(url=storage.url, steps=infos, resume_step=max(committed, default=None))


# -- verify ------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepCheck:
    """The outcome of checking one step: every problem names the file."""

    step: int
    files: int = 0
    bytes: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ok": self.ok, "files": self.files, "bytes": self.bytes,
                "problems": list(self.problems)}


def select_steps(listing: Listing, *, step: int | None = None, all_steps: bool = False) -> list[int]:
    """What ``verify`` checks: ``step``; with ``all_steps`` every step but partial ones (quarantined ones
    too); else the newest step that has a manifest (what a resume tries first).

    Example:
        >>> listing = Listing("memory://x", [StepInfo(step=10, status=COMMITTED, bytes=1, files=1, manifest=True),
        ...                                  StepInfo(step=20, status=PARTIAL, bytes=1, files=1)], 10)
        >>> select_steps(listing), select_steps(listing, step=20), select_steps(listing, all_steps=True)
        ([10], [20], [10])
    """
    if step is not None:
        return [step]
    if all_steps:
        return [i.step for i in listing.steps if i.status != PARTIAL]
    return [i.step for i in listing.steps if i.manifest][-1:]


def check_step(storage: Storage, step: int, *, on_bytes: OnBytes | None = None) -> StepCheck:
    """Check the manifest, every file's size and checksum, and for files it does not list; collect every
    problem, naming each file.

    Example:
        >>> from ft_checkpoint.storage import Storage
        >>> check_step(Storage("memory://doc/check"), 7).problems
        ['memory://doc/check/step_000000000007/manifest.json: manifest.json is missing']
    """
    rel = layout.step_dir(step)
    result = StepCheck(step=step)
    try:
        manifest = read_manifest(storage, step)
    except CheckpointCorruptError as e:
        quarantined = storage.exists(f"{rel}/{layout.MANIFEST}{SKIPPED_SUFFIX}")
        result.problems.append(f"{storage.url_of(f'{rel}/{layout.MANIFEST}')}: {_QUARANTINED if quarantined else e}")
        return result
    sizes = storage.sizes(rel)
    for name, entry in sorted(manifest.files.items()):
        result.files += 1
        problem = _file_problem(storage, f"{rel}/{name}", entry, sizes.get(name), on_bytes)
        if problem:
            result.problems.append(f"{storage.url_of(f'{rel}/{name}')}: {problem}")
        result.bytes += entry.size
    result.problems += [f"{storage.url_of(f'{rel}/{name}')}: {UNLISTED}" for name in manifest.unlisted(sizes)]
    return result


def _file_problem(storage: Storage, rel: str, entry: layout.FileEntry, size: int | None,
                  on_bytes: OnBytes | None) -> str | None:
    if size is None or size != entry.size:
        if on_bytes is not None:
            on_bytes(entry.size)  # not read, but done: keeps a progress bar honest
        if size is None:
            return "missing"
        return f"has {size} bytes, the manifest says {entry.size} (truncated or replaced)"
    if layout.checksum(_counted(storage.iter_chunks(rel), on_bytes)) != entry.checksum:
        return "does not match its checksum (corrupted)"
    return None


def _counted(chunks: Iterable[bytes], on_bytes: OnBytes | None) -> Iterator[bytes]:
    for chunk in chunks:
        if on_bytes is not None:
            on_bytes(len(chunk))
        yield chunk


# -- inspect -----------------------------------------------------------------------------------
def inspect_step(storage: Storage, step: int) -> dict[str, Any]:
    """The manifest of ``step`` and its tensors (name, shape, dtype, bytes) from DCP's ``.metadata``.

    ``.metadata`` is checked against its manifest checksum, then read by the allowlist unpickler of a
    resume, which refuses any class that is not checkpoint metadata. No tensor data is read.

    Example:
        >>> import torch
        >>> from ft_checkpoint import CheckpointManager
        >>> with CheckpointManager("memory://doc/inspect", interval=1) as ckpt:
        ...     _ = ckpt.save(3, {"w": torch.zeros(2, 4)}, block=True)
        >>> info = inspect_step(ckpt.storage, 3)
        >>> info["tensors"]
        [{'name': 'w', 'shape': [2, 4], 'dtype': 'float32', 'bytes': 32, 'chunks': 1}]
    """
    try:
        manifest = read_manifest(storage, step)
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{storage.url_of(layout.step_dir(step))}: {e}. HINT: 'ft-checkpoint ls' "
                                     "shows which steps are committed") from e
    rel = f"{layout.step_dir(step)}/.metadata"
    entry = manifest.files.get(".metadata")
    if entry is None:
        raise CheckpointCorruptError(f"{storage.url_of(layout.step_dir(step))}: the manifest lists no .metadata; "
                                     "this step was not written by ft-checkpoint's DCP engine")
    data = storage.read_bytes(rel)
    if layout.checksum([data]) != entry.checksum:
        raise CheckpointCorruptError(f"{storage.url_of(rel)}: does not match its checksum (corrupted); "
                                     "refusing to read it. HINT: run ft-checkpoint verify")
    manifest_dict = dataclasses.asdict(manifest)
    return {"url": storage.url_of(layout.step_dir(step)), "step": step, "manifest": manifest_dict,
            **_describe_metadata(_load_metadata(data, storage.url_of(rel)))}


def _load_metadata(data: bytes, where: str) -> Any:
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from ft_checkpoint.engine import _SafeUnpickler

    try:
        metadata = _SafeUnpickler(io.BytesIO(data)).load()
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{where}: {e}") from e
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointCorruptError(f"{where}: cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def _describe_metadata(metadata: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, other = [], []
    for name, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            shape = [int(d) for d in md.size]
            numel = 1
            for d in shape:
                numel *= d
            tensors.append({"name": name, "shape": shape, "dtype": str(md.properties.dtype).removeprefix("torch."),
                            "bytes": numel * md.properties.dtype.itemsize, "chunks": len(md.chunks)})
        else:
            other.append({"name": name, "kind": type(md).__name__})
    return {"tensors": tensors, "other": other}


# -- gc ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class GcPlan:
    """What ``gc`` deletes and keeps; ``protected`` is the newest verified step, never deleted."""

    url: str
    delete: list[int]
    keep: list[int]
    protected: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_gc(storage: Storage, *, keep_last: int, keep_every_n_steps: int | None = None,
            on_bytes: OnBytes | None = None) -> GcPlan:
    """The core's retention rules, plus: the newest step that verifies (checksums too) is always kept.

    Example:
        >>> from ft_checkpoint.storage import Storage
        >>> s = Storage("memory://doc/gc")
        >>> s.write_bytes("step_000000000010/a.bin", b"partial save")
        >>> plan_gc(s, keep_last=1).delete   # nothing has committed: nothing is deleted
        []
    """
    steps = list_steps(storage)
    doomed = plan_deletions(steps, keep_last=keep_last, keep_every_n_steps=keep_every_n_steps)
    protected = newest_verified(storage, sorted((s for s, ok in steps.items() if ok), reverse=True), on_bytes)
    delete = [s for s in doomed if s != protected]
    return GcPlan(url=storage.url, delete=delete, keep=sorted(set(steps) - set(delete)), protected=protected)


def newest_verified(storage: Storage, candidates: Iterable[int], on_bytes: OnBytes | None = None) -> int | None:
    """The first of ``candidates`` (newest first) whose manifest, sizes and checksums all check out."""
    for step in candidates:
        if check_step(storage, step, on_bytes=on_bytes).ok:
            return step
    return None


def apply_gc(storage: Storage, plan: GcPlan) -> None:
    """Delete the steps of ``plan``, each manifest first (a crash halfway leaves garbage, not a bad commit)."""
    for step in plan.delete:
        delete_step(storage, step)
