"""Preemption notices: signals that only set a flag, and a job end time seen coming.

Clusters warn before they take a job away: Slurm sends ``--signal=USR1@120`` before the time limit
or a preemption, Kubernetes and torchrun send SIGTERM before SIGKILL. Saving inside a signal handler
can deadlock (the handler interrupts the training thread anywhere, even inside a collective or a
lock), so the handler here only sets a flag; the manager acts on it at the next step boundary.
A handler installed before ours (the user's, the framework's) still runs: it is chained, not
replaced. A default action (``SIG_DFL``, which for SIGTERM ends the process) is not chained while
the watcher is active: that is the point. Once closed, the watcher hands signals back to what was
there before, default actions included.

Example:
    >>> import os, signal
    >>> watcher = PreemptionWatcher(["SIGUSR1"])
    >>> os.kill(os.getpid(), signal.SIGUSR1)
    >>> watcher.check(), watcher.reason
    (True, 'SIGUSR1')
    >>> watcher.close()
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

from ft_checkpoint.units import parse_signal

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class PreemptionWatcher:
    """Turns preemption notices into a flag: ``signals`` received, or ``end_time - margin`` reached.

    Args:
        signals: Signal names (or numbers) to watch; handlers are installed only from the main thread.
        end_time: Wall-clock time (``time.time()``) at which the job will be stopped, if known.
        margin: Seconds before ``end_time`` at which the notice is raised (leave time for a save).
    """

    def __init__(self, signals: Iterable[str | int] = DEFAULT_SIGNALS, *, end_time: float | None = None,
                 margin: float = 180.0) -> None:
        self.requested = False
        """Whether a notice came (a signal, or the end time is near)."""
        self.reason: str | None = None
        """What the notice was: a signal name or ``"job end time"``."""
        self.end_time = end_time
        self.margin = margin
        self._closed = False
        self._previous: dict[signal.Signals, Any] = {}
        sigs = [parse_signal(s) for s in signals]
        if sigs and threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals %s not watched: handlers can only be installed from the main thread",
                        ", ".join(s.name for s in sigs))
            return
        for sig in sigs:
            self._previous[sig] = _past_closed_watchers(sig, signal.signal(sig, self._handle))

    @property
    def signals(self) -> list[str]:
        """The names of the signals watched."""
        return [s.name for s in self._previous]

    def _handle(self, signum: int, frame: FrameType | None, *, installed: bool | None = None) -> None:
        sig = signal.Signals(signum)
        previous = self._previous.get(sig, signal.SIG_DFL)
        if not self._closed and not self.requested:
            self.requested, self.reason = True, sig.name
        if installed is None:
            installed = signal.getsignal(sig) == self._handle
        older = getattr(previous, "__self__", None)
        if isinstance(older, PreemptionWatcher):  # a watcher from before (an earlier fit's): closed ones pass it on
            older._handle(signum, frame, installed=installed and self._closed)
        elif callable(previous):
            previous(signum, frame)
        elif self._closed and installed and previous == signal.SIG_DFL:
            # closed, yet put back as the handler (Lightning restores the handlers it found), alone or chained only
            # by closed watchers (two fits in one process): act as the default
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def check(self, now: float | None = None) -> bool:
        """Whether a notice came; raises one when the end time is within ``margin``."""
        if not self.requested and self.end_time is not None:
            if (time.time() if now is None else now) >= self.end_time - self.margin:
                self.requested, self.reason = True, "job end time"
        return self.requested

    def close(self) -> None:
        """Give the signals back to the handlers that were there before (where ours is still installed)."""
        self._closed = True
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle and threading.current_thread() is threading.main_thread():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def _past_closed_watchers(sig: signal.Signals, previous: Any) -> Any:
    """What a closed watcher ``previous`` passes ``sig`` on to, past any number of them: a process that fits again
    and again chains only the handler from before the first (one link per fit overflowed the stack at ~1000)."""
    older = getattr(previous, "__self__", None)
    while isinstance(older, PreemptionWatcher) and older._closed:
        previous = older._previous.get(sig, signal.SIG_DFL)
        older = getattr(previous, "__self__", None)
    return previous
