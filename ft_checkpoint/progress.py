"""Progress of work people wait for (a resume, ``verify``, ``gc``): bytes or items done, the rate and the time
left, shown only once the work has taken longer than :data:`DELAY` seconds.

On a terminal (stderr is one) a ``tqdm`` bar; otherwise a line every :data:`EVERY` seconds, as a log record of
``ft_checkpoint.progress`` at INFO where logging shows it, else on stderr (as the start-up message), so that a
batch job's log shows a long resume. Updates may come from several threads.

Example:
    >>> with Progress("verifying", total=8_000_000, terminal=False, delay=0) as p:
    ...     p.update(2_000_000)
    >>> p.done, p.line().startswith("verifying: 2 MB of 8 MB (25%)")
    (2000000, True)
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from ft_checkpoint.units import human_bytes, human_seconds

log = logging.getLogger(__name__)
DELAY = 3.0
"""Seconds of work before anything is shown: quick work shows nothing."""
EVERY = 10.0
"""Seconds between two lines where there is no terminal."""


class Progress:
    """Progress of ``total`` units (bytes by default; ``unit="step"`` counts items) under ``label``.

    Args:
        label: What is being done, e.g. ``"loading step 120"``.
        total: How much there is to do (0: unknown yet; see :meth:`set_total`).
        unit: ``"B"`` (shown in kB, MB, GB) or the name of an item.
        terminal: Draw a bar (True) or write lines (False); default: whether stderr is a terminal.
        enabled: False shows nothing (e.g. on ranks other than 0).
        delay: Seconds before anything is shown (default :data:`DELAY`).
    """

    def __init__(self, label: str, total: int = 0, *, unit: str = "B", terminal: bool | None = None,
                 enabled: bool = True, delay: float | None = None) -> None:
        self.label, self.total, self.unit, self.done = label, total, unit, 0
        self.enabled, self.delay = enabled, DELAY if delay is None else delay
        self.terminal = _stderr_is_terminal() if terminal is None else terminal
        self._start = time.monotonic()
        self._last_line: float | None = None
        self._lock = threading.Lock()
        self._bar: Any = self._make_bar() if enabled and self.terminal else None

    def _make_bar(self) -> Any:
        try:
            from tqdm import tqdm
        except ImportError:  # no tqdm: lines, as without a terminal
            self.terminal = False
            return None
        scaled = self.unit == "B"
        return tqdm(total=self.total or None, desc=self.label, unit=self.unit, unit_scale=scaled,
                    unit_divisor=1000, delay=self.delay, leave=False, dynamic_ncols=True, file=sys.stderr)

    def set_total(self, total: int) -> None:
        """How much there is to do, once known."""
        with self._lock:
            self.total = total
            if self._bar is not None:
                self._bar.total = total or None
                self._bar.refresh()

    def update(self, n: int) -> None:
        """``n`` more units done."""
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
                return
            now = time.monotonic()
            if self.enabled and now - self._start >= self.delay and (self._last_line is None
                                                                      or now - self._last_line >= EVERY):
                self._last_line = now
                _emit(self.line())

    def line(self) -> str:
        """``verifying: 2 GB of 8 GB (25%), 410 MB/s, about 15 s left``."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self.done / elapsed
        text = f"{self.label}: {self._amount(self.done)}"
        if self.total:
            text += f" of {self._amount(self.total)} ({100 * self.done / self.total:.0f}%)"
        text += f", {self._amount(rate)}/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f", about {human_seconds((self.total - self.done) / rate)} left"
        return text

    def _amount(self, n: float) -> str:
        if self.unit == "B":
            return human_bytes(n)
        return f"{n:.3g} {self.unit}" + ("" if n == 1 else "s")

    def close(self) -> None:
        """Remove the bar (a terminal) or write the last line if any was written (otherwise)."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
            elif self.enabled and self._last_line is not None:
                _emit(self.line() + ", done")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _emit(text: str) -> None:
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", text)
    else:
        print(f"ft-checkpoint: {text}", file=sys.stderr, flush=True)
