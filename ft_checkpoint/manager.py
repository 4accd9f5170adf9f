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
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ft_checkpoint import layout
from ft_checkpoint.adaptive.failures import count_failures
from ft_checkpoint.adaptive.policy import AdaptiveInterval
from ft_checkpoint.background import submit
from ft_checkpoint.config import CheckpointConfig
from ft_checkpoint.cost import CostMeter
from ft_checkpoint.dist import Groups
from ft_checkpoint.engine import CheckpointEngine, OpenedStep, SaveStats
from ft_checkpoint.errors import ConfigError, LeaseError, Preempted, SaveError, StateMismatchError, StorageError
from ft_checkpoint.journal import Journal, attempt_summaries
from ft_checkpoint.lease import Lease
from ft_checkpoint.policy import (
    EveryInterval,
    EveryNSteps,
    SaveContext,
    SavePolicy,
    policy_from_interval,
)
from ft_checkpoint.preemption import PreemptionWatcher
from ft_checkpoint.resume import check_for_resume, resume_newest
from ft_checkpoint.retention import apply_retention
from ft_checkpoint.slurm import SlurmJob, requeue
from ft_checkpoint.state import (
    StepFiles,
    describe_participants,
    is_deepspeed_engine,
    load_tree_into,
    rng_state,
    set_rng_state,
    split_participants,
    stage_participants,
    to_tree,
)
from ft_checkpoint.storage import Storage
from ft_checkpoint.units import human_bytes, human_seconds, parse_duration

log = logging.getLogger(__name__)


def _warn_unused(keys: list[str], what: str, rank: int) -> None:
    if keys and rank == 0:
        log.warning("the checkpoint also holds %s keys %s, which the %s passed to resume() does not have: they "
                    "were not loaded anywhere", what, keys[:10], what)


class _SaveEvents:
    """What the engine reports about a save, turned into journal events, commits and retention."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager

    def on_write_start(self, stats: SaveStats) -> None:
        self.manager.journal.record("save_started", step=stats.step, stall=stats.stall, background=True)

    def check_writable(self, stats: SaveStats) -> None:
        self.manager.lease.check_owned()  # a job that lost the directory to another stops writing there

    def on_commit(self, stats: SaveStats) -> None:
        self.manager._after_commit(stats)

    def on_previous_error(self, error: SaveError) -> None:
        self.manager._save_failed(error)


def _find(policy: Any, kind: type) -> Any:
    """The first policy of type ``kind`` in ``policy`` (which may be an AnyOf), or None."""
    if isinstance(policy, kind):
        return policy
    for p in getattr(policy, "policies", ()):
        if (found := _find(p, kind)) is not None:
            return found
    return None


class CheckpointManager:
    """Asynchronous, fault-tolerant checkpoints of a training loop in one directory.

    Args:
        dirpath: Local path or fsspec URL; falls back to ``FT_CHECKPOINT_DIRPATH`` / the config file.
        policy: A :class:`~ft_checkpoint.policy.SavePolicy`; default: the one ``interval`` names.
        **config: Any :class:`~ft_checkpoint.config.CheckpointConfig` field (``interval``, ``keep_last``,
            ``storage_options``, ...). Explicit arguments win over env vars, which win over the file.

    A DeepSpeed engine in ``state`` saves itself through DeepSpeed's own files (see ``ft_checkpoint.deepspeed``).

    Every rank of a distributed job must create the manager and call ``resume``/``maybe_save``/
    ``save``/``close`` at the same steps (the step-based policies guarantee it; time-based ones are
    decided by rank 0 and broadcast).

    Closing: ``with CheckpointManager(...)`` or ``close()`` waits for the last save and records a clean end;
    a manager still open at interpreter exit is closed then (a clean end unless an uncaught exception is
    ending the program).

    Preemption: the signals in ``preemption_signals`` (SIGTERM, SIGUSR1) and, on Slurm, the job's
    time limit only raise a flag; at the next ``maybe_save`` every rank agrees, the step is saved
    and committed, the journal records the preemption, a Slurm job is requeued (rank 0), and
    :class:`~ft_checkpoint.errors.Preempted` (a ``SystemExit``) ends the process cleanly.
    Create the manager on the main thread for the signal handlers.
    """

    def __init__(self, dirpath: str | None = None, *, policy: SavePolicy | None = None, announce: bool = True,
                 **config: Any) -> None:
        self.config = CheckpointConfig.from_env(dirpath=dirpath, **config)
        self.announce = announce
        """Print where checkpoints go, the resume and when the first save is due, once, on stderr (rank 0).
        Integrations with a channel of their own (Lightning's rank-zero info) pass False and use
        :meth:`describe_start`."""
        self._announced = False
        if self.config.dirpath is None:
            raise ConfigError("dirpath is required: pass it, set FT_CHECKPOINT_DIRPATH, or put it in the "
                              "YAML file named by FT_CHECKPOINT_CONFIG")
        self.storage = Storage(self.config.dirpath, self.config.storage_options, retries=self.config.retries)
        self.groups = Groups.create()
        self.groups.on_rank0(self.storage.ensure_root)
        c = self.config
        self.policy = policy or policy_from_interval(
            c.interval, world_size=self.groups.world_size, mtbf=c.mtbf, gpu_failure_rate=c.gpu_failure_rate,
            min_interval=c.min_interval, max_interval=c.max_interval)
        self.adaptive = _find(self.policy, AdaptiveInterval)
        self.journal = Journal(self.storage, enabled=self.groups.rank == 0,
                               progress_every=parse_duration(c.progress_interval))
        self.lease = Lease(self.storage, attempt=self.journal.attempt)
        self.groups.on_rank0(lambda: self.lease.acquire(force=c.force_takeover))
        self.engine = CheckpointEngine(self.storage, self.groups, writers=c.writers, writer=c.writer,
                                       priority=c.writer_priority)
        self.slurm = SlurmJob.detect(query=self.rank == 0)
        """The Slurm job this runs in (None outside Slurm); its requeue flag and end time on rank 0 only."""
        self.watcher = PreemptionWatcher(c.preemption_signals, end_time=self.slurm and self.slurm.end_time,
                                         margin=parse_duration(c.end_time_margin))
        self.journal.record("attempt_start", world_size=self.groups.world_size,
                            progress_interval=parse_duration(c.progress_interval),
                            preemption_signals=self.watcher.signals)
        if self.adaptive is not None and self.rank == 0:
            self._learn_failures()
        self.preempted = False
        """A preemption was announced (on any rank); set it yourself for a notice of your own: the next
        ``maybe_save`` then makes the final save and exits."""
        self._preempt_reason: str | None = None
        self.last_save: SaveStats | None = None
        self.resumed_from: int | None = None
        self.failed_saves = 0
        """Saves that failed (with ``on_save_error="warn"`` training goes on after them)."""
        self._last_committed: int | None = None
        self._newest_committed: int | None = self.groups.on_rank0(
            lambda: max(layout.committed_steps(self.storage), default=None))
        self._events = _SaveEvents(self)
        self._wrapped: dict[str, Any] = {}
        self.resumed_rng: dict[str, Any] | None = None
        """The RNG states the last resume found for this rank (see ``resume(restore_rng=False)``)."""
        self._last_save_time = time.monotonic()
        self._cost = CostMeter()
        self._cleanup = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-checkpoint-retention")
        atexit.register(self._close_at_exit)
        self._closed = False

    def _learn_failures(self) -> None:
        """Feed the adaptive policy this job's failures and exposure from the journal (rank 0)."""
        summaries = attempt_summaries(self.storage)
        failures, exposure = count_failures(summaries)
        cost = next((s["save_cost"] for s in reversed(summaries) if s.get("save_cost") is not None), None)
        self.adaptive.observe_history(failures, exposure, cost=cost)  # a known cost replaces the guess
        est = self.adaptive.model.estimate(failures, exposure)
        log.info("adaptive interval: %d failures in %.3g h of this job so far; MTBF estimate %.3g h (+/-%.0f%%)",
                 failures, exposure / 3600, est.mtbf / 3600, 100 * est.relative_uncertainty)

    @property
    def rank(self) -> int:
        return self.groups.rank

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

    def should_save(self, step: int) -> bool:
        """This rank's answer to "save at ``step``?": the policy's, or a preemption notice on this rank.
        No side effect and no collective: see :meth:`agree_to_save` for the answer every rank shares."""
        return self.policy.should_save(self._context(step, self._notice()))

    def _context(self, step: int, notice: str | None) -> SaveContext:
        last = self.last_save
        return SaveContext(
            step=step, now=time.monotonic(), last_save_step=last.step if last else self.resumed_from,
            last_save_time=self._last_save_time, last_stall=last.stall if last else None,
            last_duration=last.duration if last else None, save_in_flight=self.engine.in_flight,
            preempted=notice is not None)

    def agree_to_save(self, step: int) -> bool:
        """Whether every rank saves at ``step`` (a collective when distributed: call it on every rank at the
        same steps): rank 0's policy answer for time-based policies, a preemption notice on any rank
        (then :attr:`preempted` is set), and a LeaseError on every rank if rank 0 lost the directory's lease."""
        notice = self._notice()
        ctx = self._context(step, notice)
        decision, lost = self.policy.should_save(ctx), self.rank == 0 and self.lease.lost
        if self.groups.distributed:  # one collective: rank 0's decision and lease, anyone's notice
            votes = self.groups.all_gather((decision, notice, lost))
            decision = votes[0][0] if not self.policy.deterministic else decision
            notice = next((f"{n} on rank {r}" for r, (_, n, _) in enumerate(votes) if n), None)
            lost = votes[0][2]
        if lost:
            raise LeaseError(f"another job took over the checkpoint directory {self.storage.url}; this job stops "
                             "saving there. HINT: give each job its own dirpath; see the warning about lease.json")
        self._preempt_reason = self._preempt_reason or notice  # the first notice agreed on
        self.preempted = notice is not None
        return decision or (self.preempted and step != ctx.last_save_step)

    def _notice(self) -> str | None:
        """This rank's preemption notice: a signal's name, ``"job end time"``, or set by the program."""
        if self.watcher.check():
            return self.watcher.reason
        return "preempted set by the program" if self.preempted else None

    def maybe_save(self, step: int, state: dict[str, Any], *, epoch: int | None = None,
                   metadata: dict[str, Any] | None = None) -> bool:
        """Save ``state`` as ``step`` if the policy says so; returns whether a save started.

        Call it at a step boundary (after the optimizer step), with the number of completed steps.
        """
        self.note_step(step)
        if not self.agree_to_save(step):
            return False
        self.save(step, state, epoch=epoch, metadata=metadata)
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
        step, reason = self._last_committed, self._preempt_reason or self.watcher.reason or "unknown"
        requeued = self.rank == 0 and self.slurm is not None and self._should_requeue()
        self.journal.record("preempted", step=step, reason=reason, requeue=requeued)
        if self.rank == 0:
            log.warning("preempted (%s): step %s is committed in %s; exiting%s", reason, step, self.storage.url,
                        f", Slurm job {self.slurm.job_id} requeued" if requeued else "")
        self.close(clean=False)
        if requeued:
            requeue(self.slurm.job_id)
        raise Preempted(step, reason, self.config.preemption_exit_code)

    def _should_requeue(self) -> bool:
        if self.config.requeue is not None:
            return self.config.requeue
        return self.slurm.requeue

    def save(self, step: int, state: dict[str, Any], *, epoch: int | None = None,
             metadata: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
             block: bool = False) -> SaveStats:
        """Save now. Returns once the state is staged (or committed, with ``block=True``).

        ``state`` is the same on every rank (a tensor in it is written once); values that differ by rank
        (a prefetched batch, per-rank counters) go in ``per_rank``, saved in each rank's own file and
        given back to the same rank by :meth:`resume`. A tensor of ``state`` that differs across ranks
        is an error at the commit naming it.

        Raises:
            StateMismatchError: ``step`` is not above every step committed in the directory (a restarted
                counter, or a run pointed at another run's directory).
        """
        self._check_open()
        self._check_step_is_new(step)
        self._announce_start()
        called_at = time.perf_counter()
        self.journal.progress(step, force=True)
        ranked = {"rng": rng_state() if self.config.save_rng_state else None,
                  "state": to_tree(per_rank) if per_rank is not None else None}
        plain, participants = self._split_state(state)
        described = describe_participants(participants)
        stats = self.engine.save(step, to_tree(plain), per_rank=ranked, files=lambda: stage_participants(participants),
                                 manifest_fields={"epoch": epoch, "metadata": {**described, **(metadata or {})}},
                                 listener=self._events, called_at=called_at)
        self.last_save = stats
        self._last_save_time = time.monotonic()
        if block or not self.config.async_save:
            self.wait()
        return stats

    def check_continues_from(self, step: int, *, why: str | None = None) -> None:
        """Raise StateMismatchError now if a run at ``step`` (resumed from elsewhere, e.g. ``fit(ckpt_path=...)``)
        would save at or below steps already committed in the directory; see :meth:`save`."""
        self._check_step_is_new(step + 1, why=why)

    def _check_step_is_new(self, step: int, *, why: str | None = None) -> None:
        """Refuse a step at or below the newest one committed in the directory: retention would delete the new
        save right after it commits (it keeps the highest steps), and a crash would resume the old steps."""
        newest = self._newest_committed
        if newest is None or step > newest:
            return
        newer = self.groups.on_rank0(lambda: [s for s in layout.committed_steps(self.storage) if s >= step])
        paths = " ".join(self.storage.url_of(layout.step_dir(s)) for s in newer[:3]) + (" ..." if len(newer) > 3 else "")
        raise StateMismatchError(
            f"cannot save step {step} in {self.storage.url}: step {newest} is committed there already "
            f"({why or 'a run pointed at another run directory, a restarted step counter, or a resume that fell back past steps that did not fit the state'}). "
            "Retention would delete the new steps right after their commit, and a crash would resume the old ones. "
            f"HINT: give this run its own dirpath, or continue the step count from the resumed step, or, if the newer "
            f"steps are unwanted, delete them first ({paths})")

    def _save_failed(self, error: SaveError) -> None:
        """A save failed: journal it, then raise (``on_save_error="raise"``, or a state that cannot be saved
        as given) or warn loudly and go on."""
        self.failed_saves += 1
        self.journal.record("save_failed", error=str(error), background=True)
        if self.config.on_save_error == "raise" or isinstance(error.__cause__, (ConfigError, LeaseError)):
            raise error
        log.warning("CHECKPOINT SAVE FAILED (%d so far), training continues; resume would use step %s. %s",
                    self.failed_saves, self._last_committed, error)

    def _after_commit(self, stats: SaveStats) -> None:
        """On the writer thread, after a commit: journal, log, retention (rank 0)."""
        self._last_committed = self._newest_committed = stats.step
        self.watcher.margin = max(parse_duration(self.config.end_time_margin), 2 * (stats.duration or 0.0))
        if self.rank != 0:
            return
        self.journal.record("commit", step=stats.step, stall=stats.stall, waited=stats.waited,
                            duration=stats.duration, bytes=stats.bytes, background=True)
        log.info("committed step %d to %s: %s, stall %.3f s, durable after %.2f s", stats.step,
                 self.storage.url, human_bytes(stats.bytes or 0), stats.stall, stats.duration or 0.0)
        submit(self._cleanup, self._retention, stats.step)  # off the save's path: the next save need not wait
        if self.adaptive is not None:
            self.adaptive.observe_save(cost=self._cost.cost(stats.stall), durable=stats.duration or 0.0)
            self.journal.save_cost = self.adaptive.cost

    def _retention(self, step: int) -> None:
        """Rank 0, on its own thread after each commit: delete what the retention rules say."""
        self.engine.phase("retention", step)
        try:  # the step is committed: a failed clean-up must not make the save look failed
            self.lease.check_owned()  # never delete in a directory another job took over
            apply_retention(self.storage, keep_last=self.config.keep_last,
                            keep_every_n_steps=self.config.keep_every_n_steps, protect=step)
        except (StorageError, LeaseError) as e:
            log.warning("retention after step %d failed (will retry after the next commit): %s", step, e)

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging: the last save's stall, time to durable and bytes; the interval."""
        out: dict[str, float] = {}
        last = self.last_save
        if last is not None:
            out["stall_s"] = last.stall
            if last.committed:
                out.update(durable_s=last.duration or 0.0, bytes=float(last.bytes or 0))
        out["failed_saves"] = float(self.failed_saves)
        if self.adaptive is not None:
            out.update(self.adaptive.last_decision)
        else:
            fixed = _find(self.policy, EveryInterval) or _find(self.policy, EveryNSteps)
            if isinstance(fixed, EveryInterval):
                out["interval_s"] = fixed.seconds
            elif fixed is not None:
                out["interval_steps"] = float(fixed.n)
        return out

    def describe_start(self) -> str:
        """Where checkpoints go, what the last ``resume`` found, and when saves come, in one line.

        Example:
            >>> m = CheckpointManager("memory://doc/describe", interval=50, announce=False)
            >>> m.describe_start()
            'checkpoints go to memory://doc/describe, a save every 50 steps'
            >>> m.close()
        """
        where = f"checkpoints go to {self.storage.url}"
        if self.resumed_from is not None:
            where = f"resuming from step {self.resumed_from} of {self.storage.url}"
        return f"{where}, {self._describe_interval()}"

    def _describe_interval(self) -> str:
        fixed = _find(self.policy, EveryNSteps) or _find(self.policy, EveryInterval)
        if self.adaptive is not None:
            d = self.adaptive.last_decision
            due = d["interval_s"]
            return (f"adaptive interval: the first save comes about {human_seconds(due)} in (save cost "
                    f"{'guessed' if self.adaptive.cost is None else 'measured'} {d['cost_s']:.3g} s, MTBF "
                    f"{human_seconds(d['mtbf_s'])}); a shorter run saves only on a preemption notice. HINT: set "
                    "interval= (steps or a duration) to choose")
        if isinstance(fixed, EveryNSteps):
            return f"a save every {fixed.n} steps"
        if isinstance(fixed, EveryInterval):
            return f"a save every {human_seconds(fixed.seconds)}"
        return f"saves when {self.policy!r} says so"

    def _announce_start(self, detail: str | None = None) -> None:
        if self._announced:
            return
        self._announced = True
        if self.announce and self.rank == 0:
            text = self.describe_start() + (f" ({detail})" if detail else "")
            print(f"ft-checkpoint: {text}", file=sys.stderr, flush=True)

    # -- resuming ------------------------------------------------------------------------------
    def resume(self, state: dict[str, Any], *, per_rank: dict[str, Any] | None = None,
               restore_rng: bool = True, check: Callable[[dict[str, Any]], None] | None = None) -> int | None:
        """Load the newest checkpoint that checks and loads into ``state`` in place; returns its step, or None
        on a fresh start.

        Stateful values get ``load_state_dict``; other values of ``state`` are replaced. ``per_rank`` gets
        this rank's own part (see :meth:`save`). The RNG states saved by this rank are restored
        (``restore_rng=False``: kept in :attr:`resumed_rng` for the caller to apply when it chooses).
        ``check(saved_tree)`` may raise StateMismatchError to reject a step (the previous one is tried).
        A step that fails anywhere is skipped with a warning and the previous one is tried (see ``resume``).
        """
        self._check_open()
        t0 = time.perf_counter()
        self.engine.phase("resuming", -1)
        found = resume_newest(
            self.storage, self.groups, open_step=self.engine.open_step,
            check=lambda step: check_for_resume(self.storage, step, rank=self.rank, world_size=self.groups.world_size),
            load=lambda opened: self._load(opened, state, per_rank, check), touches=lambda opened: opened.touches)
        if found is None:
            self._newest_committed = self.groups.on_rank0(lambda: max(layout.committed_steps(self.storage), default=None))
            if self.rank == 0:
                log.info("no committed checkpoint in %s: starting fresh", self.storage.url)
            self._announce_start()
            return None
        manifest, ranked = found
        self._newest_committed = self.groups.on_rank0(lambda: max(layout.committed_steps(self.storage), default=None))
        self.resumed_rng = ranked.get("rng") if self.config.save_rng_state else None
        if restore_rng and self.resumed_rng is not None:
            set_rng_state(self.resumed_rng)
        seconds = time.perf_counter() - t0
        self.resumed_from = self._last_committed = manifest.step
        self.journal.record("resume", step=manifest.step, seconds=seconds, bytes=manifest.total_bytes)
        if self.rank == 0:
            log.info("resuming from step %d (%s): %s verified and loaded in %.1f s", manifest.step,
                     self.storage.url_of(layout.step_dir(manifest.step)), human_bytes(manifest.total_bytes), seconds)
        self._announce_start(f"{human_bytes(manifest.total_bytes)} verified and loaded in {seconds:.1f} s")
        return manifest.step

    def _load(self, opened: OpenedStep, state: dict[str, Any], per_rank: dict[str, Any] | None,
              check: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        """Load one opened step into ``state`` (and ``per_rank``); returns what the rank file held per rank."""
        plain, participants = self._split_state(state)
        tree, ranked = self.engine.load(opened, to_tree(plain))
        if check is not None:
            check(tree)
        ranked = {"rng": ranked.get("rng"), "state": ranked.get("state")}  # 0.1's rank files hold only "rng"
        if per_rank is not None:
            if ranked.get("state") is None:
                raise StateMismatchError("the checkpoint has no per-rank state, but per_rank= was passed. "
                                         "HINT: pass the same per_rank keys to resume() as to save()")
            _warn_unused(load_tree_into(per_rank, ranked["state"]), "per_rank", self.rank)
        _warn_unused(load_tree_into(plain, tree), "state", self.rank)
        state.update(plain)  # values replaced (not loaded in place) go back into the caller's dict
        manifest = opened.manifest
        for key, participant in participants.items():
            opened.touches = True  # from here on a failure may leave the participant half loaded
            participant.load_files(StepFiles(
                read=lambda name: self.engine.read_file(manifest, name), names=frozenset(manifest.files),
                metadata=manifest.metadata.get(key), step=manifest.step, world_size=manifest.world_size))
        return ranked

    def _split_state(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(the rest of state, its files participants)``. A DeepSpeed engine is one: it is wrapped in a
        :class:`~ft_checkpoint.deepspeed.DeepSpeedState`, the same one at every save of this manager (it keeps
        its staging buffers); with several engines in the state, each one's files are prefixed by its key."""
        plain, participants = split_participants(state)
        engines = [k for k, v in plain.items() if is_deepspeed_engine(v)]
        for key in engines:
            engine = plain.pop(key)
            wrapped = self._wrapped.get(key)
            if wrapped is None or wrapped.engine is not engine:
                from ft_checkpoint.deepspeed import DeepSpeedState  # DeepSpeed is an optional extra

                wrapped = self._wrapped[key] = DeepSpeedState(engine, prefix="" if len(engines) == 1 else f"{key}.")
            participants[key] = wrapped
        return plain, participants

    def latest(self) -> int | None:
        """The newest step whose manifest parses (its data not verified; ``resume`` verifies)."""
        return self.groups.on_rank0(lambda: max(layout.committed_steps(self.storage), default=None))

    # -- lifecycle -----------------------------------------------------------------------------
    def wait(self, *, retention: bool = False) -> SaveStats | None:
        """Block until the save in flight committed; a background error is raised (or warned about). With
        ``retention``, also until the deletions that commit started are done."""
        try:
            return self.engine.wait()
        except SaveError as e:
            self._save_failed(e)
            return None
        finally:
            if retention:
                submit(self._cleanup, lambda: None).result()

    def close(self, *, clean: bool = True) -> None:
        """Drain the save in flight, then release the writer. ``clean`` records a clean end in the journal."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        try:
            self.wait()  # a failed drain raises here (on_save_error="raise"): that is no clean end
        finally:
            self.watcher.close()
            self.engine.close()
            self._cleanup.shutdown(wait=True)
            self.journal.close()
            if self.rank == 0:
                self.lease.release()
        if clean:
            self.journal.record("clean_end", last_step=self.last_save.step if self.last_save else None)

    def _close_at_exit(self) -> None:
        """At interpreter exit, if the program did not close the manager (a loop without ``with`` or
        ``close()``): a clean end, unless an uncaught exception is ending the program (the interpreter sets
        ``sys.last_value`` when it prints one), so that a forgotten close is not counted as a failure."""
        crashed = getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
        log.debug("closing at interpreter exit (%s)", "after an uncaught exception" if crashed else "a clean end")
        try:
            self.close(clean=not crashed)
        except Exception:  # nothing can be raised to anyone at exit
            log.exception("closing the checkpoint manager at interpreter exit failed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the training's exception matters more than a failed drain: log this one
            self.close(clean=False)
        except Exception:
            log.exception("while closing after %s, the last save failed too", exc_type.__name__)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed; create a new one")
