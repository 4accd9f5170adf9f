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

_NUMBER = r"\d+(?:\.\d+)?"
_COMPOUND_RE = re.compile(rf"(?:{_NUMBER}\s*[a-z]+\s*)+", re.ASCII)
_PART_RE = re.compile(rf"({_NUMBER})\s*([a-z]+)", re.ASCII)
_UNIT_NAMES = {
    "ms": ("ms", "msec", "millisecond", "milliseconds"),
    "s": ("s", "sec", "secs", "second", "seconds"),
    "m": ("m", "min", "mins", "minute", "minutes"),
    "h": ("h", "hr", "hrs", "hour", "hours"),
    "d": ("d", "day", "days"),
    "w": ("w", "wk", "wks", "week", "weeks"),
}
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_UNIT_OF = {name: unit for unit, names in _UNIT_NAMES.items() for name in names}
DURATION_EXAMPLES = "'90', '30s', '15 min', '56.7 min', '1.5 h', '1h30m', '2d'"
"""Forms a duration may take, for messages (every form :func:`human_seconds` prints is one)."""


def parse_duration(value: int | float | str | datetime.timedelta) -> float:
    """Seconds from a number of seconds, a ``timedelta`` or a string: a bare number is seconds, else numbers
    with units (``ms``, ``s``/``sec``, ``m``/``min``, ``h``/``hr``, ``d``/``day``, ``w``/``week``, plurals too),
    with or without spaces, combined as in ``"1h30m"`` or ``"2 d 6 h"``: whatever :func:`human_seconds` and the
    ``ft-checkpoint`` commands print (``"15 min"``, ``"56.7 min"``). ValueError for anything else, and for
    ``nan`` and ``inf``: a duration is finite.

    Example:
        >>> parse_duration("5m"), parse_duration("15 min"), parse_duration("1h30m"), parse_duration("2 d 6 h")
        (300.0, 900.0, 5400.0, 194400.0)
        >>> parse_duration(datetime.timedelta(hours=1)), parse_duration(90), parse_duration("90")
        (3600.0, 90.0, 90.0)
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
        seconds = _parse_text(value.strip().lower())
    if seconds is None:
        raise ValueError(f"{short(value)} is not a duration: use seconds, a timedelta, or a string like "
                         f"{DURATION_EXAMPLES}")
    if not math.isfinite(seconds):
        raise ValueError(f"{short(value)} is not a finite duration")
    return seconds


def _parse_text(text: str) -> float | None:
    """Seconds in ``text`` (lower case, stripped): a bare number, or numbers with units, each unit once."""
    if re.fullmatch(_NUMBER, text, re.ASCII):
        return float(text)
    if len(text) > 200 or not _COMPOUND_RE.fullmatch(text):
        return None
    parts = [(float(number), _UNIT_OF.get(name)) for number, name in _PART_RE.findall(text)]
    units = [unit for _, unit in parts]
    if None in units or len(set(units)) != len(units):
        return None
    return sum(number * _UNITS[unit] for number, unit in parts if unit is not None)


def human_seconds(seconds: float) -> str:
    """``5400`` -> ``'1.5 h'``, ``0.0123`` -> ``'12.3 ms'``; the unit that reads best (:func:`parse_duration`
    reads it back).

    Example:
        >>> human_seconds(5400), human_seconds(900), human_seconds(0.0123), human_seconds(200 * 86400)
        ('1.5 h', '15 min', '12.3 ms', '200 d')
    """
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{_digits(seconds / size)} {unit}"
    return f"{_digits(seconds * 1000)} ms" if 0 < seconds < 1 else f"{_digits(seconds)} s"


def _digits(x: float) -> str:
    """Three significant digits, never in exponent notation (which :func:`parse_duration` does not read)."""
    text = f"{x:.3g}"
    return text if "e" not in text else f"{x:.0f}" if abs(x) >= 1 else f"{x:.9f}".rstrip("0")


def plural(n: int, word: str, many: str | None = None) -> str:
    """A count and its noun, singular for one.

    Example:
        >>> plural(1, "attempt"), plural(2, "attempt"), plural(3, "step directory", "step directories")
        ('1 attempt', '2 attempts', '3 step directories')
    """
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def every(n: int, word: str) -> str:
    """How often, in words: ``every step`` for one, ``every 3 steps`` for more.

    Example:
        >>> every(1, "step"), every(500, "step")
        ('every step', 'every 500 steps')
    """
    return f"every {word}" if n == 1 else f"every {n} {word}s"


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
    if sig.name in _NOT_A_NOTICE:
        raise ConfigError(f"preemption_signals: {sig.name} {_NOT_A_NOTICE[sig.name]}, not a notice that the job will "
                          "be stopped. HINT: use the signal the scheduler sends first, such as 'SIGTERM' or 'SIGUSR1'")
    return sig


_NOT_A_NOTICE = {
    **dict.fromkeys(("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT"),
                    "reports a fault in the process itself (taken as a notice, a crash would hang or exit cleanly)"),
    **dict.fromkeys(("SIGCHLD", "SIGWINCH", "SIGURG", "SIGCONT", "SIGPIPE"),
                    "is sent in the normal course of things (a child process ending, a terminal resized, ...)"),
}
"""Signals that mean something else than a preemption notice (a save and a clean exit), and what."""
