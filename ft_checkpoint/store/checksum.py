"""Checksums of checkpoint files: CRC-32C, computed while the bytes are written or read.

A save computes each file's CRC-32C in the same pass that writes it (no read-back), and one CRC per
tensor chunk, so that a rank that reads only part of a file after resharding still verifies what it
reads. The whole file's CRC is derived from the chunk CRCs with :func:`combine` (no second pass). CRC-32C
is what GCS and S3 compute for an object, so the value can be compared with the store's own; the
``crc32c`` package hashes any buffer (a tensor's memory, no copy) at memory speed, in hardware, with the
GIL released. Manifests written before this module (``sha256:<hex>``) keep verifying.

Checksums detect corruption, not tampering: whoever can write the directory can recompute them.

Example:
    >>> a = crc32c_of(b"hello ")
    >>> combine(a, crc32c_of(b"world"), 5) == crc32c_of(b"hello world")
    True
    >>> format_crc(crc32c_of(b"hello world"))
    'crc32c:c99465aa'
    >>> matches("crc32c:c99465aa", [b"hello ", b"world"]), matches("crc32c:c99465aa", [b"hello"])
    (True, False)
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Iterable
from typing import Any

import crc32c as _crc32c

ALGORITHM = "crc32c"
_FORMAT = re.compile(r"^(crc32c:[0-9a-f]{8}|sha256:[0-9a-f]{64})$")
_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def crc32c_of(data: Any, value: int = 0) -> int:
    """The CRC-32C of ``data`` (any buffer: bytes, memoryview, ...), continuing from ``value``."""
    return _crc32c.crc32c(data, value)


@functools.lru_cache(maxsize=8192)
def zeros(n: int) -> int:
    """The CRC-32C of ``n`` zero bytes (padding; small ``n``).

    Example:
        >>> zeros(3) == crc32c_of(bytes(3)), zeros(0)
        (True, 0)
    """
    return crc32c_of(bytes(n)) if n else 0


def format_crc(crc: int) -> str:
    """``"crc32c:<8 hex digits>"``, as manifests store it."""
    return f"{ALGORITHM}:{crc:08x}"


def is_valid(text: Any) -> bool:
    """Whether ``text`` is a checksum string this version can check (``crc32c:`` or ``sha256:``).

    Example:
        >>> is_valid("crc32c:0000abcd"), is_valid("md5:00"), is_valid(12)
        (True, False, False)
    """
    return isinstance(text, str) and bool(_FORMAT.match(text))


def matches(expected: str, chunks: Iterable[Any]) -> bool:
    """Whether the concatenated ``chunks`` have the checksum ``expected`` (either algorithm)."""
    if expected.startswith("sha256:"):
        h = hashlib.sha256()
        for c in chunks:
            h.update(c)
        return expected == f"sha256:{h.hexdigest()}"
    crc = 0
    for c in chunks:
        crc = crc32c_of(c, crc)
    return expected == format_crc(crc)


def _multmodp(a: int, b: int) -> int:
    """``a * b mod p(x)`` in GF(2), reflected (as zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _powers()  # x^(2^k) mod p(x)


def _x8nmodp(n: int) -> int:
    """``x^(8n) mod p(x)``: the shift of ``n`` bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's ``crc32_combine``)."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def combine_all(crcs: list[int], lengths: list[int]) -> int:
    """The CRC-32C of buffers laid end to end, from each one's CRC-32C and length.

    Example:
        >>> combine_all([crc32c_of(b"ab"), crc32c_of(b"c")], [2, 1]) == crc32c_of(b"abc")
        True
    """
    whole = 0
    for crc, n in zip(crcs, lengths):
        whole = combine(whole, crc, n)
    return whole


def crcs_while_writing(views: list[memoryview], lengths: list[int], write: Callable[[memoryview], Any],
                       piece: int) -> list[int]:
    """Pass each view to ``write`` in pieces of ``piece`` bytes, and return each view's CRC-32C of its first
    ``lengths[i]`` bytes (the rest is padding), computed over the same pieces: one pass, no read-back.

    Example:
        >>> out = bytearray()
        >>> crcs_while_writing([memoryview(b"abc"), memoryview(b"de")], [3, 1], out.extend, 2) == [
        ...     crc32c_of(b"abc"), crc32c_of(b"d")], bytes(out)
        (True, b'abcde')
    """
    crcs = []
    for view, n in zip(views, lengths):
        crc = 0
        for start in range(0, len(view), piece):
            chunk = view[start:start + piece]
            write(chunk)
            if start < n:
                crc = crc32c_of(chunk[:n - start], crc)
        crcs.append(crc)
    return crcs


def check_in_ranges(expected: str, pieces: Iterable[Any], ends: list[int]) -> tuple[bool, list[int | None]]:
    """One pass over a file read as ``pieces``: whether the whole has the checksum ``expected`` (either algorithm),
    and the CRC-32C of each range that the ascending offsets ``ends`` close (the first starts at 0; None for one the
    pieces did not reach to its end). ``ft-checkpoint verify`` checks a data file and each tensor's bytes in it so.
    The whole file's CRC-32C is combined from the ranges' (:func:`combine_all`): the bytes are hashed once.

    Example:
        >>> whole = format_crc(crc32c_of(b"hello world"))
        >>> check_in_ranges(whole, [b"hel", b"lo world"], [5, 11]) == (True, [crc32c_of(b"hello"), crc32c_of(b" world")])
        True
        >>> check_in_ranges(whole, [b"hello"], [5, 11])[1][1] is None  # the file ended early
        True
    """
    sha = hashlib.sha256() if expected.startswith("sha256:") else None
    crcs, lengths = [0] * (len(ends) + 1), [0] * (len(ends) + 1)  # the last: bytes past the last end
    pos, i = 0, 0
    for piece in pieces:
        if sha is not None:
            sha.update(piece)
        view = memoryview(piece)
        while len(view):
            while i < len(ends) and pos >= ends[i]:
                i += 1
            n = len(view) if i == len(ends) else min(len(view), ends[i] - pos)
            crcs[i], lengths[i] = crc32c_of(view[:n], crcs[i]), lengths[i] + n
            pos, view = pos + n, view[n:]
    whole = f"sha256:{sha.hexdigest()}" if sha is not None else format_crc(combine_all(crcs, lengths))
    starts = [0, *ends]
    return whole == expected, [crc if lengths[k] == end - starts[k] else None for k, (crc, end) in enumerate(zip(crcs, ends))]
