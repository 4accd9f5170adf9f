"""Units in one place: parsing durations and signal names, and writing seconds, bytes, values and text for people.

Example:
    >>> parse_duration("5m"), parse_duration("1w"), human_seconds(5400), human_bytes(8_400_000)
    (300.0, 604800.0, '1.5 h', '8.4 MB')
"""

from __future__ import annotations

import datetime
import math
import re
import reprlib
import signal
from typing import Any

from ft_checkpoint.errors import ConfigError

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$", re.ASCII)
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: int | float | str | datetime.timedelta) -> float:
    """Seconds from a number of seconds, a ``timedelta`` or a string such as ``"30s"``, ``"5m"``, ``"6h"``, ``"2d"``, ``"1w"``
    (a bare number in a string, as env vars give it, is seconds). ValueError for anything else, and for
    ``nan`` and ``inf``: a duration is finite.

    Example:
        >>> parse_duration("5m"), parse_duration(datetime.timedelta(hours=1)), parse_duration(90)
        (300.0, 3600.0, 90.0)
    """
    seconds = None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    elif isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds is None:
        raise ValueError(f"{short(value)} is not a duration: use seconds, a timedelta, or a string like '30s', "
                         "'5m', '6h', '2d'")
    if not math.isfinite(seconds):
        raise ValueError(f"{short(value)} is not a finite duration")
    return seconds


def human_seconds(seconds: float) -> str:
    """``5400`` -> ``'1.5 h'``, ``0.0123`` -> ``'12.3 ms'``; the unit that reads best."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1000:.3g} ms" if 0 < seconds < 1 else f"{seconds:.3g} s"


def human_bytes(n: float) -> str:
    """A size for people, in decimal units.

    Example:
        >>> human_bytes(8_400_000), human_bytes(512)
        ('8.4 MB', '512 B')
    """
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n} B"


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong = 40


def short(value: Any) -> str:
    """A ``repr`` of bounded length and depth, safe for any value a file or a caller can produce.

    Example:
        >>> short("x" * 1000)[:12], len(short("x" * 1000)) < 80
        ("'xxxxxxxxxxx", True)
    """
    try:
        return _REPR.repr(value)
    except Exception:  # a hostile __repr__: name the type instead
        return f"<{type(value).__name__}>"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (escape sequences, bell, carriage return, ...)
    written as its Python escape: what a file in the directory names is shown, never obeyed.

    Example:
        >>> print(printable("w\\x1b[31m\\x07 ok é"))
        w\\x1b[31m\\x07 ok é
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def parse_signal(name: str | int) -> signal.Signals:
    """``"SIGUSR1"``, ``"USR1"``, ``"usr1"`` or ``10`` as a :class:`signal.Signals`; ConfigError otherwise.

    Example:
        >>> parse_signal("usr1").name, parse_signal("SIGTERM").name
        ('SIGUSR1', 'SIGTERM')
    """
    try:
        if isinstance(name, int) and not isinstance(name, bool):
            sig = signal.Signals(name)
        else:
            text = str(name).strip().upper()
            sig = signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ConfigError(f"preemption_signals: {name!r} is not a signal. HINT: use names such as "
                          "'SIGTERM', 'SIGUSR1', 'SIGUSR2'") from None
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"preemption_signals: {sig.name} cannot be caught; use SIGTERM or SIGUSR1")
    return sig
