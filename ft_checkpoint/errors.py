"""The errors ft-checkpoint raises.

Every error is an :class:`FTCheckpointError`, and each subclass also inherits the matching
built-in (``ValueError``, ``FileNotFoundError``, ...), so ``except ValueError`` keeps working for
code that does not know this package. Messages say what happened and what to do about it.

Example:
    >>> from ft_checkpoint.errors import ConfigError
    >>> try:
    ...     raise ConfigError("keep_last=0: must be an integer >= 1")
    ... except ValueError as e:
    ...     print(e)
    keep_last=0: must be an integer >= 1
"""

from __future__ import annotations


class FTCheckpointError(Exception):
    """Base class of every error raised by ft-checkpoint."""


class ConfigError(FTCheckpointError, ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


class StorageError(FTCheckpointError, OSError):
    """Storage failed (after retries, for transient errors); the message names the URL."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """The bucket, directory or object does not exist."""


class StorageExistsError(StorageError, FileExistsError):
    """A file that had to be new was there already (a create refused: ``O_EXCL``, S3's ``If-None-Match: *``, GCS's
    ``ifGenerationMatch=0``)."""


class StoragePermissionError(StorageError, PermissionError):
    """Credentials are missing or do not allow the operation."""


class CheckpointCorruptError(FTCheckpointError, ValueError):
    """A checkpoint failed verification (missing file, wrong size or checksum, bad manifest)."""


class SignatureError(CheckpointCorruptError):
    """A manifest is unsigned, or its signature does not verify with the configured key, run and step
    (``signing_key``); or, from a resume, no step verifies (the key or the run name may be wrong)."""


class SaveError(FTCheckpointError, RuntimeError):
    """A background save failed; re-raised at the next ``save``, ``wait`` or ``close``."""


class LeaseError(FTCheckpointError, RuntimeError):
    """Another job holds the checkpoint directory's lease; the message names it and what to do."""


class Preempted(SystemExit):
    """Raised at a step boundary after the final save of an announced preemption committed.

    A ``SystemExit``: uncaught, the process exits with ``code`` (``preemption_exit_code``, 0 by default)
    once the framework has torn down. Catch it to run something else first.

    Example:
        >>> e = Preempted(step=120, reason="SIGUSR1")
        >>> e.code, e.step, e.reason
        (0, 120, 'SIGUSR1')
    """

    def __init__(self, step: int | None, reason: str, code: int = 0) -> None:
        super().__init__(code)
        self.step = step
        """The step of the final checkpoint (None if none committed)."""
        self.reason = reason
        """What announced the preemption: a signal name, or ``"job end time"``."""


class StateMismatchError(ConfigError):
    """A checkpoint does not fit the state it is loaded into (a key missing, another shape or dtype), or a
    state cannot be saved as given (a tensor declared replicated differs across ranks)."""


class UsageError(Exception):
    """Wrong or impossible arguments of an ``ft-checkpoint`` command: printed as an error, exit code 2."""
