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
  (``manifest.json.skipped``);
- ``unverified``: with a signing key (``signer``), a manifest that is unsigned or whose signature does
  not verify for this key, run and step: a resume skips it, and ``gc`` neither counts it nor deletes it.

Example:
    >>> from ft_checkpoint.store.storage import Storage
    >>> s = Storage("memory://doc/catalog")
    >>> s.write_bytes("step_000000000010/a.bin", b"weights")
    >>> listing = list_checkpoints(s)
    >>> [(i.step, i.status) for i in listing.steps], listing.resume_step
    ([(10, 'partial')], None)
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

from ft_checkpoint.errors import CheckpointCorruptError, ConfigError, StorageNotFoundError, StoragePermissionError
from ft_checkpoint.format import layout, tensor_metadata
from ft_checkpoint.format.layout import OnBytes, StepCheck
from ft_checkpoint.format.signing import Signer
from ft_checkpoint.run.retention import counted, plan_deletions, statuses
from ft_checkpoint.store import checksum
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.units import plural

COMMITTED, PARTIAL, CORRUPT, UNVERIFIED = "committed", "partial", "corrupt", "unverified"


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
    """Raise StorageNotFoundError, saying what to check, when the directory does not exist; ConfigError when it is a
    step directory of a run (a path ``ls`` prints) or, on local disk, a file.

    Example:
        >>> try:
        ...     require_directory(Storage("memory://doc/run/step_000000000005"))
        ... except ConfigError as e:
        ...     print(str(e).split(". HINT")[0])
        memory://doc/run/step_000000000005 is step 5 of the run in memory://doc/run, not a run's checkpoint directory
    """
    run, _, name = storage.url.rstrip("/").rpartition("/")
    if (step := layout.parse_step(name)) is not None:
        raise ConfigError(f"{storage.url} is step {step} of the run in {run}, not a run's checkpoint directory. HINT: "
                          f"pass {run} (and --step {step} where the command takes one)")
    if not storage.exists(""):
        raise StorageNotFoundError(
            f"{storage.url} does not exist. HINT: check the path or URL, and for a bucket the storage "
            "options (FT_CHECKPOINT_STORAGE_OPTIONS, a JSON object)")
    if storage.is_local and not os.path.isdir(storage.path("")):
        raise ConfigError(f"{storage.url} is a file, not a checkpoint directory. HINT: pass the directory a job's "
                          "dirpath names")


def describe_step(storage: Storage, step: int, *, signer: Signer | None = None,
                  reader: layout.ManifestReader | None = None) -> StepInfo:
    """The status, size and manifest fields of one step directory (sizes checked, no checksums; with a
    ``signer``, the signature too). ``reader``: the listing's, which reads each manifest file once.

    Example:
        >>> from ft_checkpoint.store.storage import Storage
        >>> describe_step(Storage("memory://doc/describe"), 5).reason
        'no manifest.json: an interrupted save, or one still being written'
    """
    entries = storage.entries(layout.step_dir(step))
    # a step's data files, counted alike whatever its status (a committed step's manifest lists all but itself)
    sizes = {name: e.size for name, e in entries.items() if e.kind == "file" and name != layout.MANIFEST}
    info = StepInfo(step=step, status=PARTIAL, bytes=sum(sizes.values()), files=len(sizes))
    if layout.MANIFEST not in entries:  # a FIFO or a link by that name is no partial save: check_step says what
        quarantined = layout.MANIFEST + layout.SKIPPED_SUFFIX in sizes
        info.status = CORRUPT if quarantined else PARTIAL
        info.reason = layout.QUARANTINED if quarantined else "no manifest.json: an interrupted save, or one still being written"
        return info
    check = layout.check_step(storage, step, signer=signer, reader=reader)
    if not check.ok or check.manifest is None:
        status = UNVERIFIED if check.signature == layout.REFUSED else CORRUPT
        info.status, info.reason, info.manifest = status, "; ".join(check.problems), True
        return info
    m = check.manifest
    return StepInfo(step=step, status=COMMITTED, bytes=m.total_bytes, files=len(m.files), time=m.time,
                    world_size=m.world_size, epoch=m.epoch, manifest=True)


def list_checkpoints(storage: Storage, *, signer: Signer | None = None) -> Listing:
    """Every step directory with its status, and the newest committed step (what a resume would try; with a
    ``signer``, the newest whose signature verifies).

    Example:
        >>> from ft_checkpoint.store.storage import Storage
        >>> list_checkpoints(Storage("memory://doc/empty-listing")).steps
        []
    """
    reader = layout.ManifestReader(storage)  # a manifest hard-linked into many steps: read once
    infos = [describe_step(storage, step, signer=signer, reader=reader) for step in sorted(layout.list_steps(storage))]
    committed = [i.step for i in infos if i.status == COMMITTED]
    return Listing(url=storage.url, steps=infos, resume_step=max(committed, default=None))


# -- the fast tier -------------------------------------------------------------------------------
def fast_tier_steps(url: str, fast_dirpath: str) -> dict[int, dict[str, Any]]:
    """What a node's fast tier (``fast_dirpath``) holds of the runs whose durable dirpath is ``url``: by step, the
    ranks whose parts check (manifest and sizes), their bytes, whether the step is marked committed, and the
    folders (each a checkpoint directory that ``inspect`` shows). Only this user's own folders count (the only
    ones a resume uses); another user's is never read.

    Example:
        >>> fast_tier_steps("memory://doc/none", "/nonexistent")
        {}
    """
    from ft_checkpoint.tiers.folder import runs_in
    from ft_checkpoint.tiers.sources import inventory

    out: dict[int, dict[str, Any]] = {}
    for folder in runs_in(fast_dirpath):
        if folder.problem() is not None:  # another user's: a resume never uses it, so it holds none of the run's steps
            continue
        owner = folder.owner()
        if owner is None or owner.get("durable") != url:
            continue
        held = inventory(folder, node="")
        for step, ranks in sorted(held.steps.items()):
            entry = out.setdefault(step, {"ranks": [], "bytes": 0, "committed": False, "folders": []})
            entry["ranks"] = sorted(set(entry["ranks"]) | set(ranks))
            entry["bytes"] += sum(layout.read_manifest(folder.storage(r), step).total_bytes for r in ranks)
            entry["committed"] = entry["committed"] or any(m.step == step for m in held.marks.values())
            entry["folders"] += [folder.storage(r).url for r in ranks]
    return out


# -- verify ------------------------------------------------------------------------------------
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


def check_step(storage: Storage, step: int, *, on_bytes: OnBytes | None = None,
               signer: Signer | None = None, listed: bool = False) -> StepCheck:
    """Check the manifest (with a ``signer``, its signature first), every file's size, kind and checksum, for
    files it does not list, and (format 2) the tensor metadata against the manifest and each tensor's bytes against
    their own checksum, as a resume checks them; collect every problem, each naming the file by its URL. Each
    file is read once. ``listed``: a listing showed the step's manifest moments ago (a step deleted since, e.g. by
    a running job's retention, is ``gone``, not corrupt; without it, only one whose manifest the check read).

    Example:
        >>> from ft_checkpoint.store.storage import Storage
        >>> check_step(Storage("memory://doc/check"), 7).problems
        ['memory://doc/check/step_000000000007/manifest.json is missing']
    """
    rel = layout.step_dir(step)
    try:
        check = layout.check_step(storage, step, checksums=lambda name: not tensor_metadata.is_data_file(name),
                                  on_bytes=on_bytes, signer=signer)  # the data files: below, with their tensors
        try:
            _check_data_files(storage, check, _tensor_chunks(storage, check), on_bytes)
            _check_rank_files(storage, check)
        except CheckpointCorruptError as e:
            check.problems.append(str(e))
    except StorageNotFoundError as e:  # a file listed a moment ago is gone
        if layout.MANIFEST in storage.entries(rel):
            raise
        check = StepCheck(step=step, gone=True, problems=[f"{GONE} ({e})"])
    except StoragePermissionError as e:  # this step alone: the others are checked still
        check = StepCheck(step=step, unreadable=True, problems=[str(e)])
    committed = listed or check.manifest is not None  # else a missing manifest is no sign that it went meanwhile
    if check.problems and not check.gone and committed and layout.MANIFEST not in storage.entries(rel):
        check = StepCheck(step=step, gone=True, problems=[f"{GONE} ({check.problems[0]})"])  # deleted, manifest first
    prefix = storage.url_of(layout.step_dir(step))
    check.problems = [p if p.startswith(prefix) else f"{prefix}/{p}" if _names_a_file(p) else f"{prefix}: {p}"
                      for p in check.problems]
    return check


GONE = "deleted while it was checked: a running job's retention, or gc, removed it"


Chunks = dict[str, list[tuple[str, tensor_metadata.ChunkEntry]]]
"""Each data file's tensor chunks, by file name, each with its tensor's name."""


def _tensor_chunks(storage: Storage, check: StepCheck) -> Chunks:
    """Format 2, where ``metadata.json`` checked (size, checksum): each data file's tensor chunks; {} for format 1.
    A metadata file that does not parse is a problem, and the data files are then checked whole."""
    manifest = check.manifest
    if manifest is None or manifest.format_version < 2:
        return {}
    entry = manifest.files.get(layout.METADATA)
    if entry is None:
        check.problems.append(f"the manifest lists no {layout.METADATA}")
        return {}
    if any(p.startswith(f"{layout.METADATA}: ") for p in check.problems):
        return {}
    try:
        tensors = tensor_metadata.parse(storage.read_bytes(f"{layout.step_dir(check.step)}/{layout.METADATA}",
                                                           size=entry.size), tensor_metadata.data_files(manifest.files))
    except CheckpointCorruptError as e:
        check.problems.append(str(e))
        return {}
    chunks: Chunks = {}
    for fqn, t in tensors.items():
        for c in t.chunks:
            chunks.setdefault(c.file, []).append((fqn, c))
    return chunks


def _check_data_files(storage: Storage, check: StepCheck, chunks: Chunks, on_bytes: OnBytes | None) -> None:
    """Each data file that has its listed size, read once: its whole-file checksum, and each tensor chunk's bytes
    against their CRC-32C in ``metadata.json`` (``chunks``), as a resume reads and checks them. A file whose checksum
    was recomputed over changed tensor bytes is corrupt here too, not "intact" while every resume refuses the step
    (and ``gc`` deletes the steps a resume loads for it); one whose only changed bytes belong to no tensor (alignment
    padding) still loads (``check.loads``)."""
    if check.manifest is None:
        return
    tensors_intact = True
    for name, size in sorted(tensor_metadata.data_files(check.manifest.files).items()):
        if not any(p.startswith(f"{name}: ") for p in check.problems):  # else missing, a link, or the wrong size
            problem, intact = _data_file_problem(storage, check, name, size, chunks.get(name, []), on_bytes)
            tensors_intact &= intact
            if problem:
                check.problems.append(f"{name}: {problem}")
    if check.problems and all(PADDING in p for p in check.problems):
        check.loads = True
    elif not tensors_intact:
        check.loads = False


PADDING = "in bytes that belong to no tensor (alignment padding); every tensor's bytes in it match their checksums"


def _data_file_problem(storage: Storage, check: StepCheck, name: str, size: int,
                       chunks: list[tuple[str, tensor_metadata.ChunkEntry]],
                       on_bytes: OnBytes | None) -> tuple[str | None, bool]:
    """What is wrong with one data file (None: nothing) and whether every tensor's bytes in it match their
    CRC-32C, from one pass over it (``checksum.check_in_ranges``)."""
    assert check.manifest is not None
    rel = f"{layout.step_dir(check.step)}/{name}"
    ends = sorted({e for _, c in chunks if c.length for e in (c.offset, c.offset + c.length)} - {0})  # an empty
    # chunk holds no bytes: wherever it lies (inside another's, in a forged file), it splits no range
    try:
        whole_ok, crcs = checksum.check_in_ranges(check.manifest.files[name].checksum,
                                                  layout.reported(storage.iter_chunks(rel, size=size), on_bytes), ends)
    except CheckpointCorruptError as e:  # swapped for a FIFO or a link since the listing: the message names it
        return f"changed since it was listed: {e}", False
    check.bytes_checked += size
    at = dict(zip([0, *ends], crcs))
    bad = [fqn for fqn, c in chunks if (at.get(c.offset) if c.length else 0) != c.crc32c]
    if not whole_ok:
        check.mismatched.append(name)
        return (f"{layout.CHECKSUM_MISMATCH} {PADDING}" if chunks and not bad else layout.CHECKSUM_MISMATCH), not bad
    if bad:
        more = f" (and {plural(len(bad) - 1, 'more chunk')})" if len(bad) > 1 else ""
        return (f"matches the checksum the manifest gives, but the bytes of tensor {bad[0]}{more} do not match their "
                f"checksum in {layout.METADATA}: changed, and the manifest's checksum recomputed over them "
                "(forged); a resume refuses the step"), False
    return None, True


def _check_rank_files(storage: Storage, check: StepCheck) -> None:
    """For a step that checked so far, each rank file loaded and checked as a resume loads it
    (``state.parse_rank_file``): a file whose checksum was recomputed over bytes no training wrote is corrupt
    here too, not "intact" while every resume refuses the step (and ``gc`` deletes the older steps for it)."""
    if not check.ok:
        return
    from ft_checkpoint.state import parse_rank_file  # torch: here only (ls and inspect import none of it)

    assert check.manifest is not None
    rel = layout.step_dir(check.step)
    for name, entry in sorted(check.manifest.files.items()):
        if RANK_FILE.fullmatch(name):
            data = storage.read_bytes(f"{rel}/{name}", size=entry.size)
            parse_rank_file(data, name, storage.url_of(f"{rel}/{name}"))


RANK_FILE = re.compile(r"rank_\d+\.pt")


def _names_a_file(problem: str) -> bool:
    name = problem.split(":", 1)[0].split(" ", 1)[0]
    return name == layout.MANIFEST or layout.is_plain_name(name)


# -- inspect -----------------------------------------------------------------------------------
def inspect_step(storage: Storage, step: int, *, signer: Signer | None = None) -> dict[str, Any]:
    """The manifest of ``step``, its tensors (name, shape, dtype, bytes, chunks) from its tensor metadata, and
    ``signature``: ``"verified"`` (with a ``signer``: a step it refuses is an error, nothing of it is
    read), ``"not checked"`` (signed, no key given) or ``"none"``.

    The metadata is checked against its manifest checksum first; ``metadata.json`` (format 2) is plain
    JSON, checked as a resume checks it, and needs no torch. A format-1 ``.metadata`` is read by the
    allowlist unpickler of a resume (this needs torch). No tensor data is read.

    Example:
        >>> import torch
        >>> from ft_checkpoint import CheckpointManager
        >>> with CheckpointManager("memory://doc/inspect", interval=1) as ckpt:
        ...     _ = ckpt.save(3, {"w": torch.zeros(2, 4)}, block=True)
        >>> info = inspect_step(ckpt.storage, 3)
        >>> info["tensors"]
        [{'name': 'w', 'shape': [2, 4], 'dtype': 'float32', 'bytes': 32, 'chunks': 1}]
    """
    where = storage.url_of(layout.step_dir(step))
    try:
        manifest = layout.read_manifest(storage, step, signer=signer)
        name = layout.METADATA if manifest.format_version >= 2 else ".metadata"
        entry = manifest.files.get(name)
        if entry is None:
            raise CheckpointCorruptError(f"the manifest lists no {name}")
        data = storage.read_bytes(f"{layout.step_dir(step)}/{name}", size=entry.size)  # a sparse one: refused unread
        if len(data) != entry.size or not checksum.matches(entry.checksum, [data]):
            raise CheckpointCorruptError(f"{name} does not match its checksum (corrupted); refusing to read it. "
                                         "HINT: run ft-checkpoint verify")
        tensors = _describe(manifest, data)
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{where}: {e}. HINT: 'ft-checkpoint ls' shows which steps are committed, "
                                     "'ft-checkpoint verify' what is wrong") from e
    signature = "verified" if signer is not None else "none" if manifest.signature is None else "not checked"
    return {"url": where, "step": step, "manifest": dataclasses.asdict(manifest), "tensors": tensors,
            "signature": signature}


def _describe(manifest: layout.Manifest, data: bytes) -> list[dict[str, Any]]:
    if manifest.format_version >= 2:
        tensors = tensor_metadata.parse(data, tensor_metadata.data_files(manifest.files))
        return [{"name": name, "shape": list(t.size), "dtype": t.dtype, "bytes": t.nbytes, "chunks": len(t.chunks)}
                for name, t in sorted(tensors.items())]
    from ft_checkpoint.format import legacy  # format 1: a pickle, read through the allowlist (needs torch)

    metadata = legacy.parse_metadata(data, manifest)
    return [{"name": name, "shape": [int(d) for d in md.size], "dtype": str(md.properties.dtype).removeprefix("torch."),
             "bytes": md.size.numel() * md.properties.dtype.itemsize, "chunks": len(md.chunks)}
            for name, md in sorted(metadata.state_dict_metadata.items())
            if isinstance(md, legacy.TensorStorageMetadata)]  # all of them: parse_metadata refuses other kinds


# -- gc ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class GcPlan:
    """What ``gc`` deletes and keeps; ``protected`` is the newest verified step, never deleted; ``unverified``:
    with a signing key, the steps whose signature is refused, kept as they are and not counted."""

    url: str
    delete: list[int]
    keep: list[int]
    protected: int | None
    unverified: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_gc(storage: Storage, *, keep_last: int, keep_every_n_steps: int | None = None,
            on_bytes: OnBytes | None = None, signer: Signer | None = None,
            on_step: Callable[[int], None] | None = None) -> GcPlan:
    """The core's retention rules (with a ``signer``, only steps whose signature verifies count; the others are
    neither kept nor deleted), plus: the newest step that verifies (checksums too; with a ``signer``, its
    signature too, so that a forged newer step never takes its place) is always kept. ``on_step(step)``: called
    before each step is verified (the newest first, older ones while none verifies), e.g. to grow a progress total.

    Example:
        >>> from ft_checkpoint.store.storage import Storage
        >>> s = Storage("memory://doc/gc")
        >>> s.write_bytes("step_000000000010/a.bin", b"partial save")
        >>> plan_gc(s, keep_last=1).delete   # nothing has committed: nothing is deleted
        []
    """
    for _ in range(3):  # every step listed was deleted as it was checked (a running job's retention): list again
        reader = layout.ManifestReader(storage)
        status = statuses(storage, signer=signer, reader=reader)
        committed = sorted((s for s, v in status.items() if v == layout.COMMITTED), reverse=True)
        if signer is None:
            _refuse_signed_without_key(storage, reader, committed)
        gone: list[int] = []
        protected = newest_verified(storage, committed, on_bytes, signer=signer, gone=gone, on_step=on_step)
        if protected is not None or not gone:
            break
    doomed = plan_deletions(counted(status), keep_last=keep_last, keep_every_n_steps=keep_every_n_steps)
    delete = [s for s in doomed if s != protected]
    return GcPlan(url=storage.url, delete=delete, keep=sorted(set(status) - set(delete)), protected=protected,
                  unverified=sorted(s for s, v in status.items() if v == layout.REFUSED))


def _refuse_signed_without_key(storage: Storage, reader: layout.ManifestReader, committed: list[int]) -> None:
    """ConfigError if a ``committed`` step's manifest is signed: without the run's key gc cannot tell a forged or
    copied unsigned step from a good one, and would keep it as the newest that verifies and delete the signed ones."""
    signed = [step for step in committed if reader.read(step).signature is not None]
    if signed:
        raise ConfigError(
            f"the steps of {storage.url} are signed ({plural(len(signed), 'signed step')}, the newest {max(signed)}), and "
            "no signing key was given: gc cannot tell a forged or copied unsigned step from a good one, and would "
            "delete the signed steps. HINT: pass the run's key (--key-file, FT_CHECKPOINT_SIGNING_KEY_FILE or "
            "FT_CHECKPOINT_SIGNING_KEY)")


def newest_verified(storage: Storage, candidates: Iterable[int], on_bytes: OnBytes | None = None, *,
                    signer: Signer | None = None, gone: list[int] | None = None,
                    on_step: Callable[[int], None] | None = None) -> int | None:
    """The first of ``candidates`` (newest first) whose manifest, sizes and checksums (and signature, with a
    ``signer``) all check out; ``gone`` collects the candidates deleted as they were checked; ``on_step(step)`` is
    called before each candidate is checked."""
    for step in candidates:
        if on_step is not None:
            on_step(step)
        check = check_step(storage, step, on_bytes=on_bytes, signer=signer, listed=True)
        if check.ok:
            return step
        if check.gone and gone is not None:
            gone.append(step)
    return None


def apply_gc(storage: Storage, plan: GcPlan, *, on_deleted: Callable[[int], None] | None = None,
             gone: list[int] | None = None) -> dict[int, list[str]]:
    """Delete the steps of ``plan``, each manifest first (a crash halfway leaves garbage, not a bad commit), calling
    ``on_deleted(1)`` after each; returns the steps whose checkpoint is deleted, each with the URLs of what is left
    in its directory (subdirectories: never a checkpoint's, gc deletes only files; usually none). A step directory
    swapped for a symbolic link since the plan is left alone, and so is everything it points to (see
    ``layout.delete_step``). ``gone`` collects the steps whose directory was already gone when gc came to them
    (deleted since the plan by another gc, or a running job's retention): deleting them is not this gc's doing.

    Example:
        >>> s = Storage("memory://doc/apply-gc")
        >>> for step in (1, 2):
        ...     s.write_bytes(f"{layout.step_dir(step)}/a.bin", b"x")
        >>> plan = GcPlan(url=s.url, delete=[1, 2], keep=[], protected=None)
        >>> s.delete_directory(layout.step_dir(1))   # another gc, after this one's plan
        True
        >>> gone = []
        >>> apply_gc(s, plan, gone=gone), gone
        ({2: []}, [1])
    """
    listed = storage.entries("")  # one listing for all steps, not one each: a delete of a missing step says True
    deleted = {}
    for step in plan.delete:
        if layout.step_dir(step) not in listed:
            if gone is not None:
                gone.append(step)
        else:
            left = [] if layout.delete_step(storage, step) else _left_of_deleted(storage, step)
            if left is not None:
                deleted[step] = left
        if on_deleted is not None:
            on_deleted(1)
    return deleted


def _left_of_deleted(storage: Storage, step: int) -> list[str] | None:
    """The URLs of the subdirectories left in the directory of ``step``, which gc emptied of every file (its
    checkpoint is deleted); None if a file is left (its checkpoint is still there) or the directory is no longer
    one (a link swapped in: left alone)."""
    rel = layout.step_dir(step)
    entry = storage.entries("").get(rel)
    if entry is not None and entry.kind != "directory":
        return None
    left = storage.entries(rel)
    if any(e.kind != "directory" for e in left.values()):
        return None
    return [storage.url_of(f"{rel}/{name}") for name in sorted(left)]
