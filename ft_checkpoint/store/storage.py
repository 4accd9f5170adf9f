"""Storage: one fsspec filesystem behind a checkpoint directory URL, with retries.

Any local path or fsspec URL works (``/data/run``, ``file://``, ``memory://``, ``gs://`` with gcsfs,
``s3://`` with s3fs, ...). Transient errors (timeouts, 5xx, throttling, connection resets) are retried
with bounded exponential backoff and jitter (tenacity), by this layer only (the clients' own retries are off:
``client_retries``), within :data:`RETRY_WINDOW` seconds, with one warning; permanent ones (a host name that does
not resolve, a refused connection, missing credentials, a missing bucket, a permission error, a malformed URL)
fail at once with one message naming the URL and what to check.

Object stores have no append and no atomic rename, so a step is made visible by writing its manifest
last, in one ``put`` (see ``layout``). On local disk :meth:`Storage.write_bytes` writes to a temporary
name, fsyncs and renames, so a reader never sees half an object there either.

This module never imports torch: the CLI and tools can use it without a training stack.

Example:
    >>> s = Storage("memory://doc/run")
    >>> s.write_bytes("step_000000000001/hello.txt", b"hi")
    >>> s.read_bytes("step_000000000001/hello.txt")
    b'hi'
    >>> s.listdir("")
    ['step_000000000001']
    >>> s.entries("step_000000000001")
    {'hello.txt': Entry(kind='file', size=2)}
"""

from __future__ import annotations

import base64
import contextlib
import errno
import logging
import os
import posixpath
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import fsspec
import tenacity
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ft_checkpoint.errors import (
    CheckpointCorruptError,
    ConfigError,
    FTCheckpointError,
    StorageError,
    StorageExistsError,
    StorageNotFoundError,
    StoragePermissionError,
)
from ft_checkpoint.store import nofollow
from ft_checkpoint.store.buffer_pool import BufferPool
from ft_checkpoint.store.checksum import combine_all, crc32c_of, crcs_while_writing
from ft_checkpoint.store.client_retries import single_attempt, single_attempt_options
from ft_checkpoint.store.memory_fs import LockedMemoryFileSystem
from ft_checkpoint.store.nofollow import DirectoryId
from ft_checkpoint.units import human_seconds, plural

log = logging.getLogger(__name__)
T = TypeVar("T")
IO_SLICE = 16 << 20
"""Bytes per write or read call and CRC update: large enough to amortize the call, small enough to stay in cache."""
DIRECT_ALIGN = 4096
"""Alignment of ``O_DIRECT`` writes (address, length, file offset): the page size, a multiple of any block size."""


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole :data:`DIRECT_ALIGN` pages (what an ``O_DIRECT`` write of them takes).

    Example:
        >>> padded(1), padded(4096), padded(0)
        (4096, 4096, 0)
    """
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN

PART_SIZE = 64 << 20
"""Object stores: bytes per request of a streamed upload (S3 multipart part, GCS resumable-upload chunk; a multiple
of GCS's 256 KiB and of :data:`IO_SLICE`). gcsfs's default of 5 MiB sent every write as its own chunk, and the GCS
emulator took 1.85x a plain put for a 400 MB file."""
SINGLE_PUT_MAX = 100 << 20
"""Object stores: a file up to this size is sent as one object in one request, from one joined copy of its buffers
(on GCS in a buffer reused from save to save: :mod:`ft_checkpoint.store.buffer_pool`; what fsspec's own ``pipe_file``
does below twice s3fs's 50 MiB part size); a larger one is streamed in parts,
holding one part in memory. A multipart upload of a small file costs the server a reassembly, and two to three
times the requests."""
GLOB_CHARACTERS = frozenset("*?[]")
"""Characters fsspec may expand as a pattern (``rm``, ``copy``, ``expand_path``): refused in a dirpath."""

# Exception class names (anywhere in the MRO) that mean "try again": aiohttp (gcsfs), botocore
# (s3fs) and requests-style errors, matched by name so this module imports none of them.
_TRANSIENT_NAMES = frozenset({
    "ClientConnectionError", "ServerDisconnectedError", "ServerTimeoutError", "ClientOSError",
    "ClientPayloadError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError", "ResponseStreamingError", "TransientError",
})
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_ERRNO = frozenset({errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.EPIPE, errno.EBUSY})
# botocore's and google-auth's "no credentials" errors, by name (neither is imported here).
_CREDENTIAL_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                               "DefaultCredentialsError"})
_DENIED_STATUS = frozenset({401, 403})
RETRY_WINDOW = 60.0
"""Seconds from an operation's first attempt after which a transient error is no longer retried (whatever
``retries`` says): a store that stays down is reported within about this long, never after minutes."""
_LOCAL_PROTOCOLS = frozenset({"file", "local"})
_BUCKET_PROTOCOLS = frozenset({"gs", "gcs", "s3", "s3a"})
_DIRECTORY_PROTOCOLS = frozenset({"memory", "sftp", "ssh", "hdfs", "webhdfs", "arrow_hdfs", "smb", "ftp"})
"""Filesystems besides local disk whose directories are real, removed with ``rmdir`` once emptied. An object
store's ``rmdir`` deletes the bucket or container (gcsfs, s3fs, adlfs given one) or nothing: never called there."""
_EXTRAS = {"gs": "gcs", "gcs": "gcs", "s3": "s3", "s3a": "s3"}
_CONFLICT = "ConditionalRequestConflict"
"""S3's answer (409) to a create (``If-None-Match: *``) while another upload of the same name completes (its 412 for an
object there already comes from s3fs as ``FileExistsError``)."""


SPARSE_MIN_BYTES = 64 << 20
SPARSE_RATIO = 64
"""A step's file of at least SPARSE_MIN_BYTES with under 1/SPARSE_RATIO of them stored is refused as sparse."""


def size_changed(url: str, found: str, size: int) -> CheckpointCorruptError:
    """The error for a step's file found at another size (``found``: ``"12"``, ``"more than 13"``) than the ``size`` its
    manifest lists: replaced since the listing was read, and refused before it is read.

    Example:
        >>> print(size_changed("step_000000000010/metadata.json", "12", 13))
        step_000000000010/metadata.json: has 12 bytes, the manifest says 13 (changed since it was listed); refusing to read it
    """
    return CheckpointCorruptError(f"{url}: has {found} bytes, the manifest says {size} (changed since it was listed); "
                                  "refusing to read it")


def refuse_changed_or_sparse(info: os.stat_result, size: int, url: str) -> None:
    """CheckpointCorruptError unless ``info`` (``fstat`` of a step's file as opened for reading) shows the ``size``
    its manifest lists, and, from 64 MiB, at least 1/64 of it stored: a sparse file's holes read as zeros, which
    cost whoever forged it nothing and whoever reads or hashes it gigabytes or minutes. No file that ft-checkpoint
    writes is sparse; a filesystem that compresses stores JSON, pickles and tensors in far more than 1/64 of their
    size. Checked on the descriptor that is then read: a file swapped in since the listing cannot escape it.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.truncate(1 << 30)
        ...     try:
        ...         refuse_changed_or_sparse(os.fstat(f.fileno()), 1 << 30, "metadata.json")
        ...     except CheckpointCorruptError as e:
        ...         print(str(e)[:60])
        metadata.json: listed at 1073741824 bytes, of which 0 are st
    """
    if info.st_size != size:
        raise size_changed(url, str(info.st_size), size)
    stored = getattr(info, "st_blocks", None)  # not on every OS
    if stored is not None and size >= SPARSE_MIN_BYTES and stored * 512 * SPARSE_RATIO < size:
        raise CheckpointCorruptError(
            f"{url}: listed at {size} bytes, of which {stored * 512} are stored on disk (a sparse file, which "
            "ft-checkpoint never writes: forged); refusing to read it")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def unreachable(exc: BaseException) -> str | None:
    """Why the store cannot be reached at all, or None: a host name that does not resolve, a refused connection
    (nothing listens there), or no credentials. Permanent: another attempt would fail the same way.

    Example:
        >>> unreachable(ConnectionRefusedError(111, "Connection refused")), unreachable(TimeoutError())
        ('connection refused', None)
    """
    for e in _chain(exc):
        if isinstance(e, socket.gaierror):
            return "host name does not resolve"
        if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return "connection refused"
        if any(c.__name__ in _CREDENTIAL_NAMES for c in type(e).__mro__):
            return "no credentials"
    return None


def _describe(exc: BaseException) -> str:
    """``Type: message``; for an exception without a message (fsspec's ``FSTimeoutError`` around aiohttp's timeout),
    that of the first exception it was raised from that has one.

    Example:
        >>> try:
        ...     raise TimeoutError() from ConnectionError("Timeout on reading data from socket")
        ... except TimeoutError as e:
        ...     print(_describe(e))
        TimeoutError: ConnectionError: Timeout on reading data from socket
    """
    if str(exc):
        return f"{type(exc).__name__}: {exc}"
    said = next((e for e in _chain(exc) if str(e)), None)
    return f"{type(exc).__name__}: {type(said).__name__}: {said}" if said is not None else type(exc).__name__


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is worth retrying. A :class:`StorageError` is
    final: its operation was retried already, by one layer (this module).

    Example:
        >>> is_transient(TimeoutError()), is_transient(FileNotFoundError("x")), is_transient(ConnectionRefusedError())
        (True, False, False)
    """
    if unreachable(exc):
        return False
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, StorageError)):
            return False
        if isinstance(e, (TimeoutError, ConnectionError)):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        if _status(e) in _TRANSIENT_STATUS:
            return True
    return False


def _status(e: BaseException) -> int | None:
    """The HTTP status an exception carries (gcsfs's ``code``, aiohttp's ``status``, botocore's ``response``), if any."""
    status = getattr(e, "code", None) or getattr(e, "status", None)
    response = getattr(e, "response", None)
    if status is None and isinstance(response, dict) and isinstance(response.get("ResponseMetadata"), dict):
        status = response["ResponseMetadata"].get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def already_exists(exc: BaseException) -> bool:
    """Whether ``exc`` says that a file created exclusively was there already (``FileExistsError``, which s3fs raises
    for S3's 412 to ``If-None-Match: *`` and gcsfs for GCS's 412 to ``ifGenerationMatch=0``; or S3's 409 for a
    concurrent upload of the same name).

    Example:
        >>> already_exists(FileExistsError("step/a.bin")), already_exists(FileNotFoundError("step/a.bin"))
        (True, False)
    """
    for e in _chain(exc):
        response = getattr(e, "response", None)
        code = (response.get("Error") or {}).get("Code") if isinstance(response, dict) else None
        if isinstance(e, FileExistsError) or code == _CONFLICT:
            return True
    return False


def _denied(exc: BaseException) -> bool:
    """A permission error, as Python, an HTTP status (401, 403) or gcsfs's ``OSError("Forbidden: ...")`` says it."""
    return any(isinstance(e, PermissionError) or _status(e) in _DENIED_STATUS
               or (type(e) is OSError and str(e).startswith("Forbidden")) for e in _chain(exc))


_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "oci", "hdfs", "webhdfs"})
"""The protocols a URL missing its colon (``s3//bucket/run``) is taken for."""


def missing_slash(url: str) -> str | None:
    """What ``url`` was meant to be if it is a URL of a known fsspec protocol missing a slash (``gs:/bucket/run``,
    ``s3:bucket/run``): fsspec reads those as local paths (``./gs:/bucket/run``); else None.

    Example:
        >>> missing_slash("gs:/bucket/run"), missing_slash("gs://bucket/run"), missing_slash("file:/tmp/run")
        ('gs://bucket/run', None, None)
        >>> missing_slash("simplecache::gs://bucket/run"), missing_slash("simplecache::gs:/bucket/run")
        (None, None)
        >>> missing_slash("s3//bucket/run"), missing_slash("./s3//bucket/run")   # the colon left out
        ('s3://bucket/run', None)
    """
    scheme, colon, rest = url.partition(":")
    if not colon:  # "s3//bucket": only the object stores' names (a local "data//run" is a folder named data)
        scheme, slashes, rest = url.partition("//")
        return f"{scheme}://{rest}" if slashes and scheme.lower() in _OBJECT_STORES else None
    if rest.startswith(("//", ":")) or "/" in scheme or scheme.lower() in ("file", "local"):  # "::": chained
        return None
    return f"{scheme}://{rest.lstrip('/')}" if scheme.lower() in fsspec.available_protocols() else None


def refuse_missing_slash(field: str, url: str) -> None:
    """ConfigError if ``url`` is a URL missing a slash (see :func:`missing_slash`), saying what was meant."""
    if (meant := missing_slash(url)) is not None:
        slip, folder = ("a slash", url.partition(":")[0] + ":") if ":" in url else ("its colon", url.partition("/")[0])
        raise ConfigError(f"{field}={url!r} looks like {meant!r} missing {slip}: as written it is a local folder "
                          f"named {folder!r} on this node's own disk. HINT: write {meant!r} (or './{url}' for a local "
                          "folder of that name)")


def refuse_no_path(field: str, url: str) -> None:
    """ConfigError if ``url`` names nothing after its protocol (a variable left empty, say): ``file://`` is the current
    directory, ``gs://`` and ``s3://`` no bucket. ``file:///`` (the root, written out) is a path.

    Example:
        >>> try:
        ...     refuse_no_path("dirpath", "gs://")
        ... except ConfigError as e:
        ...     print(e)
        dirpath='gs://' names no bucket: a variable left empty? HINT: write e.g. 'gs://bucket/run'
    """
    protocol, separator, rest = url.partition("://")
    if separator and protocol in _LOCAL_PROTOCOLS and not rest:
        raise ConfigError(f"{field}={url!r} names no path: as written it is the current directory, {os.getcwd()!r} (a "
                          f"variable left empty?). HINT: write e.g. '{protocol}:///scratch/run' or a path")
    if separator and protocol in _BUCKET_PROTOCOLS and not rest.strip("/"):
        raise ConfigError(f"{field}={url!r} names no bucket: a variable left empty? HINT: write e.g. "
                          f"'{protocol}://bucket/run'")


def make_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve ``url`` to ``(filesystem, root path)``, with errors that say what to fix.

    The filesystem is a new instance, not fsspec's cached one: a transaction on an instance defers every
    file opened on it until the transaction ends, and Lightning's ModelCheckpoint saves inside one on
    the cached local filesystem while our writer thread may be writing a checkpoint.

    Example:
        >>> fs, root = make_filesystem("memory://doc/x")
        >>> root
        '/doc/x'
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"dirpath={url!r}: must be a non-empty local path or fsspec URL such as gs://bucket/run")
    if GLOB_CHARACTERS & set(url):
        raise ConfigError(
            f"dirpath={url!r} contains one of {''.join(sorted(GLOB_CHARACTERS))}, which fsspec expands as a pattern on "
            "some stores (a delete in 'runs/sweep[1]' would also match 'runs/sweep1'). HINT: use a name without them, "
            "e.g. 'runs/sweep-1'")
    refuse_missing_slash("dirpath", url)
    refuse_no_path("dirpath", url)
    options = single_attempt_options(url.split("://", 1)[0] if "://" in url else "file", storage_options or {})
    try:
        fs, root = url_to_fs(os.path.expanduser(url), **{**options, "skip_instance_cache": True})
    except ImportError as e:
        proto = url.split("://", 1)[0]
        extra = _EXTRAS.get(proto, "all")
        raise ConfigError(
            f"dirpath={url!r}: the driver for {proto}:// is not installed ({e}). "
            f"HINT: pip install 'ft-checkpoint[{extra}]'"
        ) from e
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"dirpath={url!r} with storage_options={sorted(storage_options or {})}: {e}. "
            "HINT: use a local path or a URL of an installed fsspec protocol (file://, memory://, gs://, s3://), "
            "and only options that filesystem accepts"
        ) from e
    except OSError as e:  # a filesystem that connects or opens a file as it is made (ftp://, zip://...)
        raise storage_error(f"open {url}", e) from e
    if type(fs) is MemoryFileSystem:  # one dict for all threads: see memory_fs
        fs = LockedMemoryFileSystem(**{**(storage_options or {}), "skip_instance_cache": True})
    single_attempt(fs)
    return fs, root


def storage_error(where: str, e: Exception, *, tried: str = "1 attempt") -> Exception:
    """``e``, a failure to ``where`` (``"list gs://b/run"``), as the StorageError that says what to check: the store
    cannot be reached, not found, permission denied, no space, still failing after ``tried`` (a transient error).

    Example:
        >>> e = storage_error("open ftp://127.0.0.1:1/run", ConnectionRefusedError(111, "Connection refused"))
        >>> str(e).split(". HINT")[0]
        'open ftp://127.0.0.1:1/run: connection refused (ConnectionRefusedError: [Errno 111] Connection refused)'
    """
    if isinstance(e, FTCheckpointError):  # ours already says what happened (corruption is no outage)
        return e
    error = _describe(e)
    cause = unreachable(e)
    if cause == "no credentials":
        return StoragePermissionError(f"{where}: no credentials ({error}). HINT: {_CREDENTIALS_HINT}")
    if cause is not None:
        return StorageError(f"{where}: {cause} ({error}). HINT: check the URL and endpoint_url in the storage "
                            "options, and that the storage service runs and this machine reaches it")
    if already_exists(e):
        return StorageExistsError(f"{where}: already exists ({error}); it was to be created new. HINT: another writer "
                                  "created it: a job that lost this directory (see the lease), or an earlier try")
    if isinstance(e, FileNotFoundError):
        return StorageNotFoundError(f"{where}: not found ({e}). HINT: check the URL, and that the bucket or directory exists")
    if _denied(e):
        return StoragePermissionError(f"{where}: permission denied ({error}). HINT: check the credentials "
                                      "(storage_options or the environment) and that this user may read the location "
                                      "(and, to save, write it)")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return StorageError(f"{where}: no space left on device. HINT: free space or point dirpath elsewhere")
    if is_transient(e):
        return StorageError(f"{where}: still failing after {tried}: {error}. "
                            "HINT: the storage service may be down or unreachable")
    return StorageError(f"{where}: {error}")


_CREDENTIALS_HINT = ("give them in the storage options (FT_CHECKPOINT_STORAGE_OPTIONS, a JSON object, or storage_options: "
                     "key and secret for S3, token for GCS) or in the environment (AWS_ACCESS_KEY_ID and "
                     "AWS_SECRET_ACCESS_KEY, or GOOGLE_APPLICATION_CREDENTIALS)")


class StoredChecksumMismatch(ConnectionError):
    """The store's own checksum of an object differs from ours: the bytes changed on the way (retried)."""


class _CountingWriter:
    """A write-only file that passes everything to ``f``, counting the bytes and their CRC-32C."""

    def __init__(self, f: Any) -> None:
        self.f, self.size, self.crc = f, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        _write_all(self.f, view)
        self.size, self.crc = self.size + len(view), crc32c_of(view, self.crc)
        return len(view)

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True


def _write_all(f: Any, view: memoryview) -> None:
    while view:
        n = f.write(view)
        if n is None:  # a buffered fsspec file takes everything
            return
        view = view[n:]


def _display_url(url: str) -> str:
    """``url`` without slashes at its end, but a filesystem's root as written (``file:///``, not ``file:``).

    Example:
        >>> _display_url("gs://b/run/"), _display_url("file:///")
        ('gs://b/run', 'file:///')
    """
    stripped = url.rstrip("/")
    return url if stripped.endswith(":") else stripped


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


class Entry(NamedTuple):
    """One name inside a directory, as :meth:`Storage.entries` lists it."""

    kind: str
    """``file``, ``directory``, or ``other`` (a symbolic link, a device, a socket, ...)."""
    size: int


class Storage:
    """A checkpoint directory on any fsspec filesystem; paths below it are relative ``str``.

    Args:
        url: Local path or fsspec URL of the checkpoint directory.
        storage_options: Passed to the fsspec filesystem (credentials, endpoint_url, ...).
        retries: Attempts for an operation that fails with a transient error (>= 1).
        backoff: Base of the exponential backoff in seconds (with full jitter, capped at 10 s).
        fsync: On local disk, make writes durable (fsync) before they count as done. False for a tier that
            must survive a process crash, not a machine's (the fast tier): the page cache keeps the bytes.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, retries: int = 5,
                 backoff: float = 0.2, fsync: bool = True) -> None:
        self.url = _display_url(url) if "://" in url else os.path.abspath(os.path.expanduser(url))
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = make_filesystem(url, self.storage_options)
        self.root = self.root.rstrip("/") or "/"
        self.retries = retries
        self.backoff = backoff
        self.fsync = fsync
        protocols = _protocols(self.fs)
        self.is_local = bool(protocols & _LOCAL_PROTOCOLS)
        self._stores_crc32c = bool(protocols & {"gs", "gcs"})  # GCS keeps a CRC-32C of every object
        self.exclusive_creates = self.is_local or bool(protocols & {"s3", "s3a", "gs", "gcs"})
        """Whether a write with ``exclusive=True`` is refused over a file that exists (local disk: ``O_EXCL``, but
        an atomic write is renamed over its name; S3's ``If-None-Match: *``, which s3fs sends on a one-request upload and on the
        completion of a multipart one; GCS's ``ifGenerationMatch=0``, which gcsfs sends on a one-request upload and
        on the start of a resumable one, whose completion GCS then refuses). Elsewhere such a write replaces what is
        there, as any write does."""
        self._bucketed = bool(protocols & _BUCKET_PROTOCOLS)
        self._has_directories = self.is_local or isinstance(self.fs, LocalFileSystem) or bool(
            protocols & _DIRECTORY_PROTOCOLS)  # a LocalFileSystem under another name: faulty:// (tests)
        # Plain read-ahead for streamed reads: gcsfs 2026.10's default "adaptive" background
        # prefetcher was seen to hang on repeated reads of the same object.
        self.read_options: dict[str, Any] = {} if self.is_local else {"cache_type": "readahead"}
        self._buffers = BufferPool()  # GCS: where a small file's views are joined (see _put_views)
        self._down = False  # see down
        self._best_effort = threading.local()  # see best_effort

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # -- paths ---------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (relative to the root)."""
        return posixpath.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str = "") -> str:
        """The URL of ``rel``, as a user would type it (for messages and for DCP)."""
        return f"{self.url}/{rel}" if rel else self.url

    # -- retries and error translation ---------------------------------------------------------
    def retrying(self, what: str, where: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, retried on transient errors up to ``retries`` attempts and within
        :data:`RETRY_WINDOW` seconds, with one warning at the first retry (the last error is raised as it is)."""
        return self._run(self._retrier(what, where), fn, *args, **kwargs)

    def _run(self, retrier: tenacity.Retrying, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``retrier(fn, *args, **kwargs)``, noting from how it ended whether the store looks :attr:`down`."""
        try:
            out = retrier(fn, *args, **kwargs)
        except Exception as e:
            self._down = self._down or is_transient(e)
            raise
        self._down = False
        return out

    @property
    def down(self) -> bool:
        """Whether the store looks down: a call ended on a transient error (after its retries) and none has
        succeeded since."""
        return self._down

    @contextlib.contextmanager
    def best_effort(self) -> Iterator[None]:
        """Calls made inside (on this thread) that a job can lose without harm (a journal note, the lease's
        release): while the store is :attr:`down`, one attempt each instead of a retry window, so that a job whose
        storage hangs ends after one window, not one per such write.

        Example:
            >>> s = Storage("memory://doc/best-effort")
            >>> with s.best_effort():
            ...     s.write_bytes("journal/note.json", b"{}")
            >>> s.down
            False
        """
        self._best_effort.once = self.down
        try:
            yield
        finally:
            self._best_effort.once = False

    def _retrier(self, what: str, where: str) -> tenacity.Retrying:
        def warn_once(rs: tenacity.RetryCallState) -> None:
            if rs.attempt_number == 1:
                e = rs.outcome.exception() if rs.outcome else None
                log.warning("%s %s failed (%s); retrying, up to %s within %s", what, where,
                            e if e is None or str(e) else _describe(e), plural(self.retries, "attempt"),
                            human_seconds(RETRY_WINDOW))

        attempts = 1 if getattr(self._best_effort, "once", False) else max(1, self.retries)
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_attempt(attempts) | tenacity.stop_before_delay(RETRY_WINDOW),
            wait=tenacity.wait_random_exponential(multiplier=self.backoff, max=10),
            before_sleep=warn_once,
            reraise=True,
        )

    def call(self, what: str, rel: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` retried on transient errors; a final error as a StorageError naming ``rel``."""
        return self._call(what, rel, fn, *args, **kwargs)

    def _call(self, what: str, rel: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        retrier, start = self._retrier(what, self.url_of(rel)), time.monotonic()
        try:
            return self._run(retrier, fn, *args, **kwargs)
        except Exception as e:
            attempts = retrier.statistics.get("attempt_number", 1)
            tried = f"{plural(attempts, 'attempt')} in {human_seconds(time.monotonic() - start)}"
            raise storage_error(f"{what} {self.url_of(rel)}", e, tried=tried) from e

    # -- primitives ----------------------------------------------------------------------------
    def ensure_root(self) -> None:
        """Create the directory (local) or check that its bucket exists (object stores)."""
        if self.is_local:
            self._call("create directory", "", self.fs.makedirs, self.root, exist_ok=True)
        elif self._bucketed:
            bucket = self.root.lstrip("/").split("/", 1)[0]
            try:  # not exists(): s3fs answers False for a bucket it cannot reach at all
                self._call("check bucket of", "", self.fs.info, bucket)
            except StorageNotFoundError:
                raise StorageNotFoundError(
                    f"bucket {bucket!r} of {self.url} does not exist. HINT: create it first, or fix the URL") from None

    def write_bytes(self, rel: str, data: bytes, *, atomic: bool = True, made: DirectoryId | None = None,
                    exclusive: bool = False) -> None:
        """Write one object whole, durably. On local disk atomically (tmp + fsync + rename + directory fsync);
        with ``atomic=False`` in place (one fsync): for a file inside a step, which no reader sees before the
        step's manifest (written atomically, after it) makes the step and its directory entries durable.
        Never through a link (see :meth:`open_write`); ``made`` (with ``atomic``): what :meth:`make_directory`
        returned for the directory of ``rel`` (CheckpointCorruptError, nothing written, if that name refers to
        another directory now). On an object store the store's CRC-32C of our upload is compared with ours (see
        :meth:`_check_stored`). ``exclusive``: StorageExistsError, nothing written, if ``rel`` exists already, where
        the store can tell (:attr:`exclusive_creates`)."""
        if not self.is_local:
            self._call("write", rel, self._put, rel, data, exclusive)
        elif atomic:
            self._call("write", rel, nofollow.replace_file, self.root, rel, data, url=self.url_of(rel),
                       fsync=self.fsync, made=made)  # renamed, even ``exclusive``: see create_new
        else:
            self.write_views(rel, [memoryview(data)], exclusive=exclusive)

    def create_new(self, rel: str, data: bytes) -> None:
        """Write ``data`` as the new file ``rel``, whole: StorageExistsError, nothing written, if ``rel`` exists
        already (of two writers at the same moment, one wins), where the store can tell: local disk (the complete
        file hard-linked to its name), S3 (``If-None-Match: *``) and GCS (``ifGenerationMatch=0``); elsewhere a plain
        write.

        Example:
            >>> s = Storage("memory://doc/create-new")
            >>> s.create_new("lease.json", b"{}"); s.read_bytes("lease.json")
            b'{}'
        """
        if self.is_local:  # a hard link, then the temporary name unlinked: a moment with both names (a step's
            # file must not have one: a listing then would see an unlisted file; the step's files are created in
            # place, its manifest is renamed into the directory this save made)
            self._call("write", rel, nofollow.replace_file, self.root, rel, data, url=self.url_of(rel),
                       fsync=self.fsync, exclusive=True)
        else:
            self.write_bytes(rel, data, exclusive=True)

    def _put(self, rel: str, data: bytes, exclusive: bool = False) -> None:
        response = self.fs.pipe_file(self.path(rel), data, **self._create(exclusive))
        self._check_stored(rel, len(data), crc32c_of(data), response)

    def _create(self, exclusive: bool) -> dict[str, str]:
        """The ``pipe_file`` option of an exclusive write (see :attr:`exclusive_creates`)."""
        return {"mode": "create"} if exclusive and self.exclusive_creates else {}

    def _check_stored(self, rel: str, size: int, crc: int, response: Any = None) -> None:
        """Where the store keeps its own CRC-32C of an object (GCS), compare it with ours: end-to-end integrity of
        what was stored, without reading it back. A mismatch is retried as a transient error (the whole object
        is written again). The CRC comes from the upload's own ``response`` where it carries one (gcsfs returns
        the object's resource for a one-request upload: no extra request, and no other writer's object seen
        in between); otherwise from the object's metadata, while it is still our upload's ``generation`` where
        the response names one: an object another writer put in its place since (a lease taken over) is not
        ours to compare, nor to write over again. A response that says nothing (gcsfs's resumable upload of a
        large file) leaves the metadata as it is, which only we write (shard files)."""
        if not self._stores_crc32c:
            return
        upload = response if isinstance(response, dict) else {}
        stored = upload.get("crc32c")
        if stored is None:
            path = self.path(rel)
            self.fs.invalidate_cache(path)
            info = self.fs.info(path)
            if upload.get("generation") not in (None, info.get("generation")):
                return
            stored = info.get("crc32c")
        if stored is None:
            return
        ours = base64.b64encode(struct.pack(">I", crc)).decode()
        if stored != ours:
            raise StoredChecksumMismatch(f"{self.url_of(rel)}: the store's CRC-32C of the object ({stored}) is not "
                                         f"that of the {size} bytes written ({ours}): corrupted on the way")

    def make_directory(self, rel: str) -> DirectoryId | None:
        """Make the directory ``rel``, which must not exist (a step just cleared), and return its identity for
        :meth:`write_bytes`; on local disk never through a link, and CheckpointCorruptError if anything took
        its name first (a link planted again). Object stores have no directories: None.

        Example:
            >>> print(Storage("memory://doc/mkdir").make_directory("step_000000000001"))
            None
        """
        if not self.is_local:
            return None
        return self._call("create directory", rel, nofollow.make_directory, self.root, rel, url=self.url_of(rel))

    @contextlib.contextmanager
    def open_write(self, rel: str, *, direct: bool = False, exclusive: bool = False) -> Iterator[Any]:
        """A file to write ``rel`` into, created or truncated (not retried: retry the whole file). On local
        disk an unbuffered file (each ``write`` goes straight to the OS, releasing the GIL), fsynced on close;
        with ``direct``, opened with ``O_DIRECT`` where the filesystem allows it: the bytes go from the
        caller's memory to the disk without a copy into the page cache (every write must then be aligned
        to :data:`DIRECT_ALIGN` in address, length and file offset). On local disk never through a link: the
        directories on the way are opened without following one (CheckpointCorruptError if one is a link),
        and the file is created afresh (a link or a hard link in its place is removed itself, never its target).
        ``exclusive``: see :meth:`write_bytes` (raised as the file is closed; an empty file is not checked)."""
        if not self.is_local:
            mode = "xb" if exclusive and self.exclusive_creates else "wb"
            with self.fs.open(self.path(rel), mode, block_size=PART_SIZE) as f:
                yield f
            return
        with open(nofollow.create_file(self.root, rel, url=self.url_of(rel), direct=direct, exclusive=exclusive), "wb",
                  buffering=0) as f:
            yield f
            if self.fsync:
                os.fsync(f.fileno())

    def write_views(self, rel: str, views: list[memoryview], *, lengths: list[int] | None = None,
                    direct: bool = False, exclusive: bool = False) -> list[int]:
        """Write the buffers ``views``, in order, as the file ``rel`` (fsynced on local disk); returns each
        buffer's CRC-32C (of its first ``lengths[i]`` bytes, if given: the rest is padding), computed over
        the same memory as it is written (no read-back). ``direct``: see :meth:`open_write`; ``exclusive``: see
        :meth:`write_bytes`. The whole file is rewritten on a transient error.

        Example:
            >>> s = Storage("memory://doc/views")
            >>> s.write_views("f.bin", [memoryview(b"ab"), memoryview(b"c")]) == [crc32c_of(b"ab"), crc32c_of(b"c")]
            True
        """
        return self._call("write", rel, self._write_views_once, rel, views, lengths, direct, exclusive)

    def _write_views_once(self, rel: str, views: list[memoryview], lengths: list[int] | None,
                          direct: bool, exclusive: bool) -> list[int]:
        if not self.is_local and sum(len(v) for v in views) <= SINGLE_PUT_MAX:
            return self._put_views(rel, views, lengths, exclusive)
        with self.open_write(rel, direct=direct, exclusive=exclusive) as f:
            crcs = crcs_while_writing(views, lengths or [len(v) for v in views], lambda piece: _write_all(f, piece),
                                      IO_SLICE)
        self._check_unpadded(rel, views, lengths, crcs)
        return crcs

    def _put_views(self, rel: str, views: list[memoryview], lengths: list[int] | None,
                   exclusive: bool = False) -> list[int]:
        """One object from the views: joined in a reused buffer for GCS (gcsfs sends a ``bytearray`` as it is),
        into ``bytes`` elsewhere (s3fs took 0.35 s longer to put 200 MB from a ``bytearray``, measured here)."""
        used = lengths or [len(v) for v in views]
        if self._stores_crc32c:
            with self._buffers.joined(views, used) as (data, crcs):
                response = self.fs.pipe_file(self.path(rel), data, **self._create(exclusive))
        else:
            crcs = [crc32c_of(v[:n]) for v, n in zip(views, used)]
            response = self.fs.pipe_file(self.path(rel), b"".join(views), **self._create(exclusive))
        self._check_unpadded(rel, views, lengths, crcs, response)
        return crcs

    def _check_unpadded(self, rel: str, views: list[memoryview], lengths: list[int] | None, crcs: list[int],
                        response: Any = None) -> None:
        """On an object store, :meth:`_check_stored` for views written without padding (local disk pads for
        ``O_DIRECT``: its file's CRC is not the views' and no store reports one)."""
        sizes = [len(v) for v in views]
        if not self.is_local and (lengths is None or lengths == sizes):
            self._check_stored(rel, sum(sizes), combine_all(crcs, sizes), response)

    def write_stream(self, rel: str, produce: Callable[[Any], None], *, exclusive: bool = False) -> tuple[int, int]:
        """Write the file ``rel`` with ``produce(f)`` (which writes into ``f``, e.g. ``torch.save(obj, f)``),
        fsynced on local disk; returns ``(size, CRC-32C)``, computed over the bytes as they are written.
        ``exclusive``: see :meth:`open_write`. The whole file is produced again on a transient error.

        Example:
            >>> Storage("memory://doc/stream").write_stream("f.bin", lambda f: f.write(b"abc")) == (3, crc32c_of(b"abc"))
            True
        """
        def once() -> tuple[int, int]:
            with self.open_write(rel, exclusive=exclusive) as f:
                counted = _CountingWriter(f)
                produce(counted)
            if not self.is_local:
                self._check_stored(rel, counted.size, counted.crc)
            return counted.size, counted.crc

        return self._call("write", rel, once)

    @contextlib.contextmanager
    def open_read(self, rel: str, *, size: int | None = None) -> Iterator[Any]:
        """A seekable file to read ``rel`` from, with ``readinto``: unbuffered (on an object store each read
        is one ranged get, with no read-ahead: read large ranges, see ``shards.ShardReader``). On local disk
        only a regular file, never through a link, and never waiting, and with ``size`` one of that size and
        not sparse (:meth:`read_bytes`)."""
        if self.is_local:
            with self._local_file(rel, size) as f:
                yield f
        else:
            with self.fs.open(self.path(rel), "rb", cache_type="none") as f:
                yield f

    def open_to_rewrite(self, rel: str) -> int:
        """Local disk: a descriptor of the file ``rel`` open to be written in place (``pwrite``), the caller's to
        close; CheckpointCorruptError, at once, unless it is a regular file with no other name, reached without a
        link (see ``nofollow.open_regular_file``).

        Example:
            >>> import tempfile
            >>> s = Storage(tempfile.mkdtemp()); s.write_bytes("note.json", b"{}   ")
            >>> fd = s.open_to_rewrite("note.json"); os.pwrite(fd, b"[]", 0); os.close(fd); s.read_bytes("note.json")
            2
            b'[]   '
        """
        return nofollow.open_regular_file(self.root, rel, url=self.url_of(rel), rewrite=True)

    def _local_file(self, rel: str, size: int | None) -> Any:
        """``rel`` on local disk, unbuffered, as :meth:`read_bytes` opens it (``size``: see there)."""
        fd = nofollow.open_regular_file(self.root, rel, url=self.url_of(rel))
        if size is not None:
            try:
                refuse_changed_or_sparse(os.fstat(fd), size, self.url_of(rel))
            except BaseException:
                os.close(fd)
                raise
        return open(fd, "rb", buffering=0)

    def sync_dir(self, rel: str) -> None:
        """Make the directory entries in ``rel`` durable (local disk, opened without following a link nor waiting on
        a FIFO in its place; a no-op elsewhere)."""
        if self.is_local and self.fsync:
            with nofollow.open_directory(self.root, rel, url=self.url_of(rel)) as fd:
                os.fsync(fd)

    def read_bytes(self, rel: str, *, size: int | None = None) -> bytes:
        """Read one whole object. On local disk only a regular file: opened without following a link (nor one on
        its way) and without waiting, checked with ``fstat`` (CheckpointCorruptError, at once, for a link, a FIFO,
        a device or a directory, even one swapped in since a listing), then read from that descriptor. ``size``:
        the size a step's manifest lists for it; on local disk the file opened must have it and not be sparse
        (:func:`refuse_changed_or_sparse`), else CheckpointCorruptError before a byte is read; elsewhere one ranged
        read of at most a byte more, and CheckpointCorruptError unless it has that size.

        Example:
            >>> s = Storage("memory://doc/read"); s.write_bytes("a.bin", b"abc")
            >>> s.read_bytes("a.bin", size=3)
            b'abc'
        """
        if self.is_local:
            return self._call("read", rel, self._read_local, rel, size)
        if not size:  # unknown, or 0 (a range of an empty object is refused by some stores)
            data = self._call("read", rel, self.fs.cat_file, self.path(rel))
            if size is None:
                return data
        else:
            data = self._call("read", rel, self.fs.cat_file, self.path(rel), start=0, end=size + 1)  # never more
        if len(data) != size:
            raise size_changed(self.url_of(rel), f"more than {size}" if len(data) > size else str(len(data)), size)
        return data

    def _read_local(self, rel: str, size: int | None) -> bytes:
        with self._local_file(rel, size) as f:
            return f.readall()

    def read_control(self, rel: str, *, max_bytes: int) -> bytes:
        """Read a small control file (a manifest, the lease, a journal event) that anyone who can write the
        directory may have replaced: CheckpointCorruptError, at once, unless it is a regular file of at most
        ``max_bytes``. On local disk it is opened without following a symbolic link (nor one on its way: a step
        directory swapped for one since a listing) and without waiting (a FIFO never blocks), checked with
        ``fstat`` and read to at most ``max_bytes + 1`` bytes (neither ``/dev/zero`` nor a sparse file of a
        terabyte is read whole); elsewhere one ranged read of as much.

        Example:
            >>> s = Storage("memory://doc/control")
            >>> s.write_bytes("lease.json", b"x" * 100)
            >>> try:
            ...     s.read_control("lease.json", max_bytes=10)
            ... except ValueError as e:  # a CheckpointCorruptError
            ...     print(e)
            memory://doc/control/lease.json: larger than the 10 bytes a file of its kind may have; refusing to read it
        """
        if self.is_local:
            data = self._call("read", rel, nofollow.read_regular_file, self.root, rel, max_bytes=max_bytes,
                              url=self.url_of(rel))
        else:
            data = self._call("read", rel, self.fs.cat_file, self.path(rel), start=0, end=max_bytes + 1)
        if len(data) > max_bytes:
            raise nofollow.too_large(self.url_of(rel), max_bytes)
        return data

    def read_control_once(self, rel: str, parse: Callable[[bytes], T], *, max_bytes: int, parsed: dict[Any, T]) -> T:
        """``parse(read_control(rel))``, except that a file parsed already under another name is neither read nor
        parsed again: ``parsed`` keeps what ``parse`` returned for each file. Only local disk has several names
        for one file (hard links: the same device and inode, told by ``fstat`` of the file opened), so a file
        hard-linked a thousand times costs one parse; elsewhere every name is read.

        Example:
            >>> import os, tempfile
            >>> s = Storage(tempfile.mkdtemp())
            >>> s.write_bytes("a.json", b"{}")
            >>> os.link(s.path("a.json"), s.path("b.json"))
            >>> calls, parsed = [], {}
            >>> [s.read_control_once(n, calls.append, max_bytes=10, parsed=parsed) for n in ("a.json", "b.json")], calls
            ([None, None], [b'{}'])
        """
        if not self.is_local:
            return parse(self.read_control(rel, max_bytes=max_bytes))
        identity, data = self._call("read", rel, nofollow.read_regular_file_unless, self.root, rel, parsed,
                                    max_bytes=max_bytes, url=self.url_of(rel))
        if data is not None:
            if len(data) > max_bytes:
                raise nofollow.too_large(self.url_of(rel), max_bytes)
            parsed[identity] = parse(data)
        return parsed[identity]

    def iter_chunks(self, rel: str, chunk_size: int = 8 << 20, *, size: int | None = None) -> Iterator[bytes]:
        """Stream an object in chunks (for checksums of large shards without holding them in memory); on local
        disk only a regular file, and with ``size`` one of that size and not sparse (see :meth:`read_bytes`)."""
        if self.is_local:
            f = self._call("open", rel, self._local_file, rel, size)
        else:
            f = self._call("open", rel, self.fs.open, self.path(rel), "rb", **self.read_options)
        with f:
            while chunk := self._call("read", rel, f.read, chunk_size):
                yield chunk

    def sizes(self, rel: str = "") -> dict[str, int]:
        """``{name: size}`` of the files directly inside ``rel`` ({} when it does not exist)."""
        return {name: e.size for name, e in self.entries(rel).items() if e.kind == "file"}

    def listdir(self, rel: str = "") -> list[str]:
        """Sorted names (files and directories) directly inside ``rel`` ([] when it does not exist)."""
        return sorted(self.entries(rel))

    def entries(self, rel: str = "") -> dict[str, Entry]:
        """What is directly inside ``rel``, by name: kind (``file``, ``directory`` or ``other``: a symbolic
        link, a device, ...) and size ({} when it does not exist). Symbolic links are never followed."""
        out = {}
        for e in self._ls(rel):
            kind = e.get("type")
            if e.get("islink") or kind not in ("file", "directory"):
                kind = "other"
            out[posixpath.basename(e["name"].rstrip("/"))] = Entry(kind, int(e.get("size") or 0))
        return out

    def _ls(self, rel: str) -> list[dict[str, Any]]:
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        try:
            return self._call("list", rel, self.fs.ls, path, detail=True)
        except StorageNotFoundError:
            return []

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists (file or directory)."""
        self.fs.invalidate_cache(self.path(rel))
        return self._call("check", rel, self.fs.exists, self.path(rel))

    def delete_file(self, rel: str) -> None:
        """Delete one file (or object), literally: its name is never expanded as a glob pattern, a symbolic
        link is removed itself, never what it points to. Deleting nothing is not an error."""
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        try:
            self._call("delete", rel, self.fs.rm_file, path)
        except StorageNotFoundError:
            pass

    def rename(self, rel: str, new_rel: str) -> None:
        """Rename ``rel`` (a file, or on local disk a directory) to ``new_rel``; a symbolic link is renamed itself.
        On local disk atomically, and never through a link: the directories of both names are opened without
        following one (CheckpointCorruptError if one is a link, e.g. swapped in after a listing). Elsewhere a
        copy, then a delete.

        Example:
            >>> s = Storage("memory://doc/rename")
            >>> s.write_bytes("a.json", b"{}"); s.rename("a.json", "b.json"); s.listdir("")
            ['b.json']
        """
        if self.is_local:
            self._call("rename", rel, nofollow.rename, self.root, rel, new_rel, url=self.url_of(rel))
        else:
            self._call("rename", rel, self.fs.mv, self.path(rel), self.path(new_rel))

    def delete_directory(self, rel: str, *, first: str | None = None, unlink_link: bool = False) -> bool:
        """Delete the directory ``rel``: the file ``first`` (if given) before the others, then every other name
        its own listing holds, one by one, then the directory itself; a subdirectory is left in place (with a
        warning), and so is ``rel``. Returns whether ``rel`` is gone.

        Never through a symbolic link, even one swapped in after the caller listed ``rel``: on local disk the
        directory is opened without following a link (a link or anything but a directory in its place is left
        alone, with a warning), and each name is listed, unlinked and the directory removed relative to that
        open directory, so a link inside it is removed itself, never its target. ``unlink_link``: a link in place
        of ``rel`` itself is removed (never its target), for a writer about to create ``rel``.

        Example:
            >>> s = Storage("memory://doc/delete-dir")
            >>> s.write_bytes("step/manifest.json", b"{}"); s.write_bytes("step/a.bin", b"1")
            >>> s.delete_directory("step", first="manifest.json"), s.listdir("")
            (True, [])
        """
        if self.is_local:
            return self._call("delete", rel, nofollow.delete_directory, self.root, rel, first=first, url_of=self.url_of,
                              unlink_link=unlink_link)
        names = sorted(self.entries(rel).items(), key=lambda item: item[0] != first)
        for name, entry in names:
            if entry.kind == "directory":
                log.warning("left %s in place: only files are deleted", self.url_of(f"{rel}/{name}"))
                continue
            self.delete_file(f"{rel}/{name}")
        self.delete_empty_dir(rel)
        return not self.exists(rel)

    def delete_empty_dir(self, rel: str) -> None:
        """Remove the directory ``rel`` if it is empty, on a filesystem with real directories (local disk,
        memory, SFTP, HDFS, ...: an emptied step directory left there would count as not cleared, and a save of
        that step be refused at every try). Object stores have none: nothing to do."""
        if not self._has_directories:
            return
        try:
            os.rmdir(self.path(rel)) if self.is_local else self.fs.rmdir(self.path(rel))
        except FileNotFoundError:
            pass
        except (OSError, NotImplementedError) as e:
            log.warning("left %s in place: %s: %s", self.url_of(rel), type(e).__name__, e)
