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
is not corruption: it raises, and nothing is skipped. With a signing key, a step whose manifest is
unsigned or does not verify (``signing``) is skipped before anything else of it is read, and set aside
like a corrupt one once a step verifies (the key and the run name are right then); if none verifies,
the resume raises and renames nothing (the key or the run name, not the steps, may be what is wrong).
After a resume with a key, rank 0 warns if the journal records a newer step than the one resumed
(:func:`warn_if_rolled_back`). If no step loads after one failed *while
loading* (the state may be partly overwritten) or did not fit the state, the resume raises instead
of starting fresh with a wrong state.

Example:
    >>> from ft_checkpoint.store.storage import Storage
    >>> from ft_checkpoint.run.dist import Groups
    >>> fail = lambda *a: 1 / 0
    >>> resume_newest(Storage("memory://doc/empty"), Groups(), check=fail, open_step=fail, load=fail) is None
    True
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from ft_checkpoint.errors import CheckpointCorruptError, SignatureError, StateMismatchError, StorageError
from ft_checkpoint.format import layout
from ft_checkpoint.format.signing import Signer
from ft_checkpoint.run.journal import newest_recorded_step
from ft_checkpoint.store import checksum
from ft_checkpoint.store.storage import Storage

if TYPE_CHECKING:  # torch.distributed: kept out so that the CLI can read and verify without torch
    from ft_checkpoint.run.dist import Groups

log = logging.getLogger(__name__)
T = TypeVar("T")
Opened = TypeVar("Opened")


def check_for_resume(storage: Storage, step: int, *, rank: int = 0, world_size: int = 1,
                     signer: Signer | None = None, reader: layout.ManifestReader | None = None) -> layout.Manifest:
    """Phase 1 for one rank: the step's manifest (with a ``signer``, its signature first), sizes, kinds and
    unlisted files; for a format-1 step also the checksums of this rank's share of its files (format 2 is
    checked as it is read). ``reader``: the :class:`~ft_checkpoint.format.layout.ManifestReader` of this resume,
    which knows the manifests this start read (checked like ones read now) and reads each other one once.

    Raises:
        CheckpointCorruptError: naming the first problems (SignatureError: the signature was refused).
    """
    manifest = layout.check_step(storage, step, signer=signer, reader=reader).raise_if_bad()
    if manifest.format_version == 1:
        rel = layout.step_dir(step)
        for i, (name, entry) in enumerate(sorted(manifest.files.items())):
            if i % world_size != rank:
                continue
            chunks = storage.iter_chunks(f"{rel}/{name}", size=entry.size)  # never hours over a forged sparse file
            if not checksum.matches(entry.checksum, chunks):
                raise CheckpointCorruptError(f"{name}: does not match its checksum (corrupted)")
    return manifest


def resume_newest(storage: Storage, groups: Groups, *, check: Callable[[int], layout.Manifest],
                  open_step: Callable[[layout.Manifest], Opened], load: Callable[[Opened], T],
                  touches: Callable[[Opened], bool] = lambda opened: True,
                  steps: list[int] | None = None) -> tuple[layout.Manifest, T] | None:
    """``(manifest, what load returned)`` for the newest step that passes ``check``, ``open_step`` and ``load``
    on every rank, or None when no step was ever committed (or every one is corrupt and nothing was
    loaded). ``load`` is collective; the three may raise CheckpointCorruptError or StateMismatchError
    (skip the step), or StorageError (stop). ``touches(opened)`` tells whether a ``load`` that fails may
    have changed the state already (it fills tensors of the state in place). SignatureError (from ``check``):
    the step is skipped, and if no step passes ``check``, raised (see the module's docstring). ``steps``: the
    step directories as this start listed them already (the same on every rank); None: rank 0 lists them."""
    listed = steps if steps is not None else groups.on_rank0(lambda: list(layout.list_steps(storage)))
    candidates = sorted(listed, reverse=True)
    skipped: list[int] = []
    unfit: list[str] = []
    refused: dict[int, str] = {}  # steps whose signature a rank refused, and why
    touched: int | None = None
    verified = False  # a step passed the check on every rank: the key and run name are right
    for step in candidates:  # each lambda runs at once, inside _phase (ruff's B023 does not apply)
        manifest, reasons = _phase(groups, step, lambda: check(step))  # noqa: B023
        opened: Any = None
        if not reasons:
            verified = True
            opened, reasons = _phase(groups, step, lambda: open_step(manifest))  # noqa: B023
        if not reasons:
            result, reasons = _phase(groups, step, lambda: load(opened))  # noqa: B023
            if not reasons:
                groups.on_rank0(lambda: layout.quarantine(storage, skipped + list(refused)))
                return manifest, result
            if any(groups.all_gather(opened is not None and touches(opened))):
                touched = step
        _warn_skipped(storage, groups, step, [r for _, r in reasons])
        kinds = {kind for kind, _ in reasons}
        if "corrupt" in kinds:
            skipped.append(step)
        elif "unsigned" in kinds:
            refused[step] = next(r for kind, r in reasons if kind == "unsigned")
        else:
            unfit += [f"step {step}: {r}" for _, r in reasons]
    if refused and not verified:
        _raise_none_verifies(storage, groups, skipped, refused)
    groups.on_rank0(lambda: layout.quarantine(storage, skipped + list(refused)))
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


def _raise_none_verifies(storage: Storage, groups: Groups, skipped: list[int], refused: dict[int, str]) -> NoReturn:
    """No step verifies with this job's key: the key or the run name may be what is wrong, so the refused
    steps are kept as they are (the corrupt ones set aside), and the resume raises instead of starting fresh."""
    groups.on_rank0(lambda: layout.quarantine(storage, skipped))
    reasons = "; ".join(f"step {step}: {reason}" for step, reason in list(refused.items())[:2])
    raise SignatureError(
        f"no step in {storage.url} verifies with this job's signing key, and {len(refused)} were refused ({reasons}). "
        "They were kept as they are. HINT: if the key or run_name is wrong, fix it; if these steps are not this "
        "run's (saved without the key, or planted), move them out of the directory, or give this run a new dirpath")


def _phase(groups: Groups, step: int, fn: Callable[[], T]) -> tuple[Any, list[tuple[str, str]]]:
    """Run one phase on every rank: ``(this rank's result, [(kind, reason) of every rank that failed])``;
    a StorageError anywhere raises on every rank."""
    result, outcome = None, None
    try:
        result = fn()
    except SignatureError as e:
        outcome = ("unsigned", str(e))
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


def warn_if_rolled_back(storage: Storage, resumed: int | None) -> str | None:
    """Warn (and return the warning) if the journal records a newer step than ``resumed`` (None: a fresh start).

    Signatures cannot tell that newer steps were deleted: every step left still verifies. The journal
    can (``newest_recorded_step``), as long as whoever deleted the steps did not delete their journal
    entries too. Costs a few listings and one read; a journal that cannot be read is warned about.

    Example:
        >>> from ft_checkpoint.run.journal import Journal
        >>> s = Storage("memory://doc/rollback")
        >>> Journal(s, attempt="20261129T000000.000000Z-abc123").record("commit", step=40)
        >>> warn_if_rolled_back(s, 40) is None, warn_if_rolled_back(s, 30)[:52]
        (True, 'the journal of memory://doc/rollback records step 40')
    """
    try:
        recorded = newest_recorded_step(storage)
    except StorageError as e:
        log.warning("could not read the journal of %s to check for a rollback: %s", storage.url, e)
        return None
    if recorded is None or (resumed is not None and recorded[0] <= resumed):
        return None
    step, attempt = recorded
    found = f"the newest step that verifies is {resumed}" if resumed is not None else "no step verifies"
    message = (f"the journal of {storage.url} records step {step} as committed (attempt {attempt}), but {found}: the "
               f"newer steps were deleted, or skipped (see the warnings above). If nobody deleted them on purpose, "
               f"the run was rolled back. HINT: check who can write to {storage.url}")
    log.warning("%s", message)
    return message


def refuse_older_step(storage: Storage, groups: Groups, step: int, newest: int, *, why: str | None = None,
                      signer: Signer | None = None) -> None:
    """Raise StateMismatchError for a save of ``step`` in a directory where ``newest >= step`` is committed (with a
    ``signer``, the steps it names are those whose signature verifies, as ``newest`` is).

    Such a save is refused rather than written: retention keeps the highest steps, so it would delete the
    new save right after its commit, and a crash would resume the old steps.
    """
    newer = groups.on_rank0(lambda: [s for s in layout.committed_steps(storage, signer=signer) if s >= step])
    paths = " ".join(storage.url_of(layout.step_dir(s)) for s in newer[:3]) + (" ..." if len(newer) > 3 else "")
    why = why or ("a run pointed at another run directory, a restarted step counter, or a resume that fell back "
                  "past steps that did not fit the state")
    raise StateMismatchError(
        f"cannot save step {step} in {storage.url}: step {newest} is committed there already ({why}). "
        "Retention would delete the new steps right after their commit, and a crash would resume the old ones. "
        f"HINT: give this run its own dirpath, or continue the step count from the resumed step, or, if the newer "
        f"steps are unwanted, delete them first ({paths})")
