"""Configuration: one frozen, keyword-only dataclass, also loadable from env vars and a YAML file.

``accelerate launch``, sbatch scripts and Kubernetes manifests configure jobs through the
environment, so every field can come from ``FT_CHECKPOINT_<FIELD>`` (e.g. ``FT_CHECKPOINT_DIRPATH``,
``FT_CHECKPOINT_INTERVAL=30m``) or from a YAML file named by ``FT_CHECKPOINT_CONFIG``. Precedence:
explicit arguments > environment > file. Every value is validated when the config is built; an error
names the field, the bad value and what is allowed.

Example:
    >>> cfg = CheckpointConfig(dirpath="/tmp/run", interval="30m", keep_last=2)
    >>> cfg.interval
    datetime.timedelta(seconds=1800)
    >>> CheckpointConfig(dirpath="/tmp/run", interval=500).interval
    500
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import os
import re
from typing import Any

from ft_checkpoint.errors import ConfigError
from ft_checkpoint.preemption import parse_signal

ENV_PREFIX = "FT_CHECKPOINT_"
ENV_CONFIG_FILE = "FT_CHECKPOINT_CONFIG"
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def parse_duration(value: int | float | str | datetime.timedelta) -> float:
    """Seconds from a number of seconds, a ``timedelta`` or a string such as ``"30s"``, ``"5m"``, ``"6h"``, ``"2d"``
    (a bare number in a string, as env vars give it, is seconds).

    Example:
        >>> parse_duration("5m"), parse_duration(datetime.timedelta(hours=1)), parse_duration(90)
        (300.0, 3600.0, 90.0)
    """
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2) or "s"]
    raise ValueError(f"{value!r} is not a duration: use seconds, a timedelta, or a string like '30s', '5m', '6h', '2d'")


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
    """Adaptive interval: prior failures per GPU-second (default: Llama 3's, 419 in 54 days on 16,384 GPUs)."""

    keep_last: int = 3
    """How many of the newest committed steps to keep (>= 1)."""

    keep_every_n_steps: int | None = None
    """Also keep, forever, every step that is a multiple of this (milestones); None keeps none."""

    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Options for the fsspec filesystem: credentials, ``endpoint_url``, ``token``, ..."""

    async_save: bool = True
    """Write in the background after staging; False makes every save block until committed."""

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

    def __post_init__(self) -> None:
        if self.dirpath is not None and (not isinstance(self.dirpath, str) or not self.dirpath.strip()):
            _bad("dirpath", self.dirpath, "a non-empty local path or fsspec URL such as 'gs://bucket/run'")
        object.__setattr__(self, "interval", _normalize_interval(self.interval))
        for name in ("min_interval", "max_interval", "mtbf"):
            _check_duration(name, getattr(self, name))
        try:
            ok = parse_duration(self.progress_interval) >= 0 and not isinstance(self.progress_interval, bool)
        except ValueError:
            ok = False
        if not ok:
            _bad("progress_interval", self.progress_interval, "a duration >= 0: seconds, a timedelta, or '10s'")
        if self.gpu_failure_rate is not None and (
                not isinstance(self.gpu_failure_rate, (int, float)) or isinstance(self.gpu_failure_rate, bool)
                or self.gpu_failure_rate <= 0):
            _bad("gpu_failure_rate", self.gpu_failure_rate, "a positive number of failures per GPU-second")
        if (self.min_interval is not None and self.max_interval is not None
                and parse_duration(self.min_interval) > parse_duration(self.max_interval)):
            _bad("min_interval", self.min_interval, f"a duration no longer than max_interval={self.max_interval!r}")
        _check_int("keep_last", self.keep_last, minimum=1)
        if self.keep_every_n_steps is not None:
            _check_int("keep_every_n_steps", self.keep_every_n_steps, minimum=1)
        if not isinstance(self.storage_options, dict):
            _bad("storage_options", self.storage_options, "a dict of fsspec filesystem options")
        for name in ("async_save", "save_rng_state", "verify_checksums", "force_takeover"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, getattr(self, name), "True or False")
        _check_int("retries", self.retries, minimum=1)
        if self.on_save_error not in ("raise", "warn"):
            _bad("on_save_error", self.on_save_error, "'raise' or 'warn'")
        object.__setattr__(self, "preemption_signals", _normalize_signals(self.preemption_signals))
        if self.requeue is not None and not isinstance(self.requeue, bool):
            _bad("requeue", self.requeue, "True, False or None (requeue if the Slurm job allows it)")
        _check_duration("end_time_margin", self.end_time_margin)
        if not isinstance(self.preemption_exit_code, int) or isinstance(self.preemption_exit_code, bool) \
                or not 0 <= self.preemption_exit_code <= 255:
            _bad("preemption_exit_code", self.preemption_exit_code, "an integer from 0 to 255")

    def replace(self, **changes: Any) -> CheckpointConfig:
        """A copy with ``changes`` applied (validated)."""
        _check_names(changes)
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
        _check_names(explicit)
        values = _from_file()
        values.update(_from_env())
        values.update({k: v for k, v in explicit.items() if v is not None})
        return cls(**values)


FIELDS = tuple(f.name for f in dataclasses.fields(CheckpointConfig))


def _bad(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{field}={value!r} is invalid: expected {allowed}")


def _check_int(field: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _bad(field, value, f"an integer >= {minimum}")


def _check_duration(field: str, value: Any) -> None:
    if value is None:
        return
    try:
        ok = parse_duration(value) > 0
    except ValueError:
        ok = False
    if not ok or isinstance(value, bool):
        _bad(field, value, "a positive duration: seconds, a timedelta, or a string like '30s', '5m', '6h', '2d'")


def _check_names(names: Any, where: str = "argument") -> None:
    for name in names:
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f" HINT: did you mean {close[0]!r}?" if close else f" Known fields: {', '.join(FIELDS)}."
            raise ConfigError(f"unknown checkpoint config {where} {name!r}.{hint}")


def _normalize_interval(value: Any) -> int | datetime.timedelta | str:
    if isinstance(value, bool):
        _bad("interval", value, "an int >= 1 (steps), a timedelta, a duration like '30m', or 'adaptive'")
    if isinstance(value, int):
        _check_int("interval", value, minimum=1)
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "adaptive":
            return "adaptive"
        if text.isdigit():
            return _normalize_interval(int(text))
    try:
        seconds = parse_duration(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        _bad("interval", value, "an int >= 1 (steps), a positive timedelta, a duration like '30m', or 'adaptive'")
    return datetime.timedelta(seconds=seconds)


def _normalize_signals(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [] if value.strip().lower() in ("", "none") else value.split(",")
    if not isinstance(value, (list, tuple)):
        _bad("preemption_signals", value, "a list of signal names such as ['SIGTERM', 'SIGUSR1'], or []")
    return tuple(parse_signal(v).name for v in value)


def _parse_env_value(field: str, text: str) -> Any:
    if field == "requeue" and text.strip().lower() in ("", "none", "auto"):
        return None
    if field in ("async_save", "save_rng_state", "verify_checksums", "force_takeover", "requeue"):
        if text.strip().lower() in _TRUE | _FALSE:
            return text.strip().lower() in _TRUE
        _bad(field, text, "one of 1/0, true/false, yes/no, on/off")
    if field in ("keep_last", "retries", "keep_every_n_steps", "preemption_exit_code"):
        if field == "keep_every_n_steps" and text.strip().lower() in ("", "none"):
            return None
        try:
            return int(text)
        except ValueError:
            _bad(field, text, "an integer")
    if field == "gpu_failure_rate":
        try:
            return float(text)
        except ValueError:
            _bad(field, text, "a positive number of failures per GPU-second")
    if field == "storage_options":
        try:
            options = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"storage_options={text!r} is invalid: expected a JSON object ({e})") from e
        return options
    return text


def _from_env() -> dict[str, Any]:
    out = {}
    for field in FIELDS:
        text = os.environ.get(ENV_PREFIX + field.upper())
        if text is not None:
            out[field] = _parse_env_value(field, text)
    return out


def _from_file() -> dict[str, Any]:
    path = os.environ.get(ENV_CONFIG_FILE)
    if not path:
        return {}
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"{ENV_CONFIG_FILE}={path!r}: cannot read the file ({e})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{ENV_CONFIG_FILE}={path!r}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{ENV_CONFIG_FILE}={path!r}: expected a mapping of field: value, got {type(data).__name__}")
    _check_names(data, where=f"key in {path}:")
    return data
