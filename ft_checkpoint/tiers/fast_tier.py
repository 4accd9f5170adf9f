"""The fast tier of one manager: saving a step into each node's folder (and a peer's), and resuming from it.

A save writes on the background writer, from the staged copy the durable save uses (see the engine's
``tier_write``), in three phases, each ended by an agreement of every rank over the fast tier's own gloo
group (never the training's, never the training thread): every rank writes its part into its node's folder
(once every rank measured its part, its rank file's real size included, and the room of its node: a node that
cannot hold two steps writes nothing); every rank sends its part to its peer on the next node while it receives
the part of the rank it keeps a copy of (``transfer``); then every rank marks the step committed in the folders it
wrote and deletes the older steps there. A phase that fails anywhere leaves the step uncommitted everywhere,
with a warning, and what it wrote is deleted at once: the fast tier never stops training, and the previous
committed step (and its copies) stays.

A resume (:meth:`FastTier.resume`, every rank, on the training thread) takes the newest step that some node
marks committed and whose parts some node holds, if it is not older than the durable tier's newest: each rank
reads its own node's folder, or receives its part from the node that keeps a copy; a part that fails its
checks (as its bytes are read) rules that copy out, and the same step is tried from another copy, then an
older one, then the caller resumes from the durable tier.

Example:
    >>> import tempfile, torch
    >>> from ft_checkpoint import CheckpointManager
    >>> model = torch.nn.Linear(4, 2)
    >>> fast = tempfile.mkdtemp()
    >>> with CheckpointManager("memory://doc/tiers", interval=100, fast_dirpath=fast, fast_interval=2) as ckpt:
    ...     for step in range(1, 5):
    ...         _ = ckpt.maybe_save(step, {"model": model})   # steps 2 and 4 go to the fast tier only
    ...     _ = ckpt.wait()
    ...     ckpt.fast.committed, ckpt.latest()
    (4, None)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ft_checkpoint.config import CheckpointConfig
from ft_checkpoint.errors import CheckpointCorruptError, ConfigError, SignatureError, StateMismatchError, StorageError
from ft_checkpoint.format import layout
from ft_checkpoint.format.signing import Signer
from ft_checkpoint.load.loading import OpenedStep, StepLoader
from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval
from ft_checkpoint.policies.interval import policy_from_interval
from ft_checkpoint.policies.policy import SaveContext, SavePolicy, find_policy
from ft_checkpoint.run.dist import Groups
from ft_checkpoint.run.lease import job_id
from ft_checkpoint.state import merge_tree, split_tree
from ft_checkpoint.store import retry
from ft_checkpoint.tiers import room, sources
from ft_checkpoint.tiers.folder import FastFolder, clean_other_runs, run_key
from ft_checkpoint.tiers.node import Ring, default_node_id
from ft_checkpoint.tiers.transfer import exchange
from ft_checkpoint.tiers.write import local_part, write_rank_step
from ft_checkpoint.units import human_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class FastSave:
    """One fast-tier save: what it stalled the training, and when its step (and peer copies) committed."""

    step: int
    started: float
    stall: float
    duration: float | None = None
    """Seconds from the save's start until every rank's part and its peer copy were committed."""
    bytes: int | None = None
    """Bytes of this rank's part."""
    durable: bool = False
    """Whether the same save writes the durable tier too (then the durable save's commit measures its cost)."""


def create_fast_tier(config: CheckpointConfig, durable_url: str, groups: Groups, *, lineage: Callable[[], str],
                     **adaptive: Any) -> FastTier | None:
    """The manager's fast tier, or None without ``fast_dirpath`` or where a node's folder for this run is not this
    user's own (a warning says why: see ``FastFolder.claim``); collective when distributed (every rank must configure
    it alike). ``lineage``: what names the durable directory's incarnation (see ``run_key``), called on rank 0 only
    where a fast tier is configured. ``adaptive``: the adaptive interval's options, for ``fast_interval="adaptive"``."""
    on = [config.fast_dirpath is not None] * groups.world_size
    if groups.distributed:
        on = groups.all_gather(config.fast_dirpath is not None)
    if any(on) != all(on):
        raise ConfigError(f"fast_dirpath is set on ranks {[r for r, o in enumerate(on) if o]} only: set it on every "
                          "rank (each node its own node-local folder), or on none")
    if not all(on):
        return None
    assert config.fast_dirpath is not None
    folder = FastFolder(config.fast_dirpath, run_key(durable_url, job_id(), groups.on_rank0(lineage)))
    problems = sorted({p for p in groups.all_gather(folder.claim()) if p})
    if problems:  # another user may have prepared it: nothing in it is read, written or deleted
        folder.release()
        if groups.rank == 0:
            log.warning("the fast tier is not used (this run saves to its durable tier only): %s", "; ".join(problems))
        return None
    return FastTier(config, durable_url, groups, folder, **adaptive)


class FastTier:
    """See the module's docstring. Made by :func:`create_fast_tier` (at the manager's start, on every rank)."""

    def __init__(self, config: CheckpointConfig, durable_url: str, groups: Groups, folder: FastFolder,
                 **adaptive: Any) -> None:
        assert config.fast_dirpath is not None
        self.config, self.groups, self.durable_url = config, groups, durable_url
        self.dirpath: str = folder.fast_dirpath
        """``fast_dirpath`` as resolved when the folder was claimed (a link on the way is not followed again)."""
        self.node = config.node_id or default_node_id(self.dirpath)
        self.folder = folder
        """This run's folder on this node, claimed (see ``FastFolder.claim``)."""
        agent = os.getppid() if "TORCHELASTIC_RESTART_COUNT" in os.environ else None  # torchrun's, which restarts us
        pids = groups.all_gather((self.node, os.getpid(), agent))
        self.attempt: str = groups.broadcast(uuid.uuid4().hex[:12])
        """This start of the job (rank 0's, on every rank): with a count of its saves, it names each save, which every
        part and mark of the save carries (a part of another save of the same step is never taken for this one's)."""
        self._saves = 0
        self.ring = Ring(tuple(node for node, _, _ in pids))
        self.replicas = config.fast_replicas if len(self.ring.nodes) > 1 else 0
        group = dist.new_group(backend="gloo") if groups.distributed else None  # the fast tier's own
        self.tier = dataclasses.replace(groups, writer=group, control=group)
        """Rank and world size, and the fast tier's own gloo group (its collectives use ``writer=True``)."""
        self.policy: SavePolicy = policy_from_interval(config.fast_interval, **adaptive)
        self.adaptive = find_policy(self.policy, AdaptiveInterval)
        """The fast tier's adaptive interval (``fast_interval="adaptive"``), fed each fast-tier save's cost."""
        self.signer: Signer | None = None
        """Signs each part's manifest, and a resume takes only parts signed with its key (the manager's signer)."""
        self.on_commit: Callable[[FastSave], None] | None = None
        """Called after each save committed (the writer thread): the manager measures its cost there."""
        self.failure_class: str | None = None
        """What the last :meth:`resume` found in the nodes' folders (see ``sources.failure_class``)."""
        self.why: str | None = None
        """Why the last :meth:`resume` took no step from the fast tier (None: it did)."""
        self.last: FastSave | None = None
        self.committed: int | None = self._own_mark()
        """The newest step committed in this rank's own folder."""
        self._room_checked = False
        if self.local_index == 0:
            for path in clean_other_runs(self.dirpath, self.folder.key):
                log.info("removed %s: the fast-tier folder of another run, whose processes are gone", path)
            here = {pid for node, *two in pids if node == self.node for pid in two if pid is not None}
            self.folder.write_owner(durable_url, sorted(here), start=self.attempt)
        self._check_nodes_apart()

    def _check_nodes_apart(self) -> None:
        """ConfigError on every rank if ranks that name the same node do not share its folder (two machines given one
        ``node_id``, or one host name and path): the ring would put no peer copy on the other machine, and a resume
        would read one machine's folder only. Each node's first rank wrote this start's name into its owner file."""
        if not self.groups.distributed:
            return
        self.groups.barrier()
        apart = self.groups.all_gather((self.folder.owner() or {}).get("start") != self.attempt)
        if not any(apart):
            return
        self.folder.release()
        self.tier.destroy()
        raise ConfigError(f"ranks {[r for r, a in enumerate(apart) if a]} name their node {self.node!r} like other "
                          "ranks, whose fast-tier folder they do not see: another machine has the same node_id. "
                          "HINT: give each node a node_id of its own (FT_CHECKPOINT_NODE_ID), or leave it unset "
                          "where host names differ (the default: host name and fast_dirpath)")

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def local_index(self) -> int:
        return self.ring.local_index(self.rank)

    @property
    def held(self) -> list[int]:
        """The ranks whose parts this rank writes here: its own, and the peers' it keeps a copy of."""
        return [self.rank] + (self.ring.sources(self.rank) if self.replicas else [])

    def _own_mark(self) -> int | None:
        mark = self.folder.committed(self.rank)
        return mark.step if mark is not None else None

    def describe(self) -> str:
        """Where the fast tier is, and its peer copies, in words (for the line a run prints at its start)."""
        copies = f", a copy on the next of {len(self.ring.nodes)} nodes" if self.replicas else ""
        return f"a fast tier in {self.folder.root}{copies}"

    # -- saving ------------------------------------------------------------------------------------
    def context(self, step: int, *, in_flight: bool) -> SaveContext:
        """What the fast tier's policy decides from (a preemption is the durable tier's: its final save)."""
        last = self.last
        return SaveContext(step=step, now=time.monotonic(), last_save_step=last.step if last else None,
                           last_save_time=last.started if last else None, last_stall=last.stall if last else None,
                           last_duration=last.duration if last else None, save_in_flight=in_flight, preempted=False)

    def check_room(self, tree: Mapping[str, Any], files: Mapping[str, Any] | None = None) -> None:
        """At the first fast-tier save (every rank, training thread): ConfigError on every rank if a node's fast
        tier cannot hold what it will keep (see ``room``). ``files``: the state's own staged files of this rank's
        part (their writers' ``nbytes``). Each write checks again, with the rank file's real size."""
        if self._room_checked:
            return
        mine = _part_bytes(split_tree(tree)[0], files or {})
        parts = self.groups.all_gather(mine)
        need = room.room_needed(self.ring, parts, node=self.node, replicas=self.replicas)
        problem = room.room_problem(self.dirpath, need=need, free=room.free_bytes(self.dirpath, self.folder.root),
                                    node=self.node)
        problems = sorted({p for p in self.groups.all_gather(problem) if p})
        if problems:
            raise ConfigError("; ".join(problems))
        self._room_checked = True
        if self.rank == 0:
            log.info("fast tier: %s per node at most (%s per rank)", human_bytes(need), human_bytes(mine))

    def started(self, step: int, stall: float) -> FastSave:
        """A fast-tier save was staged (training thread)."""
        self.last = FastSave(step=step, started=time.monotonic() - stall, stall=stall)
        return self.last

    def writer(self, save: FastSave, fields: dict[str, Any], *, writers: int,
               part_only: Mapping[str, Any] | None = None) -> Callable[[Mapping[str, Any]], bool]:
        """What the engine's writer thread runs for this save, from the staged copy (the engine's ``tier_write``).
        ``part_only``: staged files this rank's part holds besides the step's own (filled in by the time it runs)."""
        return lambda staged: self.write(save, {**staged, "files": {**staged.get("files", {}), **(part_only or {})}},
                                         fields, writers)

    def write(self, save: FastSave, staged: Mapping[str, Any], fields: dict[str, Any], writers: int) -> bool:
        """Write, copy and commit ``save.step`` from ``staged`` (the writer thread, every rank), then delete the
        older steps; whether it committed."""
        step, self._saves = save.step, self._saves + 1
        name = f"{self.attempt}.{self._saves}"
        measured = self.tier.all_gather(self._measure(staged), writer=True)  # by every rank before any rank writes
        ok = self._agree(step, "written", lambda: self._write_own(step, name, staged, fields, writers, measured))
        if ok and self.replicas:
            ok = self._agree(step, "copied to its peer", lambda: self._copy(step))
        if ok:
            ok = self._agree(step, "marked committed", lambda: self._mark(step, name))
        if not ok:
            self._discard(step)
            return False
        save.duration = time.monotonic() - save.started
        if self.rank == 0:
            log.info("fast-tier step %d committed on %d node(s)%s, %.2f s after the save began", step,
                     len(self.ring.nodes), " with peer copies" if self.replicas else "", save.duration)
        if self.on_commit is not None:
            self.on_commit(save)
        try:  # the step is committed: a failed clean-up is only logged (the next save retries it)
            for rank in self.held:
                self.folder.retain(rank, {step})
        except (OSError, StorageError) as e:
            log.warning("fast tier: deleting the steps before step %d failed: %s", step, e)
        return True

    def _measure(self, staged: Mapping[str, Any]) -> tuple[int, int] | None:
        """``(bytes of this rank's part of the save, with its rank file's real size; the room of its node's fast
        tier)``, or None if unknown."""
        try:
            return (_part_bytes(staged["tensors"], staged.get("files", {}), rank_file=len(staged["rank_file"])),
                    room.free_bytes(self.dirpath, self.folder.root))
        except Exception as e:  # never a reason to skip the gather of what every rank measured
            log.debug("fast tier: the room for rank %d's part was not measured: %s", self.rank, e)
            return None

    def _check_room(self, measured: list[tuple[int, int] | None]) -> None:
        """ConfigError if this node's fast tier cannot hold what it will keep, counted with every part's real size."""
        known = [m for m in measured if m is not None]
        if len(known) < len(measured):  # a rank could not measure: its write says what is wrong
            return
        need = room.room_needed(self.ring, [part for part, _ in known], node=self.node, replicas=self.replicas)
        problem = room.room_problem(self.dirpath, need=need, free=known[self.rank][1], node=self.node)
        if problem:
            raise ConfigError(problem)

    def _write_own(self, step: int, name: str, staged: Mapping[str, Any], fields: dict[str, Any], writers: int,
                   measured: list[tuple[int, int] | None]) -> None:
        self._check_room(measured)
        keep = {s for s in (self.committed, step) if s is not None}
        for rank in self.held:
            self.folder.retain(rank, keep)
        if self.local_index == 0:  # folders of ranks no rank here holds now (renumbered, another world size)
            held_here = {h for r in self.ring.ranks_on(self.node) for h in [r, *self.ring.sources(r)]}
            for rank in set(self.folder.held_ranks()) - held_here:
                self.folder.remove(rank)
        tensors, sharding = local_part(staged["tensors"])
        manifest = write_rank_step(self.folder.storage(self.rank), step, tensors, staged["rank_file"], rank=self.rank,
                                   world_size=self.ring.world_size, save=name, node=self.node,
                                   sharding=sharding, writers=writers, fields=fields, signer=self.signer,
                                   files=staged.get("files"))
        if self.last is not None and self.last.step == step:
            self.last.bytes = manifest.total_bytes

    def _copy(self, step: int) -> None:
        peer = self.ring.peer(self.rank)
        assert peer is not None
        exchange(self.tier.writer, [(peer, self.folder.storage(self.rank), step)],
                 [(src, self.folder.storage(src), step) for src in self.ring.sources(self.rank)])

    def _mark(self, step: int, name: str) -> None:
        for rank in self.held:
            self.folder.commit(rank, step=step, world_size=self.ring.world_size, save=name)
        self.committed = step

    def _discard(self, step: int) -> None:
        """Delete at once what this rank wrote of ``step``, which was not committed (it takes room the node may
        need), in each folder that does not mark ``step`` committed: a committed step is never deleted here."""
        for rank in self.held:
            mark = self.folder.committed(rank)
            if mark is not None and mark.step == step:
                continue
            try:
                layout.delete_step(self.folder.storage(rank), step)
            except (OSError, StorageError) as e:
                log.warning("fast tier: deleting what step %d left failed (the next save retries): %s", step, e)

    def _agree(self, step: int, what: str, fn: Callable[[], None]) -> bool:
        """Run ``fn`` here; whether it succeeded on every rank (a warning on rank 0 names the failures). Every rank
        takes part in the agreement whatever ``fn`` raised: none is left waiting in it."""
        try:
            fn()
            outcome = None
        except (Exception, CheckpointException) as e:  # the fast tier never stops training: a warning, not committed
            outcome = f"rank {self.rank} ({self.node}): {retry.describe(e)}"
        except BaseException as e:  # an interrupt goes on up, once every rank heard of it
            self.tier.all_gather(f"rank {self.rank} ({self.node}): {type(e).__name__}", writer=True)
            raise
        failures = [o for o in self.tier.all_gather(outcome, writer=True) if o]
        if failures and self.rank == 0:
            log.warning("fast-tier step %d not committed (not %s everywhere): %s; the fast tier keeps step %s",
                        step, what, "; ".join(failures[:3]), self.committed)
        return not failures

    # -- resuming ----------------------------------------------------------------------------------
    def resume(self, load: Callable[[StepLoader, OpenedStep], T], *, durable_newest: int | None
               ) -> tuple[tuple[layout.Manifest, T, str] | None, bool]:
        """``((manifest, what load returned, source), touched)``: the newest step the fast tier gives every rank
        (not older than ``durable_newest``), loaded with ``load(loader, opened)``; None if none. ``touched``:
        a load that failed may have changed the state. Every rank, training thread."""
        holdings = self.groups.all_gather(sources.inventory(self.folder, self.node))
        self._explain_world_size(holdings)
        self.failure_class, self.why = sources.failure_class(holdings, self.ring), None
        ruled_out: set[tuple[str, int]] = set()
        touched = False
        while True:
            complete = sources.plan_steps(holdings, self.ring, ruled_out=frozenset(ruled_out))
            plans = [p for p in complete if durable_newest is None or p.step >= durable_newest]
            if not plans:
                self.why = _why_not(holdings, self.ring, complete, ruled_out, durable_newest)
                return None, touched
            plan = plans[0]
            result, failed, touched_now = self._try(plan, load)
            touched = touched or touched_now
            if not failed:
                self.committed = self._own_mark()
                return result, touched
            ruled_out |= {(self.ring.node_of[plan.holders[r]], r) for r in failed}

    def _try(self, plan: sources.StepPlan, load: Callable[[StepLoader, OpenedStep], T]) -> tuple[Any, list[int], bool]:
        """Fetch, check, open and load this rank's part of ``plan``: ``(result, ranks that failed, touched)``."""
        step, storage = plan.step, self.folder.storage(self.rank)
        loader = FastStepLoader(storage, self.rank)
        done: list[Any] = []  # each phase's value: None, the checked manifest (read once), the opened step, the result
        phases: list[Callable[[], Any]] = [
            lambda: self._fetch(plan),
            lambda: self._check(plan),
            lambda: loader.open_step(done[1]),
            lambda: load(loader, done[2]),
        ]
        for phase in phases:
            value, failed, corrupt = self._phase(plan, phase)
            if failed:
                opened: OpenedStep | None = done[2] if len(done) > 2 else None
                touched = any(self.groups.all_gather(opened is not None and opened.touches))
                if corrupt and plan.holders[self.rank] == self.rank:  # set aside: no later resume tries it again
                    layout.delete_step(storage, step)
                return None, failed, touched
            done.append(value)
        source = f"fast tier, {plan.source}"
        if self.rank == 0:
            log.info("fast-tier step %d: every rank's part checked and loaded (%s)", step, plan.source)
        return (done[1], done[3], source), [], False

    def _fetch(self, plan: sources.StepPlan) -> None:
        """Parts some ranks' nodes lack, sent over the fast tier's group by the ranks whose nodes hold them."""
        sends = [(r, self.folder.storage(r), plan.step) for r, h in enumerate(plan.holders) if h == self.rank and r != h]
        holder = plan.holders[self.rank]
        receives = [(holder, self.folder.storage(self.rank), plan.step)] if holder != self.rank else []
        if sends or receives:
            exchange(self.tier.writer, sends, receives)
            if receives:
                log.info("rank %d: received its part of fast-tier step %d from rank %d", self.rank, plan.step, holder)

    def _check(self, plan: sources.StepPlan) -> layout.Manifest:
        """This rank's part of ``plan``: its manifest (signature, sizes, kinds) and whose part it is; the manifest."""
        manifest = layout.check_step(self.folder.storage(self.rank), plan.step, signer=self.signer).raise_if_bad()
        own = manifest.metadata.get(layout.FAST_TIER)
        expected = {"rank": self.rank, "world_size": self.ring.world_size, "save": plan.save}
        if not isinstance(own, dict) or any(own.get(k) != v for k, v in expected.items()):
            raise CheckpointCorruptError(f"{self.folder.storage(self.rank).url}: step {plan.step} is not rank "
                                         f"{self.rank}'s part of the save {plan.save} by {self.ring.world_size} ranks")
        return manifest

    def _phase(self, plan: sources.StepPlan, fn: Callable[[], T]) -> tuple[T | None, list[int], bool]:
        """Run ``fn`` on every rank: ``(its result here, the ranks where it failed, whether it failed here for
        corruption)``; a warning (rank 0) names each failure."""
        value, problem, corrupt = None, None, False
        try:
            value = fn()
        except (StateMismatchError, SignatureError) as e:  # the state or the key, not the part, may be what changed:
            problem = f"{type(e).__name__}: {e}"  # the part is kept (a restart with the right key takes it)
        except (CheckpointCorruptError, StorageError, OSError) as e:
            problem, corrupt = f"{type(e).__name__}: {e}", True
        problems = self.groups.all_gather(problem)
        failed = [r for r, p in enumerate(problems) if p]
        if failed and self.rank == 0:
            log.warning("fast-tier step %d (%s) is not used: %s; trying the next source", plan.step, plan.source,
                        "; ".join(f"rank {r}: {problems[r]}" for r in failed[:3]))
        return value, failed, corrupt

    def _explain_world_size(self, holdings: list[sources.Holding]) -> None:
        other = sources.other_world_sizes(holdings, self.ring.world_size)
        if other and self.rank == 0:
            step = max(other)
            log.warning("fast-tier step %d was saved by %d ranks and this job has %d: a fast-tier part is one rank's "
                        "local state, which needs the same world size and sharding; resuming from the durable tier",
                        step, other[step], self.ring.world_size)

    # -- the end -----------------------------------------------------------------------------------
    def forget(self, why: str) -> str:
        """Delete what this run's folder holds on every node (a deleted run's parts: ``why``), so that no resume
        takes them and no retention keeps them over this run's own steps; returns ``why``. Collective: one rank
        per node deletes, and no rank goes on (to save into the folder) before every node is done."""
        held = self.folder.held_ranks() if self.local_index == 0 else []
        if held:
            log.warning("deleting the fast tier's parts of ranks %s in %s: %s", held, self.folder.root, why)
        self._remove_parts(held, when="")
        self.groups.barrier()
        return why

    def close(self, *, clean: bool) -> None:
        """At a clean end, delete this run's fast-tier folder (each rank what it wrote; then the rest, once per node).
        Either way, this process no longer holds the folder (see ``FastFolder.claim``)."""
        if clean:
            self._remove_parts(self.held, when=" at the clean end", whole_folder=self.local_index == 0)
        self.folder.release()
        self.tier.destroy()

    def _remove_parts(self, ranks: Iterable[int], *, when: str, whole_folder: bool = False) -> None:
        """Delete the parts of ``ranks`` in this node's folder, then with ``whole_folder`` the folder itself; a
        warning (naming ``when``) if the storage refuses: deleting is never worth stopping the training for."""
        try:
            for rank in ranks:
                self.folder.remove(rank)
            if whole_folder:
                self.folder.remove_all()
        except (OSError, StorageError) as e:
            log.warning("could not delete the fast tier's parts in %s%s: %s", self.folder.root, when, e)


def _part_bytes(tensors: Mapping[str, Any], files: Mapping[str, Any], *, rank_file: int = 0) -> int:
    """Bytes of this rank's part of a save (see ``room.part_bytes``): ``tensors`` as staged (a DTensor counts its
    local shard), ``files`` the state's own (their writers' ``nbytes``)."""
    return room.part_bytes([t.numel() * t.element_size() for t in local_part(tensors)[0].values()],
                           [getattr(w, "nbytes", 0) for w in files.values()], rank_file=rank_file)


def _why_not(holdings: list[sources.Holding], ring: Ring, complete: list[sources.StepPlan], ruled_out: set[Any],
             durable_newest: int | None) -> str:
    """Why a resume takes no step from the fast tier, in words (for the journal)."""
    if complete:
        return f"its newest complete step {complete[0].step} is older than the durable tier's step {durable_newest}"
    if ruled_out:
        return "its newest complete step failed its checks"
    other = sources.other_world_sizes(holdings, ring.world_size)
    if other:
        return f"its step {max(other)} was saved by {other[max(other)]} ranks and this job has {ring.world_size}"
    return "no step of it is complete on the nodes of this job"


class FastStepLoader(StepLoader):
    """Loads one rank's part of a fast-tier step (a single-process checkpoint of its local state): a DTensor of the
    state takes its local shard, in place, when the part's shard lies where the state's does."""

    def __init__(self, storage: Any, rank: int) -> None:
        super().__init__(storage, Groups(rank=rank))

    def _rank_file_name(self, manifest: layout.Manifest) -> str:
        return layout.rank_file(0)

    def load(self, opened: OpenedStep, tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors, skeleton = split_tree(tree)
        local, where = local_part(tensors)
        saved = opened.manifest.metadata.get(layout.FAST_TIER, {}).get("sharding")
        if saved != where:
            raise StateMismatchError(f"step {opened.manifest.step}'s fast-tier part was saved with another sharding "
                                     "than the state has now (a fast-tier part is one rank's local shards)")
        loaded, ranked = super().load(opened, merge_tree(skeleton, local))
        flat, saved_skeleton = split_tree(loaded)
        return merge_tree(saved_skeleton, {k: tensors[k] if k in where else t for k, t in flat.items()}), ranked

