"""Every invalid config value fails at construction with a message naming the field; env and file work."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import math
import os
import pickle
import re
from decimal import Decimal
from fractions import Fraction

import pytest
import torch

from ft_checkpoint import CheckpointConfig, CheckpointManager
from ft_checkpoint.config import ENV_CONFIG_FILE, ENV_PREFIX, FIELDS
from ft_checkpoint.errors import ConfigError
from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval
from ft_checkpoint.policies.interval import policy_from_interval
from ft_checkpoint.store.storage import Storage, missing_slash
from ft_checkpoint.units import parse_duration

INVALID = [
    ("dirpath", ""), ("dirpath", 5),
    ("interval", 0), ("interval", -3), ("interval", "soon"), ("interval", True), ("interval", "0s"),
    ("interval", datetime.timedelta(0)),
    ("keep_last", 0), ("keep_last", "3"), ("keep_every_n_steps", 0),
    ("storage_options", "token=anon"),
    ("async_save", "yes"), ("save_rng_state", 1), ("verify_checksums", None),
    ("retries", 0),
    ("min_interval", "-5m"), ("max_interval", 0), ("mtbf", "often"), ("gpu_failure_rate", 0),
    ("gpu_failure_rate", "high"), ("on_save_error", "ignore"),
    ("progress_interval", "-1s"), ("progress_interval", "soon"),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_value_names_field_and_value(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}=.*invalid: expected") as e:
        CheckpointConfig(**{field: value})
    assert repr(value) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_unknown_field_suggests_the_right_one():
    with pytest.raises(ConfigError, match="'keep_lsat'.*did you mean 'keep_last'"):
        CheckpointConfig.from_env(keep_lsat=2)
    with pytest.raises(ConfigError, match="keep_lsat"):
        CheckpointManager("memory://cfg", keep_lsat=2)
    with pytest.raises(ConfigError, match="'keep_lsat'.*did you mean 'keep_last'"):  # it was a bare TypeError
        CheckpointConfig(keep_lsat=2)
    config = CheckpointConfig(keep_last=2)
    assert dataclasses.replace(config, keep_last=3).keep_last == 3 and copy.deepcopy(config) == config
    assert pickle.loads(pickle.dumps(config)) == config


def test_interval_forms():
    assert CheckpointConfig(interval=200).interval == 200
    assert CheckpointConfig(interval="200").interval == 200
    assert CheckpointConfig(interval="90s").interval == datetime.timedelta(seconds=90)
    assert CheckpointConfig(interval="2.5 s").interval == datetime.timedelta(seconds=2.5)
    assert CheckpointConfig(interval="2h").interval == datetime.timedelta(hours=2)
    assert CheckpointConfig(interval=datetime.timedelta(minutes=5)).interval == datetime.timedelta(minutes=5)
    assert CheckpointConfig(interval="Adaptive").interval == "adaptive"


def test_env_then_file_then_explicit(tmp_path, monkeypatch):
    cfg_file = tmp_path / "ft.yaml"
    cfg_file.write_text("dirpath: /from/file\nkeep_last: 9\ninterval: 30m\nstorage_options: {token: anon}\n")
    monkeypatch.setenv("FT_CHECKPOINT_CONFIG", str(cfg_file))
    monkeypatch.setenv("FT_CHECKPOINT_KEEP_LAST", "4")
    monkeypatch.setenv("FT_CHECKPOINT_ASYNC_SAVE", "false")
    cfg = CheckpointConfig.from_env(interval=50)
    assert cfg.dirpath == "/from/file"  # file only
    assert cfg.keep_last == 4  # env beats file
    assert cfg.interval == 50  # explicit beats file
    assert cfg.async_save is False and cfg.storage_options == {"token": "anon"}
    assert CheckpointConfig.from_env(keep_last=None).keep_last == 4  # None means "not given"


def test_a_misspelt_env_variable_is_warned_about_with_the_closest_name(tmp_path, monkeypatch, caplog):
    """``FT_CHECKPOINT_FAST_DIRPTH`` left the job without a fast tier, without a word (a keyword or a YAML key
    with a typo is a ConfigError)."""
    monkeypatch.setenv("FT_CHECKPOINT_FAST_DIRPTH", str(tmp_path / "fast"))
    monkeypatch.setenv("FT_CHECKPOINT_RUN_ID", "job-7")  # not a field, but ours: no warning
    with caplog.at_level("WARNING", logger="ft_checkpoint"):
        with CheckpointManager(str(tmp_path / "run"), interval=1) as ckpt:
            assert ckpt.fast is None
    warned = [r.getMessage() for r in caplog.records if "names no ft-checkpoint setting" in r.getMessage()]
    assert warned and all("FT_CHECKPOINT_FAST_DIRPTH" in w for w in warned), caplog.text
    assert "HINT: did you mean FT_CHECKPOINT_FAST_DIRPATH?" in warned[0]


def test_env_storage_options_is_json(monkeypatch):
    monkeypatch.setenv("FT_CHECKPOINT_STORAGE_OPTIONS", '{"endpoint_url": "http://127.0.0.1:1"}')
    assert CheckpointConfig.from_env().storage_options == {"endpoint_url": "http://127.0.0.1:1"}
    monkeypatch.setenv("FT_CHECKPOINT_STORAGE_OPTIONS", "endpoint_url=x")
    with pytest.raises(ConfigError, match="storage_options=.*JSON object"):
        CheckpointConfig.from_env()


@pytest.mark.parametrize("var,value,field,allowed", [
    ("FT_CHECKPOINT_KEEP_LAST", "many", "keep_last", "an integer from 1 to "),  # the range too: it said "an integer"
    ("FT_CHECKPOINT_WRITERS", "4.5", "writers", "an integer from 1 to 64"),
    ("FT_CHECKPOINT_INTERVAL", "often", "interval", ""),
    ("FT_CHECKPOINT_SAVE_RNG_STATE", "maybe", "save_rng_state", "one of 1/0"),
])
def test_bad_env_value_names_field(monkeypatch, var, value, field, allowed):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"^{field}='{value}' is invalid.*{allowed}"):
        CheckpointConfig.from_env()


def test_a_bad_integer_in_the_environment_is_refused_even_where_the_caller_sets_that_field(monkeypatch):
    """An integration passes its own keep_last; the user's typo'd FT_CHECKPOINT_KEEP_LAST was let through unseen."""
    monkeypatch.setenv("FT_CHECKPOINT_KEEP_LAST", "many")
    with pytest.raises(ConfigError, match="^keep_last='many' is invalid.*an integer from 1 to "):
        CheckpointConfig.from_env(keep_last=5)


def test_a_subclass_with_fields_of_its_own_is_still_made_and_checked():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class TeamConfig(CheckpointConfig):
        team: str = "x"

    config = TeamConfig(team="vision", keep_last=3)
    assert (config.team, config.keep_last) == ("vision", 3)
    with pytest.raises(ConfigError, match="'keep_lsat'.*did you mean 'keep_last'"):
        TeamConfig(team="vision", keep_lsat=3)


def test_bad_file(tmp_path, monkeypatch):
    f = tmp_path / "ft.yaml"
    f.write_text("keep_lst: 3\n")
    monkeypatch.setenv("FT_CHECKPOINT_CONFIG", str(f))
    with pytest.raises(ConfigError, match="keep_lst.*did you mean 'keep_last'"):
        CheckpointConfig.from_env()
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        CheckpointConfig.from_env()
    monkeypatch.setenv("FT_CHECKPOINT_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="cannot read the file"):
        CheckpointConfig.from_env()


def test_manager_needs_a_dirpath(monkeypatch):
    monkeypatch.delenv("FT_CHECKPOINT_DIRPATH", raising=False)
    with pytest.raises(ConfigError, match="dirpath is required"):
        CheckpointManager()


def test_wrong_url_scheme_is_clear():
    with pytest.raises(ConfigError, match=r"dirpath='nosuch://b/run'.*Protocol not known"):
        CheckpointManager("nosuch://b/run")


@pytest.mark.parametrize("url", ["gs:/bucket/run", "s3:bucket/run", "gcs:/b/run", "memory:/run"])
def test_a_url_missing_a_slash_is_refused_not_made_a_local_folder(url, tmp_path, monkeypatch):
    """fsspec reads ``gs:/bucket/run`` as the local path ``./gs:/bucket/run``: the job saved to the node's own disk,
    lost with the node, while its user believed it saved to GCS."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"dirpath='{url}' looks like .* missing a slash") as e:
        CheckpointManager(url, interval=1)
    scheme = url.split(":")[0]
    assert f"HINT: write '{scheme}://" in str(e.value) and f"'./{url}'" in str(e.value)
    assert os.listdir(tmp_path) == [], "nothing is made on the local disk"
    for given in (lambda: Storage(url), lambda: CheckpointConfig(dirpath=url)):  # the CLI; each integration's config
        with pytest.raises(ConfigError, match="missing a slash"):
            given()


@pytest.mark.parametrize("url", ["s3//bucket/run", "gs//bucket/run"])
def test_a_url_missing_its_colon_is_refused_not_made_a_local_folder(url, tmp_path, monkeypatch):
    """``s3//bucket/run`` was the local folder ``./s3/bucket/run``, with no word: the job saved to the node's disk."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"dirpath='{url}' looks like .* missing its colon") as e:
        CheckpointManager(url, interval=1)
    assert f"HINT: write '{url.replace('//', '://', 1)}'" in str(e.value)
    assert os.listdir(tmp_path) == [], "nothing is made on the local disk"


@pytest.mark.parametrize("url", ["file://", "local://", "gs://", "s3://", "gcs:///", "s3a://"])
def test_a_url_with_nothing_after_its_protocol_is_refused(url, tmp_path, monkeypatch):
    """``f"file://{os.environ.get('CKPT_DIR', '')}"`` with the variable unset: ``file://`` was the current directory,
    where the job wrote its journal, lease and steps, shown as ``file:``; ``gs://`` went on to fail later, on a bucket
    named nothing."""
    monkeypatch.chdir(tmp_path)
    what = "path" if url.startswith(("file", "local")) else "bucket"
    for given in (lambda: CheckpointManager(url, interval=1), lambda: CheckpointConfig(fast_dirpath=url)
                  if what == "path" else CheckpointConfig(dirpath=url), lambda: Storage(url)):
        with pytest.raises(ConfigError, match=f"='{url}' names no {what}"):
            given()
    assert os.listdir(tmp_path) == [], "nothing is made on the local disk"


def test_the_root_written_out_is_a_path_and_shown_as_written():
    assert Storage("file:///").url == "file:///" and Storage("file:///").root == "/"


@pytest.mark.parametrize("url", ["file:/tmp/run", "./gs:/bucket/run", "runs/gs:/x", "C:/x", "./s3//x", "data//run",
                                 "runs//s3"])
def test_paths_that_only_look_like_a_url_missing_a_slash_are_kept(url):
    assert not missing_slash(url)


@pytest.mark.parametrize("field", ["interval", "fast_interval"])
@pytest.mark.parametrize("value", [1e3, 100.0, 2.5, "100.0", " 2.5 "])
def test_a_bare_fractional_number_for_an_interval_is_refused_not_taken_for_seconds(field, value):
    """``interval=100`` saves every 100 steps, but ``interval=100.0`` (a YAML ``1e3``, a computed value) saved every
    100 seconds, with nothing said: a bare number with a fraction could mean either."""
    with pytest.raises(ConfigError, match=rf"^{field}=.* is invalid: .*could mean steps or seconds.*HINT: ") as e:
        CheckpointConfig(**{field: value})
    hinted = str(e.value).split("or '", 1)[1].split("'", 1)[0]
    assert getattr(CheckpointConfig(**{field: hinted}), field) == datetime.timedelta(seconds=float(value))


@pytest.mark.parametrize("field", ["interval", "fast_interval"])
@pytest.mark.parametrize("value", ["-5", " -3 ", "-2.5", -5.0, "0.0"])
def test_a_negative_or_zero_interval_is_refused_as_not_positive(field, value, monkeypatch):
    """``FT_CHECKPOINT_INTERVAL=-5`` was refused as "a bare fractional number", with the HINT '-5s', itself invalid."""
    monkeypatch.setenv(ENV_PREFIX + field.upper(), str(value))
    with pytest.raises(ConfigError, match=rf"^{field}=.* is invalid: expected a positive interval: an int >= 1") as e:
        CheckpointConfig.from_env()
    assert "fractional" not in str(e.value) and "HINT" not in str(e.value)


def test_min_interval_cannot_exceed_max_interval():
    with pytest.raises(ConfigError, match="min_interval='2h'.*max_interval='1h'"):
        CheckpointConfig(min_interval="2h", max_interval="1h")


# -- hostile values: every one is valid, or a ConfigError naming the field ----------------------------
class Hostile:
    """An object whose comparisons, hash-independent dunders and repr all raise."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no eq")

    __hash__ = object.__hash__


def deep_list(depth: int = 100_000) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


def self_containing() -> list:
    out: list = []
    out.append(out)
    return out


NAN, INF = float("nan"), float("inf")
HOSTILE = {
    "nan": NAN, "inf": INF, "-inf": -INF, "'nan'": "nan", "'inf'": "inf", "'-inf'": "-inf", "'Infinity'": "Infinity",
    "10**400": 10**400, "-10**400": -(10**400), "1e308": 1e308, "-1e308": -1e308, "5e-324": 5e-324,
    "timedelta.max": datetime.timedelta.max, "timedelta.min": datetime.timedelta.min,
    "timedelta(0)": datetime.timedelta(0), "1 us": datetime.timedelta(microseconds=1),
    "-0.0": -0.0, "0": 0, "-1": -1, "1.5": 1.5, "True": True, "False": False, "None": None,
    "''": "", "' '": " ", "NUL": "\x00", "'30s' + NUL": "30s\x00", "1 MB string": "x" * 10**6,
    "5000 digits": "9" * 5000, "5000 digits s": "9" * 5000 + "s", "superscript 2": "\u00b2", "arabic 12": "\u0661\u0662",
    "deep list": deep_list(), "self-containing list": self_containing(), "[1, 2]": [1, 2], "[]": [], "()": (),
    "{}": {}, "{'a': 1}": {"a": 1}, "{1: 2}": {1: 2}, "{(1, 2): 3}": {(1, 2): 3}, "object()": object(),
    "Hostile()": Hostile(), "b'30s'": b"30s", "bytearray": bytearray(b"1"), "1+2j": complex(1, 2),
    "Decimal nan": Decimal("nan"), "Decimal 1e400": Decimal("1e400"), "Fraction 1/3": Fraction(1, 3),
    "set()": set(), "['SIGTERM'] * 10**5": ["SIGTERM"] * 10**5, "[[['SIGTERM']]]": [[["SIGTERM"]]],
    "'SIGKILL'": "SIGKILL", "10**400 signal": [10**400], "['SIG' * 10**5]": ["SIG" * 10**5],
}
NON_FINITE_FIELDS = ["interval", "mtbf", "gpu_failure_rate", "min_interval", "max_interval", "end_time_margin",
                     "progress_interval"]


def usable(cfg: CheckpointConfig) -> None:
    """A valid config must also work downstream: a policy that saves at a finite interval, finite durations."""
    policy = policy_from_interval(cfg.interval, world_size=1024, mtbf=cfg.mtbf, gpu_failure_rate=cfg.gpu_failure_rate,
                                  min_interval=cfg.min_interval, max_interval=cfg.max_interval)
    adaptive = next((p for p in policy.policies if isinstance(p, AdaptiveInterval)), None)
    if adaptive is not None:
        assert math.isfinite(adaptive.seconds) and adaptive.seconds > 0, adaptive.last_decision
    for name in ("progress_interval", "end_time_margin"):
        assert math.isfinite(parse_duration(getattr(cfg, name)))


def outcome(field: str, build) -> str | None:
    """None if ``build()`` gave a usable config or a ConfigError naming ``field``; else what went wrong."""
    try:
        cfg = build()
    except ConfigError as e:
        return None if field in str(e) or ENV_CONFIG_FILE in str(e) else f"ConfigError not naming {field}: {e}"
    except Exception as e:  # noqa: BLE001 - the point: nothing but ConfigError
        return f"{type(e).__name__}: {str(e)[:200]}"
    try:
        usable(cfg)
    except Exception as e:  # noqa: BLE001
        return f"accepted, then {type(e).__name__}: {str(e)[:200]}"
    return None


@pytest.mark.parametrize("field", FIELDS)
def test_every_hostile_value_is_valid_or_a_config_error_naming_the_field(field):
    bad = {label: why for label, value in HOSTILE.items()
           if (why := outcome(field, lambda value=value: CheckpointConfig(**{field: value})))}
    assert not bad, bad


@pytest.mark.parametrize("field", NON_FINITE_FIELDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF, "nan", "inf", "-inf", "Infinity", 10**400, "9" * 400])
def test_nan_and_inf_are_a_config_error_naming_the_field(field, value, monkeypatch):
    with pytest.raises(ConfigError, match=f"^{field}=.*is invalid"):
        CheckpointConfig(**{field: value})
    monkeypatch.setenv(ENV_PREFIX + field.upper(), str(value))
    with pytest.raises(ConfigError, match=f"^{field}=.*is invalid"):
        CheckpointConfig.from_env()


def test_gpu_failure_rate_nan_or_mtbf_inf_no_longer_mean_never_saving():
    for bad in ({"gpu_failure_rate": NAN}, {"mtbf": INF}, {"mtbf": datetime.timedelta.max},
                {"gpu_failure_rate": 1e-300}):
        with pytest.raises(ConfigError, match=f"^{next(iter(bad))}="):
            CheckpointConfig(**bad)
    assert CheckpointConfig(gpu_failure_rate="5e-9").gpu_failure_rate == 5e-9  # as YAML gives it: a string


ENV_TEXTS = ["nan", "inf", "-inf", "1e400", "9" * 5000, "", " ", "\t", "x" * 100_000, "[" * 100_000, "{}", "[]",
             '{"1": 2}', '{"a": ' + "1" * 5000 + "}", "null", "true", "-0", "0x10", "1_000", "\u0661\u0662", "\u00b2",
             "30s", "1e-9", "-5", "none", "SIGKILL", "SIGTERM,,", "9" * 20]


@pytest.mark.parametrize("field", FIELDS)
def test_every_hostile_env_value_is_valid_or_a_config_error_naming_the_field(field, monkeypatch):
    bad = {}
    for text in ENV_TEXTS:
        monkeypatch.setenv(ENV_PREFIX + field.upper(), text)
        if why := outcome(field, CheckpointConfig.from_env):
            bad[text[:20]] = why
    assert not bad, bad


YAML_VALUES = [".nan", ".inf", "-.inf", "1.0e+400", "1e400", "[" * 10_000 + "]" * 10_000, "{a: 1}", "{1: 2}",
               "!!binary aGVsbG8=", "2001-12-14", "~", "yes", "0x10", "1_000", "12:30", "&a [*a]",
               "!!python/object/apply:os.system ['true']", "'" + "x" * 100_000 + "'", "[SIGTERM, [SIGUSR1]]"]


@pytest.mark.slow  # 30 fields x 30 hostile values through PyYAML: about 40 s
@pytest.mark.parametrize("field", FIELDS)
def test_every_hostile_yaml_value_is_valid_or_a_config_error(field, tmp_path, monkeypatch):
    path = tmp_path / "ft.yaml"
    monkeypatch.setenv(ENV_CONFIG_FILE, str(path))
    bad = {}
    for text in YAML_VALUES:
        path.write_text(f"{field}: {text}\n")
        if why := outcome(field, CheckpointConfig.from_env):
            bad[text[:20]] = why
    assert not bad, bad


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


@pytest.mark.parametrize("text,expected", [
    ("- dirpath: /x\n", "expected a mapping.*got list"),
    ("just a string\n", "expected a mapping.*got str"),
    ("1: 2\n", "1 is not a field name"),
    ("~: 2\n", "None is not a field name"),
    ("[a, b]: 1\n", "not valid YAML"),
    ("keep_last: 3\n" + "# padding\n" * 200_000, "larger than"),
    ("[" * 100_000, "not valid YAML|nested too deeply"),
    (BILLION_LAUGHS + "preemption_signals: *i\n", "unknown checkpoint config key"),
    ("preemption_signals: [[[SIGTERM]]]\n", "preemption_signals="),
])
def test_a_hostile_yaml_file_is_a_config_error(text, expected, tmp_path, monkeypatch):
    path = tmp_path / "ft.yaml"
    path.write_text(text)
    monkeypatch.setenv(ENV_CONFIG_FILE, str(path))
    with pytest.raises(ConfigError, match=expected):
        CheckpointConfig.from_env()


@pytest.mark.parametrize(("text", "read_as", "hint"), [
    ("interval: 10:00", "the base-60 number 600", "'10m'"),
    ("interval: 1:30:00", "the base-60 number 5400", "'1h30m'"),
    ("keep_last: 010", "the octal number 8", "write 10 (no leading 0)"),
    ("storage_options: {port: 0021}", "the octal number 17", "write 21 (no leading 0)"),
])
def test_a_yaml_1_1_base_60_or_octal_number_is_refused_not_read_otherwise_than_written(text, read_as, hint, tmp_path,
                                                                                         monkeypatch):
    """``interval: 10:00`` saved every 600 steps and ``keep_last: 010`` kept 8 steps, without a word: YAML 1.1 reads
    them as base-60 and octal numbers (YAML 1.2, and most people, do not)."""
    path = tmp_path / "ft.yaml"
    path.write_text(text + "\n")
    monkeypatch.setenv(ENV_CONFIG_FILE, str(path))
    key, value = text.split(": ", 1)
    if key == "storage_options":
        key, value = "storage_options.port", "0021"
    with pytest.raises(ConfigError, match=f"^{ENV_CONFIG_FILE}=.*: {key}: '{value}' is invalid: YAML reads it as "
                                          f"{read_as}. HINT: .*{re.escape(hint)}"):
        CheckpointConfig.from_env()
    path.write_text("interval: '10:00'\nkeep_last: 07\n")  # quoted: a string; 07: 7 either way
    with pytest.raises(ConfigError, match="^interval='10:00' is invalid: expected an int >= 1"):
        CheckpointConfig.from_env()
    path.write_text("keep_last: 07\n")
    assert CheckpointConfig.from_env().keep_last == 7


def test_a_yaml_file_of_bad_bytes_or_a_directory_is_a_config_error(tmp_path, monkeypatch):
    path = tmp_path / "ft.yaml"
    path.write_bytes(b"keep_last: \xff\xfe\n")
    monkeypatch.setenv(ENV_CONFIG_FILE, str(path))
    with pytest.raises(ConfigError, match="not UTF-8"):
        CheckpointConfig.from_env()
    monkeypatch.setenv(ENV_CONFIG_FILE, str(tmp_path))
    with pytest.raises(ConfigError, match="cannot read the file"):
        CheckpointConfig.from_env()


@pytest.mark.parametrize("options", [{1: "x"}, {("a",): 1}, {None: 1}])
def test_storage_options_need_string_keys(options):
    with pytest.raises(ConfigError, match="^storage_options=.*string keys"):
        CheckpointConfig(storage_options=options)


def test_storage_options_may_hold_objects_such_as_credentials():
    credentials = object()  # gcsfs takes a google.auth Credentials object as token
    assert CheckpointConfig(storage_options={"token": credentials}).storage_options["token"] is credentials


@pytest.mark.parametrize(("dirpath", "expected"), [
    ("{run}/step_000000000005", "is step 5 of the run in '{run}'"),
    ("{run}/step_000000000005/again", "is inside step 5 of the run in '{run}'"),
])
def test_a_dirpath_in_a_committed_step_is_refused_and_the_step_left_intact(tmp_path, dirpath, expected):
    """A path ``ft-checkpoint ls`` printed, pasted as dirpath: the new job wrote its journal and steps into the
    committed step, which no longer verified, and a restart of the run skipped it (its only step: all lost)."""
    run = str(tmp_path / "run")
    with CheckpointManager(run, interval=1, keep_last=1) as ckpt:
        ckpt.save(5, {"w": torch.ones(3)}, block=True)
    with pytest.raises(ConfigError, match=re.escape(expected.format(run=run))) as e:
        CheckpointManager(dirpath.format(run=run), interval=1)
    assert f"HINT: pass the run's directory, '{run}'" in str(e.value)
    assert sorted(os.listdir(os.path.join(run, "step_000000000005"))) == \
        ["__0_0.distcp", "manifest.json", "metadata.json", "rank_00000.pt"], "nothing is written into the step"
    state = {"w": torch.zeros(3)}
    with CheckpointManager(run, interval=1) as again:
        assert again.resume(state) == 5 and torch.equal(state["w"], torch.ones(3))


@pytest.mark.parametrize(("dirpath", "expected"), [
    (" /tmp/run", "without spaces at its start or end"), ("/tmp/run ", "without spaces at its start or end"),
    ('"/tmp/run"', "without the quotes around it"), ("'/tmp/run'", "without the quotes around it"),
    ("${SCRATCH}/run", "with ${SCRATCH} expanded"), ("$HOME/run", "with $HOME expanded"),
    ("/scratch/$USER/run", "with $USER expanded"),
])
def test_a_dirpath_that_names_another_folder_than_meant_is_refused(tmp_path, monkeypatch, dirpath, expected):
    """Quotes an env file left in, a variable a YAML file or a container's env did not expand, a space: each made
    the job save into a folder of that literal name, under the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FT_CHECKPOINT_DIRPATH", dirpath)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        CheckpointManager(interval=1)
    assert os.listdir(tmp_path) == [], "nothing is made on the local disk"


def test_a_relative_step_directory_names_the_working_directory_as_its_run():
    with pytest.raises(ConfigError, match=r"is step 5 of the run in '\.'.*HINT: pass the run's directory, '\.'"):
        CheckpointConfig(dirpath="step_000000000005")


@pytest.mark.parametrize("dirpath", ["/data/price$usd", "/data/run$1", "~/runs/x"])
def test_paths_with_a_dollar_inside_a_name_are_kept(dirpath):
    assert CheckpointConfig(dirpath=dirpath).dirpath == dirpath


def test_storage_options_with_a_local_dirpath_are_refused_not_ignored(tmp_path, monkeypatch):
    """``my-bucket/run-7`` with S3 credentials (``s3://`` forgotten) saved to ``./my-bucket/run-7`` on the node's disk
    and ignored the options."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"dirpath='my-bucket/run-7' is a local path, which ignores them. HINT: "
                                          r"write the store's URL, e\.g\. 's3://my-bucket/run-7'"):
        CheckpointManager("my-bucket/run-7", storage_options={"key": "k", "secret": "s"})
    assert os.listdir(tmp_path) == []


def test_a_pathlib_path_is_a_dirpath(tmp_path):
    with CheckpointManager(tmp_path / "run", interval=1, announce=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)}, block=True)
    assert ckpt.storage.url == str(tmp_path / "run") and CheckpointConfig(dirpath=tmp_path).dirpath == str(tmp_path)


@pytest.mark.parametrize("name", ["SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGWINCH", "SIGPIPE", "SIGABRT"])
def test_a_signal_that_is_no_preemption_notice_is_refused(name):
    """SIGCHLD (any child process ending) made the job save and exit 0 at its first ``subprocess.run``; a SIGSEGV
    taken as a notice turned a crash into a hang."""
    with pytest.raises(ConfigError, match=f"preemption_signals: {name} .*not a notice .*HINT"):
        CheckpointConfig(dirpath="/tmp/run", preemption_signals=(name,))
