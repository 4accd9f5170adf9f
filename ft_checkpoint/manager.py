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

import logging
import time
from typing import Any

from ft_checkpoint import layout
from ft_checkpoint.config import CheckpointConfig, parse_duration
from ft_checkpoint.dist import Groups
from ft_checkpoint.engine import CheckpointEngine, SaveStats
from ft_checkpoint.errors import CheckpointCorruptError, ConfigError, Preempted, SaveError, StorageError
from ft_checkpoint.failures import count_failures
from ft_checkpoint.journal import Journal, attempt_summaries
from ft_checkpoint.lease import Lease
from ft_checkpoint.policy import (
    AdaptiveInterval,
    EveryInterval,
    EveryNSteps,
    SaveContext,
    SavePolicy,
    policy_from_interval,
)
from ft_checkpoint.preemption import PreemptionWatcher
from ft_checkpoint.resume import find_resume_step, quarantine, warn_skipped
from ft_checkpoint.retention import apply_retention, list_steps
from ft_checkpoint.slurm import SlurmJob, requeue
from ft_checkpoint.state import load_tree_into, rng_state, set_rng_state, to_tree
from ft_checkpoint.storage import Storage

log = logging.getLogger(__name__)


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

    Every rank of a distributed job must create the manager and call ``resume``/``maybe_save``/
    ``save``/``close`` at the same steps (the step-based policies guarantee it; time-based ones are
    decided by rank 0 and broadcast).

    Preemption: the signals in ``preemption_signals`` (SIGTERM, SIGUSR1) and, on Slurm, the job's
    time limit only raise a flag; at the next ``maybe_save`` every rank agrees, the step is saved
    and committed, the journal records the preemption, a Slurm job is requeued (rank 0), and
    :class:`~ft_checkpoint.errors.Preempted` (a ``SystemExit``) ends the process cleanly.
    Create the manager on the main thread for the signal handlers.
    """

    def __init__(self, dirpath: str | None = None, *, policy: SavePolicy | None = None, **config: Any) -> None:
        self.config = CheckpointConfig.from_env(dirpath=dirpath, **config)
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
        self.engine = CheckpointEngine(self.storage, self.groups)
        self.slurm = SlurmJob.detect(query=self.rank == 0)
        """The Slurm job this runs in (None outside Slurm); its requeue flag and end time on rank 0 only."""
        self.watcher = PreemptionWatcher(c.preemption_signals, end_time=self.slurm and self.slurm.end_time,
                                         margin=parse_duration(c.end_time_margin))
        self.journal.record("attempt_start", world_size=self.groups.world_size,
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
        self._last_save_time = time.monotonic()
        self._last_boundary: float | None = None
        self._idle_step: float | None = None
        self._write_steps: list[float] = []
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

    # -- saving --------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: the policy's answer, or a preemption (the same answer on every rank)."""
        self._time_step()
        self.journal.progress(step)
        last = self.last_save
        last_step = last.step if last else self.resumed_from
        notice = self._notice()
        ctx = SaveContext(
            step=step, now=time.monotonic(), last_save_step=last_step,
            last_save_time=self._last_save_time, last_stall=last.stall if last else None,
            last_duration=last.duration if last else None, save_in_flight=self.engine.in_flight,
            preempted=notice is not None)
        decision = self.policy.should_save(ctx)
        if self.groups.distributed:
            votes = self.groups.all_gather((decision, notice))  # one collective: rank 0's decision, anyone's notice
            decision = votes[0][0] if not self.policy.deterministic else decision
            notice = next((f"{n} on rank {r}" for r, (_, n) in enumerate(votes) if n), None)
        self._preempt_reason = self._preempt_reason or notice  # the first notice agreed on
        self.preempted = notice is not None
        return decision or (self.preempted and step != last_step)

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
        if not self.should_save(step):
            return False
        self.save(step, state, epoch=epoch, metadata=metadata)
        self._last_boundary = time.monotonic()  # the stall is counted once, not again as a slow step
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

    def _time_step(self) -> None:
        """Step times at each boundary: while a write runs they measure its slowdown of training."""
        now = time.monotonic()
        if self._last_boundary is not None:
            dt = now - self._last_boundary
            if self.engine.in_flight:
                self._write_steps.append(dt)
            else:
                self._idle_step = dt if self._idle_step is None else 0.9 * self._idle_step + 0.1 * dt
        self._last_boundary = now

    def save(self, step: int, state: dict[str, Any], *, epoch: int | None = None,
             metadata: dict[str, Any] | None = None, block: bool = False) -> SaveStats:
        """Save now. Returns once the state is staged (or committed, with ``block=True``)."""
        self._check_open()
        called_at = time.perf_counter()
        self.journal.progress(step, force=True)
        per_rank = {"rng": rng_state()} if self.config.save_rng_state else {}
        stats = self.engine.save(step, to_tree(state), per_rank=per_rank,
                                 manifest_fields={"epoch": epoch, "metadata": dict(metadata or {})},
                                 on_start=self._before_write, on_commit=self._after_commit,
                                 on_previous_error=self._save_failed, called_at=called_at)
        self.last_save = stats
        self._last_save_time = time.monotonic()
        if block or not self.config.async_save:
            self.wait()
        return stats

    def _save_failed(self, error: SaveError) -> None:
        """A save failed: journal it, then raise (``on_save_error="raise"``) or warn loudly and go on."""
        self.failed_saves += 1
        self.journal.record("save_failed", error=str(error), background=True)
        if self.config.on_save_error == "raise":
            raise error
        log.warning("CHECKPOINT SAVE FAILED (%d so far), training continues; resume would use step %s. %s",
                    self.failed_saves, self._last_committed, error)

    def _before_write(self, stats: SaveStats) -> None:
        """On the writer thread, before the write: journal (rank 0)."""
        self.journal.record("save_started", step=stats.step, stall=stats.stall)

    def _after_commit(self, stats: SaveStats) -> None:
        """On the writer thread, after a commit: journal, log, retention (rank 0)."""
        self._last_committed = stats.step
        self.watcher.margin = max(parse_duration(self.config.end_time_margin), 2 * (stats.duration or 0.0))
        if self.rank != 0:
            return
        self.journal.record("commit", step=stats.step, stall=stats.stall, waited=stats.waited,
                            duration=stats.duration, bytes=stats.bytes)
        log.info("committed step %d to %s: %s, stall %.3f s, durable after %.2f s", stats.step,
                 self.storage.url, layout.human_bytes(stats.bytes or 0), stats.stall, stats.duration or 0.0)
        self.engine.phase("retention", stats.step)
        try:  # the step is committed: a failed clean-up must not make the save look failed
            apply_retention(self.storage, keep_last=self.config.keep_last,
                            keep_every_n_steps=self.config.keep_every_n_steps)
        except StorageError as e:
            log.warning("retention after step %d failed (will retry after the next commit): %s", stats.step, e)
        if self.adaptive is not None:
            during, self._write_steps = self._write_steps, []
            idle = self._idle_step
            slowdown = sum(max(0.0, dt - idle) for dt in during) if idle is not None else 0.0
            self.adaptive.observe_save(cost=stats.stall + slowdown, durable=stats.duration or 0.0)
            self.journal.save_cost = self.adaptive.cost

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

    # -- resuming ------------------------------------------------------------------------------
    def resume(self, state: dict[str, Any]) -> int | None:
        """Load the newest verified checkpoint into ``state`` in place; returns its step, or None if fresh.

        Stateful values get ``load_state_dict``; other values of ``state`` are replaced.
        """
        self._check_open()
        t0 = time.perf_counter()
        self.engine.phase("resuming", -1)
        manifest, opened = self._find_loadable()
        if manifest is None:
            if self.rank == 0:
                log.info("no committed checkpoint in %s: starting fresh", self.storage.url)
            return None
        tree, per_rank = self.engine.load(manifest.step, to_tree(state), opened)
        load_tree_into(state, tree)
        if self.config.save_rng_state and "rng" in per_rank:
            set_rng_state(per_rank["rng"])
        seconds = time.perf_counter() - t0
        self.resumed_from = self._last_committed = manifest.step
        self.journal.record("resume", step=manifest.step, seconds=seconds, bytes=manifest.total_bytes)
        if self.rank == 0:
            log.info("resuming from step %d (%s): %s verified and loaded in %.1f s", manifest.step,
                     self.storage.url_of(layout.step_dir(manifest.step)), layout.human_bytes(manifest.total_bytes), seconds)
        return manifest.step

    def _find_loadable(self) -> tuple[Any, Any]:
        """The newest verified step whose metadata and state files also load safely on every rank."""
        below = None
        while True:
            manifest = find_resume_step(self.storage, self.groups, verify_checksums=self.config.verify_checksums,
                                        below=below)
            if manifest is None:
                return None, None
            opened, problem = None, None
            try:
                opened = self.engine.open_step(manifest.step)
            except CheckpointCorruptError as e:
                problem = f"rank {self.rank}: {e}" if self.groups.distributed else str(e)
            problems = [p for p in self.groups.all_gather(problem) if p]
            if not problems:
                return manifest, opened
            warn_skipped(self.storage, self.groups, manifest.step, problems)
            self.groups.on_rank0(lambda: quarantine(self.storage, [manifest.step]))
            below = manifest.step

    def latest(self) -> int | None:
        """The newest step with a manifest (not verified; ``resume`` verifies)."""
        committed = self.groups.on_rank0(lambda: [s for s, ok in list_steps(self.storage).items() if ok])
        return max(committed, default=None)

    # -- lifecycle -----------------------------------------------------------------------------
    def wait(self) -> SaveStats | None:
        """Block until the save in flight committed; a background error is raised (or warned about)."""
        try:
            return self.engine.wait()
        except SaveError as e:
            self._save_failed(e)
            return None

    def close(self, *, clean: bool = True) -> None:
        """Drain the save in flight, then release the writer. ``clean`` records a clean end in the journal."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()  # a failed drain raises here (on_save_error="raise"): that is no clean end
        finally:
            self.watcher.close()
            self.engine.close()
            self.journal.close()
            if self.rank == 0:
                self.lease.release()
        if clean:
            self.journal.record("clean_end", last_step=self.last_save.step if self.last_save else None)

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
