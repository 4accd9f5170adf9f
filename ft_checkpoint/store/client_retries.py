"""One retry layer: the object-store clients' own retries turned off, so that :class:`~ft_checkpoint.store.storage.Storage`
retries alone.

gcsfs retries every request 6 times (sleeping 1, 2, 4, 8 and 16 s in between, a refused connection and a host
name that does not resolve included), s3fs 5 times, each over botocore's own attempts. Under Storage's retries
these multiply: ``ft-checkpoint ls gs://bucket/run`` without network took 185 s. Here each request is tried
once; Storage decides what is worth another attempt (see ``storage.is_transient``), how often and for how
long. A user's own botocore retry setting (``config_kwargs={"retries": ...}``) is kept.

Example:
    >>> single_attempt_options("s3", {"key": "k"})
    {'key': 'k', 'config_kwargs': {'retries': {'total_max_attempts': 1}}}
    >>> single_attempt_options("gs", {"token": "anon"})
    {'token': 'anon'}
"""

from __future__ import annotations

import logging
import types
from typing import Any

log = logging.getLogger(__name__)
_S3 = frozenset({"s3", "s3a"})


def single_attempt_options(protocol: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` with botocore's retries off (one attempt per request) for an S3 URL, unless the user
    configured them; unchanged for any other protocol."""
    if protocol not in _S3:
        return storage_options
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    return {**storage_options, "config_kwargs": config}


def single_attempt(fs: Any) -> None:
    """Turn off the retries ``fs`` (gcsfs, s3fs) makes by itself around each request; other filesystems make
    none. gcsfs fixes its count when its class is defined: this instance calls the undecorated request.

    Example:
        >>> from fsspec.implementations.memory import MemoryFileSystem
        >>> single_attempt(MemoryFileSystem())  # nothing to turn off
    """
    if type(fs).__module__.startswith("s3fs"):
        fs.retries = 1
    elif type(fs).__module__.startswith("gcsfs"):
        request = getattr(type(fs)._request, "__wrapped__", None)
        if request is None:
            log.debug("gcsfs %s: its request has no __wrapped__; its own retries stay on", type(fs).__module__)
            return
        fs._request = types.MethodType(request, fs)
