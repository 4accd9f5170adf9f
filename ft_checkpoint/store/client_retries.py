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

An S3 write must end too, and botocore's read timeout alone does not see to it: botocore sends every upload with
``Expect: 100-continue``, and aiohttp waits for the server's ``100 Continue`` with no timeout, then starts its read
timeout only once the whole body is sent (a server that stopped reading it leaves the upload waiting for room in
the socket, with no timeout either). A hung S3 server (SIGSTOP) kept a save, and the training behind it, waiting
for as long as it hung. So the header is left out (the body goes at once; the 15 s read timeout starts after it),
and each connection gets ``TCP_USER_TIMEOUT`` (Linux): bytes sent and not acknowledged for :data:`S3_SILENCE_TIMEOUT`
seconds, a stalled upload included, end the connection, an error retried like any other. A user's own
``connector_args`` are kept, a ``socket_factory`` among them replacing ours. GCS uploads go through the same
aiohttp (a 30 MB write to a stopped GCS emulator still waited after 150 s): gcsfs's session gets the same socket
option, unless the user gave ``session_kwargs`` a ``connector`` or gcsfs presents a client certificate (its own
connector then).

Example:
    >>> options = single_attempt_options("s3", {"key": "k"})
    >>> options["config_kwargs"]["retries"], options["config_kwargs"]["connector_args"]["socket_factory"].__name__
    ({'total_max_attempts': 1}, 'silence_limited_socket')
    >>> t = single_attempt_options("gs", {"token": "anon"})["requests_timeout"]
    >>> t.sock_connect, t.sock_read, t.total
    (5.0, 15.0, None)
    >>> single_attempt_options("gs", {"requests_timeout": 600})["requests_timeout"]
    600
"""

from __future__ import annotations

import logging
import socket
import types
from typing import Any

log = logging.getLogger(__name__)
_S3 = frozenset({"s3", "s3a"})
_GCS = frozenset({"gs", "gcs"})
GCS_CONNECT_TIMEOUT = 5.0
"""Seconds a GCS request may take to connect (s3fs's ``connect_timeout``, which every S3 request gets)."""
GCS_READ_TIMEOUT = 15.0
"""Seconds a GCS request may wait for the server's next byte (s3fs's ``read_timeout``)."""
S3_SILENCE_TIMEOUT = 15.0
"""Seconds bytes an S3 or GCS connection sent may stay unacknowledged before it is ended (``TCP_USER_TIMEOUT``)."""


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
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        config["connector_args"] = {"socket_factory": silence_limited_socket, **(config.get("connector_args") or {})}
    return {**storage_options, "config_kwargs": config}


def silence_limited_socket(addr_info: Any) -> socket.socket:
    """aiohttp's socket factory for S3 and GCS connections: a socket whose unacknowledged bytes end it after
    :data:`S3_SILENCE_TIMEOUT` seconds (``TCP_USER_TIMEOUT``, Linux only: see the module's docstring).

    Example:
        >>> s = silence_limited_socket((socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", 0)))
        >>> s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        15000
        >>> s.close()
    """
    family, kind, proto = addr_info[:3]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(S3_SILENCE_TIMEOUT * 1000))
    return sock


def single_attempt(fs: Any) -> None:
    """Turn off the retries ``fs`` (gcsfs, s3fs) makes by itself around each request; other filesystems make
    none. gcsfs fixes its count when its class is defined: this instance calls the undecorated request.

    Example:
        >>> from fsspec.implementations.memory import MemoryFileSystem
        >>> single_attempt(MemoryFileSystem())  # nothing to turn off
    """
    if type(fs).__module__.startswith("s3fs"):
        fs.retries = 1
        _without_expect_continue(fs)
    elif type(fs).__module__.startswith("gcsfs"):
        _silence_limited_session(fs)
        request = getattr(type(fs)._request, "__wrapped__", None)
        if request is None:
            log.debug("gcsfs %s: its request has no __wrapped__; its own retries stay on", type(fs).__module__)
            return
        fs._request = types.MethodType(request, fs)


def _without_expect_continue(fs: Any) -> None:
    """Have every S3 client ``fs`` makes send uploads without ``Expect: 100-continue`` (see the module's docstring).
    s3fs makes its client on first use (and again on ``connect(refresh=True)``): the instance's ``set_session``
    removes botocore's handler that adds the header from each client it returns."""
    from botocore.handlers import add_expect_header

    make_client = fs.set_session

    async def set_session(*args: Any, **kwargs: Any) -> Any:
        client = await make_client(*args, **kwargs)
        client.meta.events.unregister("before-call.s3", add_expect_header)
        return client

    fs.set_session = set_session


def _silence_limited_session(fs: Any) -> None:
    """Have the aiohttp session gcsfs makes on first use connect with :func:`silence_limited_socket` (see the module's
    docstring), unless the user gave a ``connector`` or gcsfs uses a client certificate (mutual TLS)."""
    if not hasattr(socket, "TCP_USER_TIMEOUT") or "connector" in fs.session_kwargs \
            or getattr(fs, "_use_client_cert", False):
        return
    make_session = fs._set_session

    async def _set_session() -> Any:
        if fs._session is not None or "connector" in fs.session_kwargs:
            return await make_session()
        import aiohttp

        own = fs.session_kwargs  # a new connector for each session made (a closed session closes its connector)
        fs.session_kwargs = {**own, "connector": aiohttp.TCPConnector(socket_factory=silence_limited_socket)}
        try:
            return await make_session()
        finally:
            fs.session_kwargs = own

    fs._set_session = _set_session
