"""CheckpointManager: what a training loop calls. Framework-free; both integrations sit on it.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.Adam(model.parameters())
    >>> state = {"model": model, "optim": opt, "epoch": 0}
    >>> with CheckpointManager("memory://doc/manager", interval=2) as ckpt:
    ...     start = ckpt.resume(state) or 0           # None on a fresh start
    ...     for step in range(start + 1, 5):
    ...         opt.zero_grad(); model(torch.randn(3, 4)).sum().backward(); opt.step()
    ...         saved = ckpt.maybe_save(step, state)  # saves at steps 2 and 4, in the background
    ...     _ = ckpt.wait()                       # until committed
    ...     ckpt.latest()
    4
"""

from __future__ import annotations

import atexit
import logging
import operator
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ft_checkpoint.config import CheckpointConfig
from ft_checkpoint.errors import CheckpointCorruptError, ConfigError, LeaseError, Preempted, SaveError, StorageError
from ft_checkpoint.format import layout
from ft_checkpoint.format.signing import Signer
from ft_checkpoint.load.loading import StepLoader, load_state
from ft_checkpoint.load.resume import check_for_resume, refuse_older_step, resume_newest, warn_if_rolled_back
from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval
from ft_checkpoint.policies.adaptive.tier_policy import multilevel_for
from ft_checkpoint.policies.cost import CostMeter
from ft_checkpoint.policies.interval import describe_policy, policy_from_interval, policy_metrics
from ft_checkpoint.policies.policy import OnPreemption, SaveContext, SavePolicy, find_policy
from ft_checkpoint.run.dist import Groups, peer_lost, short_error
from ft_checkpoint.run.journal import Journal, attempt_summaries, first_attempt, new_attempt_id
from ft_checkpoint.run.lease import Lease
from ft_checkpoint.run.preemption import PreemptionWatcher
from ft_checkpoint.run.slurm import SlurmJob, requeue
from ft_checkpoint.save.engine import CheckpointEngine, SaveStats
from ft_checkpoint.save.save_events import SaveEvents
from ft_checkpoint.state import (
    Participants,
    check_tensors_match,
    describe_participants,
    require_state_dict,
    rng_state,
    set_rng_state,
    stage_participants,
    stands_alone,
    to_tree,
)
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.units import human_bytes, human_seconds, parse_duration

if TYPE_CHECKING:  # the fast tier is imported only where one may be configured (see __init__)
    from ft_checkpoint.tiers.fast_tier import FastSave, FastTier

log = logging.getLogger(__name__)

_saved_by_this_process: set[str] = set()
"""The checkpoint directories (URLs) a manager of this process saved to: a later manager of this process that resumes
from one warns (a new training of the same process in the same directory, a cross-validation's next fold or a retry
with another batch size, would continue the earlier one)."""


class CheckpointManager:
    """Asynchronous, fault-tolerant checkpoints of a training loop in one directory.

    Args:
        dirpath: Local path or fsspec URL; falls back to ``FT_CHECKPOINT_DIRPATH`` / the config file.
        policy: A :class:`~ft_checkpoint.policies.policy.SavePolicy`; default: the one ``interval`` names.
        **config: Any :class:`~ft_checkpoint.config.CheckpointConfig` field (``interval``, ``keep_last``,
            ``storage_options``, ...). Explicit arguments win over env vars, which win over the file.

    A DeepSpeed engine in ``state`` saves itself through DeepSpeed's own files (see ``ft_checkpoint.integrations.deepspeed``).

    Every rank of a distributed job must create the manager and call ``resume``/``maybe_save``/
    ``save``/``close`` at the same steps (the step-based policies guarantee it; time-based ones are
    decided by rank 0 and broadcast).

    Closing: ``with CheckpointManager(...)`` or ``close()`` saves the last step ``maybe_save`` was given
    unless it is saved already (``final_save``; ``close(final=False)`` skips it), waits for the last save
    and records a clean end: a restart of the finished run resumes at its end. A manager still open at
    interpreter exit is closed then, without that final save (a clean end unless an uncaught exception is
    ending the program). After an exception it closes in one log line, naming a peer rank that is gone.

    Preemption: the signals in ``preemption_signals`` (SIGTERM, SIGUSR1) and, on Slurm, the job's
    time limit only raise a flag; at the next ``maybe_save`` every rank agrees, the step is saved
    and committed, the journal records the preemption, a Slurm job is requeued (rank 0), and
    :class:`~ft_checkpoint.errors.Preempted` (a ``SystemExit``) ends the process cleanly.
    Create the manager on the main thread for the signal handlers.
    """

    def __init__(self, dirpath: str | None = None, *, policy: SavePolicy | None = None, announce: bool = True,
                 **config: Any) -> None:
        self.config = c = CheckpointConfig.from_env(dirpath=dirpath, **config)
        self.announce = announce
        """Print where checkpoints go, the resume and when the first save is due, once, on stderr (rank 0): the
        one line a start gets (the log has it at DEBUG only). Integrations with a line of their own (Lightning's
        rank-zero info, Accelerate's with the data position) pass False and use :meth:`describe_start`."""
        if c.dirpath is None:
            raise ConfigError("dirpath is required: pass it, set FT_CHECKPOINT_DIRPATH, or put it in the "
                              "YAML file named by FT_CHECKPOINT_CONFIG")
        self.storage = Storage(c.dirpath, c.storage_options, retries=c.retries)
        self.signer = Signer.from_config(c, self.storage.url)
        """Signs every manifest this job commits and refuses unsigned steps at resume (None: no ``signing_key``)."""
        self.groups = Groups.create()
        attempt = self.groups.on_rank0(self._ensure_root)
        adaptive = dict(world_size=self.groups.world_size, mtbf=c.mtbf, gpu_failure_rate=c.gpu_failure_rate,
                        min_interval=c.min_interval, max_interval=c.max_interval)
        self.policy = policy or policy_from_interval(c.interval, **adaptive)
        self.adaptive = find_policy(self.policy, AdaptiveInterval)
        self.fast: FastTier | None = None
        """The fast tier (``fast_dirpath``), or None: see ``ft_checkpoint.tiers``."""
        self._first_attempt: str | None = None  # rank 0, with a fast tier: the journal's oldest start before this one
        if c.fast_dirpath is not None or self.groups.distributed:  # collective: every rank checks the setting alike
            from ft_checkpoint.tiers.fast_tier import create_fast_tier

            self.fast = create_fast_tier(c, self.storage.url, self.groups, **adaptive, lineage=self._lineage(attempt))
        self.tiers = multilevel_for(c.interval, c.fast_interval, self.fast, **adaptive) if policy is None else None
        """Both tiers' adaptive intervals from one plan (both ``"adaptive"``, with a fast tier), or None."""
        if self.tiers is not None and self.fast is not None:
            self.policy, self.adaptive = self.tiers.durable | OnPreemption(), None
            self.fast.policy, self.fast.adaptive = self.tiers.fast, None
        if self.fast is not None:
            self.fast.on_commit, self.fast.signer = self._fast_committed, self.signer
        self.journal = Journal(self.storage, attempt=attempt, enabled=self.rank == 0,
                               progress_every=parse_duration(c.progress_interval))
        self.lease = Lease(self.storage, attempt=self.journal.attempt)
        self._listing: layout.Listing | None = self.groups.on_rank0(lambda: self._acquire_and_list(c.force_takeover))
        """The steps as this start listed them (rank 0's, on every rank): the first ``resume`` takes its candidates
        from it unless a save came before, then drops it."""
        self.engine = CheckpointEngine(self.storage, self.groups, writers=c.writers, writer=c.writer,
                                       priority=c.writer_priority, signer=self.signer, lazy=c.lazy_snapshot)
        self.loader = StepLoader(self.storage, self.groups)
        self.slurm = SlurmJob.detect(query=self.rank == 0)
        """The Slurm job this runs in (None outside Slurm); its requeue flag and end time on rank 0 only."""
        self.watcher = PreemptionWatcher(c.preemption_signals, end_time=self.slurm.end_time if self.slurm else None,
                                         margin=parse_duration(c.end_time_margin))
        self.journal.record("attempt_start", world_size=self.groups.world_size,
                            progress_interval=0.0 if self.journal.notes_every_step else parse_duration(c.progress_interval),
                            preemption_signals=self.watcher.signals)
        learners = [p for p in (self.adaptive, self.fast and self.fast.adaptive, self.tiers) if p]
        if learners and self.rank == 0:
            summaries = attempt_summaries(self.storage)
            for learner in learners:
                learner.observe_journal(summaries)
        self._cost = CostMeter()
        durable_learner = self.tiers.durable if self.tiers is not None else self.adaptive
        self._events = SaveEvents(storage=self.storage, config=c, rank=self.rank, journal=self.journal, lease=self.lease,
                                  watcher=self.watcher, cost=self._cost, adaptive=durable_learner, phase=self.engine.phase,
                                  signer=self.signer)
        self._init_run_state()
        atexit.register(self._close_at_exit)

    def _init_run_state(self) -> None:
        self.preempted = False
        """A preemption was announced (on any rank); set it yourself for a notice of your own: the next
        ``maybe_save`` then makes the final save and exits."""
        self._preempt_reason: str | None = None
        self.last_save: SaveStats | None = None
        """The last save started (of either tier: ``last_save.durable`` says whether it writes the durable one)."""
        self._last_durable: SaveStats | None = None
        self._due: tuple[int, bool, bool] | None = None
        """``(step, durable, fast)``: what :meth:`agree_to_save` decided last (until a save takes it)."""
        self._agreed = False  # set by maybe_save for its own save: it writes the tiers agreed on for its step
        self._fast_refused = False
        self._held = (False, False)
        """``(durable, fast)``: saves that were due at steps a ``hold`` put off; they come at the next step without."""
        self.resumed_from: int | None = None
        self.resumed_source: str | None = None
        """Where the last resume took its step from: ``"fast tier, own node"``, ``"fast tier, peer copies"``, or the
        durable step directory's URL."""
        self.resumed_rng: dict[str, Any] | None = None
        """The RNG states the last resume found for this rank (see ``resume(restore_rng=False)``)."""
        self.loaded: str | None = None
        """What the last resume loaded, in words: ``"3.6 MB verified and loaded in 0.1 s"``."""
        self._offered: tuple[int, Mapping[str, Any], dict[str, Any]] | None = None
        """The last ``maybe_save``'s step, state and options (or a fast-tier resume's): what a final save saves, until
        the training goes past that step."""
        self._newest_committed: int | None = self._listing.newest if self._listing is not None else self.latest()
        self._participants = Participants()
        self._last_save_time = time.monotonic()
        self._announced = self._closed = False

    def _ensure_root(self) -> str:
        """Rank 0: make the checkpoint directory if need be, and name this start. Every rank gets the name: the lease
        rank 0 takes by it is the job's, which each rank checks before the files of a save (a rank with a name of its
        own took the lease for lost, and stopped saving, once its writes outlasted a sight of it)."""
        self.storage.ensure_root()
        return new_attempt_id()

    def _lineage(self, attempt: str) -> Callable[[], str]:
        """What names the durable directory's incarnation for the fast tier (rank 0, once, before this start's
        journal is written): the oldest start its journal records, or this one's ``attempt``. The listing is kept
        for :meth:`_durable_has_history`."""
        def lineage() -> str:
            self._first_attempt = first_attempt(self.storage)
            return self._first_attempt or attempt
        return lineage

    def _durable_has_history(self) -> bool:
        """Whether the journal recorded a start before this one (rank 0, with a fast tier: the listing the fast tier's
        lineage made). Without one, and without a step, the durable directory is new or was emptied: what the fast
        tier holds for it is a deleted run's."""
        return self._first_attempt is not None

    def _acquire_and_list(self, force: bool) -> layout.Listing:
        """Rank 0's start-up I/O: take the lease while another thread lists the steps and reads their manifests down to
        the newest committed (both wait on the storage; the listing only reads, so nothing is written before the lease
        is held)."""
        with ThreadPoolExecutor(1, thread_name_prefix="ft-checkpoint-list") as pool:
            listing = pool.submit(layout.Listing.of, self.storage, signer=self.signer)
            self.lease.acquire(force=force)
            steps = listing.result()
        if self.signer is None and steps.newest is not None and steps.manifests[steps.newest].signature is not None:
            self.lease.release()
            raise ConfigError(
                f"the newest step of {self.storage.url} (step {steps.newest}) is signed, and this job has no signing key: "
                "it would resume that step unchecked, save unsigned steps, and its retention would delete the signed "
                "ones, after which a job with the key finds no step to resume. HINT: set the run's key "
                "(FT_CHECKPOINT_SIGNING_KEY_FILE, FT_CHECKPOINT_SIGNING_KEY or signing_key_file: in the YAML file); to "
                "go on without signing, give this job a new dirpath")
        return steps

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (nothing can be saved or resumed any more)."""
        return self._closed

    @property
    def failed_saves(self) -> int:
        """Saves that failed (with ``on_save_error="warn"`` training goes on after them)."""
        return self._events.failed

    @property
    def preemption_requested(self) -> bool:
        """Whether this rank noticed a preemption (a signal in ``preemption_signals``, or the Slurm job's end
        time) that no save has acted on yet; :meth:`agree_to_save` makes every rank agree on it."""
        return self.watcher.requested

    # -- saving --------------------------------------------------------------------------------
    def note_step(self, step: int) -> None:
        """A step boundary: time the step (what a background write costs the training, for the adaptive
        interval) and note the step reached in the journal (at most every ``progress_interval``)."""
        self._cost.step(writing=self.engine.in_flight)
        self.journal.progress(step)
        self._forget_offered_before(step)

    def _forget_offered_before(self, step: int) -> None:
        """The training has gone past the step :meth:`maybe_save` was last given (or that a resume took from the fast
        tier): its state has changed since, so a final save of it under that step would mix two steps."""
        if self._offered is not None and self._offered[0] < step:
            self._offered = None

    def should_save(self, step: int) -> bool:
        """This rank's answer to "save at ``step``?": the policy's, or a preemption notice on this rank.
        No side effect and no collective: see :meth:`agree_to_save` for the answer every rank shares."""
        return self.policy.should_save(self._context(step, self._notice())) or self._fast_due(step)

    def _fast_due(self, step: int) -> bool:
        """The fast tier's policy's answer (False without a fast tier)."""
        return self.fast is not None and not self._fast_refused and self.fast.policy.should_save(
            self.fast.context(step, in_flight=self.engine.in_flight))

    def _context(self, step: int, notice: str | None) -> SaveContext:
        last = self._last_durable
        return SaveContext(
            step=step, now=time.monotonic(), last_save_step=last.step if last else self.resumed_from,
            last_save_time=self._last_save_time, last_stall=last.stall if last else None,
            last_duration=last.duration if last else None, save_in_flight=self.engine.in_flight,
            preempted=notice is not None)

    def agree_to_save(self, step: int, *, hold: bool = False) -> bool:
        """Whether every rank saves at ``step`` (a collective when distributed: call it on every rank at the
        same steps): rank 0's policy answer for time-based policies, a preemption notice on any rank
        (then :attr:`preempted` is set), and a LeaseError on every rank if rank 0 lost the directory's lease.
        ``hold``: this rank's state is no point to resume from (an optimizer holds gradients for a later step, see
        ``save.pending_gradients``); then no rank saves at ``step`` (unless a preemption notice came), and a save due
        now comes at the next step without a hold, whatever the policy says there."""
        notice = self._notice()
        ctx = self._context(step, notice)
        decision, lost, fast = self.policy.should_save(ctx), self.rank == 0 and self.lease.lost, self._fast_due(step)
        if self.groups.distributed:  # one collective: rank 0's decisions and lease, anyone's notice and hold
            votes = self.groups.all_gather((decision, notice, lost, fast, hold))
            decision = votes[0][0] if not self.policy.deterministic else decision
            fast = votes[0][3] if self.fast is not None and not self.fast.policy.deterministic else fast
            notice = next((f"{n} on rank {r}" for r, (_, n, _, _, _) in enumerate(votes) if n), None)
            lost, hold = votes[0][2], any(v[4] for v in votes)
        if hold and notice is None:  # a preemption notice saves now: one optimizer's partial gradients lost, not more
            self._held = (self._held[0] or decision, self._held[1] or fast)
            decision = fast = False
        elif not hold:
            decision, fast = decision or self._held[0], fast or self._held[1]
            self._held = (False, False)
        if self.tiers is not None:  # nested: a durable save comes with a fast-tier save (see MultiLevelInterval)
            decision = decision and (fast or self._fast_refused)
        if lost:
            raise LeaseError(f"another job took over the checkpoint directory {self.storage.url}; this job stops "
                             "saving there. HINT: give each job its own dirpath; see the warning about lease.json")
        self._preempt_reason = self._preempt_reason or notice  # the first notice agreed on
        self.preempted = notice is not None
        durable = decision or (self.preempted and step != ctx.last_save_step)
        self._due = (step, durable, fast)
        return durable or fast

    def _notice(self) -> str | None:
        """This rank's preemption notice: a signal's name, ``"job end time"``, or set by the program."""
        if self.watcher.check():
            return self.watcher.reason
        return "preempted set by the program" if self.preempted else None

    def maybe_save(self, step: int, state: Mapping[str, Any], *, epoch: int | None = None,
                   metadata: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
                   hold: bool = False) -> bool:
        """Save ``state`` as ``step`` if the policy says so; returns whether a save started.

        Call it at a step boundary (after the optimizer step), with the number of completed steps.
        ``per_rank`` holds values that differ by rank, as in :meth:`save` (nanoGPT's prefetched batch).
        ``hold``: not here, a save due now comes later (see :meth:`agree_to_save`).

        Example:
            >>> import torch
            >>> with CheckpointManager("memory://doc/maybe-save", interval=1, announce=False) as m:
            ...     m.maybe_save(1, {"w": torch.zeros(2)}, per_rank={"batch": torch.ones(2)})
            True
        """
        step = checked_step(step)
        require_state_dict(state)
        self.note_step(step)
        self._offered = (step, state, {"epoch": epoch, "metadata": metadata, "per_rank": per_rank})
        if not self.agree_to_save(step, hold=hold):
            return False
        self._agreed = True  # this save writes the tiers just agreed on (see _tiers_due)
        try:
            self.save(step, state, epoch=epoch, metadata=metadata, per_rank=per_rank)
        finally:
            self._agreed = False
        self._cost.saved()
        if self.preempted:
            self.stop_for_preemption()
        return True

    def stop_for_preemption(self) -> None:
        """End the process after a preemption notice: wait for the final save to commit, journal it, requeue
        the Slurm job (rank 0), close, and raise :class:`~ft_checkpoint.errors.Preempted`.

        ``maybe_save`` calls it after the final save; call it yourself after a ``save`` of your own.
        """
        self.wait()  # a failed final save raises here (on_save_error="raise"); "warn" exits anyway
        step, reason = self._events.last_committed, self._preempt_reason or self.watcher.reason or "unknown"
        slurm = self.slurm if self.rank == 0 else None
        requeued = slurm is not None and (self.config.requeue if self.config.requeue is not None else slurm.requeue)
        self.journal.record("preempted", step=step, reason=reason, requeue=requeued)
        if self.rank == 0:
            log.warning("preempted (%s): step %s is committed in %s; exiting%s", reason, step, self.storage.url,
                        f", Slurm job {slurm.job_id} requeued" if slurm is not None and requeued else "")
        self.close(clean=False)
        if slurm is not None and requeued:
            requeue(slurm.job_id)
        raise Preempted(step, reason, self.config.preemption_exit_code)

    def save(self, step: int, state: Mapping[str, Any], *, epoch: int | None = None,
             metadata: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
             block: bool = False) -> SaveStats:
        """Save now. Returns once the state is staged (or committed, with ``block=True``).

        ``state`` is the same on every rank (a tensor in it is written once); values that differ by rank
        (a prefetched batch, per-rank counters) go in ``per_rank``, saved in each rank's own file and
        given back to the same rank by :meth:`resume`. A tensor of ``state`` that differs across ranks
        is an error at the commit naming it.

        Raises:
            StateMismatchError: ``step`` is not above every step committed in the directory (a restarted
                counter, or a run pointed at another run's directory); or a key of ``state`` holds a tensor on
                some ranks and another type on others (raised here, on every rank, naming the key and types).
            ConfigError: ``metadata`` nests deeper than a manifest may hold (32 levels).
        """
        self._check_open()
        step = checked_step(step)
        require_state_dict(state)
        self._forget_offered_before(step)
        self._check_step_is_new(step)
        if metadata is not None and not layout.nests_within(metadata, layout.MAX_METADATA_DEPTH):
            raise ConfigError(f"save(metadata=...) nests deeper than {layout.MAX_METADATA_DEPTH} levels, more than a "
                              "manifest may hold (a resume would refuse the step). HINT: flatten it")
        self._announce_start()
        called_at = time.perf_counter()
        self.journal.progress(step, force=True)
        rng = {"rng": rng_state() if self.config.save_rng_state else None}  # fresh objects: no copy needed
        ranked = {"state": to_tree(per_rank) if per_rank is not None else None}
        plain, participants = self._participants.split(state)
        tree = to_tree(plain)
        check_tensors_match(tree, self.groups)
        durable, fast = self._tiers_due(step, participants)
        fields = {"epoch": epoch, "metadata": {**describe_participants(participants), **(metadata or {})}}
        fast_save, tier_write = None, None
        part_only: dict[str, Any] = {}
        if fast and self.fast is not None:
            fast_save = self.fast.started(step, 0.0)
            fast_save.durable = durable
            tier_write = self.fast.writer(fast_save, fields, writers=self.config.writers, part_only=part_only)

        def stage_files() -> dict[str, Any]:  # in the engine's save, once the previous save committed
            own, extra = stage_participants(participants, standalone=fast_save is not None)
            if self.fast is not None and fast_save is not None:
                self.fast.check_room(tree, {**own, **extra})
            part_only.update(extra)
            return own

        stats = self.engine.save(step, tree, per_rank=ranked, owned=rng, files=stage_files, manifest_fields=fields,
                                 listener=self._events, called_at=called_at, durable=durable, tier_write=tier_write)
        self.last_save = stats
        _saved_by_this_process.add(self.storage.url)
        if fast_save is not None:
            fast_save.stall = stats.stall
        if durable:
            self._last_durable, self._last_save_time = stats, time.monotonic()
        if block or not self.config.async_save:
            self.wait()
        return stats

    def has_saved(self, step: int) -> bool:
        """Whether ``step`` (or a later one) was saved to the durable tier by this run or resumed from there: a final
        save would repeat it. (A fast-tier save does not count: a clean end deletes the fast tier.) A save still in
        flight is waited for (call it on every rank): one that fails, or is abandoned (a torn lazy snapshot), does
        not count.

        Example:
            >>> with CheckpointManager("memory://doc/has-saved", interval=2, announce=False) as m:
            ...     _ = m.maybe_save(2, {"step": 2})
            ...     m.has_saved(2), m.has_saved(3)
            (True, False)
        """
        last = self._last_durable
        if last is not None and not last.committed and self.engine.in_flight:
            self.wait()  # its outcome decides: a lazy snapshot found torn at its settling is abandoned, never saved
        saved = last.step if last is not None and last.committed else None
        resumed = self.resumed_from if not self._resumed_from_fast_tier else None
        return any(s is not None and s >= step for s in (saved, resumed))

    def save_final(self) -> SaveStats | None:
        """Save the last step :meth:`maybe_save` was given (or that :meth:`resume` took from the fast tier), with its
        state as it is now, unless it is saved already (:meth:`has_saved`) or the training has gone past it since
        (:meth:`note_step` or :meth:`save` of a later step); returns the save's stats, or None. ``close()`` calls it
        (``final_save``); an integration calls it at the clean end of its loop. Call it on every rank.

        Example:
            >>> with CheckpointManager("memory://doc/final", interval=10, announce=False) as m:
            ...     saved = [m.maybe_save(step, {"step": step}) for step in (1, 2, 3)]
            ...     m.save_final().step, m.save_final()
            (3, None)
        """
        if self._offered is None or self.has_saved(self._offered[0]):
            return None
        step, state, options = self._offered
        return self.save(step, state, **options)

    def _tiers_due(self, step: int, participants: Mapping[str, Any]) -> tuple[bool, bool]:
        """``(durable, fast)``: the tiers a save of ``step`` writes: for :meth:`maybe_save`'s, those :meth:`agree_to_save`
        agreed on; for a save agreed on at an earlier step and made now (the first step a resume can start from after
        it), those agreed on then; else (a save of the caller's own: a final save) the durable tier and, unless the
        agreement for this step said no, the fast one. A state with files of its own that cannot give each rank's alone
        (DeepSpeed's pipeline and expert parallelism, ZeRO's elastic checkpoints) is durable only, and so is a step
        the fast tier holds or is saving already (a final save after a fast-tier save or resume of that step): its
        write would delete that copy of the step first, and a crash there would leave the fast tier without it."""
        due, self._due = self._due, None
        agreed, self._agreed = self._agreed, False
        if due is not None and ((due[0] == step and agreed) or (due[0] < step and (due[1] or due[2]))):
            durable, fast = due[1], due[2]  # maybe_save's; or agreed at an earlier step where no save could be made
        elif due is not None and due[0] == step:  # the caller's own save at a step agreed on without one: a final save
            durable, fast = True, due[2]
        else:
            durable, fast = True, self.fast is not None
        if fast and self._fast_tier_has(step):
            return True, False
        if fast and not stands_alone(participants):  # a rank's part would need files other ranks hold
            if self.rank == 0:
                log.warning("the fast tier does not take state whose files of its own do not load a rank on their "
                            "own (%s): from step %d on, this run saves to the durable tier only",
                            ", ".join(participants), step)
            self._fast_refused = True
            return True, False
        return durable or not fast, fast

    @property
    def _resumed_from_fast_tier(self) -> bool:
        """Whether :meth:`resume` took its step from the fast tier (whose steps the directory may not hold yet)."""
        return (self.resumed_source or "").startswith("fast tier")

    def _fast_tier_has(self, step: int) -> bool:
        """Whether the fast tier resumed ``step`` or its last save was of ``step`` (committed, in flight or failed):
        the same answer on every rank, so that every rank writes the same tiers."""
        last = self.fast.last if self.fast is not None else None
        resumed = self.resumed_from if self._resumed_from_fast_tier else None
        return step in (last.step if last is not None else None, resumed)

    def check_continues_from(self, step: int, *, why: str | None = None) -> None:
        """Raise StateMismatchError now if a run at ``step`` (resumed from elsewhere, e.g. ``fit(ckpt_path=...)``)
        would save at or below steps already committed in the directory; see :meth:`save`."""
        self._check_step_is_new(step + 1, why=why)

    def _check_step_is_new(self, step: int, *, why: str | None = None) -> None:
        """Refuse (StateMismatchError) a step at or below the newest committed in the directory."""
        newest = max((s for s in (self._newest_committed, self._events.last_committed) if s is not None), default=None)
        if newest is not None and step <= newest:
            if why is None and self.resumed_from is not None and self.resumed_from < newest:
                why = (f"this run resumed from step {self.resumed_from} because the newer steps did not fit the state "
                       "passed to resume (the warnings 'skipping step ...' at its start say why; e.g. a param group or "
                       "a layer the training adds as it goes, which must be there before resume)")
            refuse_older_step(self.storage, self.groups, step, newest, why=why, signer=self.signer)

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging: the last save's stall, time to durable and bytes; the interval."""
        out: dict[str, float] = {}
        last = self.last_save
        if last is not None:
            out["stall_s"] = last.stall
            if last.committed:
                out.update(durable_s=last.duration or 0.0, bytes=float(last.bytes or 0))
        out["failed_saves"] = float(self.failed_saves)
        out.update(policy_metrics(self.policy))
        if self.tiers is not None:
            out.update(self.tiers.last_decision)
        return out

    def describe_start(self, position: str | None = None) -> str:
        """Where checkpoints go, what the last ``resume`` found, and when saves come, in one line.

        ``position``: where the resumed run continues in its data, in an integration's words.

        Example:
            >>> m = CheckpointManager("memory://doc/describe", interval=50, announce=False)
            >>> m.describe_start()
            'checkpoints go to memory://doc/describe, a save every 50 steps'
            >>> m.close()
        """
        fast = f"; {self.fast.describe()}: {describe_policy(self.fast.policy)}" if self.fast is not None else ""
        when = describe_policy(self.policy)
        if self.tiers is not None and self.fast is not None:
            when, fast = self.tiers.describe(), f"; {self.fast.describe()}"
        if self.resumed_from is None:
            return f"checkpoints go to {self.storage.url}, {when}{fast}"
        where = f"resuming from step {self.resumed_from}" + (f" ({position})" if position else "")
        source = f" ({self.resumed_source})" if self._resumed_from_fast_tier else ""
        return f"{where} of {self.storage.url}{source}, {when}{fast} ({self.loaded})"

    def _announce_start(self) -> None:
        if self._announced:
            return
        self._announced = True
        if self.announce and self.rank == 0:
            print(f"ft-checkpoint: {self.describe_start()}", file=sys.stderr, flush=True)

    # -- resuming ------------------------------------------------------------------------------
    def resume(self, state: dict[str, Any], *, per_rank: dict[str, Any] | None = None,
               restore_rng: bool = True, check: Callable[[dict[str, Any]], None] | None = None) -> int | None:
        """Load the newest checkpoint that checks and loads into ``state`` in place; returns its step, or None
        on a fresh start.

        Stateful values get ``load_state_dict``; other values of ``state`` are replaced. ``per_rank`` gets
        this rank's own part (see :meth:`save`). The RNG states saved by this rank are restored
        (``restore_rng=False``: kept in :attr:`resumed_rng` for the caller to apply when it chooses).
        ``check(saved_tree)`` may raise StateMismatchError (or CheckpointCorruptError, which sets the step
        aside) to reject a step (the previous one is tried).
        A step that fails anywhere is skipped with a warning and the previous one is tried (see ``resume``).
        """
        self._check_open()
        require_state_dict(state)
        t0 = time.perf_counter()
        self.engine.phase("resuming", -1)
        load = lambda loader, opened: load_state(loader, opened, state, participants=self._participants,  # noqa: E731
                                                 per_rank=per_rank, check=check)
        fast, touched = None, False
        found_in_fast: str | None = None
        why: str | None = "no fast tier"
        asked = False  # whether the fast tier was asked for a step (it holds this run's parts)
        if self.fast is not None and stands_alone(self._participants.split(state)[1]):
            if self._newest_committed is None and not self.groups.on_rank0(self._durable_has_history):
                why = self.fast.forget(f"{self.storage.url} holds no step and no journal of an earlier start (new, or "
                                       "emptied): the fast tier's parts are a deleted run's")
            else:
                fast, touched = self.fast.resume(load, durable_newest=self._newest_committed)
                found_in_fast, why, asked = self.fast.failure_class, self.fast.why, True
        listing, self._listing = self._listing, None  # what this start listed serves its first resume only,
        listing = listing if self.last_save is None else None  # and only before this manager saved anything
        found, source = (fast[:2], fast[2]) if fast is not None else self._durable_or_newer_fast(load, touched, listing,
                                                                                                asked=asked)
        if not (self._newest_committed is None or (found is not None and found[0].step >= self._newest_committed)):
            self._newest_committed = self.latest()  # fell back past the newest: it may be set aside now
        if self.signer is not None and self.rank == 0:
            warn_if_rolled_back(self.storage, found[0].step if found else None)
        if found is None:
            if self.rank == 0:  # the one line is the announcement's (or the integration's): here DEBUG only
                log.debug("no committed checkpoint in %s: starting fresh", self.storage.url)
                self._hint_runs_below()
            self._announce_start()
            return None
        manifest, ranked = found
        self.resumed_rng = ranked.get("rng") if self.config.save_rng_state else None
        if restore_rng and self.resumed_rng is not None:
            set_rng_state(self.resumed_rng)
        seconds = time.perf_counter() - t0
        self.resumed_from, self.resumed_source = manifest.step, source
        tier = "fast" if self._resumed_from_fast_tier else "durable"
        if tier == "durable":  # a fast-tier step is not in the directory: a save of it there is still to come
            self._events.last_committed = manifest.step
        else:  # a clean end with no later step saves it there (a crash after the last step's fast save, say)
            metadata = {k: v for k, v in manifest.metadata.items() if k != layout.FAST_TIER}
            self._offered = (manifest.step, state, {"epoch": manifest.epoch, "metadata": metadata, "per_rank": per_rank})
        self.journal.record("resume", step=manifest.step, seconds=seconds, bytes=manifest.total_bytes, tier=tier,
                            source=source, failure_class=found_in_fast, why=why if tier == "durable" else None)
        if self.tiers is not None and self.rank == 0:
            self.tiers.observe_failure(found_in_fast)
            if tier == "fast":  # the durable tier's next save comes as long after its newest step as planned
                self._last_save_time -= self._durable_age(manifest, listing)
        self.loaded = f"{human_bytes(manifest.total_bytes)} verified and loaded in {human_seconds(seconds)}"
        if self.rank == 0:
            log.debug("resuming from step %d (%s): %s", manifest.step, source, self.loaded)
            self._warn_if_saved_by_this_process(manifest.step)
        self._announce_start()
        return manifest.step

    def _warn_if_saved_by_this_process(self, step: int) -> None:
        """A resume from a directory an earlier manager of this process saved to: usually a new training that was
        meant to start fresh (the next fold of a cross-validation, a retry with a smaller batch size, a notebook
        cell run again), which would continue the earlier one's weights and position instead."""
        if self.storage.url in _saved_by_this_process:
            log.warning("resuming from step %d of %s, which this process saved (a checkpoint manager before this "
                        "one): the training goes on from there, as meant if it continues that one. HINT: a new "
                        "training in the same process (the next fold of a cross-validation, a retry with another "
                        "batch size) needs a dirpath of its own", step, self.storage.url)

    def _hint_runs_below(self) -> None:
        """A fresh start in a directory without a step, but with folders right below it that hold steps (a run's
        parent, a Lightning ``default_root_dir``): warn, naming them, since the job would train from scratch."""
        try:
            below = layout.checkpoint_dirs_below(self.storage, limit=3)
        except StorageError as e:
            log.debug("the folders below %s could not be listed: %s", self.storage.url, e)
            return
        if below:
            log.warning("no checkpoint in %s, but %s right below it %s steps: this job starts from scratch. HINT: to "
                        "resume that run, pass dirpath=%r", self.storage.url, ", ".join(below),
                        "holds" if len(below) == 1 else "hold", below[0])

    def _durable_or_newer_fast(self, load: Callable[[StepLoader, Any], Any], touched: bool,
                               listing: layout.Listing | None, *, asked: bool) -> tuple[Any, str]:
        """``(found, source)``: the durable tier's newest step that checks and loads (see :meth:`_resume_durable`).
        Where that is not its newest (which failed), or none is, the fast tier's steps were ruled out as older than
        that newest, and one newer than what was found is the newest step that checks: it is tried then (``asked``:
        the fast tier holds this run's parts). A fast-tier load that fails after changing the state has the durable
        step loaded again (or, none, raises CheckpointCorruptError)."""
        try:
            found, source, error = *self._resume_durable(load, touched, listing), None
        except CheckpointCorruptError as e:  # no durable step loads, and one failed after changing the state
            found, source, error = None, "", e
        newest = self._newest_committed
        if asked and self.fast is not None and newest is not None and (found is None or found[0].step < newest):
            fast, fast_touched = self.fast.resume(load, durable_newest=found[0].step + 1 if found is not None else None)
            if fast is not None:
                return fast[:2], fast[2]
            if fast_touched:  # the durable step again, or (none) an error: the state may be partly overwritten
                return self._resume_durable(load, True, None)
        if error is not None:
            raise error
        return found, source

    def _durable_age(self, fast: layout.Manifest, listing: layout.Listing | None) -> float:
        """How long the fast-tier step ``fast`` was saved after the durable tier's newest step (seconds; inf: none);
        its manifest from ``listing`` if there."""
        if self._newest_committed is None:
            return float("inf")
        try:
            known = listing.manifests.get(self._newest_committed) if listing is not None else None
            durable = known if known is not None else layout.read_manifest(self.storage, self._newest_committed)
            return max(0.0, fast.time - durable.time)
        except (StorageError, CheckpointCorruptError, ValueError) as e:
            log.debug("the durable tier's newest step has no readable time: %s", e)
            return 0.0

    def _fast_committed(self, save: FastSave) -> None:
        """A fast-tier save committed (the writer thread): its step goes into the journal's progress note, and the
        cost of a save to the fast tier only (its stall and the slowdown of the steps while it was written) to the
        fast tier's interval; a save to both tiers is measured when its durable part commits."""
        self.journal.note_fast_step(save.step)
        if save.durable:
            return
        cost = self._cost.cost(save.stall)
        learner = self.tiers.fast if self.tiers is not None else self.fast.adaptive if self.fast is not None else None
        if learner is not None:
            learner.observe_save(cost=cost, durable=save.duration or 0.0)

    def _resume_durable(self, load: Callable[[StepLoader, Any], Any], touched: bool,
                        listing: layout.Listing | None) -> tuple[Any, str]:
        """``(found, source)`` from the durable tier (see ``resume_newest``); ``touched``: a fast-tier step failed while
        it was loaded into the state, so finding nothing here is an error, not a fresh start. ``listing``: the steps
        and manifests this start read already (None: list them now)."""
        reader = layout.ManifestReader(self.storage, known=listing.outcomes if listing is not None else None)
        found = resume_newest(
            self.storage, self.groups, open_step=self.loader.open_step,
            check=lambda step: check_for_resume(self.storage, step, rank=self.rank, world_size=self.groups.world_size,
                                                signer=self.signer, reader=reader),
            load=lambda opened: load(self.loader, opened), touches=lambda opened: opened.touches,
            steps=list(listing.steps) if listing is not None else None)
        if found is None and touched:
            raise CheckpointCorruptError(
                "a fast-tier step failed while it was loaded into the state, which may now be partly overwritten, "
                f"and {self.storage.url} has no step to load instead. HINT: start the job again: it will start fresh")
        return found, self.storage.url_of(layout.step_dir(found[0].step)) if found is not None else self.storage.url

    def latest(self) -> int | None:
        """The newest step whose manifest parses (with a signing key, whose signature verifies; its data not
        verified: ``resume`` verifies)."""
        return self.groups.on_rank0(lambda: layout.Listing.of(self.storage, signer=self.signer).newest)

    # -- lifecycle -----------------------------------------------------------------------------
    def wait(self, *, retention: bool = False) -> SaveStats | None:
        """Block until the save in flight committed; a background error is raised (or warned about). With
        ``retention``, also until the deletions that commit started are done.

        When distributed, call it on every rank (as ``save``): a save commits once every rank's copy of the
        state is settled, and with the lazy snapshot a rank settles its copy on its own training thread (at its
        next optimizer step, save, wait or close). A ``wait`` on one rank while the others go on to a collective
        of the training (DDP's all-reduce) waits for each other forever.

        Example:
            >>> import torch
            >>> with CheckpointManager("memory://doc/wait", interval=1) as ckpt:
            ...     _ = ckpt.save(1, {"w": torch.ones(2)})
            ...     ckpt.wait().step
            1
        """
        try:
            return self.engine.wait()
        except SaveError as e:
            self._events.save_failed(e)
            return None
        finally:
            if retention:
                self._events.wait_for_retention()

    def close(self, *, clean: bool = True, final: bool | None = None) -> None:
        """Drain the save in flight, then release the writer. ``clean`` records a clean end in the journal.

        ``final``: on a clean close, first save the last step :meth:`maybe_save` was given unless it is saved
        already (:meth:`save_final`); None takes ``final_save`` from the config (default True).
        """
        if self._closed:
            return
        try:
            if clean and (self.config.final_save if final is None else final):
                self.save_final()
            self.wait()  # a failed drain raises here (on_save_error="raise"): that is no clean end
        finally:
            self._closed = True
            atexit.unregister(self._close_at_exit)
            self.watcher.close()
            self.engine.close()
            self._events.close()
            self.journal.close()
            if self.rank == 0:
                self.lease.release()
        if clean:
            self.journal.record("clean_end", last_step=self.last_save.step if self.last_save else None)
        if self.fast is not None:
            self.fast.close(clean=clean)
        self.groups.destroy()

    def _close_at_exit(self) -> None:
        """At interpreter exit, if the program did not close the manager (a loop without ``with`` or
        ``close()``): a clean end, unless an uncaught exception is ending the program (the interpreter sets
        ``sys.last_value`` when it prints one), so that a forgotten close is not counted as a failure."""
        crashed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        log.debug("closing at interpreter exit (%s)", "after an uncaught exception" if crashed else "a clean end")
        if crashed:
            self.close_after(crashed)
            return
        try:
            self.close(final=False)  # the ranks may be gone already: no collective save at exit
        except Exception as e:  # nothing can be raised to anyone at exit
            log.error("closing the checkpoint manager at interpreter exit failed: %s: %s", type(e).__name__, e)

    def close_after(self, error: BaseException) -> None:
        """Close after the training raised ``error``: no clean end, no final save, and nothing raised. What
        matters is the training's own traceback, so a save in flight that failed too is one log line (no
        traceback); when ``error`` says a peer rank is gone, one line says so and where the job resumes.
        ``with CheckpointManager(...)`` calls it when its block raises.

        Example:
            >>> m = CheckpointManager("memory://doc/close-after", interval=2, announce=False)
            >>> m.close_after(RuntimeError("Read error: Connection reset by peer"))   # logs one warning
            >>> m.closed
            True
        """
        try:
            self.close(clean=False)
            failed = None
        except Exception as e:
            failed = e
        newest = self._events.last_committed if self._events.last_committed is not None else self.resumed_from
        resumes = f"a restart resumes from step {newest}, the newest committed" if newest is not None \
            else "a restart starts fresh"
        fast = self.fast.committed if self.fast is not None else None
        if fast is not None and (newest is None or fast > newest):
            fallback = f"from step {newest}" if newest is not None else "fresh"
            resumes = f"a restart resumes from step {fast}, the fast tier's newest ({fallback} where its copies are lost)"
        if peer_lost(error):
            lost = "; the save in flight did not commit" if failed is not None else ""
            log.warning("rank %d stops: a peer rank is gone (%s)%s; %s", self.rank,
                        short_error(error), lost, resumes)
        elif failed is not None:
            log.error("while closing after %s, the save in flight failed too (%s); %s", type(error).__name__,
                      short_error(failed), resumes)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, *_: Any) -> None:
        if exc is None:
            self.close()
            return
        self.close_after(exc)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed; create a new one")


def checked_step(step: Any) -> int:
    """``step`` as an int (a NumPy or torch integer too); ConfigError, naming what was passed, if it is no integer
    in [0, 10**12).

    Example:
        >>> import numpy
        >>> checked_step(numpy.int64(7))
        7
    """
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise ConfigError(f"step must be an int (the number of optimizer steps done); got {type(step).__name__} "
                          f"{step!r}") from None
    if not 0 <= value < layout.MAX_STEP:
        raise ConfigError(f"step={value} is invalid: the number of optimizer steps done, in [0, 10**12)")
    return value
