"""Files that ``torch.save`` wrote (a rank's state file, DeepSpeed's files), loaded back without trusting them.

``torch.load(weights_only=True)`` runs no code from a file, but it trusts the file's sizes: it inflates a
DEFLATE-compressed zip record (a 65 kB record of zeros becomes 64 MB, a 16 MB file tens of GB), and in torch's
legacy (non-zip) format it allocates each storage at the size the pickle declares. ``torch.save`` writes neither:
its zip records are all stored as they are. So a file is loaded only if it is a zip archive whose records are all
stored uncompressed and together fit in the file: what a load allocates is then bounded by the file's size, which
the step's manifest lists. Checking the zip's central directory costs microseconds; no byte is copied.

Example:
    >>> import io, torch
    >>> buf = io.BytesIO(); torch.save({"x": torch.arange(3)}, buf)
    >>> load(buf.getvalue(), "rank_00000.pt")["x"]
    tensor([0, 1, 2])
"""

from __future__ import annotations

import contextlib
import io
import zipfile
from collections.abc import Iterable
from typing import Any

import torch

from ft_checkpoint.errors import CheckpointCorruptError


def load(data: bytes, name: str, *, safe_globals: Iterable[Any] = (), map_location: str | None = None) -> Any:
    """``torch.load(weights_only=True)`` of ``data`` (``safe_globals``: classes allowed besides torch's own;
    ``map_location`` as torch's), once :func:`check_stored` passed; CheckpointCorruptError naming ``name`` for
    whatever cannot be loaded safely."""
    check_stored(data, name)
    allowed = torch.serialization.safe_globals(list(safe_globals)) if safe_globals else contextlib.nullcontext()
    try:
        with allowed:
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:  # a forged or damaged file; nothing in it ran
        raise CheckpointCorruptError(f"{name}: cannot be loaded safely ({type(e).__name__}: {_why(e)})") from e


def check_stored(data: bytes, name: str) -> None:
    """CheckpointCorruptError unless ``data`` is a zip archive as ``torch.save`` writes it: every record stored
    uncompressed, their sizes together no more than the archive's.

    Example:
        >>> check_stored(b"not a zip", "rank_00000.pt")
        Traceback (most recent call last):
        ft_checkpoint.errors.CheckpointCorruptError: rank_00000.pt: not a zip archive as torch.save writes ...
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise CheckpointCorruptError(f"{name}: not a zip archive as torch.save writes (torch's legacy format "
                                     f"declares its own sizes; refusing it): {e}") from None
    packed = [r.filename for r in records if r.compress_type != zipfile.ZIP_STORED or r.compress_size != r.file_size]
    if packed:
        raise CheckpointCorruptError(f"{name}: {len(packed)} record(s) compressed ({packed[0]}, ...), which torch.save "
                                     "never writes (loading would inflate them): refusing it")
    if sum(r.file_size for r in records) > len(data):
        raise CheckpointCorruptError(f"{name}: its records claim more bytes than the file holds: refusing it")


def _why(e: Exception) -> str:
    """The line of torch's weights-only error that names what was refused (the rest is advice to load anyway)."""
    lines = [line.strip() for line in str(e).splitlines()]
    line = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0] if lines else "")
    return line.split(". Please use")[0]
