"""Strict reading of the small JSON control files that anyone who can write the directory may garble.

The lease, the journal's events and its progress notes are written by this package, but whoever can
write the checkpoint directory may replace them with anything: bytes that are not JSON, a list, an
object nested 100,000 deep, ``NaN``, a string where a number belongs, an integer of 5,000 digits.
The readers here turn each of those into a ``ValueError`` whose message says what is wrong, so a
caller can skip the file with a warning instead of crashing. Types are strict: an int is an ``int``
(not a ``bool``, not ``2.0``), a number is a finite ``int`` or ``float``.

Example:
    >>> note = load_object(b'{"step": 2.0, "time": NaN}')
    >>> for read in (lambda: get_int(note, "step"), lambda: get_number(note, "time")):
    ...     try:
    ...         read()
    ...     except ValueError as e:
    ...         print(e)
    step=2.0: expected an integer
    time=nan: expected a finite number
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

from ft_checkpoint.units import short

MAX_BYTES = 1 << 20
"""The largest control file read (bytes): a lease, an event or a progress note is a few hundred."""

def load_object(data: bytes, *, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """The JSON object in ``data``; ValueError naming what is wrong with it otherwise.

    Example:
        >>> load_object(b'{"a": 1}')
        {'a': 1}
    """
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes, larger than any file ft-checkpoint writes ({max_bytes} at most)")
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of too many digits
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, expected a JSON object")
    return value


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` (a ``bool`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[float]:
    """Whether ``value`` is a finite ``int`` or ``float`` (a ``bool`` is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def get_int(obj: dict[str, Any], key: str, *, minimum: int | None = None, maximum: int | None = None,
            optional: bool = False) -> int | None:
    """``obj[key]`` as an int in ``[minimum, maximum]``; None if ``optional`` and missing or null."""
    value = obj.get(key)
    if value is None and optional:
        return None
    if not is_int(value):
        raise ValueError(f"{key}={short(value)}: expected an integer")
    _check_range(key, value, minimum, maximum)
    return value


def get_number(obj: dict[str, Any], key: str, *, minimum: float | None = None, maximum: float | None = None,
               optional: bool = False) -> float | None:
    """``obj[key]`` as a finite number in ``[minimum, maximum]``; None if ``optional`` and missing or null."""
    value = obj.get(key)
    if value is None and optional:
        return None
    if not is_number(value):
        raise ValueError(f"{key}={short(value)}: expected a finite number")
    _check_range(key, value, minimum, maximum)
    return float(value)


def get_str(obj: dict[str, Any], key: str, *, optional: bool = False) -> str | None:
    """``obj[key]`` as a string; None if ``optional`` and missing or null."""
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{key}={short(value)}: expected a string")
    return value


def _check_range(key: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise ValueError(f"{key}={short(value)}: expected at least {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{key}={short(value)}: expected at most {maximum:g}")
