"""Resume detection: the newest committed step that verifies, agreed on by every rank.

Rank 0 lists the step directories, newest first, and every rank gets the list; one without a manifest
(an interrupted save) is skipped with a warning like any other that fails.
For each candidate, every rank checks the manifest, every file's size, that the directory holds no file
the manifest does not list (a leftover or a copied-in file a loader could read), and the checksums of
its share of the files (file ``i`` is hashed by rank ``i % world_size``, so the work is spread). The
first step that passes everywhere wins. A step that fails is skipped with a warning naming it and the
reason; its manifest is then renamed to ``manifest.json.skipped`` so that no later resume or retention
takes it for a good step. A storage outage is not corruption: it raises, and nothing is skipped.

Example:
    >>> from ft_checkpoint.storage import Storage
    >>> from ft_checkpoint.dist import Groups
    >>> find_resume_step(Storage("memory://doc/empty"), Groups()) is None
    True
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ft_checkpoint import layout
from ft_checkpoint.errors import CheckpointCorruptError, StorageError, StorageNotFoundError
from ft_checkpoint.retention import list_steps
from ft_checkpoint.storage import Storage

if TYPE_CHECKING:  # torch.distributed: kept out so that the CLI can read and verify without torch
    from ft_checkpoint.dist import Groups

log = logging.getLogger(__name__)
SKIPPED_SUFFIX = ".skipped"
UNLISTED = "not listed in the manifest (left over or copied in; a step must hold only what it committed)"


def read_manifest(storage: Storage, step: int) -> layout.Manifest:
    """Read and parse the manifest of ``step``; CheckpointCorruptError if missing or invalid."""
    rel = f"{layout.step_dir(step)}/{layout.MANIFEST}"
    try:
        data = storage.read_bytes(rel)
    except StorageNotFoundError as e:
        raise CheckpointCorruptError("manifest.json is missing") from e
    manifest = layout.Manifest.from_json(data, where=storage.url_of(rel))
    if manifest.step != step:
        raise CheckpointCorruptError(f"manifest.json says step {manifest.step}, the directory says {step}")
    return manifest


def verify_step(storage: Storage, step: int, *, checksums: bool = True, rank: int = 0,
                world_size: int = 1) -> layout.Manifest:
    """Check a step: manifest, every file's size, no file it does not list, checksums of this rank's share.

    Raises:
        CheckpointCorruptError: naming the first problem found.
    """
    manifest = read_manifest(storage, step)
    rel = layout.step_dir(step)
    sizes = storage.sizes(rel)
    for name, entry in sorted(manifest.files.items()):
        if name not in sizes:
            raise CheckpointCorruptError(f"{name} is missing")
        if sizes[name] != entry.size:
            raise CheckpointCorruptError(f"{name} has {sizes[name]} bytes, the manifest says {entry.size} (truncated or replaced)")
    unlisted = manifest.unlisted(sizes)
    if unlisted:
        raise CheckpointCorruptError(f"{', '.join(unlisted[:5])}{', ...' if len(unlisted) > 5 else ''}: {UNLISTED}")
    if checksums:
        for i, (name, entry) in enumerate(sorted(manifest.files.items())):
            if i % world_size == rank and layout.checksum(storage.iter_chunks(f"{rel}/{name}")) != entry.checksum:
                raise CheckpointCorruptError(f"{name} does not match its checksum (corrupted)")
    return manifest


def find_resume_step(storage: Storage, groups: Groups, *, verify_checksums: bool = True,
                     below: int | None = None) -> layout.Manifest | None:
    """The manifest of the newest step (older than ``below``, if given) that verifies on every rank."""
    candidates = groups.on_rank0(
        lambda: sorted((s for s in list_steps(storage) if below is None or s < below), reverse=True))
    skipped = []
    for step in candidates:
        outcome: tuple[str, str | None]
        try:
            manifest = verify_step(storage, step, checksums=verify_checksums, rank=groups.rank,
                                   world_size=groups.world_size)
            outcome = ("ok", None)
        except CheckpointCorruptError as e:
            outcome = ("corrupt", f"rank {groups.rank}: {e}" if groups.distributed else str(e))
        except StorageError as e:
            outcome = ("error", str(e))
        outcomes = groups.all_gather(outcome)
        errors = [msg for kind, msg in outcomes if kind == "error"]
        if errors:
            raise StorageError(f"cannot verify step {step} in {storage.url}: {errors[0]}")
        reasons = [msg for kind, msg in outcomes if kind == "corrupt"]
        if not reasons:
            groups.on_rank0(lambda: quarantine(storage, skipped))
            return manifest
        warn_skipped(storage, groups, step, reasons)
        skipped.append(step)
    groups.on_rank0(lambda: quarantine(storage, skipped))
    return None


def warn_skipped(storage: Storage, groups: Groups, step: int, reasons: list[str]) -> None:
    """Log (rank 0) that ``step`` is skipped and why."""
    if groups.rank == 0:
        log.warning("skipping step %d (%s): %s; trying the previous one",
                    step, storage.url_of(layout.step_dir(step)), "; ".join(reasons))


def quarantine(storage: Storage, steps: list[int]) -> None:
    """Rename the manifests of ``steps`` to ``manifest.json.skipped``: they no longer count as commits."""
    for step in steps:
        rel = f"{layout.step_dir(step)}/{layout.MANIFEST}"
        try:
            storage.write_bytes(rel + SKIPPED_SUFFIX, storage.read_bytes(rel))
        except StorageNotFoundError:
            continue
        storage.delete(rel)
