"""Layout of a checkpoint directory, and the manifest that commits a step.

::

    <dirpath>/
      step_000000001200/          one directory per step, zero-padded so names sort by step
        __0_0.distcp  __1_0.distcp  .metadata    DCP's shards and metadata
        rank_00000.pt  rank_00001.pt             per-rank non-tensor state and RNG (weights-only)
        manifest.json                            the commit marker: written last, by rank 0
      journal/<attempt>/<seq>-<event>.json       what happened to the run (see ``journal``)

A step exists for readers only if its ``manifest.json`` exists and verifies: every file it lists is
present with the listed size (always checked) and checksum (checked for the files a reader is about
to load), and the directory holds no other file (one left over or copied in could be read by a loader).
A step directory without a manifest is garbage from an interrupted save.

Example:
    >>> step_dir(1200)
    'step_000000001200'
    >>> parse_step("step_000000001200"), parse_step("step_12.tmp")
    (1200, None)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Iterable
from typing import Any

from ft_checkpoint.errors import CheckpointCorruptError

MANIFEST = "manifest.json"
JOURNAL_DIR = "journal"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "sha256"
_STEP_RE = re.compile(r"^step_(\d{12})$")
_SAFE_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def step_dir(step: int) -> str:
    """The directory name of ``step``."""
    if step < 0 or step >= 10**12:
        raise ValueError(f"step={step}: must be in [0, 10**12)")
    return f"step_{step:012d}"


def parse_step(name: str) -> int | None:
    """The step of a step directory name, or None for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s non-tensor state file."""
    return f"rank_{rank:05d}.pt"


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


def checksum(chunks: Iterable[bytes]) -> str:
    """``"sha256:<hex>"`` of the concatenated chunks."""
    h = hashlib.new(CHECKSUM_ALGO)
    for c in chunks:
        h.update(c)
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a committed step."""

    size: int
    checksum: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """The commit marker of one step: what was saved, by whom, and how to check it."""

    step: int
    world_size: int
    files: dict[str, FileEntry]
    epoch: int | None = None
    time: float = dataclasses.field(default_factory=time.time)
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        """Bytes of all files of the step."""
        return sum(f.size for f in self.files.values())

    def unlisted(self, names: Iterable[str]) -> list[str]:
        """The names among ``names`` (a step directory's files) that this manifest does not list, itself aside.

        Example:
            >>> m = Manifest(step=1, world_size=1, files={"a.bin": FileEntry(size=1, checksum="sha256:0")})
            >>> m.unlisted(["a.bin", "manifest.json", "stray.distcp"])
            ['stray.distcp']
        """
        return sorted(set(names) - set(self.files) - {MANIFEST})

    def to_json(self) -> bytes:
        """Serialize (stable key order, readable)."""
        d = dataclasses.asdict(self)
        return json.dumps({"format": "ft-checkpoint", **d}, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest; raises CheckpointCorruptError saying what is wrong."""
        try:
            d = json.loads(data)
        except (ValueError, RecursionError) as e:  # bad bytes or syntax, an endless number, deep nesting
            raise CheckpointCorruptError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from e
        if not isinstance(d, dict) or d.pop("format", None) != "ft-checkpoint":
            raise CheckpointCorruptError(f"{where}: not an ft-checkpoint manifest")
        version = d.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{where}: format_version {version!r} is newer than this ft-checkpoint supports "
                f"({FORMAT_VERSION}). HINT: upgrade ft-checkpoint to read it")
        try:
            files = {name: FileEntry(**entry) for name, entry in d.pop("files").items()}
            manifest = cls(files=files, **d)
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(f"{where}: malformed ({e})") from e
        for name in files:
            if not _SAFE_NAME_RE.match(name) or name in (".", "..") or name == MANIFEST:
                raise CheckpointCorruptError(
                    f"{where}: file name {name!r} is not a plain name inside the step directory; refusing it")
        return manifest
