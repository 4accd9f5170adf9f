"""The engine: stage, write in the background with DCP, commit with a manifest; and load.

A save blocks the caller only while the state is staged: tensors are copied into CPU buffers that are
allocated once and reused by every later save (pinned, with non-blocking copies, for CUDA tensors),
by DCP's own ``DefaultStager``. The write then runs on one background thread:

1. rank 0 clears any leftover directory of this step (manifest first), then all ranks meet;
2. every rank writes its non-tensor state file, then DCP writes the sharded tensors (each rank its
   own files; a replicated tensor once, the work spread over ranks) and ``.metadata``;
3. every rank reads its files back to measure sizes and checksums of what is really stored; rank 0
   gathers them and writes ``manifest.json`` last, in one object: the commit.

One save is in flight at a time: a new save first waits for the previous one (the wait is part of its
measured stall). A background error is kept and re-raised at the next ``save``, ``wait`` or ``close``.

Example:
    >>> import torch
    >>> from ft_checkpoint.storage import Storage, is_transient
    >>> from ft_checkpoint.dist import Groups
    >>> eng = CheckpointEngine(Storage("memory://doc/engine"), Groups())
    >>> stats = eng.save(10, {"w": torch.arange(3.0)})
    >>> eng.wait().step
    10
    >>> eng.load(10, {"w": torch.zeros(3)})[0]["w"]
    tensor([0., 1., 2.])
    >>> eng.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import logging
import pickle
import platform
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _DCPFsspecAdapter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ft_checkpoint import layout
from ft_checkpoint.dist import Groups
from ft_checkpoint.errors import CheckpointCorruptError, SaveError, StorageError
from ft_checkpoint.retention import delete_step
from ft_checkpoint.state import merge_tree, split_tree
from ft_checkpoint.storage import Storage, is_transient

T = TypeVar("T")
log = logging.getLogger(__name__)
# DCP warns on every single-process save and load; single process is a normal case here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclasses.dataclass
class SaveStats:
    """What one save cost. ``stall`` is what the training waited; the rest happened in the background."""

    step: int
    stall: float
    """Seconds the caller was blocked: waiting for the previous save plus staging."""
    waited: float
    """Part of ``stall`` spent waiting for the previous save to commit."""
    started: float = dataclasses.field(default_factory=time.time)
    duration: float | None = None
    """Seconds from the start of the save until its manifest was written."""
    bytes: int | None = None
    committed: bool = False


class _TransientSaveError(SaveError):
    """A save failed on some rank with a transient storage error: worth retrying whole."""


def _dcp_failures(e: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's CheckpointException (values are ``(exception, trace)``)."""
    if not isinstance(e, CheckpointException):
        return []
    return [v[0] if isinstance(v, tuple) else v for v in e.failures.values()]


def _transient(e: BaseException) -> bool:
    if isinstance(e, _TransientSaveError):
        return True
    if isinstance(e, CheckpointException):
        return any(isinstance(x, BaseException) and is_transient(x) for x in _dcp_failures(e))
    return is_transient(e)


def _describe_dcp(e: BaseException) -> str:
    """One line per failed rank instead of DCP's multi-line tracebacks."""
    if not isinstance(e, CheckpointException):
        return f"{type(e).__name__}: {e}"
    return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in zip(e.failures, _dcp_failures(e)))


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` but refuses every class that is not checkpoint metadata.

    DCP reads ``.metadata`` with plain ``pickle.load``; a replaced file could run code. Nothing in
    torch offers a restricted loader for it, so this allowlist is written here.
    """

    _MODULES = {"torch.distributed.checkpoint.metadata"}
    _NAMES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointCorruptError(f".metadata refers to {module}.{name}, which checkpoint metadata never does; refusing to load it")


class _StorageAdapter(_DCPFsspecAdapter):
    """DCP's fsspec adapter on our storage's filesystem instance: each operation retried on transient
    errors, and renaming by copy + delete off local disk.

    DCP makes every open, rename and delete once: without retries here, one transient error among the
    dozens of calls of a save fails the whole save, which the engine then retries whole. DCP writes
    ``.metadata.tmp`` and renames it. On object stores rename is a copy anyway, and gcsfs first tries a
    ``moveTo`` call that some endpoints reject only after a long retry loop; our commit does not rely on
    that rename (the manifest is the commit), so a plain copy + delete is enough.
    """

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.storage = storage
        self.fs = storage.fs

    def _retry(self, what: str, path: Any, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self.storage.retrying(what, os.fspath(path), fn, *args, **kwargs)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        path = os.fspath(path)
        options = self.storage.read_options if "r" in mode else {}
        with self._retry("open", path, self.fs.open, path, mode, **options) as stream:
            try:
                yield stream
            except BaseException:
                if any(ch in mode for ch in "w+a"):  # as DCP's adapter: no partial file left behind
                    with contextlib.suppress(Exception):
                        self.fs.rm(path)
                raise

    def mkdir(self, path: Any) -> None:
        self._retry("create directory", path, self.fs.makedirs, path, exist_ok=True)

    def exists(self, path: Any) -> bool:
        return self._retry("check", path, self.fs.exists, path)

    def rm_file(self, path: Any) -> None:
        self._retry("delete", path, self.fs.rm, path)

    def rename(self, path: Any, new_path: Any) -> None:
        if self.storage.is_local:
            self._retry("rename", path, self.fs.mv, path, new_path)
        else:
            self._retry("copy", path, self.fs.copy, path, new_path)
            self._retry("delete", path, self.fs.rm, path)


def _writer(storage: Storage, url: str) -> FsspecWriter:
    writer = FsspecWriter(url, sync_files=storage.is_local, **storage.storage_options)
    writer.fs = _StorageAdapter(storage)
    return writer


class _SafeReader(FsspecReader):
    """DCP's fsspec reader with ``.metadata`` read by :class:`_SafeUnpickler`."""

    storage: Storage
    step_dir: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        data = self.storage.read_bytes(f"{self.step_dir}/{name}")  # retried on transient errors
        try:
            metadata = _SafeUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
            if isinstance(e, CheckpointCorruptError):
                raise
            raise CheckpointCorruptError(f".metadata cannot be read ({type(e).__name__}: {e})") from e
        if not isinstance(metadata, Metadata):
            raise CheckpointCorruptError(f".metadata holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def _versions() -> dict[str, str]:
    from ft_checkpoint import __version__

    return {"ft_checkpoint": __version__, "torch": torch.__version__, "python": platform.python_version()}


class CheckpointEngine:
    """Asynchronous sharded save with a commit protocol, and verified load, for one directory.

    Args:
        storage: The checkpoint directory.
        groups: Rank, world size and process groups (``Groups()`` for a single process).
    """

    def __init__(self, storage: Storage, groups: Groups) -> None:
        self.storage = storage
        self.groups = groups
        self.retries = storage.retries
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-checkpoint-writer")
        self._future: Future[SaveStats] | None = None
        self.phase_hook: Callable[[str, int], None] | None = None
        """Called as ``hook(phase, step)`` at each phase of a save (for tests, tracing and fault injection)."""

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, tree: dict[str, Any], *, per_rank: dict[str, Any] | None = None,
             manifest_fields: dict[str, Any] | None = None,
             on_start: Callable[[SaveStats], None] | None = None,
             on_commit: Callable[[SaveStats], None] | None = None,
             on_previous_error: Callable[[SaveError], None] | None = None,
             called_at: float | None = None) -> SaveStats:
        """Stage ``tree`` (tensors and plain values) and write it as step ``step``; returns once staged.

        ``per_rank`` is extra state kept in this rank's own file (e.g. RNG states), never deduplicated.
        ``manifest_fields`` (epoch, metadata) go into the manifest. ``on_start`` and ``on_commit`` run
        on the writer thread, before the write and after the commit. ``on_previous_error`` receives
        the previous save's error instead of it being raised. ``called_at`` (a ``time.perf_counter()``
        value) is when the caller's save began, so the stall counts its work too.
        """
        t0 = time.perf_counter() if called_at is None else called_at
        try:
            self._wait_previous()
        except SaveError as e:
            if on_previous_error is None:
                raise
            on_previous_error(e)
        waited = time.perf_counter() - t0
        self.phase("staging", step)
        staged = self._stager.stage({"tree": tree, "per_rank": per_rank or {}})
        stats = SaveStats(step=step, stall=time.perf_counter() - t0, waited=waited)
        self.phase("staged", step)
        job = self._write_job(stats, staged, manifest_fields or {}, on_start, on_commit)
        self._future = self._executor.submit(job)
        if waited > 0.05:
            log.info("save of step %d waited %.2f s for the previous save to commit", step, waited)
        return stats

    def wait(self) -> SaveStats | None:
        """Block until the save in flight committed; re-raise its error. Returns its stats (or None)."""
        return self._wait_previous()

    def close(self) -> None:
        """Drain the save in flight (re-raising its error) and release the writer thread and buffers."""
        try:
            self._wait_previous()
        finally:
            self._executor.shutdown(wait=True)
            self._stager.close()

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still running."""
        return self._future is not None and not self._future.done()

    def _wait_previous(self) -> SaveStats | None:
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            return future.result()
        except Exception as e:
            what = str(e) if isinstance(e, SaveError) else f"{type(e).__name__}: {e}"
            raise SaveError(f"background save to {self.storage.url} failed: {what}") from e

    def phase(self, phase: str, step: int) -> None:
        """Report a phase to :attr:`phase_hook` (staging, staged, writing, data_written, committing,
        committed; the manager adds retention and resuming)."""
        if self.phase_hook is not None:
            self.phase_hook(phase, step)

    def _write_job(self, stats: SaveStats, staged: dict[str, Any], fields: dict[str, Any],
                   on_start: Callable[[SaveStats], None] | None,
                   on_commit: Callable[[SaveStats], None] | None) -> Callable[[], SaveStats]:
        def job() -> SaveStats:
            start = time.perf_counter()
            if on_start is not None:
                on_start(stats)
            manifest = self._write(stats.step, staged, fields)
            stats.duration, stats.bytes, stats.committed = time.perf_counter() - start + stats.stall, manifest, True
            if on_commit is not None:
                on_commit(stats)
            return stats

        return job

    def _write(self, step: int, staged: dict[str, Any], fields: dict[str, Any]) -> int | None:
        """Write and commit one step (writer thread), retrying the whole save on transient errors.

        Every rank takes the same decision: errors are exchanged at each phase (see :meth:`_agree`),
        and DCP reports a failure of any rank to all of them.
        """
        for attempt in range(1, self.retries + 1):
            try:
                return self._write_once(step, staged, fields)
            except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
                if attempt == self.retries or not _transient(e):
                    if isinstance(e, CheckpointException):
                        raise SaveError(f"step {step} not committed: {_describe_dcp(e)}") from e
                    raise
                log.warning("save of step %d failed with a transient error (%s); retrying it whole (%d of %d)",
                            step, _describe_dcp(e), attempt + 1, self.retries)
        raise AssertionError("unreachable")

    def _write_once(self, step: int, staged: dict[str, Any], fields: dict[str, Any]) -> int | None:
        g, rel = self.groups, layout.step_dir(step)
        self._agree(step, lambda: delete_step(self.storage, step) if g.rank == 0 else None)
        self.phase("writing", step)
        tensors, skeleton = split_tree(staged["tree"])
        own = self._agree(step, lambda: self._write_rank_file(rel, skeleton, staged["per_rank"]))
        dcp.save(tensors, storage_writer=_writer(self.storage, self.storage.url_of(rel)),
                 process_group=g.writer, no_dist=not g.distributed)
        self.phase("data_written", step)
        entries = self._agree(step, lambda: self._describe_own_files(rel, own), gather=True)
        if g.rank != 0:
            return None
        files = {name: entry for per_rank in entries for name, entry in per_rank.items()}
        manifest = layout.Manifest(step=step, world_size=g.world_size, files=files,
                                   versions=_versions(), **fields)
        self.phase("committing", step)
        self.storage.write_bytes(f"{rel}/{layout.MANIFEST}", manifest.to_json())
        self.phase("committed", step)
        return manifest.total_bytes

    def _agree(self, step: int, fn: Callable[[], Any], *, gather: bool = False) -> Any:
        """Run ``fn`` on every rank; if it failed anywhere, raise on every rank (no rank is left waiting
        in a collective). Returns ``fn``'s result, or every rank's results with ``gather``."""
        try:
            outcome = (True, fn(), False)
        except Exception as e:
            outcome = (False, f"rank {self.groups.rank}: {type(e).__name__}: {e}", _transient(e))
        outcomes = self.groups.all_gather(outcome, writer=True)
        failures = [msg for ok, msg, _ in outcomes if not ok]
        if failures:
            error = _TransientSaveError if any(t for _, _, t in outcomes) else SaveError
            raise error(f"step {step} not committed: " + "; ".join(failures))
        return [value for _, value, _ in outcomes] if gather else outcome[1]

    def _write_rank_file(self, rel: str, skeleton: Any, per_rank: dict[str, Any]) -> str:
        buf = io.BytesIO()
        torch.save({"skeleton": skeleton, "per_rank": per_rank}, buf)
        data = buf.getvalue()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise SaveError(
                f"the non-tensor part of the state cannot be loaded safely (weights_only): {e}. HINT: keep "
                "only tensors, numbers, strings, lists, tuples and dicts in state (convert other objects)") from e
        name = layout.rank_file(self.groups.rank)
        self.storage.write_bytes(f"{rel}/{name}", data)
        return name

    def _describe_own_files(self, rel: str, rank_file: str) -> dict[str, layout.FileEntry]:
        sizes = self.storage.sizes(rel)
        prefix = f"__{self.groups.rank}_"
        names = [n for n in sizes if n.startswith(prefix) and n.endswith(".distcp")] + [rank_file]
        if self.groups.rank == 0:
            names.append(".metadata")
        return {n: layout.FileEntry(size=sizes[n], checksum=layout.checksum(self.storage.iter_chunks(f"{rel}/{n}")))
                for n in names}

    # -- loading -------------------------------------------------------------------------------
    def open_step(self, step: int) -> tuple[Metadata, dict[str, Any]]:
        """Read the small files of a verified step safely: ``(DCP metadata, this rank's state file)``.

        Raises CheckpointCorruptError before anything is loaded into the training state.
        """
        reader = self._reader(step)
        return reader.read_metadata(), self._read_rank_file(step)

    def load(self, step: int, tree: dict[str, Any],
             opened: tuple[Metadata, dict[str, Any]] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load step ``step``: ``(saved tree, this rank's per_rank state)``. Collective.

        Tensors of ``tree`` (the current state) with the same key, shape and dtype are filled in place
        (DTensors are resharded by DCP); any other saved tensor is read into a new CPU tensor.
        Call only for a step that resume verified; ``opened`` is what :meth:`open_step` returned.
        """
        metadata, payload = opened or self.open_step(step)
        current, _ = split_tree(tree)
        targets: dict[str, torch.Tensor] = {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            have = current.get(key)
            if have is not None and tuple(have.shape) == tuple(md.size) and have.dtype == md.properties.dtype:
                targets[key] = have
            else:
                targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
        for attempt in range(1, self.retries + 1):
            try:
                dcp.load(targets, storage_reader=self._reader(step), process_group=self.groups.writer,
                         no_dist=not self.groups.distributed)
                break
            except CheckpointException as e:  # a BaseException: make it one callers can catch
                if attempt < self.retries and _transient(e):  # every rank sees the same failures
                    log.warning("loading step %d failed with a transient error (%s); retrying", step, _describe_dcp(e))
                    continue
                error = StorageError if _transient(e) else CheckpointCorruptError
                raise error(f"loading step {step} from {self.storage.url} failed: {_describe_dcp(e)}") from e
        return merge_tree(payload["skeleton"], targets), payload["per_rank"]

    def _reader(self, step: int) -> _SafeReader:
        reader = _SafeReader(self.storage.url_of(layout.step_dir(step)), **self.storage.storage_options)
        reader.fs = _StorageAdapter(self.storage)
        reader.storage, reader.step_dir = self.storage, layout.step_dir(step)
        return reader

    def _read_rank_file(self, step: int) -> dict[str, Any]:
        rel = layout.step_dir(step)
        saved = sorted(n for n in self.storage.listdir(rel) if n.startswith("rank_"))
        name = layout.rank_file(self.groups.rank)
        if name not in saved:
            name = layout.rank_file(self.groups.rank % max(1, len(saved)))
            log.warning("step %d was saved by %d ranks; rank %d takes the non-tensor state of %s",
                        step, len(saved), self.groups.rank, name)
        data = self.storage.read_bytes(f"{rel}/{name}")
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise CheckpointCorruptError(f"{self.storage.url_of(rel)}/{name}: cannot be loaded safely ({e})") from e
