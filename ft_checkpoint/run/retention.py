"""Retention: which step directories to delete after a commit.

Rules: keep the newest ``keep_last`` committed steps, every milestone (a multiple of
``keep_every_n_steps``) and the step just committed; delete other committed steps and every other
step directory (partial, quarantined, or with a manifest that does not parse) older than the newest
commit. Directories newer than the newest commit are left alone (a save may be writing them). A step
counts as committed only if its manifest parses and names its own step, so a garbage manifest never
makes retention delete good steps. With a signing key, only if its signature verifies too: a step whose
signature is refused (unsigned, or forged by someone without the key) is neither kept nor deleted, so
forged steps never push the job's own steps out of ``keep_last`` (a resume sets them aside once a step
verifies). Deleting is ``layout.delete_step``: manifest first, literal names.

Example:
    >>> plan_deletions({10: True, 20: True, 30: True, 25: False, 40: False}, keep_last=2)
    [10, 25]
    >>> plan_deletions({100: True, 200: True, 300: True}, keep_last=1, keep_every_n_steps=200)
    [100]
    >>> plan_deletions({5: True, 100: True, 200: True}, keep_last=1, protect=5)   # never the step just saved
    [100]
"""

from __future__ import annotations

import logging

from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage

log = logging.getLogger(__name__)


def plan_deletions(steps: dict[int, bool], *, keep_last: int, keep_every_n_steps: int | None = None,
                   protect: int | None = None) -> list[int]:
    """Steps to delete, given ``{step: committed}``; ``protect`` (the step just committed) is never among them."""
    committed = sorted(s for s, ok in steps.items() if ok)
    if not committed:
        return []
    keep = set(committed[-max(1, keep_last):]) | {protect}
    if keep_every_n_steps:
        keep |= {s for s in committed if s % keep_every_n_steps == 0}
    newest = committed[-1]
    return sorted(s for s, ok in steps.items() if s not in keep and (ok or s < newest))


def statuses(storage: Storage, *, signer: layout.SignatureCheck | None = None,
             reader: layout.ManifestReader | None = None) -> dict[int, str]:
    """``{step: layout.COMMITTED, NOT_COMMITTED or REFUSED}`` of every step directory (see
    ``layout.ManifestReader.status``), each manifest file read once.

    Example:
        >>> statuses(Storage("memory://doc/statuses"))
        {}
    """
    reader = reader or layout.ManifestReader(storage)
    status = {step: reader.status(step, signer=signer) if has_manifest else layout.NOT_COMMITTED
              for step, has_manifest in sorted(layout.list_steps(storage).items())}  # warnings by step, not set order
    layout.report_left_out(storage)
    return status


def counted(status: dict[int, str]) -> dict[int, bool]:
    """``{step: committed}``, as :func:`plan_deletions` takes it, less the steps whose signature was refused:
    :func:`plan_deletions` never deletes a step it is not given.

    Example:
        >>> counted({1: layout.COMMITTED, 2: layout.NOT_COMMITTED, 3: layout.REFUSED})
        {1: True, 2: False}
    """
    return {step: s == layout.COMMITTED for step, s in status.items() if s != layout.REFUSED}


def apply_retention(storage: Storage, *, keep_last: int, keep_every_n_steps: int | None = None,
                    protect: int | None = None, dry_run: bool = False,
                    signer: layout.SignatureCheck | None = None) -> list[int]:
    """Delete what :func:`plan_deletions` says; returns the deleted (or, with ``dry_run``, deletable) steps.
    With a ``signer``, only steps whose signature verifies count as committed (see the module's docstring).
    A step directory swapped for a symbolic link after the listing is left alone (see ``layout.delete_step``)."""
    doomed = plan_deletions(counted(statuses(storage, signer=signer)), keep_last=keep_last,
                            keep_every_n_steps=keep_every_n_steps, protect=protect)
    if dry_run:
        return doomed
    deleted = [step for step in doomed if layout.delete_step(storage, step)]
    log.debug("retention deleted steps %s in %s", deleted, storage.url)
    return deleted
