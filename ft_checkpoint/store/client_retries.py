"""One retry layer: the object-store clients' own retries turned off, so that :class:`~ft_checkpoint.store.storage.Storage`
retries alone.

gcsfs retries every request 6 times (sleeping 1, 2, 4, 8 and 16 s in between, a refused connection and a host
name that does not resolve included), s3fs 5 times, each over botocore's own attempts. Under Storage's retries
these multiply: ``ft-checkpoint ls gs://bucket/run`` without network took 185 s. Here each request is tried
once; Storage decides what is worth another attempt (see ``storage.is_transient``), how often and for how
long. A user's own botocore retry setting (``config_kwargs={"retries": ...}``) is kept.

Each attempt must also end: gcsfs sets no timeout on its requests by default (``requests_timeout=None`` becomes
aiohttp's ``ClientTimeout(total=None)``, which waits forever), so an endpoint that accepts the connection and never
answers hung ``ft-checkpoint ls`` for good. A GCS request gets the timeouts s3fs gives every S3 request (5 s to
connect, 15 s without a byte from the server): a silent peer fails as a transient timeout, retried within Storage's
retry window, then reported, as on S3. Silence is measured, not the whole request (aiohttp starts the read timeout once
the request is sent and restarts it at every byte received): a large upload or download on a slow link is not cut. A
user's own ``requests_timeout`` (a number: a limit on the whole request; or an ``aiohttp.ClientTimeout``) is kept.

Example:
    >>> single_attempt_options("s3", {"key": "k"})
    {'key': 'k', 'config_kwargs': {'retries': {'total_max_attempts': 1}}}
    >>> t = single_attempt_options("gs", {"token": "anon"})["requests_timeout"]
    >>> t.sock_connect, t.sock_read, t.total
    (5.0, 15.0, None)
    >>> single_attempt_options("gs", {"requests_timeout": 600})["requests_timeout"]
    600
"""

from __future__ import annotations

import logging
import types
from typing import Any

log = logging.getLogger(__name__)
_S3 = frozenset({"s3", "s3a"})
_GCS = frozenset({"gs", "gcs"})
GCS_CONNECT_TIMEOUT = 5.0
"""Seconds a GCS request may take to connect (s3fs's ``connect_timeout``, which every S3 request gets)."""
GCS_READ_TIMEOUT = 15.0
"""Seconds a GCS request may wait for the server's next byte (s3fs's ``read_timeout``)."""


def single_attempt_options(protocol: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` with botocore's retries off (one attempt per request) for an S3 URL, unless the user
    configured them; with a connect and a read timeout on each request for a GCS URL, unless the user gave
    ``requests_timeout``; unchanged for any other protocol."""
    if protocol in _GCS:
        if "requests_timeout" in storage_options:
            return storage_options
        try:
            import aiohttp  # gcsfs's HTTP client; without it gcsfs is missing too (make_filesystem says so)
        except ImportError:
            return storage_options
        timeout = aiohttp.ClientTimeout(sock_connect=GCS_CONNECT_TIMEOUT, sock_read=GCS_READ_TIMEOUT)
        return {**storage_options, "requests_timeout": timeout}
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
