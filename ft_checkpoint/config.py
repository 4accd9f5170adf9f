"""Configuration: one frozen, keyword-only dataclass, also loadable from env vars and a YAML file.

``accelerate launch``, sbatch scripts and Kubernetes manifests configure jobs through the
environment, so every field can come from ``FT_CHECKPOINT_<FIELD>`` (e.g. ``FT_CHECKPOINT_DIRPATH``,
``FT_CHECKPOINT_INTERVAL=30m``) or from a YAML file named by ``FT_CHECKPOINT_CONFIG``. Precedence:
explicit arguments > environment > file. Every value is validated when the config is built; any bad
value (of any type: ``nan``, ``inf``, ``10**400``, a nested list, bytes, an object) is a
:class:`~ft_checkpoint.errors.ConfigError` that names the field, the bad value and what is allowed.
Durations are finite, from 1 ms up to 100 years; counts of steps below ``10**12`` (the step range).

Example:
    >>> cfg = CheckpointConfig(dirpath="/tmp/run", interval="30m", keep_last=2)
    >>> cfg.interval
    datetime.timedelta(seconds=1800)
    >>> CheckpointConfig(dirpath="/tmp/run", interval=500).interval
    500
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import difflib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from ft_checkpoint.errors import ConfigError
from ft_checkpoint.format import layout, signing
from ft_checkpoint.store.jsonfile import is_int, is_number
from ft_checkpoint.store.nofollow import read_named_file
from ft_checkpoint.store.storage import refuse_missing_slash, refuse_no_path
from ft_checkpoint.units import parse_duration, parse_signal, short

log = logging.getLogger(__name__)
ENV_PREFIX = "FT_CHECKPOINT_"
ENV_CONFIG_FILE = "FT_CHECKPOINT_CONFIG"
MAX_DURATION = 100 * 365.25 * 86400
"""The longest duration a field takes (100 years, in seconds): longer is a mistake, and overflows."""
MIN_DURATION = 0.001
"""The shortest positive duration a field takes (1 ms, the smallest unit): shorter underflows."""
MAX_STEPS = 10**12 - 1
"""The largest step count (step directories have 12 digits)."""
MAX_RETRIES = 1000
MIN_GPU_FAILURE_RATE = 1e-12
"""The smallest prior failure rate per GPU-second (one failure in 31,700 GPU-years)."""
MAX_CONFIG_FILE = 1 << 20
DEFAULT_SUBDIR = "ft_checkpoints"
"""Without a dirpath, the integrations put checkpoints in this folder of the framework's own run directory
(Lightning's ``default_root_dir``, Accelerate's ``project_dir``)."""
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Everything that configures checkpointing. Build it with :meth:`from_env` to include env and file.

    Example:
        >>> CheckpointConfig(dirpath="gs://bucket/run-7", keep_last=5).keep_last
        5
    """

    dirpath: str | None = None
    """Checkpoint directory: a local path or an fsspec URL (``gs://b/run``, ``s3://b/run``, ``memory://run``)."""

    interval: int | datetime.timedelta | str = "adaptive"
    """When to save: an int (every N steps), a timedelta or duration string (``"30m"``), or ``"adaptive"``."""

    min_interval: float | str | datetime.timedelta | None = None
    """Adaptive interval: never save more often than this (seconds, timedelta or ``"5m"``)."""

    max_interval: float | str | datetime.timedelta | None = None
    """Adaptive interval: never save less often than this."""

    mtbf: float | str | datetime.timedelta | None = None
    """Adaptive interval: prior mean time between failures of this job (default: from ``gpu_failure_rate``)."""

    gpu_failure_rate: float | None = None
    """Adaptive interval: prior failures per GPU-second (default: Llama 3's, 419 in 54 days on 16,384 GPUs),
    from ``1e-12`` to ``1``; a numeric string (``"5e-9"``, as YAML gives it) is read as a number."""

    keep_last: int = 3
    """How many of the newest committed steps to keep (>= 1)."""

    keep_every_n_steps: int | None = None
    """Also keep, forever, every step that is a multiple of this (milestones); None keeps none."""

    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Options for the fsspec filesystem: credentials, ``endpoint_url``, ``token``, ..."""

    async_save: bool = True
    """Write in the background after staging; False makes every save block until committed."""

    final_save: bool = True
    """At a clean end (Lightning's ``fit`` returns, ``ft.epochs()`` ends, ``CheckpointManager.close()``), save
    the last step unless it is saved already: the final weights are in the directory, and a restart of the
    finished run resumes at its end and trains no step again."""

    save_rng_state: bool = True
    """Save and restore each rank's RNG states (torch, CUDA, Python, NumPy) for bit-exact resume."""

    verify_checksums: bool = True
    """On resume, check the checksum of every file about to be loaded (sizes are always checked)."""

    retries: int = 5
    """Attempts for a storage operation that fails with a transient error (>= 1)."""

    progress_interval: float | str | datetime.timedelta = 10.0
    """How often (at most) the journal notes the step reached, from a background thread; the goodput
    report's recomputed work after a crash is exact to within this much training time (0: every step,
    written before the step returns: an exact report for one small write per step)."""

    force_takeover: bool = False
    """Take the directory's lease even if another live job seems to hold it (see ``lease``)."""

    on_save_error: str = "raise"
    """A save that fails in the background: ``"raise"`` it at the next save/wait/close, or ``"warn"``
    loudly and keep training (the last committed step stays the resume point)."""

    preemption_signals: tuple[str, ...] | list[str] | str = ("SIGTERM", "SIGUSR1")
    """Signals that announce a preemption (``()`` watches none). Their handlers only set a flag; at the
    next step boundary every rank makes a final synchronous save, then the process exits (see
    ``preemption_exit_code``). Handlers installed before (yours, the framework's) still run."""

    requeue: bool | None = None
    """On Slurm, ``scontrol requeue`` the job after the final save of a preemption. None: only if the
    job can be requeued (``sbatch --requeue``)."""

    end_time_margin: float | str | datetime.timedelta = "3m"
    """On Slurm, make the final save this long before the job's time limit (or twice the time a save
    takes to become durable, if longer), even if no signal comes."""

    preemption_exit_code: int = 0
    """Exit code after a preemption's final save (``ft_checkpoint.Preempted`` is a ``SystemExit``).
    Non-zero for launchers that only restart failed workers (Kubernetes ``restartPolicy: ExitCode``)."""

    writer: str = "thread"
    """Who writes the shard files in the background: ``"thread"`` (in the training process; the writes and
    checksums release the GIL) or ``"process"`` (a child process fed from shared-memory staging buffers,
    where ``writer_priority`` applies to all of its work). See the README's benchmarks for the choice."""

    writer_priority: int = 0
    """The writer's nice value, 0 (as the training) to 19 (only idle CPU): lower priority for the
    background work (the thread's or the process's; read back from the OS by the tests)."""

    writers: int = 2
    """Shard files (and parallel writers) per rank: more than one helps a large state on fast storage."""

    lazy_snapshot: bool = True
    """Let a save return before parameters and optimizer state are copied: their copy overlaps the next forward
    and backward, and the next optimizer step waits for what is not yet copied. Everything that can change
    outside an optimizer step (buffers, other tensors, RNG, data position) is still copied before ``save``
    returns; an in-place edit of a parameter before the next step is detected (version counters) and that save
    is abandoned, never committed torn. DeepSpeed engines are always copied at once. See ``snapshot``."""

    signing_key: str | None = dataclasses.field(default=None, repr=False)
    """A secret (32 to 4096 bytes of text, e.g. ``openssl rand -hex 32``) that signs every manifest (HMAC-SHA256)
    and without whose signature no step is resumed (see ``signing``). Best from the environment
    (``FT_CHECKPOINT_SIGNING_KEY``) or ``signing_key_file``; never printed or logged."""

    signing_key_file: str | None = None
    """A local file holding the signing key (one trailing line ending dropped), outside the checkpoint directory;
    instead of ``signing_key``."""

    run_name: str | None = None
    """The run's identity that signatures bind (default: the checkpoint directory's URL). Set it to the same name
    in every job of a run whose directory may be moved or copied, so that its signed steps verify there too."""

    fast_dirpath: str | None = None
    """The fast tier: a node-local directory each node keeps recent steps in, beside the durable ``dirpath``:
    host shared memory (``/dev/shm/ft``: outlives the training processes, not the node) or a node-local disk.
    A restart takes the newest step from the fastest place that has it. None: no fast tier (see the README's
    "Tiers")."""

    fast_interval: int | datetime.timedelta | str = "adaptive"
    """When to save to the fast tier (with ``fast_dirpath``): like ``interval``, every N steps, a duration, or
    ``"adaptive"`` (the optimum for the fast tier's own measured cost). A step due on both tiers is staged once."""

    fast_replicas: int = 1
    """Peer copies of each rank's fast-tier files, held by the next node of a ring over the nodes (1: the fast
    tier survives the loss of one node; 0: none, a process crash only). Ignored on one node."""

    node_id: str | None = None
    """This node's name for the fast tier (whose files its folder holds). Default: the host name and
    ``fast_dirpath``; torchrun's node rank is not used, since its c10d rendezvous renumbers nodes at each restart."""

    def __new__(cls, *args: Any, **kwargs: Any) -> CheckpointConfig:
        own = () if cls is CheckpointConfig else {f.name for f in dataclasses.fields(cls)}  # a subclass's fields too
        # a typo: a ConfigError naming the closest field, not the generated __init__'s TypeError
        check_names([k for k in kwargs if k not in own])
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name, validate in _VALIDATORS.items():
            object.__setattr__(self, name, _validated(name, validate, getattr(self, name)))
        if self.signing_key is not None and self.signing_key_file is not None:
            raise ConfigError("signing_key and signing_key_file are both set: give one (the values are not shown). "
                              "HINT: unset FT_CHECKPOINT_SIGNING_KEY or FT_CHECKPOINT_SIGNING_KEY_FILE")
        if self.storage_options and self.dirpath is not None and "://" not in self.dirpath \
                and not self.dirpath.startswith(("/", ".", "~")):  # 'bucket/run' with credentials: 's3://' forgotten
            raise ConfigError(f"storage_options are given, but dirpath={self.dirpath!r} is a local path, which ignores "
                              f"them. HINT: write the store's URL, e.g. 's3://{self.dirpath}' or 'gs://{self.dirpath}' "
                              f"(or './{self.dirpath}' for a local folder)")
        if (self.min_interval is not None and self.max_interval is not None
                and parse_duration(self.min_interval) > parse_duration(self.max_interval)):
            _bad("min_interval", self.min_interval, f"a duration no longer than max_interval={self.max_interval!r}")

    def replace(self, **changes: Any) -> CheckpointConfig:
        """A copy with ``changes`` applied (validated)."""
        check_names(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, **explicit: Any) -> CheckpointConfig:
        """Build from the YAML file in ``FT_CHECKPOINT_CONFIG``, then ``FT_CHECKPOINT_*`` env vars, then ``explicit``.

        Arguments that are None are treated as not given, so a wrapper can pass its defaults through.

        Example:
            >>> os.environ["FT_CHECKPOINT_KEEP_LAST"] = "7"
            >>> CheckpointConfig.from_env(dirpath="/tmp/run").keep_last
            7
            >>> del os.environ["FT_CHECKPOINT_KEEP_LAST"]
        """
        check_names(explicit)
        values = _from_file()
        values.update(_from_env())
        values.update({k: v for k, v in explicit.items() if v is not None})
        return cls(**values)


FIELDS = tuple(f.name for f in dataclasses.fields(CheckpointConfig))


def given(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields among ``arguments`` that were given (not None): what an ``__init__`` that takes every
    field as a keyword argument defaulting to None (the integrations') passes on, from its ``locals()``.

    Example:
        >>> given({"self": object(), "interval": 5, "keep_last": None})
        {'interval': 5}
    """
    return {name: arguments[name] for name in FIELDS if arguments.get(name) is not None}


def _bad(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{field}={short(value)} is invalid: expected {allowed}")


def _validated(name: str, validate: Callable[[str, Any], Any], value: Any) -> Any:
    """``validate(name, value)``; whatever else it raises on a hostile value becomes a ConfigError naming the field."""
    try:
        return validate(name, value)
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError, AttributeError, LookupError) as e:
        raise ConfigError(f"{name}={short(value)} is invalid ({type(e).__name__}: {e})") from None


def _check_int(field: str, value: Any, *, minimum: int, maximum: int = MAX_STEPS) -> int:
    if not is_int(value) or not minimum <= value <= maximum:
        _bad(field, value, f"an integer from {minimum} to {maximum}")
    return value


def _int(minimum: int, maximum: int = MAX_STEPS, *, optional: bool = False) -> Callable[[str, Any], Any]:
    def check(field: str, value: Any) -> int | None:
        return None if optional and value is None else _check_int(field, value, minimum=minimum, maximum=maximum)
    return check


def _duration(*, optional: bool = False, zero_ok: bool = False) -> Callable[[str, Any], Any]:
    """A validator of a duration field: > 0 (or >= 0), at most 100 years; None only if ``optional``."""
    def check(field: str, value: Any) -> Any:
        if value is None and optional:
            return None
        try:
            seconds = None if isinstance(value, bool) else parse_duration(value)
        except ValueError:
            seconds = None
        if seconds is None or not (seconds >= 0 if zero_ok else seconds >= MIN_DURATION) or seconds > MAX_DURATION:
            _bad(field, value, f"a duration {'>= 0' if zero_ok else 'from 1 ms'} up to 100 years: seconds, a "
                               "timedelta, or a string like '30s', '5m', '6h', '2d'")
        return value
    return check


def _bool(*, optional: bool = False) -> Callable[[str, Any], Any]:
    def check(field: str, value: Any) -> bool | None:
        if not (isinstance(value, bool) or (optional and value is None)):
            _bad(field, value, "True or False" + (" or None" if optional else ""))
        return value
    return check


def _check_dirpath(field: str, value: Any) -> str | None:
    if isinstance(value, os.PathLike):  # pathlib.Path
        value = os.fspath(value)
    if value is not None and (not isinstance(value, str) or not value.strip() or "\x00" in value or len(value) > 4096):
        _bad(field, value, "a non-empty local path or fsspec URL such as 'gs://bucket/run' (at most 4096 characters)")
    if value is not None and set("*?[]") & set(value):
        _bad(field, value, "a path without *, ?, [ or ], which fsspec expands as patterns on some stores (a delete "
                           "in 'runs/sweep[1]' would also match 'runs/sweep1'); e.g. 'runs/sweep-1'")
    if isinstance(value, str):
        refuse_missing_slash(field, value)
        refuse_no_path(field, value)
        _refuse_careless_path(field, value)
    return value


_UNEXPANDED = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}|(?:^|/)\$[A-Za-z_][A-Za-z0-9_]*")
"""``${NAME}`` anywhere, ``$NAME`` at the start of a folder's name: a shell variable left unexpanded."""


def refuse_careless_text(field: str, value: str) -> None:
    """ConfigError for a path with spaces at an end, quotes left in or an environment variable nobody expanded (see
    :func:`_refuse_careless_path`): a ``dirpath``, a key file, a CLI's ``DIR``.

    Example:
        >>> try:
        ...     refuse_careless_text("DIR", "run ")
        ... except ConfigError as e:
        ...     print(e)
        DIR='run ' is invalid: expected a path without spaces at its start or end (they name another path): 'run'
    """
    if value != value.strip():
        _bad(field, value, f"a path without spaces at its start or end (they name another path): {value.strip()!r}")
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        _bad(field, value, f"a path without the quotes around it (left in by an env file, say): {value[1:-1]!r}")
    if (variable := _UNEXPANDED.search(value)) is not None:
        _bad(field, value, f"a path with {variable.group(0).lstrip('/')} expanded (it is not, where this value came from: a YAML "
                           "file or a container's env); as written it names a path of that name")


def _refuse_careless_path(field: str, value: str) -> None:
    """ConfigError for a path that names another folder than its writer meant: spaces at an end, quotes left in
    (``docker --env-file`` keeps them), an environment variable a YAML file or a Kubernetes env did not expand, or a
    step directory of a run (a path ``ft-checkpoint ls`` prints), into which a job would write its own steps and
    journal, so that the committed step no longer verifies.

    Example:
        >>> try:
        ...     _refuse_careless_path("dirpath", "gs://b/run/step_000000000005")
        ... except ConfigError as e:
        ...     print(str(e).split(": a job")[0])
        dirpath='gs://b/run/step_000000000005' is step 5 of the run in 'gs://b/run'
    """
    refuse_careless_text(field, value)
    parts = value.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if (step := layout.parse_step(part)) is not None:
            run = "/".join(parts[:i]) or ("/" if value.startswith("/") else ".")
            raise ConfigError(f"{field}={value!r} is {'step' if i == len(parts) - 1 else 'inside step'} {step} of the "
                              f"run in {run!r}: a job there would write its steps and journal into that committed "
                              f"step, which would then no longer verify. HINT: pass the run's directory, {run!r}")


def _check_fast_dirpath(field: str, value: Any) -> str | None:
    _check_dirpath(field, value)
    if isinstance(value, str) and "://" in value and not value.startswith("file://"):
        _bad(field, value, "a node-local path such as '/dev/shm/ft' or '/local_nvme/ft' (the fast tier is on each node; "
                           "the durable tier is dirpath)")
    return value.removeprefix("file://") if isinstance(value, str) else value


def _check_node_id(field: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip() or len(value) > 255
                              or not value.isprintable()):
        _bad(field, value, "a non-empty printable string of at most 255 characters naming this node, or None")
    return value


def _normalize_interval(field: str, value: Any) -> int | datetime.timedelta | str:
    if isinstance(value, bool):
        _bad(field, value, "an int >= 1 (steps), a timedelta, a duration like '30m', or 'adaptive'")
    if isinstance(value, int):
        return _check_int(field, value, minimum=1)
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "adaptive":
            return "adaptive"
        if text.isascii() and text.isdigit():
            return _check_int(field, int(text) if len(text) <= 13 else math.inf, minimum=1)
    if _finite_number(value) and float(value) <= 0:  # -5, "-5", "-2.5", 0.0
        _bad(field, value, "a positive interval: an int >= 1 (steps), a timedelta or duration like '30m', or 'adaptive'")
    if _finite_number(value):  # 100.0, "100.0", a YAML 1e3
        plain = format(float(value), "f").rstrip("0").rstrip(".")
        raise ConfigError(f"{field}={short(value)} is invalid: a bare fractional number could mean steps or seconds "
                          f"(an int is a number of steps). HINT: write an int for every N steps, or "
                          f"'{plain}s', '30m' or a timedelta for a time")
    try:
        seconds = parse_duration(value)
    except ValueError:
        seconds = -1.0
    if not MIN_DURATION <= seconds <= MAX_DURATION:
        _bad(field, value, "an int >= 1 (steps), a timedelta or duration from 1 ms up to 100 years like '30m', "
                           "or 'adaptive'")
    return datetime.timedelta(seconds=seconds)


def _finite_number(value: Any) -> bool:
    """Whether ``value`` is a float, or a string of one, that is finite."""
    if not isinstance(value, (float, str)):
        return False
    try:
        return math.isfinite(float(value))
    except ValueError:
        return False


def _normalize_rate(field: str, value: Any) -> float | None:
    if value is None:
        return None
    rate = value
    if isinstance(value, str):
        try:
            rate = float(value)
        except ValueError:
            rate = None
    if not is_number(rate) or not MIN_GPU_FAILURE_RATE <= rate <= 1:
        _bad(field, value, f"a finite number of failures per GPU-second from {MIN_GPU_FAILURE_RATE:g} to 1")
    return float(rate)


def _check_storage_options(field: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        _bad(field, value, "a dict of fsspec filesystem options with string keys (in the environment: a JSON object)")
    return value


def _check_signing_key(field: str, value: Any) -> str | None:
    """Never shows the value: a ConfigError says what is wrong with the key, not what it is."""
    if value is not None:
        signing.check_key_text(field, value)
    return value


def _check_path_or_name(*, key_file: bool) -> Callable[[str, Any], Any]:
    def check(field: str, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip() or "\x00" in value or len(value) > layout.MAX_RUN_NAME:
            _bad(field, value, "a non-empty text without NUL, at most 4096 characters")
        if key_file:  # '~/.ft-checkpoint.key' as the README writes it, in a YAML file or an env file
            refuse_careless_text(field, value)
            value = os.path.expanduser(value)
            signing.read_key_file(field, value)  # readable, a regular file, a key of the right length
        return value
    return check


def _check_choice(*choices: str) -> Callable[[str, Any], str]:
    def check(field: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            _bad(field, value, " or ".join(repr(c) for c in choices))
        return value
    return check


def check_names(names: Any, where: str = "argument") -> None:
    """Raise ConfigError for a name that is not a config field, with a HINT naming the closest one.

    Example:
        >>> check_names(["keep_lst"])
        Traceback (most recent call last):
        ...
        ft_checkpoint.errors.ConfigError: unknown checkpoint config argument 'keep_lst'. HINT: did you mean 'keep_last'?
    """
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"checkpoint config {where} {short(name)} is not a field name. Known fields: "
                              f"{', '.join(FIELDS)}.")
        if name not in FIELDS:
            close = difflib.get_close_matches(name[:100], FIELDS, n=1)
            hint = f" HINT: did you mean {close[0]!r}?" if close else f" Known fields: {', '.join(FIELDS)}."
            raise ConfigError(f"unknown checkpoint config {where} {short(name)}.{hint}")


def _normalize_signals(field: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [] if value.strip().lower() in ("", "none") else value.split(",")
    if not isinstance(value, (list, tuple)) or len(value) > 64 or \
            not all(isinstance(v, str) and len(v) < 32 or is_int(v) for v in value):
        _bad(field, value, "a list of signal names such as ['SIGTERM', 'SIGUSR1'], or []")
    return tuple(parse_signal(v).name for v in value)


_VALIDATORS: dict[str, Callable[[str, Any], Any]] = {
    "dirpath": _check_dirpath,
    "interval": _normalize_interval,
    "min_interval": _duration(optional=True),
    "max_interval": _duration(optional=True),
    "mtbf": _duration(optional=True),
    "gpu_failure_rate": _normalize_rate,
    "keep_last": _int(1),
    "keep_every_n_steps": _int(1, optional=True),
    "storage_options": _check_storage_options,
    "async_save": _bool(),
    "final_save": _bool(),
    "save_rng_state": _bool(),
    "verify_checksums": _bool(),
    "retries": _int(1, MAX_RETRIES),
    "progress_interval": _duration(zero_ok=True),
    "force_takeover": _bool(),
    "on_save_error": _check_choice("raise", "warn"),
    "preemption_signals": _normalize_signals,
    "requeue": _bool(optional=True),
    "end_time_margin": _duration(),
    "preemption_exit_code": _int(0, 255),
    "writer": _check_choice("thread", "process"),
    "writer_priority": _int(0, 19),
    "writers": _int(1, 64),
    "lazy_snapshot": _bool(),
    "signing_key": _check_signing_key,
    "signing_key_file": _check_path_or_name(key_file=True),
    "run_name": _check_path_or_name(key_file=False),
    "fast_dirpath": _check_fast_dirpath,
    "fast_interval": _normalize_interval,
    "fast_replicas": _int(0, 1),
    "node_id": _check_node_id,
}
"""Each field's validator: ``(name, value) -> value`` (normalized), or a ConfigError naming the field."""


def _parse_env_value(field: str, text: str) -> Any:
    """The value of ``FT_CHECKPOINT_<FIELD>=text`` (validated later, with the other fields)."""
    word = text.strip().lower()
    if field in ("requeue", "keep_every_n_steps", "fast_dirpath", "node_id") and word in ("", "none", "auto"):
        return None
    if field in ("async_save", "final_save", "save_rng_state", "verify_checksums", "force_takeover", "requeue",
                 "lazy_snapshot"):
        if word in _TRUE | _FALSE:
            return word in _TRUE
        _bad(field, text, "one of 1/0, true/false, yes/no, on/off")
    if field in ("keep_last", "retries", "keep_every_n_steps", "preemption_exit_code", "writer_priority", "writers",
                 "fast_replicas"):
        digits = word.removeprefix("-").removeprefix("+")
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):  # refused now, naming the range:
            return _validated(field, _VALIDATORS[field], text)  # an explicit value given with it hides it later
        return int(word)
    if field == "storage_options":
        try:
            return json.loads(text)
        except RecursionError:
            raise ConfigError(f"storage_options={short(text)} is invalid: expected a JSON object (nested too "
                              "deeply)") from None
        except ValueError as e:
            raise ConfigError(f"storage_options={short(text)} is invalid: expected a JSON object ({e})") from None
    return text


ENV_OTHER = ("CONFIG", "DEBUG", "RUN_ID")
"""The ``FT_CHECKPOINT_*`` variables that name no field (the YAML file, debug output, the run id of the fast tier)."""


def _from_env() -> dict[str, Any]:
    out = {}
    for field in FIELDS:
        text = os.environ.get(ENV_PREFIX + field.upper())
        if text is not None:
            out[field] = _parse_env_value(field, text)
    warn_unknown_env(os.environ)
    return out


_warned_env: set[str] = set()
"""The unknown ``FT_CHECKPOINT_*`` variables warned about in this process (a config is built several times)."""


def warn_unknown_env(environ: Mapping[str, str]) -> list[str]:
    """Warn about each ``FT_CHECKPOINT_*`` variable that names no setting (a typo would otherwise leave the
    setting at its default without a word), with the closest name, once per process; returns the warnings given.

    Example:
        >>> warn_unknown_env({"FT_CHECKPOINT_INTERVALL": "10", "FT_CHECKPOINT_KEEP_LAST": "3"})
        ['FT_CHECKPOINT_INTERVALL names no ft-checkpoint setting and is ignored. HINT: did you mean FT_CHECKPOINT_INTERVAL?']
        >>> warn_unknown_env({"FT_CHECKPOINT_INTERVALL": "10"})  # warned already
        []
    """
    known = [ENV_PREFIX + name for name in (*(f.upper() for f in FIELDS), *ENV_OTHER)]
    messages = []
    for name in sorted(n for n in environ if n.startswith(ENV_PREFIX) and n not in known and n not in _warned_env):
        _warned_env.add(name)
        close = difflib.get_close_matches(name[:100], known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"the settings are {ENV_PREFIX}<FIELD>, of {', '.join(FIELDS)}"
        messages.append(f"{name[:100]} names no ft-checkpoint setting and is ignored. HINT: {hint}")
        log.warning("%s", messages[-1])
    return messages


def _from_file() -> dict[str, Any]:
    path = os.environ.get(ENV_CONFIG_FILE)
    if not path:
        return {}
    import yaml

    where = f"{ENV_CONFIG_FILE}={path!r}"
    try:  # a FIFO or /dev/stdin there: refused, never waited on
        data = read_named_file(path, max_bytes=MAX_CONFIG_FILE)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read the file ({e}). HINT: name a YAML file") from e
    if len(data) > MAX_CONFIG_FILE:
        raise ConfigError(f"{where}: larger than {MAX_CONFIG_FILE} bytes, not a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e})") from None
    try:
        _refuse_yaml11_numbers(yaml.compose(text, Loader=yaml.SafeLoader), where)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({e})") from e
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of field: value, got {type(data).__name__}")
    check_names(data, where=f"key in {path}:")
    return data


_YAML11_NUMBERS = {"base-60": re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?"),
                   "octal": re.compile(r"[-+]?0[0-7_]+")}
"""Numbers only YAML 1.1 (PyYAML) reads as such: ``10:00`` is 600, ``010`` is 8. YAML 1.2 reads ``10:00`` as a
string and ``010`` as 10, and so do most people (``07`` means 7 either way)."""


def _refuse_yaml11_numbers(root: Any, where: str) -> None:
    """ConfigError for a plain scalar of the config file that YAML 1.1 reads as a base-60 or octal number (which
    changes the setting without a word), naming its key and the value as written. Each node is looked at once (an
    alias is not followed again).

    Example:
        >>> import yaml
        >>> try:
        ...     _refuse_yaml11_numbers(yaml.compose("keep_last: 010", Loader=yaml.SafeLoader), "c.yaml")
        ... except ConfigError as e:
        ...     print(e)
        c.yaml: keep_last: '010' is invalid: YAML reads it as the octal number 8. HINT: write 10 (no leading 0) or '010'
    """
    import yaml

    seen, todo = set(), collections.deque([(root, "")])
    while todo:
        node, key = todo.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
                todo.append((v, f"{key}.{name}" if key else name))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((v, key) for v in node.value)
        elif isinstance(node, yaml.ScalarNode) and node.tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
            _refuse_yaml11_number(node.value, where, key)


def _refuse_yaml11_number(text: str, where: str, key: str) -> None:
    import yaml

    if _YAML11_NUMBERS["base-60"].fullmatch(text):
        raise ConfigError(f"{where}: {key}: {short(text)} is invalid: YAML reads it as the base-60 number "
                          f"{yaml.safe_load(text)!r}. HINT: write a duration with its unit, e.g. '10m' or '1h30m' "
                          f"(or '{text}' in quotes for the text)")
    if _YAML11_NUMBERS["octal"].fullmatch(text) and (octal := yaml.safe_load(text)) != int(text.replace("_", "")):
        decimal = re.sub(r"^([-+]?)0+(?=[0-9])", r"\1", text)
        raise ConfigError(f"{where}: {key}: {short(text)} is invalid: YAML reads it as the octal number {octal!r}. "
                          f"HINT: write {decimal} (no leading 0) or '{text}'")
