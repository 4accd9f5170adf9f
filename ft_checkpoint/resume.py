"""Resume: load the newest step that checks and loads, agreed on by every rank, falling back step by step.

Rank 0 lists the step directories, newest first, and every rank gets the list (one without a manifest,
an interrupted save, is skipped with a warning like any other that fails).
For each candidate, in three phases, each ended by an exchange of outcomes so that every rank takes
the same decision (and none is left waiting in a collective):

1. **check**: the manifest (strictly typed), every file's size and kind, no file it does not list
   (format 1: also the checksums of this rank's share of the files, ``i % world_size``);
2. **open**: the small files (tensor metadata, this rank's state file), each against its checksum,
   and the metadata against the manifest (paths, byte ranges, exact cover);
3. **load**: the tensors, each byte range checked against its CRC as it is read, then into the state.

A step that fails anywhere is skipped with a warning naming it and the reason, and the previous one is
tried. A corrupt step is quarantined (its manifest renamed to ``manifest.json.skipped``) so that no
later resume or retention takes it for a good one; a step that does not fit the state (another shape,
a missing key) is only skipped, since the state, not the step, may be what changed. A storage outage
is not corruption: it raises, and nothing is skipped. If no step loads after one failed *while
loading* (the state may be partly overwritten) or did not fit the state, the resume raises instead
of starting fresh with a wrong state.

Example:
    >>> from ft_checkpoint.storage import Storage
    >>> from ft_checkpoint.dist import Groups
    >>> fail = lambda *a: 1 / 0
    >>> resume_newest(Storage("memory://doc/empty"), Groups(), check=fail, open_step=fail, load=fail) is None
    True
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ft_checkpoint import checksum, layout
from ft_checkpoint.errors import CheckpointCorruptError, StateMismatchError, StorageError
from ft_checkpoint.storage import Storage

if TYPE_CHECKING:  # torch.distributed: kept out so that the CLI can read and verify without torch
    from ft_checkpoint.dist import Groups

log = logging.getLogger(__name__)
T = TypeVar("T")
Opened = TypeVar("Opened")


def check_for_resume(storage: Storage, step: int, *, rank: int = 0, world_size: int = 1) -> layout.Manifest:
    """Phase 1 for one rank: the step's manifest, sizes, kinds and unlisted files; for a format-1 step also
    the checksums of this rank's share of its files (format 2 is checked as it is read).

    Raises:
        CheckpointCorruptError: naming the first problems.
    """
    manifest = layout.check_step(storage, step).raise_if_bad()
    if manifest.format_version == 1:
        rel = layout.step_dir(step)
        for i, (name, entry) in enumerate(sorted(manifest.files.items())):
            if i % world_size == rank and not checksum.matches(entry.checksum, storage.iter_chunks(f"{rel}/{name}")):
                raise CheckpointCorruptError(f"{name}: does not match its checksum (corrupted)")
    return manifest


def resume_newest(storage: Storage, groups: Groups, *, check: Callable[[int], layout.Manifest],
                  open_step: Callable[[layout.Manifest], Opened], load: Callable[[Opened], T],
                  touches: Callable[[Opened], bool] = lambda opened: True) -> tuple[layout.Manifest, T] | None:
    """``(manifest, what load returned)`` for the newest step that passes ``check``, ``open_step`` and ``load``
    on every rank, or None when no step was ever committed (or every one is corrupt and nothing was
    loaded). ``load`` is collective; the three may raise CheckpointCorruptError or StateMismatchError
    (skip the step), or StorageError (stop). ``touches(opened)`` tells whether a ``load`` that fails may
    have changed the state already (it fills tensors of the state in place)."""
    candidates = groups.on_rank0(lambda: sorted(layout.list_steps(storage), reverse=True))
    skipped: list[int] = []
    unfit: list[str] = []
    touched: int | None = None
    for step in candidates:  # each lambda runs at once, inside _phase (ruff's B023 does not apply)
        manifest, reasons = _phase(groups, step, lambda: check(step))  # noqa: B023
        opened: Any = None
        if not reasons:
            opened, reasons = _phase(groups, step, lambda: open_step(manifest))  # noqa: B023
        if not reasons:
            result, reasons = _phase(groups, step, lambda: load(opened))  # noqa: B023
            if not reasons:
                groups.on_rank0(lambda: layout.quarantine(storage, skipped))
                return manifest, result
            if any(groups.all_gather(opened is not None and touches(opened))):
                touched = step
        _warn_skipped(storage, groups, step, [r for _, r in reasons])
        if any(kind == "corrupt" for kind, _ in reasons):
            skipped.append(step)
        else:
            unfit += [f"step {step}: {r}" for _, r in reasons]
    groups.on_rank0(lambda: layout.quarantine(storage, skipped))
    if unfit:
        raise StateMismatchError(
            f"no checkpoint in {storage.url} fits the state passed to resume: {'; '.join(unfit[:3])}. HINT: pass the "
            "same state (keys, shapes, dtypes) as the run that saved, or give this run a new dirpath")
    if touched is not None:
        raise CheckpointCorruptError(
            f"step {touched} in {storage.url} failed while it was loaded into the state, which may now be partly "
            "overwritten, and no earlier step loads. The corrupt steps were set aside (manifest.json.skipped). "
            "HINT: start the job again: it will start fresh")
    return None


def _phase(groups: Groups, step: int, fn: Callable[[], T]) -> tuple[Any, list[tuple[str, str]]]:
    """Run one phase on every rank: ``(this rank's result, [(kind, reason) of every rank that failed])``;
    a StorageError anywhere raises on every rank."""
    result, outcome = None, None
    try:
        result = fn()
    except CheckpointCorruptError as e:
        outcome = ("corrupt", str(e))
    except StateMismatchError as e:
        outcome = ("unfit", str(e))
    except StorageError as e:
        outcome = ("error", str(e))
    outcomes = groups.all_gather(outcome)
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    errors = [msg for _, (kind, msg) in failed if kind == "error"]
    if errors:
        raise StorageError(f"cannot resume from step {step}: {errors[0]}")
    return result, [(kind, f"rank {r}: {msg}" if groups.distributed else msg) for r, (kind, msg) in failed]


def _warn_skipped(storage: Storage, groups: Groups, step: int, reasons: list[str]) -> None:
    """Log (rank 0) that ``step`` is skipped and why."""
    if groups.rank == 0:
        log.warning("skipping step %d (%s): %s; trying the previous one",
                    step, storage.url_of(layout.step_dir(step)), "; ".join(reasons))


def refuse_older_step(storage: Storage, groups: Groups, step: int, newest: int, *, why: str | None = None) -> None:
    """Raise StateMismatchError for a save of ``step`` in a directory where ``newest >= step`` is committed.

    Such a save is refused rather than written: retention keeps the highest steps, so it would delete the
    new save right after its commit, and a crash would resume the old steps.
    """
    newer = groups.on_rank0(lambda: [s for s in layout.committed_steps(storage) if s >= step])
    paths = " ".join(storage.url_of(layout.step_dir(s)) for s in newer[:3]) + (" ..." if len(newer) > 3 else "")
    why = why or ("a run pointed at another run directory, a restarted step counter, or a resume that fell back "
                  "past steps that did not fit the state")
    raise StateMismatchError(
        f"cannot save step {step} in {storage.url}: step {newest} is committed there already ({why}). "
        "Retention would delete the new steps right after their commit, and a crash would resume the old ones. "
        f"HINT: give this run its own dirpath, or continue the step count from the resumed step, or, if the newer "
        f"steps are unwanted, delete them first ({paths})")
