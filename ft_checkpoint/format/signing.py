"""Signed manifests: an HMAC-SHA256 over each manifest, with a key that never lies in the checkpoint directory.

With a key configured (``signing_key`` / ``FT_CHECKPOINT_SIGNING_KEY``, or the file named by
``signing_key_file`` / ``FT_CHECKPOINT_SIGNING_KEY_FILE``), rank 0 signs every manifest it commits, and
a resume skips any step whose manifest is unsigned or does not verify. The MAC covers the manifest's
canonical bytes (every field a loader uses: each file with its size and checksum, the step, the
metadata, ...), so a file replaced with recomputed checksums is caught, and it binds two more things:

- **the run's identity**: ``run_name`` if set, else the checkpoint directory's URL as this job names
  it (``/data/run``, ``gs://bucket/run``; a ``file://`` prefix dropped). A step copied from another run
  does not verify. A run moved or copied on purpose verifies again once ``run_name`` names the identity
  it was signed for (the warning quotes it), or at once if every job of the run sets ``run_name``;
- **the step**: a step copied under another step number does not verify, even with its ``step`` edited.

The key is never printed or logged (``repr`` hides it); a key file inside the checkpoint directory is
refused. Without a key nothing changes: manifests carry no signature, and one that is there is not checked.

Example:
    >>> from ft_checkpoint.format.layout import Manifest
    >>> signer = Signer(b"k" * 32, run="gs://bucket/run-7")
    >>> signed = signer.sign(Manifest(step=3, world_size=1, files={}, time=0.0))
    >>> signed.signature["alg"], signer.check(signed, 3)
    ('hmac-sha256', None)
    >>> try:
    ...     Signer(b"k" * 32, run="gs://bucket/run-8").check(signed, 3)
    ... except SignatureError as e:
    ...     print(str(e).split(": a step")[0])
    manifest.json is signed for run 'gs://bucket/run-7', not for this run 'gs://bucket/run-8'
    >>> signer
    Signer(run='gs://bucket/run-7', key=<hidden>)
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
from typing import Any, Protocol

from ft_checkpoint.errors import ConfigError, SignatureError
from ft_checkpoint.format.layout import SIGNATURE_ALGORITHM, Manifest
from ft_checkpoint.store.nofollow import read_named_file
from ft_checkpoint.units import short

MIN_KEY_BYTES = 32
"""The shortest key taken (bytes): 32 hex digits or more, e.g. ``openssl rand -hex 32``."""
MAX_KEY_BYTES = 4096
"""The longest key taken (bytes); a key file may hold this much, plus a line ending."""
_DOMAIN = "ft-checkpoint manifest signature v1"
KEY_HINT = "HINT: make one with 'openssl rand -hex 32 > ~/.ft-checkpoint.key' (kept outside the checkpoint directory)"
_PATH_HINT = ("HINT: check the path (a run signed with a key resumes only with that key); only for a run that has no "
              "key yet, make one with 'openssl rand -hex 32 > ~/.ft-checkpoint.key' (kept outside the checkpoint directory)")


class KeySettings(Protocol):
    """The settings a signer is made from (a :class:`~ft_checkpoint.config.CheckpointConfig` has them)."""

    @property
    def signing_key(self) -> str | None: ...

    @property
    def signing_key_file(self) -> str | None: ...

    @property
    def run_name(self) -> str | None: ...


def check_key_text(field: str, value: Any) -> bytes:
    """The key ``value`` (text) as bytes; ConfigError naming ``field``, never the value, if it cannot be one."""
    if not isinstance(value, str):
        raise ConfigError(f"{field} is invalid: expected the key as text (a {type(value).__name__} was given; "
                          f"the value is not shown). {KEY_HINT}")
    try:
        key = value.encode("utf-8", "surrogateescape")  # the bytes of an environment variable, as they were
    except UnicodeEncodeError:
        raise ConfigError(f"{field} is invalid: the key is not encodable text (the value is not shown). "
                          f"{KEY_HINT}") from None
    return _checked_key(field, key)


def _checked_key(field: str, key: bytes) -> bytes:
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise ConfigError(f"{field} is invalid: the key has {len(key)} bytes, expected {MIN_KEY_BYTES} to "
                          f"{MAX_KEY_BYTES} (the value is not shown). {KEY_HINT}")
    return key


def read_key_file(field: str, path: str) -> bytes:
    """The key in the file ``path`` (one trailing line ending dropped); ConfigError naming ``field`` and the path,
    never the key, if it is not a readable regular file holding one.

    Example:
        >>> read_key_file("signing_key_file", "/nonexistent/key")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ft_checkpoint.errors.ConfigError: signing_key_file='/nonexistent/key': cannot read the key file (...
    """
    where = f"{field}={short(path)}"
    try:
        data = read_named_file(path, max_bytes=MAX_KEY_BYTES + 2)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read the key file ({type(e).__name__}: {e}). {_PATH_HINT}") from None
    key = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
    return _checked_key(where, key)


def default_run_name(url: str) -> str:
    """The run's identity when ``run_name`` is not set: the directory's URL, ``file://`` dropped.

    Example:
        >>> default_run_name("file:///data/run"), default_run_name("gs://bucket/run")
        ('/data/run', 'gs://bucket/run')
    """
    return url.removeprefix("file://") if url.startswith("file:///") else url


@dataclasses.dataclass(frozen=True)
class Signer:
    """Signs manifests and checks their signatures, for one key and one run (see the module's docstring).

    Example:
        >>> Signer(b"k" * 32, run="/data/run").key_id
        '0ebc8ce316bb07e5'
    """

    key: bytes = dataclasses.field(repr=False)
    run: str

    def __repr__(self) -> str:
        return f"Signer(run={self.run!r}, key=<hidden>)"

    @classmethod
    def from_config(cls, config: KeySettings, url: str) -> Signer | None:
        """The signer ``config`` asks for in the directory ``url`` (None without a key).

        Raises:
            ConfigError: the key file lies inside the checkpoint directory, or cannot be read.
        """
        if config.signing_key is not None:
            key = check_key_text("signing_key", config.signing_key)
        elif config.signing_key_file is not None:
            _refuse_key_inside(config.signing_key_file, url)
            key = read_key_file("signing_key_file", config.signing_key_file)
        else:
            return None
        return cls(key, run=config.run_name or default_run_name(url))

    @property
    def key_id(self) -> str:
        """A short fingerprint of the key (an HMAC of a constant: it tells keys apart, reveals nothing of one)."""
        return hmac.new(self.key, b"ft-checkpoint key id", hashlib.sha256).hexdigest()[:16]

    def sign(self, manifest: Manifest) -> Manifest:
        """``manifest`` with its ``signature`` field set."""
        mac = self._mac(manifest, manifest.step)
        signature = {"alg": SIGNATURE_ALGORITHM, "run": self.run, "key_id": self.key_id, "mac": mac}
        return dataclasses.replace(manifest, signature=signature)

    def check(self, manifest: Manifest, step: int) -> None:
        """Raise SignatureError unless ``manifest`` is signed with this key, for this run and for ``step`` (the
        step of the directory it was read from). The MACs are compared in constant time."""
        sig = manifest.signature
        if sig is None:
            raise SignatureError("manifest.json is not signed, and this job requires signed manifests (a signing key "
                                 "is configured): it was written without the key, or forged. HINT: a step saved "
                                 "without the key is never resumed with one; resume it without signing_key, or "
                                 "start a new run directory")
        if sig["run"] != self.run:
            raise SignatureError(  # names quoted whole (at most 4096 characters), control characters escaped
                f"manifest.json is signed for run {sig['run']!r}, not for this run {self.run!r}: a step copied from "
                f"another run. HINT: if this directory was moved or copied here on purpose, set run_name "
                f"(FT_CHECKPOINT_RUN_NAME, or --run-name) to {sig['run']!r}")
        if not hmac.compare_digest(sig["key_id"], self.key_id):
            raise SignatureError(f"manifest.json is signed with another key (key id {sig['key_id']}, this job's is "
                                 f"{self.key_id}). HINT: use the key the run was saved with")
        # a manifest of another step never verifies (it is signed for its own): no MAC computed for it, so that one
        # hard-linked into many step directories costs no MAC of its whole size for each
        if manifest.step != step or not hmac.compare_digest(sig["mac"], self._mac(manifest, step)):
            raise SignatureError("the signature of manifest.json does not verify: the manifest was changed after it "
                                 "was signed (forged, e.g. with recomputed checksums), or it belongs to another step")

    def _mac(self, manifest: Manifest, step: int) -> str:
        """HMAC-SHA256 of the canonical bytes of the manifest (signature left out), the run and ``step``."""
        content = json.loads(manifest.to_json())
        content.pop("signature", None)
        message = {"domain": _DOMAIN, "run": self.run, "step": step, "manifest": content}
        data = json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        return hmac.new(self.key, data.encode("ascii"), hashlib.sha256).hexdigest()


def _refuse_key_inside(path: str, url: str) -> None:
    """ConfigError if the key file lies inside the checkpoint directory (whoever writes checkpoints could replace it)."""
    local = default_run_name(url)
    if "://" in local:
        return  # an object store or memory://: a local key file cannot lie inside it
    directory, key = os.path.realpath(local), os.path.realpath(path)
    if os.path.commonpath([directory, key]) == directory:
        raise ConfigError(f"signing_key_file={short(path)} lies inside the checkpoint directory {short(local)}: "
                          "whoever can write checkpoints could replace the key. HINT: keep the key file outside "
                          "it (e.g. ~/.ft-checkpoint.key, readable only by you)")
