"""Whole-save and whole-load retries after transient errors, and DCP's exceptions made readable.

Each storage call is retried on its own already (``Storage``), and the :class:`StorageError` it ends with is
final (``storage.is_transient`` says no), so that one layer retries: what is retried here is a whole save or
load whose failure was transient on some rank outside those calls (a read stream broken halfway). DCP wraps
the ranks' exceptions in a ``CheckpointException`` (a ``BaseException``): :func:`describe` turns it into one line per rank.

Example:
    >>> from ft_checkpoint.errors import CheckpointCorruptError
    >>> transient(TimeoutError()), transient(CheckpointCorruptError("x")), describe(ValueError("bad"))
    (True, False, 'ValueError: bad')
"""

from __future__ import annotations

import logging

import tenacity
from torch.distributed.checkpoint.api import CheckpointException

from ft_checkpoint.errors import CheckpointCorruptError, SaveError
from ft_checkpoint.store.storage import Storage, is_transient

log = logging.getLogger(__name__)


class TransientSaveError(SaveError):
    """A save failed on some rank with a transient storage error: worth retrying whole."""


def failures(e: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's CheckpointException (values are ``(exception, trace)``)."""
    if not isinstance(e, CheckpointException):
        return []
    return [v[0] if isinstance(v, tuple) else v for v in e.failures.values()]


def transient(e: BaseException) -> bool:
    """Whether ``e`` (or a rank's exception inside it) is a storage error worth retrying."""
    if isinstance(e, TransientSaveError):
        return True
    if isinstance(e, CheckpointException):
        return any(isinstance(x, BaseException) and is_transient(x) for x in failures(e))
    return is_transient(e)


def corrupt(e: BaseException) -> bool:
    """Whether ``e`` (or a rank's exception inside it) says the stored bytes are corrupt: never retried."""
    return isinstance(e, CheckpointCorruptError) or any(isinstance(x, CheckpointCorruptError) for x in failures(e))


def describe(e: BaseException | None) -> str:
    """One line per failed rank instead of DCP's multi-line tracebacks."""
    if not isinstance(e, CheckpointException):
        return f"{type(e).__name__}: {e}"
    return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in zip(e.failures, failures(e)))


def retrying(storage: Storage, what: str, step: int) -> tenacity.Retrying:
    """Retries of a whole save or load of ``step`` after a transient error, up to ``storage.retries`` tries.

    Every rank must see the same failures (the engine exchanges them; DCP reports a rank's failure to all).
    """
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda e: transient(e) and not corrupt(e)),
        stop=tenacity.stop_after_attempt(max(1, storage.retries)),
        wait=tenacity.wait_random_exponential(multiplier=storage.backoff, max=10),
        before_sleep=lambda rs: log.warning(
            "%s of step %d failed with a transient error (%s); retrying it whole (%d of %d)", what, step,
            describe(rs.outcome.exception() if rs.outcome else None), rs.attempt_number + 1, storage.retries),
        reraise=True)
