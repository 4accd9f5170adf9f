"""Retention: which step directories to delete, and deleting them safely.

Rules: keep the newest ``keep_last`` committed steps and every milestone (a multiple of
``keep_every_n_steps``); delete other committed steps and every partial directory older than the
newest commit. Partial directories newer than the newest commit are left alone (a save may be
writing them). Nothing is deleted before a step has committed, so the newest committed step is always
kept. A step is deleted manifest first, so a crash halfway leaves garbage, never a broken commit.

Example:
    >>> plan_deletions({10: True, 20: True, 30: True, 25: False, 40: False}, keep_last=2)
    [10, 25]
    >>> plan_deletions({100: True, 200: True, 300: True}, keep_last=1, keep_every_n_steps=200)
    [100]
"""

from __future__ import annotations

import logging

from ft_checkpoint import layout
from ft_checkpoint.storage import Storage

log = logging.getLogger(__name__)


def plan_deletions(steps: dict[int, bool], *, keep_last: int, keep_every_n_steps: int | None = None) -> list[int]:
    """Steps to delete, given ``{step: committed}``."""
    committed = sorted(s for s, ok in steps.items() if ok)
    if not committed:
        return []
    keep = set(committed[-max(1, keep_last):])
    if keep_every_n_steps:
        keep |= {s for s in committed if s % keep_every_n_steps == 0}
    newest = committed[-1]
    return sorted(s for s, ok in steps.items() if s not in keep and (ok or s < newest))


def list_steps(storage: Storage) -> dict[int, bool]:
    """``{step: has a manifest}`` for every step directory."""
    steps = {}
    for name in storage.listdir(""):
        step = layout.parse_step(name)
        if step is not None:
            steps[step] = layout.MANIFEST in storage.listdir(name)
    return steps


def delete_step(storage: Storage, step: int) -> None:
    """Delete one step directory, its manifest first."""
    rel = layout.step_dir(step)
    storage.delete(f"{rel}/{layout.MANIFEST}")
    storage.delete(rel)


def apply_retention(storage: Storage, *, keep_last: int, keep_every_n_steps: int | None = None,
                    dry_run: bool = False) -> list[int]:
    """Delete what :func:`plan_deletions` says; returns the deleted (or, with ``dry_run``, deletable) steps."""
    doomed = plan_deletions(list_steps(storage), keep_last=keep_last, keep_every_n_steps=keep_every_n_steps)
    for step in doomed if not dry_run else ():
        delete_step(storage, step)
        log.debug("retention deleted step %d in %s", step, storage.url)
    return doomed
