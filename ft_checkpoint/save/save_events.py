"""What happens around a save the engine writes: journal events, the commit's log line, retention, failures.

:class:`SaveEvents` is the manager's :class:`~ft_checkpoint.save.engine.SaveListener`. It runs on the writer
thread: it journals the start of a write, checks the directory's lease before the engine clears or
commits anything, and after a commit journals and logs it, feeds the adaptive interval and hands
retention to a thread of its own (rank 0), so that the next save need not wait for deletions. A failed
save is counted, journaled, then raised or warned about (``on_save_error``).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ft_checkpoint.config import CheckpointConfig
from ft_checkpoint.errors import ConfigError, LeaseError, SaveError, StorageError
from ft_checkpoint.format.signing import Signer
from ft_checkpoint.policies.cost import CostMeter
from ft_checkpoint.run.background import submit
from ft_checkpoint.run.journal import Journal
from ft_checkpoint.run.lease import Lease
from ft_checkpoint.run.preemption import PreemptionWatcher
from ft_checkpoint.run.retention import apply_retention
from ft_checkpoint.save.engine import SaveStats
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.units import human_bytes, parse_duration

log = logging.getLogger(__name__)


class SaveEvents:
    """The manager's listener on its engine's saves (see the module's docstring).

    Args:
        adaptive: The adaptive interval policy to feed each save's measured cost, or None.
        phase: ``phase(name, step)``: reports ``retention`` (the engine's phase hook).
        signer: The job's signer (None: no signing key): retention counts only the steps it verifies.
    """

    def __init__(self, *, storage: Storage, config: CheckpointConfig, rank: int, journal: Journal, lease: Lease,
                 watcher: PreemptionWatcher, cost: CostMeter, adaptive: Any = None,
                 phase: Any = lambda phase, step: None, signer: Signer | None = None) -> None:
        self.storage, self.config, self.rank, self.signer = storage, config, rank, signer
        self.journal, self.lease, self.watcher, self.cost, self.adaptive = journal, lease, watcher, cost, adaptive
        self.phase = phase
        self.failed = 0
        """Saves that failed (with ``on_save_error="warn"`` training goes on after them)."""
        self.last_committed: int | None = None
        """The step this run committed last, or resumed from."""
        self._cleanup = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-checkpoint-retention")

    # -- SaveListener ----------------------------------------------------------------------------
    def on_write_start(self, stats: SaveStats) -> None:
        self.journal.record("save_started", step=stats.step, stall=stats.stall, background=True)

    def check_writable(self, stats: SaveStats) -> None:
        self.lease.wait_out_previous_owner()  # a job taken over that may still be alive: see there
        self.lease.check_owned()  # a job that lost the directory to another stops writing there

    def writable_confirmed(self, since: float) -> None:
        self.lease.vouched(since)

    def check_still_writable(self) -> None:
        self.lease.check_recent()  # reads lease.json only after a long stand-still (see Lease.check_recent)

    def confirm_writable(self) -> None:
        self.lease.check_now()

    def on_commit(self, stats: SaveStats) -> None:
        """On the writer thread, after a commit: journal, log, retention (rank 0)."""
        self.last_committed = stats.step
        self.watcher.margin = max(parse_duration(self.config.end_time_margin), 2 * (stats.duration or 0.0))
        if self.rank != 0:
            return
        self.journal.record("commit", step=stats.step, stall=stats.stall, waited=stats.waited,
                            duration=stats.duration, bytes=stats.bytes, background=True)
        log.info("committed step %d to %s: %s, stall %.3f s, durable after %.2f s", stats.step,
                 self.storage.url, human_bytes(stats.bytes or 0), stats.stall, stats.duration or 0.0)
        submit(self._cleanup, self._retention, stats.step)  # off the save's path: the next save need not wait
        if self.adaptive is not None:
            self.adaptive.observe_save(cost=self.cost.cost(stats.stall), durable=stats.duration or 0.0)
            self.journal.save_cost = self.adaptive.cost

    def on_previous_error(self, error: SaveError) -> None:
        self.save_failed(error)

    # -- the rest ----------------------------------------------------------------------------------
    def save_failed(self, error: SaveError) -> None:
        """A save failed: journal it, then raise (``on_save_error="raise"``, or a state that cannot be saved
        as given) or warn loudly and go on."""
        self.failed += 1
        self.journal.record("save_failed", error=str(error), background=True)
        if self.config.on_save_error == "raise" or isinstance(error.__cause__, (ConfigError, LeaseError)):
            raise error
        log.warning("CHECKPOINT SAVE FAILED (%d so far), training continues; resume would use step %s. %s",
                    self.failed, self.last_committed, error)

    def wait_for_retention(self) -> None:
        """Block until the deletions started by the commits so far are done."""
        submit(self._cleanup, lambda: None).result()

    def close(self) -> None:
        self._cleanup.shutdown(wait=True)

    def _retention(self, step: int) -> None:
        """Rank 0, on its own thread after each commit: delete what the retention rules say."""
        self.phase("retention", step)
        try:  # the step is committed: a failed clean-up must not make the save look failed
            self.lease.check_owned()  # never delete in a directory another job took over
            apply_retention(self.storage, keep_last=self.config.keep_last,
                            keep_every_n_steps=self.config.keep_every_n_steps, protect=step, signer=self.signer)
        except (StorageError, LeaseError) as e:
            log.warning("retention after step %d failed (will retry after the next commit): %s", step, e)
