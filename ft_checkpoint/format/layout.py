"""Step directories: their names, the manifest that commits one, and listing, checking and deleting them.

::

    <dirpath>/
      step_000000001200/          one directory per step, zero-padded so names sort by step
        __0_0.distcp  __1_0.distcp               tensor data, raw bytes (one or more files per rank)
        metadata.json                            where each tensor chunk lies, with its CRC-32C (rank 0)
        rank_00000.pt  rank_00001.pt             per-rank non-tensor state and RNG (weights-only)
        manifest.json                            the commit marker: written last, by rank 0
      journal/<attempt>/<seq>-<event>.json       what happened to the run (see ``journal``)

A step exists for readers only if its ``manifest.json`` exists and checks: strictly typed fields, every
file it lists present with the listed size, no other file in the directory (one left over or copied in
could be read by a loader), no symbolic link. Checksums are verified as the bytes are read (see
``dcp_format``). A step directory without a manifest is garbage from an interrupted save. Only real
directories named ``step_`` + 12 ASCII digits are steps: a file, a symbolic link or another name is
not ours, and nothing here reads, follows or deletes it. Format 1 (before CRC-32C and ``metadata.json``:
DCP's own shard format, pickled ``.metadata``, SHA-256) keeps loading.
With a signing key, a step also needs a manifest whose signature verifies (see ``signing``).

Example:
    >>> step_dir(1200)
    'step_000000001200'
    >>> parse_step("step_000000001200"), parse_step("step_12.tmp"), parse_step("step_٠٠٠٠٠٠٠٠٠٠١٢")
    (1200, None, None)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from ft_checkpoint.errors import CheckpointCorruptError, SignatureError, StorageNotFoundError, StoragePermissionError
from ft_checkpoint.store import checksum as crc
from ft_checkpoint.store.jsonfile import is_int
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.units import plural, short

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
METADATA = "metadata.json"  # see tensor_metadata
FAST_TIER = "fast_tier"
"""The key of a fast-tier part's own metadata in its manifest (whose part it is: rank, world size, save, node)."""
JOURNAL_DIR = "journal"
FORMAT_VERSION = 2
"""2: raw tensor bytes, ``metadata.json``, CRC-32C. 1: DCP's FileSystemWriter format, SHA-256 (still read)."""
SKIPPED_SUFFIX = ".skipped"
MAX_MANIFEST_BYTES = 64 << 20
"""The largest ``manifest.json`` read (bytes): about 750,000 files at ~85 bytes per entry; a larger one is corrupt."""
MAX_STEP = 10**12
_STEP_RE = re.compile(r"step_([0-9]{12})", re.ASCII)
_SAFE_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+", re.ASCII)
UNLISTED = "not listed in the manifest (left over or copied in; a step must hold only what it committed)"
REFUSED = "refused"
"""A :attr:`StepCheck.signature` (or a :meth:`ManifestReader.status`) that a signing key refused (unsigned, or not
verifying)."""
QUARANTINED = "quarantined: a resume found it corrupt and renamed its manifest to manifest.json.skipped"


def step_dir(step: int) -> str:
    """The directory name of ``step``."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP:
        raise ValueError(f"step={step!r}: must be an integer in [0, 10**12)")
    return f"step_{step:012d}"


def parse_step(name: str) -> int | None:
    """The step of a step directory name (ASCII digits only), or None for anything else."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s non-tensor state file."""
    return f"rank_{rank:05d}.pt"


MAX_METADATA_DEPTH = 32
"""The deepest nesting of objects and arrays a manifest's ``metadata`` may have (what a save records there is
a few levels deep; a forged one of hundreds of levels made signing's and ``inspect``'s walks overflow)."""


def nests_within(value: Any, levels: int) -> bool:
    """Whether the JSON value ``value`` nests dicts and lists at most ``levels`` deep (iterative: any depth).

    Example:
        >>> nests_within({"a": [1, {"b": 2}]}, 3), nests_within({"a": [1, {"b": 2}]}, 2)
        (True, False)
    """
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            if depth >= levels:
                return False
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return True


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` is a plain file name inside a step directory (no path, no ``..``, not the manifest).

    Example:
        >>> is_plain_name("__0_0.distcp"), is_plain_name("../x"), is_plain_name("/etc/passwd"), is_plain_name("..")
        (True, False, False, False)
    """
    return (isinstance(name, str) and bool(_SAFE_NAME_RE.fullmatch(name)) and name not in (".", "..")
            and name != MANIFEST and len(name) <= 255)


def checksum(chunks: Iterable[Any]) -> str:
    """``"crc32c:<hex>"`` of the concatenated chunks (how manifests name a file's checksum)."""
    value = 0
    for c in chunks:
        value = crc.crc32c_of(c, value)
    return crc.format_crc(value)


# -- the manifest ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a committed step."""

    size: int
    checksum: str


SIGNATURE_ALGORITHM = "hmac-sha256"
"""The algorithm of a manifest's ``signature`` (see :mod:`ft_checkpoint.format.signing`)."""
MAX_RUN_NAME = 4096
"""The longest run name a signature may name."""
_HEX_RE = re.compile(r"[0-9a-f]+", re.ASCII)


def is_signature(value: Any) -> bool:
    """Whether ``value`` has the shape of a manifest's ``signature`` field (not whether it verifies).

    Example:
        >>> is_signature({"alg": "hmac-sha256", "run": "r", "key_id": "0" * 16, "mac": "0" * 64}), is_signature({})
        (True, False)
    """
    return (isinstance(value, dict) and set(value) == {"alg", "run", "key_id", "mac"} and value["alg"] == SIGNATURE_ALGORITHM
            and isinstance(value["run"], str) and 0 < len(value["run"]) <= MAX_RUN_NAME
            and _is_hex(value["key_id"], 16) and _is_hex(value["mac"], 64))


def _is_hex(value: Any, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and bool(_HEX_RE.fullmatch(value))


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
    signature: dict[str, str] | None = None
    """With a signing key: ``{"alg": "hmac-sha256", "run", "key_id", "mac"}`` (see ``signing``); else absent."""

    @property
    def total_bytes(self) -> int:
        """Bytes of all files of the step."""
        return sum(f.size for f in self.files.values())

    def unlisted(self, names: Iterable[str]) -> list[str]:
        """The names among ``names`` (a step directory's files) that this manifest does not list, itself aside.

        Example:
            >>> m = Manifest(step=1, world_size=1, files={"a.bin": FileEntry(size=1, checksum="crc32c:00000000")})
            >>> m.unlisted(["a.bin", "manifest.json", "stray.distcp"])
            ['stray.distcp']
        """
        return sorted(set(names) - set(self.files) - {MANIFEST})

    def to_json(self) -> bytes:
        """Serialize (stable key order, readable); an unsigned manifest has no ``signature`` field at all."""
        d = dataclasses.asdict(self)
        if d["signature"] is None:
            del d["signature"]
        return json.dumps({"format": "ft-checkpoint", **d}, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest strictly (an int is an int, not a bool or a float); raises
        CheckpointCorruptError saying what is wrong.

        Example:
            >>> Manifest.from_json(Manifest(step=3, world_size=1, files={}).to_json()).step
            3
            >>> try:
            ...     Manifest.from_json(b'{"format": "ft-checkpoint", "format_version": 2, "step": 2.0, '
            ...                        b'"world_size": 1, "files": {}}')
            ... except CheckpointCorruptError as e:
            ...     print(e)
            manifest: field 'step' is 2.0: expected an integer in [0, 10**12)
        """
        try:
            d = json.loads(data, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as e:  # bad bytes or syntax, NaN, an endless number, deep nesting
            raise CheckpointCorruptError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from e
        if not isinstance(d, dict) or d.pop("format", None) != "ft-checkpoint":
            raise CheckpointCorruptError(f"{where}: not an ft-checkpoint manifest")
        version = d.get("format_version")
        if is_int(version) and version > FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{where}: format_version {version!r} is newer than this ft-checkpoint supports "
                f"({FORMAT_VERSION}). HINT: upgrade ft-checkpoint to read it")
        return cls(**_checked_fields(d, where))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _checked_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """The manifest's fields, each type-checked; CheckpointCorruptError naming the first bad one."""
    def bad(field: str, expected: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: field {field!r} is {short(d.get(field))}: expected {expected}")

    known = {f.name for f in dataclasses.fields(Manifest)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CheckpointCorruptError(f"{where}: unknown fields {unknown[:5]}")
    for field in ("format_version", "step", "world_size", "files"):
        if field not in d:
            raise CheckpointCorruptError(f"{where}: field {field!r} is missing")
    checks: dict[str, tuple[Callable[[Any], bool], str]] = {
        "format_version": (lambda v: is_int(v) and 1 <= v <= FORMAT_VERSION, f"an integer from 1 to {FORMAT_VERSION}"),
        "step": (lambda v: is_int(v) and 0 <= v < MAX_STEP, "an integer in [0, 10**12)"),
        "world_size": (lambda v: is_int(v) and 1 <= v <= 10**7, "an integer >= 1"),
        "epoch": (lambda v: v is None or (is_int(v) and v >= 0), "null or an integer >= 0"),
        "time": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                 "a finite number (seconds since the epoch)"),
        "versions": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for kv in v.items() for x in kv),
                     "an object of strings"),
        "metadata": (lambda v: isinstance(v, dict) and nests_within(v, MAX_METADATA_DEPTH),
                     f"an object nested at most {MAX_METADATA_DEPTH} levels"),
        "files": (lambda v: isinstance(v, dict), "an object of file entries"),
        "signature": (lambda v: v is None or is_signature(v),
                      'null or {"alg": "hmac-sha256", "run": <str>, "key_id": <16 hex>, "mac": <64 hex>}'),
    }
    for field, (ok, expected) in checks.items():
        if field in d and not ok(d[field]):
            raise bad(field, expected)
    d["files"] = {name: _file_entry(name, entry, where) for name, entry in d["files"].items()}
    return d


def _file_entry(name: Any, entry: Any, where: str) -> FileEntry:
    if not is_plain_name(name):
        raise CheckpointCorruptError(f"{where}: file name {short(name)} is not a plain name inside the step "
                                     "directory; refusing it")
    if not isinstance(entry, dict) or set(entry) != {"size", "checksum"}:
        raise CheckpointCorruptError(f"{where}: the entry of {name} is {short(entry)}: expected "
                                     '{"size": <int>, "checksum": <str>}')
    size, check = entry["size"], entry["checksum"]
    if not is_int(size) or size < 0:
        raise CheckpointCorruptError(f"{where}: the size of {name} is {short(size)}: expected an integer >= 0")
    if not crc.is_valid(check):
        raise CheckpointCorruptError(f"{where}: the checksum of {name} is {short(check)}: expected "
                                     "'crc32c:<8 hex digits>' or 'sha256:<64 hex digits>'")
    return FileEntry(size=size, checksum=check)


# -- listing -----------------------------------------------------------------------------------
def list_steps(storage: Storage) -> dict[int, bool]:
    """``{step: has a manifest.json}`` for every step directory (real directories only: a file or a
    symbolic link named like a step is not one of ours and is ignored)."""
    steps = {}
    for name, entry in storage.entries("").items():
        step = parse_step(name)
        if step is None:
            continue
        if entry.kind != "directory":
            log.warning("ignoring %s: named like a step directory but it is a %s", storage.url_of(name),
                        "symbolic link or special file" if entry.kind == "other" else "file")
            continue
        try:
            steps[step] = MANIFEST in storage.sizes(name)
        except StoragePermissionError as e:  # planted by another user of a shared directory, say
            _warn_once(f"ignoring {storage.url_of(name)}: it cannot be read by this user, so it is none of this run's "
                       f"steps ({e})")
    return steps


_WARNED: set[str] = set()
"""The warnings :func:`_warn_once` gave in this process."""


def _warn_once(message: str) -> None:
    """A warning the first time this process meets ``message``, a debug line after: a step that does not count is
    met again by every listing (each save's retention lists the directory)."""
    if message in _WARNED:
        log.debug("%s", message)
    else:
        _WARNED.add(message)
        log.warning("%s", message)


MAX_NOT_COUNTED_WARNINGS = 20
"""The most warnings of steps that do not count as committed a process gives (:meth:`ManifestReader.status`): anyone
who can write the directory can plant thousands of garbage step directories, and each would be a line of every
``gc`` and of the training's log. The others are logged at DEBUG, and counted in one line (:func:`report_left_out`)."""
_NOT_COUNTED: set[str] = set()
"""The warnings of steps that do not count that this process gave (at most :data:`MAX_NOT_COUNTED_WARNINGS`)."""
_LEFT_OUT: set[str] = set()
"""Those it left out (DEBUG only), each counted once by :func:`report_left_out`..."""
_UNREPORTED: set[str] = set()
"""... and those of them not counted yet."""


def _warn_not_counted(message: str) -> None:
    """:func:`_warn_once` for the first :data:`MAX_NOT_COUNTED_WARNINGS` steps that do not count; a debug line for
    the others, which :func:`report_left_out` counts."""
    if message in _NOT_COUNTED or len(_NOT_COUNTED) < MAX_NOT_COUNTED_WARNINGS:
        _NOT_COUNTED.add(message)
        _warn_once(message)
        return
    log.debug("%s", message)
    if message not in _LEFT_OUT:
        _LEFT_OUT.add(message)
        _UNREPORTED.add(message)


def report_left_out(storage: Storage) -> None:
    """One warning saying how many steps that do not count (met in the listing of ``storage`` just made) had their
    warning left out, and how to see them; nothing if none was (or all were counted by an earlier listing).

    Example:
        >>> report_left_out(Storage("memory://doc/left-out"))   # none left out: no line
    """
    if _UNREPORTED:
        log.warning("left out the warnings of %s in %s that do not count as committed (this process gives the first "
                    "%d; the others are logged at DEBUG). HINT: 'ft-checkpoint ls %s' lists every step with why it "
                    "does not count", plural(len(_UNREPORTED), "more step"), storage.url, MAX_NOT_COUNTED_WARNINGS,
                    storage.url)
        _UNREPORTED.clear()


class SignatureCheck(Protocol):
    """What checks a manifest's signature for this run (a :class:`~ft_checkpoint.format.signing.Signer`)."""

    def check(self, manifest: Manifest, step: int) -> None:
        """Raise SignatureError unless ``manifest`` is signed for this run and ``step``."""


def read_manifest(storage: Storage, step: int, *, signer: SignatureCheck | None = None,
                  reader: ManifestReader | None = None) -> Manifest:
    """Read and parse the manifest of ``step``; CheckpointCorruptError if missing or invalid, and with a
    ``signer``, SignatureError if it is unsigned or its signature does not verify for this run and step.
    ``reader``: the :class:`ManifestReader` of a listing, which reads each manifest once (None: read it now)."""
    return check_manifest((reader or ManifestReader(storage)).read(step), step, signer=signer)


def check_manifest(manifest: Manifest, step: int, *, signer: SignatureCheck | None = None) -> Manifest:
    """``manifest`` if it is the one of ``step`` (and with a ``signer``, signed for this run and step): see
    :func:`read_manifest`, which reads it first."""
    if signer is not None:
        signer.check(manifest, step)
    if manifest.step != step:
        raise CheckpointCorruptError(f"manifest.json says step {manifest.step}, the directory says {step}")
    return manifest


class ManifestReader:
    """Reads the manifests of a checkpoint directory, each at most once: a step read already gives the same answer
    again, and a manifest hard-linked into many step directories (one file, many names) is read and parsed once
    (see ``Storage.read_control_once``): a thousand links to a 60 MB manifest cost one parse, not a thousand.

    Args:
        known: What a reader found before (its :attr:`outcomes`, e.g. rank 0's at the start): not read again.

    Example:
        >>> reader = ManifestReader(Storage("memory://doc/reader"))
        >>> reader.status(3), reader.outcomes
        ('not committed', {3: 'manifest.json is missing'})
    """

    def __init__(self, storage: Storage, known: dict[int, Manifest | str] | None = None) -> None:
        self.storage = storage
        self.outcomes: dict[int, Manifest | str] = dict(known or {})
        """By step: the manifest read, parsed (its step and signature not checked yet), or why it is not one."""
        self._files: dict[Any, Manifest | str] = {}  # by file identity: local to this machine, never sent elsewhere

    def read(self, step: int) -> Manifest:
        """The manifest of ``step``, parsed (neither its step nor its signature checked: see :func:`check_manifest`);
        CheckpointCorruptError if it is missing, not a regular file, too large or invalid."""
        if step not in self.outcomes:
            self.outcomes[step] = self._read(step)
        found = self.outcomes[step]
        if isinstance(found, str):
            raise CheckpointCorruptError(found)
        return found

    def status(self, step: int, *, signer: SignatureCheck | None = None) -> str:
        """Whether ``step`` (a step directory that has a ``manifest.json``) counts as committed: :data:`COMMITTED`;
        :data:`NOT_COMMITTED` (garbage: its manifest does not parse, or names another step); with a ``signer``,
        :data:`REFUSED` (unsigned or forged: neither committed nor garbage). A step that does not count is warned about
        (once per process, the first :data:`MAX_NOT_COUNTED_WARNINGS` of them: call :func:`report_left_out` after a
        listing)."""
        try:
            check_manifest(self.read(step), step, signer=signer)
            return COMMITTED
        except CheckpointCorruptError as e:  # SignatureError among them
            _warn_not_counted(f"step {step} in {self.storage.url} does not count as committed: {e}")
            return REFUSED if isinstance(e, SignatureError) else NOT_COMMITTED

    def _read(self, step: int) -> Manifest | str:
        rel = f"{step_dir(step)}/{MANIFEST}"

        def parse(data: bytes) -> Manifest | str:
            try:
                return Manifest.from_json(data, where=self.storage.url_of(rel))
            except CheckpointCorruptError as e:
                return str(e)

        try:  # never a FIFO, a link, a huge file; and each file parsed once
            return self.storage.read_control_once(rel, parse, max_bytes=MAX_MANIFEST_BYTES, parsed=self._files)
        except StorageNotFoundError:
            return "manifest.json is missing"
        except StoragePermissionError as e:
            return f"manifest.json cannot be read by this user ({e})"
        except CheckpointCorruptError as e:
            return str(e)


COMMITTED = "committed"
"""A step whose manifest parses and names its step (with a signing key, whose signature verifies)."""
NOT_COMMITTED = "not committed"
"""A step without a manifest, or whose manifest does not parse or names another step: garbage."""


@dataclasses.dataclass
class Listing:
    """The step directories of a checkpoint directory, listed once, and the manifests read newest first down to
    the newest committed step: what a start needs (the newest committed step, the candidates of a resume), without
    reading them again; older manifests are read only when a resume falls back to them.

    Example:
        >>> Listing.of(Storage("memory://doc/listing")).newest is None
        True
    """

    steps: dict[int, bool]
    """``{step: has a manifest.json}``, as :func:`list_steps` returns it."""
    outcomes: dict[int, Manifest | str]
    """The manifests read, by step: parsed, or why not (see :attr:`ManifestReader.outcomes`)."""
    newest: int | None
    """The newest committed step (with a signing key, the newest whose signature verifies), or None."""

    @classmethod
    def of(cls, storage: Storage, steps: dict[int, bool] | None = None, *,
           signer: SignatureCheck | None = None) -> Listing:
        """List ``storage`` (or take ``steps``) and read the manifests newest first, down to the newest committed
        step (with a ``signer``, the newest that verifies); one that does not count is warned about."""
        steps = list_steps(storage) if steps is None else steps
        reader = ManifestReader(storage)
        newest = next((step for step in sorted(steps, reverse=True)
                       if steps[step] and reader.status(step, signer=signer) == COMMITTED), None)
        report_left_out(storage)
        return cls(steps=steps, outcomes=reader.outcomes, newest=newest)

    @property
    def manifests(self) -> dict[int, Manifest]:
        """The manifests read that parse (not checked against a signing key: a resume does that)."""
        return {step: m for step, m in self.outcomes.items() if isinstance(m, Manifest)}


def committed_steps(storage: Storage, steps: dict[int, bool] | None = None, *,
                    signer: SignatureCheck | None = None) -> list[int]:
    """Steps whose manifest exists and parses, ascending (with a ``signer``, whose signature verifies too): what
    counts as committed. One small read each, a manifest hard-linked into several steps read once."""
    steps = list_steps(storage) if steps is None else steps
    reader = ManifestReader(storage)
    committed = [step for step in sorted(steps) if steps[step] and reader.status(step, signer=signer) == COMMITTED]
    report_left_out(storage)
    return committed


# -- checking ----------------------------------------------------------------------------------
@dataclasses.dataclass
class StepCheck:
    """The outcome of checking one step: its manifest (if it parsed) and every problem, each naming a file."""

    step: int
    manifest: Manifest | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    bytes_checked: int = 0
    signature: str | None = None
    """``"verified"`` (with a key), ``"refused"`` (with a key: unsigned or not verifying; the first problem says
    why), ``"not checked"`` (signed, no key given), ``"none"`` (unsigned, no key given); None: no manifest."""
    mismatched: list[str] = dataclasses.field(default_factory=list)
    """The files (by name) whose bytes do not match the manifest's checksum of the whole file."""
    gone: bool = False
    """The step was deleted while it was checked (a running job's retention, or ``gc``): neither intact nor corrupt."""
    unreadable: bool = False
    """A file of the step cannot be read by this user (permission denied): not checked, neither intact nor corrupt."""
    loads: bool | None = None
    """Whether a resume loads the step despite its problems (``ft-checkpoint verify`` works it out for a step whose
    only problem is data files whose bytes outside every tensor changed); None: not worked out (a resume loads a
    step only if it is ``ok``)."""

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems

    @property
    def files(self) -> int:
        """Files the manifest lists (0 without a manifest)."""
        return len(self.manifest.files) if self.manifest else 0

    @property
    def bytes(self) -> int:
        """Bytes the manifest lists."""
        return self.manifest.total_bytes if self.manifest else 0

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ok": self.ok, "resume_loads": self.resume_loads, "files": self.files,
                "bytes": self.bytes, "signature": self.signature, "problems": list(self.problems), "gone": self.gone,
                "unreadable": self.unreadable}

    @property
    def resume_loads(self) -> bool:
        """Whether a resume loads this step (as far as the checks made tell)."""
        return self.ok or bool(self.loads)

    def raise_if_bad(self) -> Manifest:
        """The manifest, or CheckpointCorruptError with the first problems (unlisted files in one); SignatureError
        if the signature was refused."""
        if self.ok:
            assert self.manifest is not None
            return self.manifest
        if self.signature == REFUSED:
            raise SignatureError(self.problems[0])
        suffix = f": {UNLISTED}"
        unlisted = [p.removesuffix(suffix) for p in self.problems if p.endswith(suffix)]
        problems = [p for p in self.problems if not p.endswith(suffix)]
        if unlisted:
            problems.append(f"{', '.join(unlisted[:5])}{', ...' if len(unlisted) > 5 else ''}{suffix}")
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointCorruptError("; ".join(problems[:3]) + more)


OnBytes = Callable[[int], None]
"""Called with the number of bytes just read (drives a progress bar)."""


def check_step(storage: Storage, step: int, *, checksums: bool | Callable[[str], bool] = False,
               on_bytes: OnBytes | None = None, signer: SignatureCheck | None = None,
               reader: ManifestReader | None = None) -> StepCheck:
    """Check a step: the manifest (with a ``signer``, its signature first: nothing else is looked at in a
    step it refuses), every file's size and kind, no file it does not list, and checksums (``True``: every
    file; a predicate: the files it selects, e.g. this rank's share; ``False``: none — a resume verifies
    format-2 data as it reads it). ``reader``: the :class:`ManifestReader` of a :class:`Listing` made moments
    ago (a manifest it read is checked here like one read now, and not read again).

    Example:
        >>> check_step(Storage("memory://doc/check"), 7).problems
        ['manifest.json is missing']
    """
    result = StepCheck(step=step)
    rel = step_dir(step)
    try:
        result.manifest = manifest = read_manifest(storage, step, signer=signer, reader=reader)
    except SignatureError as e:
        result.signature = REFUSED
        result.problems.append(str(e))
        return result
    except CheckpointCorruptError as e:
        quarantined = MANIFEST + SKIPPED_SUFFIX in storage.sizes(rel)
        result.problems.append(QUARANTINED if quarantined else str(e))
        return result
    result.signature = "verified" if signer is not None else "none" if manifest.signature is None else "not checked"
    entries = storage.entries(rel)
    for name, entry in sorted(manifest.files.items()):
        problem = _entry_problem(entries.get(name), entry)
        if problem is None and (checksums is True or (callable(checksums) and checksums(name))):
            problem = _checksum_problem(storage, f"{rel}/{name}", entry, on_bytes)
            result.bytes_checked += entry.size
            if problem == CHECKSUM_MISMATCH:
                result.mismatched.append(name)
        if problem:
            result.problems.append(f"{name}: {problem}")
    result.problems += [f"{name}: {UNLISTED}" for name in manifest.unlisted(entries)]
    return result


CHECKSUM_MISMATCH = "does not match its checksum (corrupted)"


def _entry_problem(found: Any, entry: FileEntry) -> str | None:
    if found is None:
        return "missing"
    if found.kind != "file":
        return "is a symbolic link or not a regular file; refusing to read through it"
    if found.size != entry.size:
        return f"has {found.size} bytes, the manifest says {entry.size} (truncated or replaced)"
    return None


def _checksum_problem(storage: Storage, rel: str, entry: FileEntry, on_bytes: OnBytes | None) -> str | None:
    try:
        return None if crc.matches(entry.checksum, reported(storage.iter_chunks(rel, size=entry.size), on_bytes)) \
            else CHECKSUM_MISMATCH
    except CheckpointCorruptError as e:  # swapped for a FIFO or a link since the listing: the message names it
        return f"changed since it was listed: {e}"


def reported(pieces: Iterable[bytes], on_bytes: OnBytes | None) -> Iterator[bytes]:
    """``pieces`` as they are, each one's size passed to ``on_bytes`` (a progress bar) as it goes by.

    Example:
        >>> seen = []
        >>> b"".join(reported([b"ab", b"c"], seen.append)), seen
        (b'abc', [2, 1])
    """
    for piece in pieces:
        if on_bytes is not None:
            on_bytes(len(piece))
        yield piece


# -- deleting and setting aside ----------------------------------------------------------------
def delete_step(storage: Storage, step: int, *, before_write: bool = False) -> bool:
    """Delete one step directory: its manifest first (a crash halfway leaves garbage, never a broken
    commit), then every other file its own listing holds, by its literal name, then the empty directory;
    returns whether it is gone. Nothing is expanded as a pattern and no symbolic link is followed, even one
    swapped in for the directory after it was listed (see ``Storage.delete_directory``); a subdirectory
    (never ours) is left alone. ``before_write`` (a save about to write this step): a symbolic link planted in
    the step directory's place is removed itself, so that the save never writes through it."""
    try:
        return storage.delete_directory(step_dir(step), first=MANIFEST, unlink_link=before_write)
    except StoragePermissionError as e:  # another user's, planted in a shared directory, say
        _warn_once(f"left {storage.url_of(step_dir(step))} in place: this user cannot delete it ({e})")
        return False


def quarantine(storage: Storage, steps: Iterable[int]) -> None:
    """Rename the manifests of ``steps`` to ``manifest.json.skipped``: they no longer count as commits. Never
    through a symbolic link, even one swapped in for the step directory since it was checked (see
    ``Storage.rename``): such a step is left as it is, with a warning."""
    for step in steps:
        rel = f"{step_dir(step)}/{MANIFEST}"
        try:
            storage.rename(rel, rel + SKIPPED_SUFFIX)
        except StorageNotFoundError:
            continue
        except (CheckpointCorruptError, StoragePermissionError) as e:
            log.warning("left %s as it is: %s", storage.url_of(rel), e)


def checkpoint_dirs_below(storage: Storage, limit: int = 5, scan: int = 20) -> list[str]:
    """URLs of the directories right below ``storage`` that hold step directories (a Lightning
    ``default_root_dir`` holds them in ``ft_checkpoints/``), among the first ``scan`` folders there: what ``ls``
    suggests when it finds none, and what a job's first start in a directory without a step warns about.

    Example:
        >>> s = Storage("memory://doc/root")
        >>> s.write_bytes("ft_checkpoints/step_000000000010/manifest.json", b"{}")
        >>> checkpoint_dirs_below(s)
        ['memory://doc/root/ft_checkpoints']
    """
    found: list[str] = []
    folders = [name for name, entry in sorted(storage.entries("").items())
               if entry.kind == "directory" and parse_step(name) is None and name != JOURNAL_DIR]
    for name in folders[:scan]:
        if any(parse_step(n) is not None for n in storage.listdir(name)):
            found.append(storage.url_of(name))
        if len(found) >= limit:
            break
    return found
