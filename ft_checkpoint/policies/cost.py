"""What a save costs the training: its stall, plus the slowdown of the steps that ran while it was written.

The adaptive interval plans with this cost. The stall is measured by the engine; the slowdown is
measured here, from the time between step boundaries: a smoothed step time while no save is being
written, against the steps that ran while one was.

Example:
    >>> m = CostMeter()
    >>> for t in (0.0, 1.0, 2.0, 3.0):      # idle steps of 1 s
    ...     m.step(writing=False, now=t)
    >>> m.saved(now=3.2)                      # a save stalled 0.2 s
    >>> m.step(writing=True, now=4.7)         # a step of 1.5 s while the save was written
    >>> m.step(writing=False, now=5.7)
    >>> round(m.cost(stall=0.2), 3)           # the stall + 0.5 s of slowdown
    0.7
"""

from __future__ import annotations

import time


class CostMeter:
    """Step times at each boundary, to measure how much a background write slows training."""

    def __init__(self, smoothing: float = 0.1) -> None:
        self.smoothing = smoothing
        self.idle_step: float | None = None
        """The smoothed time of a step while no save is being written (seconds)."""
        self._last: float | None = None
        self._during: list[float] = []

    def step(self, *, writing: bool, now: float | None = None) -> None:
        """A step boundary; ``writing`` is whether a save's write ran during the step that just ended."""
        now = time.monotonic() if now is None else now
        if self._last is not None:
            dt = now - self._last
            if writing:
                self._during.append(dt)
            else:
                self.idle_step = dt if self.idle_step is None else (1 - self.smoothing) * self.idle_step + self.smoothing * dt
        self._last = now

    def saved(self, now: float | None = None) -> None:
        """A save just returned: its stall is counted once, not again as a slow step."""
        self._last = time.monotonic() if now is None else now

    def cost(self, stall: float) -> float:
        """The cost of the save that just committed: ``stall`` plus the slowdown of the steps during its write."""
        during, self._during = self._during, []
        if self.idle_step is None:
            return stall
        return stall + sum(max(0.0, dt - self.idle_step) for dt in during)
