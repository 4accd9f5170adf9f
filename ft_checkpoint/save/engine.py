"""The engine: stage, write in the background, commit with a manifest (loading: ``loading``).

A save blocks the caller only while the state is staged: tensors are copied into host buffers that are
allocated once and reused by every later save (pinned, with non-blocking copies, for CUDA tensors; see
``staging``), and the non-tensor state is serialized. The write then runs on one background thread
(the bytes written by it, or by a writer process fed from shared staging memory: ``writer_process``):

1. once every rank joined the save (a barrier of the writer group, with a listener, on several ranks), rank 0
   checks that the job still holds the directory's lease and clears any leftover directory of
   this step; every rank writes its rank file (the non-tensor
   state and its per-rank state) and shares a fingerprint of each tensor: a tensor of the shared state
   that differs across ranks is an error naming it (it would come back as one rank's value everywhere);
2. DCP plans the tensor chunks (a replicated tensor written once, the work spread over ranks) and
   :class:`~ft_checkpoint.format.shards.ShardWriter` writes their raw bytes, CRC-32C computed as they are
   written; the coordinator writes ``metadata.json``;
3. rank 0 checks that the job still holds the directory's lease and writes ``manifest.json`` last, in
   one object: the commit; every rank learns whether it succeeded. No file is read back.

With ``lazy=True`` the copy of parameters and optimizer state is deferred to a thread of its own and the
next optimizer step waits for it (see ``snapshot``): the save blocks only for the rest. A snapshot torn by an
in-place change is abandoned with a warning (never committed), and later saves copy everything at once.

One save is in flight at a time: a new save first waits for the previous one (the wait is part of its
measured stall). A background error is kept and re-raised at the next ``save``, ``wait`` or ``close``.

Example:
    >>> import torch
    >>> from ft_checkpoint.store.storage import Storage
    >>> from ft_checkpoint.run.dist import Groups
    >>> eng = CheckpointEngine(Storage("memory://doc/engine"), Groups())
    >>> stats = eng.save(10, {"w": torch.arange(3.0)})
    >>> eng.wait().step
    10
    >>> sorted(layout.read_manifest(eng.storage, 10).files)
    ['__0_0.distcp', 'metadata.json', 'rank_00000.pt']
    >>> eng.close()
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import platform
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ft_checkpoint.errors import ConfigError, LeaseError, SaveError, StateMismatchError
from ft_checkpoint.format import layout, shards
from ft_checkpoint.format.shards import ThreadSink, set_thread_priority
from ft_checkpoint.format.signing import Signer
from ft_checkpoint.run.dist import Groups
from ft_checkpoint.save import snapshot
from ft_checkpoint.save.staging import Stager
from ft_checkpoint.save.writer_process import ProcessSink, WriterProcess
from ft_checkpoint.state import split_tree
from ft_checkpoint.store import checksum, retry
from ft_checkpoint.store.fence import Fence, write_fenced
from ft_checkpoint.store.nofollow import DirectoryId
from ft_checkpoint.store.storage import Storage

log = logging.getLogger(__name__)
# DCP warns on every single-process save and load; single process is a normal case here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
FINGERPRINT_WHOLE = 1 << 20
"""Tensors up to this many bytes are fingerprinted whole; larger ones by samples (start, end, 8 strides)."""


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
    deferred: int = 0
    """Bytes of parameters and optimizer state whose copy was deferred to the next optimizer step (``lazy``)."""
    step_wait: float = 0.0
    """Seconds the next optimizer step (or save, wait, close) waited for the lazy copy (``lazy_snapshot``)."""
    abandoned: str | None = None
    """Why the save was abandoned without a commit (a torn lazy snapshot), or None."""
    durable: bool = True
    """Whether the save writes the durable tier (False: the fast tier only; then it never counts as committed)."""


class SaveListener(Protocol):
    """What the engine tells its owner about a save, on the writer thread (and the previous save's error)."""

    def on_write_start(self, stats: SaveStats) -> None:
        """Before the write of ``stats.step``."""

    def check_writable(self, stats: SaveStats) -> None:
        """Rank 0, before the step's directory is cleared and again right before the manifest is written;
        raising (e.g. LeaseError: another job took the directory over) leaves the step uncommitted."""

    def writable_confirmed(self, since: float) -> None:
        """Every rank, once rank 0's :meth:`check_writable` before the clear passed: that check came after ``since``
        (``time.monotonic()`` on this rank, taken before a collective that every rank entered before the check), so
        the directory was the job's own at ``since`` or later. Never "now": a rank that stood still (SIGSTOP, a VM
        paused) before it joined the save may have been taken over long after the check."""

    def check_still_writable(self) -> None:
        """Every rank, before each file of the step it writes; raising (LeaseError) stops the write there. A
        process that stood still since the check (SIGSTOP, a VM paused) may find another job writing the step."""

    def confirm_writable(self) -> None:
        """Every rank, when a file of the step it creates is there already (S3), before it deletes that file: read
        the lease now; raising (LeaseError) stops the write there (see ``store.fence``)."""

    def on_commit(self, stats: SaveStats) -> None:
        """After the commit (every rank)."""

    def on_previous_error(self, error: SaveError) -> None:
        """The previous save failed; raise to stop this save, return to go on."""


def versions() -> dict[str, str]:
    """The versions a manifest records: ft-checkpoint, torch, Python."""
    from ft_checkpoint._version import __version__

    return {"ft_checkpoint": __version__, "torch": torch.__version__, "python": platform.python_version()}


def fingerprint(t: torch.Tensor) -> int:
    """A CRC of a (staged, CPU) tensor's bytes: all of them up to :data:`FINGERPRINT_WHOLE`, else samples."""
    view = shards.byte_view(shards._plain(t))
    if len(view) <= FINGERPRINT_WHOLE:
        return checksum.crc32c_of(view)
    window, crc = 4096, checksum.crc32c_of(view[:65536])
    for k in range(1, 9):
        start = len(view) * k // 9
        crc = checksum.crc32c_of(view[start:start + window], crc)
    return checksum.crc32c_of(view[-65536:], crc)


class CheckpointEngine:
    """Asynchronous sharded save with a commit protocol, and verified load, for one directory.

    Args:
        storage: The checkpoint directory.
        groups: Rank, world size and process groups (``Groups()`` for a single process).
        writers: Files (and parallel writers) per rank for the tensor data.
        writer: ``"thread"`` (write in this process) or ``"process"`` (writer processes).
        priority: The writers' nice value (0 to 19).
        signer: Signs each manifest before it is written (see ``signing``); None writes it unsigned.
        lazy: Defer the copy of parameters and optimizer state to the next optimizer step (see ``snapshot``).
    """

    def __init__(self, storage: Storage, groups: Groups, *, writers: int = 1, writer: str = "thread",
                 priority: int = 0, signer: Signer | None = None, lazy: bool = False) -> None:
        self.storage = storage
        self.signer = signer
        self.groups = groups
        self.writers = writers
        self.writer = writer
        self.priority = priority
        self._stager = Stager(shared=writer == "process")
        self._processes: list[WriterProcess] = []
        self._processes_arena: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-checkpoint-writer")
        self._future: Future[SaveStats] | None = None
        self.lazy = lazy
        self._lazy: snapshot.LazyCopy | None = None
        self._copier: ThreadPoolExecutor | None = None
        if lazy:
            snapshot.install()
        self.phase_hook: Callable[[str, int], None] | None = None
        """Called as ``hook(phase, step)`` at each phase of a save (for tests, tracing and fault injection)."""

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, tree: dict[str, Any], *, per_rank: dict[str, Any] | None = None,
             manifest_fields: dict[str, Any] | None = None, listener: SaveListener | None = None,
             called_at: float | None = None,
             files: Mapping[str, FileWriter] | Callable[[], Mapping[str, FileWriter]] | None = None,
             durable: bool = True, tier_write: Callable[[dict[str, Any]], Any] | None = None,
             owned: Mapping[str, Any] | None = None) -> SaveStats:
        """Stage ``tree`` (tensors and plain values) and write it as step ``step``; returns once staged.

        ``per_rank`` is state kept in this rank's own file (RNG states, values that differ by rank), never
        deduplicated across ranks; ``owned`` is more of it, made for this save and referenced nowhere else (the RNG
        states just taken), so kept as it is, without the copy that protects ``per_rank`` from later changes.
        ``manifest_fields`` (epoch, metadata) go into the manifest. ``files``
        are this rank's files of its own (names unique across ranks), each written in the background by
        its writer (``fn(f)`` writes into ``f``; it must use only what was staged before this call), with
        its size and CRC-32C in the manifest like every other file. A callable ``files`` is called (on this
        thread, part of the stall) once the previous save has committed, so that what it stages may reuse
        buffers the previous write read from.
        ``listener`` hears about the write (see :class:`SaveListener`). ``called_at`` (a
        ``time.perf_counter()`` value) is when the caller's save began, so the stall counts its work too.
        ``tier_write(staged)`` writes another tier from the same staged copy (``staged["tensors"]``, the rank file
        ``staged["rank_file"]``), on the writer thread, before the durable write (none if not ``durable``); an error
        it raises is logged, and the durable write goes on.
        """
        t0 = time.perf_counter() if called_at is None else called_at
        try:
            self._wait_previous()
        except SaveError as e:
            if listener is None:
                raise
            listener.on_previous_error(e)
        waited = time.perf_counter() - t0
        self.phase("staging", step)
        tensors, skeleton = split_tree(tree)
        own = files() if callable(files) else files
        defer = snapshot.deferrable(tensors) if self.lazy and not own else set()  # DeepSpeed's files: eager
        copies = self._stager.stage(tensors, defer=defer)
        staged = {"tensors": copies, "rank_file": (_freeze(skeleton, per_rank or {}), dict(owned or {})),
                  "files": dict(own or {})}
        stats = SaveStats(step=step, stall=0.0, waited=waited, durable=durable)
        lazy = self._start_lazy({k: tensors[k] for k in defer}, copies, stats) if defer else None
        stats.stall = time.perf_counter() - t0
        self.phase("staged", step)
        self._future = self._executor.submit(self._write_job(stats, staged, manifest_fields or {}, listener, tier_write,
                                                             lazy))
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
            if self._copier is not None:
                self._copier.shutdown(wait=True)
            self._close_processes()
            self._stager.close()

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still running."""
        return self._future is not None and not self._future.done()

    def _start_lazy(self, sources: dict[str, torch.Tensor], staged: dict[str, torch.Tensor],
                    stats: SaveStats) -> snapshot.LazyCopy:
        """Start copying ``sources`` into their staged slots on the copy thread; the next step settles it."""
        def waited(seconds: float) -> None:
            stats.step_wait = seconds

        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-checkpoint-snapshot")
        self._lazy = lazy = snapshot.LazyCopy(sources, staged, on_wait=waited)
        stats.deferred = sum(t.numel() * t.element_size() for t in sources.values())

        def copy() -> None:
            try:
                self.phase("copying", stats.step)
            finally:  # the copy runs whatever a phase hook does: a step waits for it
                lazy.run()

        self._copier.submit(copy)
        return lazy

    def _settle(self) -> None:
        """Settle this engine's lazy copy, if one is pending (the training thread, before waiting on the writer)."""
        lazy, self._lazy = self._lazy, None
        if lazy is not None:
            lazy.settle()

    def _wait_previous(self) -> SaveStats | None:
        self._settle()
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            return future.result()
        except Exception as e:
            what = str(e) if isinstance(e, SaveError) else f"{type(e).__name__}: {e}"
            raise SaveError(f"background save to {self.storage.url} failed: {what}") from e

    def phase(self, phase: str, step: int) -> None:
        """Report a phase to :attr:`phase_hook` (staging, staged, copying (on the lazy copy's thread), writing,
        data_written, committing, committed; the manager adds retention and resuming)."""
        if self.phase_hook is not None:
            self.phase_hook(phase, step)

    def _write_job(self, stats: SaveStats, staged: dict[str, Any], fields: dict[str, Any],
                   listener: SaveListener | None, tier_write: Callable[[dict[str, Any]], Any] | None,
                   lazy: snapshot.LazyCopy | None) -> Callable[[], SaveStats]:
        def job() -> SaveStats:
            if self.writer == "thread":
                set_thread_priority(self.priority)
            if lazy is not None:  # the durable write starts once copied; only its commit waits for the verdict
                lazy.wait_copied()
                staged["lazy"] = lazy
                if (tier_write is not None or not stats.durable) and self._torn(stats, lazy.verdict()):
                    return stats  # the fast tier commits on its own: it writes only a settled snapshot
            staged["rank_file"] = _serialize(*staged["rank_file"])
            if tier_write is not None:
                self._write_tier(stats, tier_write, staged)
            if not stats.durable:
                return stats
            start = time.perf_counter()
            if listener is not None:
                listener.on_write_start(stats)
            total = self._write(stats, staged, fields, listener)
            if stats.abandoned is not None:
                return stats
            stats.duration, stats.bytes, stats.committed = time.perf_counter() - start + stats.stall, total, True
            if listener is not None:
                listener.on_commit(stats)
            return stats

        return job

    @staticmethod
    def _write_tier(stats: SaveStats, tier_write: Callable[[dict[str, Any]], Any], staged: dict[str, Any]) -> None:
        """Run the other tier's write: whatever it raises is a warning, never the end of the durable write."""
        try:
            tier_write(staged)
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            log.warning("the fast tier's write of step %d failed, so the fast tier keeps its previous step%s: %s",
                        stats.step, " (the durable save of the step goes on)" if stats.durable else "",
                        retry.describe(e))

    def _torn(self, stats: SaveStats, changed: list[str]) -> bool:
        """Whether the lazy snapshot is torn (``changed``: tensors edited in place before their copy was
        settled); then the save is abandoned, never committed, and later saves copy everything at once."""
        if not changed:
            return False
        stats.abandoned = (f"{len(changed)} tensor(s) changed in place between the save and the next optimizer step: "
                           f"{', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}")
        self.lazy = False
        log.warning("step %d abandoned (not committed; the previous committed step stays the resume point): %s. "
                    "Lazy snapshots are off for the rest of this run: every later save copies all tensors before "
                    "it returns. HINT: edit parameters before the save, or set lazy_snapshot=False",
                    stats.step, stats.abandoned)
        return True

    def _write(self, stats: SaveStats, staged: dict[str, Any], fields: dict[str, Any],
               listener: SaveListener | None) -> int | None:
        """Write and commit one step (writer thread), retrying the whole save on transient errors.

        Every rank takes the same decision: errors are exchanged at each phase (see :meth:`_agree`),
        and DCP reports a failure of any rank to all of them.
        """
        try:
            return retry.retrying(self.storage, "save", stats.step)(self._write_once, stats, staged, fields, listener)
        except CheckpointException as e:  # DCP's exception is a BaseException: make it one callers catch
            raise SaveError(f"step {stats.step} not committed: {retry.describe(e)}") from e

    def _write_once(self, stats: SaveStats, staged: dict[str, Any], fields: dict[str, Any],
                    listener: SaveListener | None) -> int | None:
        g, step, rel = self.groups, stats.step, layout.step_dir(stats.step)
        since = time.monotonic()
        if listener is not None and g.distributed:
            g.barrier(writer=True)  # rank 0 checks the lease only once every rank is here: after each rank's `since`
        made = self._agree(step, lambda: self._clear(stats, listener) if g.rank == 0 else None)
        fence = None if listener is None else Fence(self.storage, listener.check_still_writable, listener.confirm_writable)
        if listener is not None:
            listener.writable_confirmed(since)
        self.phase("writing", step)
        tensors = staged["tensors"]
        prints = {k: fingerprint(t) for k, t in tensors.items() if type(t).__name__ != "DTensor"}
        shared = self._agree(step, lambda: (self._write_rank_file(rel, staged["rank_file"], fence), prints,
                                            write_own_files(self.storage, rel, staged["files"], fence)), gather=True)
        _check_replicated([p for _, p, _ in shared])
        own = _unique_files([f for _, _, f in shared])
        writer = shards.ShardWriter(self.storage, rel, rank=g.rank, writers=self.writers, sinks=self._sinks(),
                                    arena=self._stager.arena, fence=fence)
        dcp.save(tensors, storage_writer=writer, process_group=g.writer, no_dist=not g.distributed)
        self.phase("data_written", step)
        lazy = staged.get("lazy")
        if lazy is not None and self._torn(stats, sorted({k for c in self._agree(step, lazy.verdict, gather=True)
                                                          for k in c})):
            return None  # every rank abandons the step: one rank's torn snapshot is the step's
        files = {**writer.files, **{name: entry for (name, entry), _, _ in shared}, **own}
        return self._agree(step, lambda: self._commit(stats, files, fields, listener, made, fence) if g.rank == 0
                           else None, gather=True)[0]

    def _clear(self, stats: SaveStats, listener: SaveListener | None) -> DirectoryId | None:
        """Rank 0: delete what an interrupted save of this step left behind (a link planted in its place: the link,
        never its target) and make the step directory afresh; SaveError if something is left that the save would
        write through. Returns the directory's identity (local disk), which the commit checks."""
        if listener is not None:
            listener.check_writable(stats)
        if not layout.delete_step(self.storage, stats.step, before_write=True):
            raise SaveError(f"{self.storage.url_of(layout.step_dir(stats.step))} could not be cleared before the save "
                            "(see the warning above); nothing was written there")
        return self.storage.make_directory(layout.step_dir(stats.step))

    def _commit(self, stats: SaveStats, files: dict[str, layout.FileEntry], fields: dict[str, Any],
                listener: SaveListener | None, made: DirectoryId | None, fence: Fence | None) -> int:
        """Rank 0: write the manifest, last, in one object, into the step directory that ``_clear`` made (``made``:
        not one swapped in since), through the ``fence``. Every rank learns the outcome (see ``_agree``)."""
        manifest = layout.Manifest(step=stats.step, world_size=self.groups.world_size, files=files,
                                   versions=versions(), **fields)
        if self.signer is not None:
            manifest = self.signer.sign(manifest)
        if listener is not None:
            listener.check_writable(stats)
        self.phase("committing", stats.step)
        rel, data = f"{layout.step_dir(stats.step)}/{layout.MANIFEST}", manifest.to_json()
        write_fenced(fence, rel, lambda exclusive: self.storage.write_bytes(rel, data, made=made, exclusive=exclusive))
        self.phase("committed", stats.step)
        return manifest.total_bytes

    def _agree(self, step: int, fn: Callable[[], Any], *, gather: bool = False) -> Any:
        """Run ``fn`` on every rank; if it failed anywhere, raise on every rank (no rank is left waiting
        in a collective). Returns ``fn``'s result, or every rank's results with ``gather``."""
        try:
            outcome: tuple[bool, Any, Any] = (True, fn(), False)
        except LeaseError as e:  # another job writes here now: every rank stops, whatever on_save_error says
            outcome = (False, f"rank {self.groups.rank}: LeaseError: {e}", "lease")
        except Exception as e:
            outcome = (False, f"rank {self.groups.rank}: {type(e).__name__}: {e}", retry.transient(e))
        outcomes = self.groups.all_gather(outcome, writer=True)
        failures = [msg for ok, msg, _ in outcomes if not ok]
        if failures:
            kinds = [t for _, _, t in outcomes]
            message = f"step {step} not committed: " + "; ".join(failures)
            if "lease" in kinds:
                raise LeaseError(message)
            raise (retry.TransientSaveError if any(kinds) else SaveError)(message)
        return [value for _, value, _ in outcomes] if gather else outcome[1]

    def _sinks(self) -> list[shards.Sink]:
        """Where the shard files are written: this thread, or the writer processes of the current arena
        (started, or restarted after a new staging layout or a death, here on the writer thread)."""
        local = ThreadSink(self.storage, self.priority)
        arena = self._stager.arena
        if self.writer != "process" or arena is None or arena.fd is None:
            return [local]
        if self._processes_arena is not arena or not all(p.alive for p in self._processes):
            self._close_processes()
            self._processes = [WriterProcess(self.storage, arena.fd, arena.nbytes, priority=self.priority)
                               for _ in range(self.writers)]
            self._processes_arena = arena
        return [ProcessSink(p, arena.base, arena.nbytes, local) for p in self._processes]

    def _close_processes(self) -> None:
        for p in self._processes:
            p.close()
        self._processes, self._processes_arena = [], None

    @property
    def writer_pids(self) -> list[int]:
        """The writer processes' pids (``writer="process"``, once a save started them)."""
        return [p.pid for p in self._processes]

    def _write_rank_file(self, rel: str, data: bytes, fence: Fence | None = None) -> tuple[str, layout.FileEntry]:
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise ConfigError(
                f"the non-tensor part of the state cannot be loaded safely (weights_only): {e}. HINT: keep "
                "only tensors, numbers, strings, lists, tuples and dicts in state (convert other objects)") from e
        name = layout.rank_file(self.groups.rank)
        path = f"{rel}/{name}"
        write_fenced(fence, path, lambda exclusive: self.storage.write_bytes(path, data, atomic=False,
                                                                             exclusive=exclusive))
        return name, layout.FileEntry(size=len(data), checksum=layout.checksum([data]))

FileWriter = Callable[[Any], None]
"""Writes one file's bytes into the file object it is given (``torch.save(obj, f)``, ``f.write(...)``)."""


def write_own_files(storage: Storage, rel: str, files: Mapping[str, FileWriter],
                    fence: Fence | None = None) -> dict[str, layout.FileEntry]:
    """Write a rank's files of its own (see :meth:`CheckpointEngine.save`) into ``rel``: their manifest entries.
    Each through the ``fence`` (see ``store.fence``)."""
    out = {}
    for name, produce in files.items():
        if not layout.is_plain_name(name) or _reserved(name):
            raise ConfigError(f"a state's own file may not be named {name!r}: use a plain name that is not "
                              "one of ft-checkpoint's (manifest.json, metadata.json, rank_*.pt, *.distcp)")
        path = f"{rel}/{name}"
        size, crc = write_fenced(fence, path, lambda exclusive: storage.write_stream(path, produce,  # noqa: B023
                                                                                     exclusive=exclusive))
        out[name] = layout.FileEntry(size=size, checksum=checksum.format_crc(crc))
    return out


def _reserved(name: str) -> bool:
    return name in (layout.MANIFEST, layout.METADATA, ".metadata") or name.endswith(".distcp") \
        or (name.startswith("rank_") and name.endswith(".pt"))


def _unique_files(per_rank: list[dict[str, layout.FileEntry]]) -> dict[str, layout.FileEntry]:
    """Every rank's own files in one dict; a name written by two ranks is an error naming it."""
    out: dict[str, layout.FileEntry] = {}
    for files in per_rank:
        clash = sorted(set(out) & set(files))
        if clash:
            raise ConfigError(f"two ranks wrote a file named {clash[0]!r}: each rank's own files need names of their own")
        out.update(files)
    return out


def _freeze(skeleton: Any, per_rank: dict[str, Any]) -> bytes:
    """The non-tensor state and this rank's own, as they are now, in a form that later changes cannot reach
    (on the caller's thread): pickle's C pickler takes a fraction of ``torch.save``'s time (which calls Python
    for every object pickled: some milliseconds for the RNG states alone)."""
    try:
        return pickle.dumps({"skeleton": skeleton, "per_rank": per_rank}, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # a lambda, an open file, a lock, a generator
        # the manager passes the user's per_rank= as per_rank["state"]
        where, what = _unpicklable(skeleton, "state") or _unpicklable(per_rank.get("state"), "per_rank") or ("the state", e)
        raise ConfigError(f"{where} cannot be saved ({type(what).__name__}: {what}). HINT: keep tensors, numbers, "
                          "strings and containers of them in the state (objects with state_dict() give theirs); "
                          "leave out functions, open files and the like") from None


def _unpicklable(node: Any, path: str) -> tuple[str, BaseException] | None:
    """The path of the first value in ``node`` (dicts, lists, tuples) that cannot be pickled, and why."""
    items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, (list, tuple)) else None
    if items is not None:
        return next((found for key, value in items if (found := _unpicklable(value, f"{path}[{key!r}]"))), None)
    try:
        pickle.dumps(node, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        return path, e
    return None


def _serialize(frozen: bytes, owned: Mapping[str, Any]) -> bytes:
    """The rank file (``torch.save``) of what :func:`_freeze` took and the per-rank values the save ``owned`` (on the
    writer thread; our own bytes)."""
    data = pickle.loads(frozen)
    data["per_rank"].update(owned)
    buf = io.BytesIO()
    torch.save(data, buf)
    return buf.getvalue()


def _check_replicated(prints: list[dict[str, int]]) -> None:
    """Raise StateMismatchError naming the tensors whose fingerprints differ across ranks."""
    if len(prints) < 2:
        return
    differ = sorted(k for k, v in prints[0].items() if any(p.get(k) != v for p in prints[1:]))
    if differ:
        raise StateMismatchError(
            f"{len(differ)} tensor(s) of the shared state differ across ranks: {', '.join(differ[:5])}"
            f"{', ...' if len(differ) > 5 else ''}. A tensor in the state is saved once, as replicated, and would "
            "come back as one rank's value on every rank. HINT: pass values that differ by rank (a prefetched "
            "batch, per-rank statistics) in per_rank=, e.g. save(step, state, per_rank={'batch': x}); model weights "
            "or optimizer state that differ mean the ranks train apart (Accelerate's LocalSGD between its averaging "
            "steps: save on them; with an optimizer that keeps state, such as AdamW, whose moments it never "
            "averages, on no step: such a job cannot be checkpointed as one state)")
