"""Every invalid config value fails at construction with a message naming the field; env and file work."""

from __future__ import annotations

import datetime

import pytest

from ft_checkpoint import CheckpointConfig, CheckpointManager
from ft_checkpoint.errors import ConfigError

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


def test_interval_forms():
    assert CheckpointConfig(interval=200).interval == 200
    assert CheckpointConfig(interval="200").interval == 200
    assert CheckpointConfig(interval="90s").interval == datetime.timedelta(seconds=90)
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


def test_env_storage_options_is_json(monkeypatch):
    monkeypatch.setenv("FT_CHECKPOINT_STORAGE_OPTIONS", '{"endpoint_url": "http://127.0.0.1:1"}')
    assert CheckpointConfig.from_env().storage_options == {"endpoint_url": "http://127.0.0.1:1"}
    monkeypatch.setenv("FT_CHECKPOINT_STORAGE_OPTIONS", "endpoint_url=x")
    with pytest.raises(ConfigError, match="storage_options=.*JSON object"):
        CheckpointConfig.from_env()


@pytest.mark.parametrize("var,value,field", [
    ("FT_CHECKPOINT_KEEP_LAST", "many", "keep_last"),
    ("FT_CHECKPOINT_INTERVAL", "often", "interval"),
    ("FT_CHECKPOINT_SAVE_RNG_STATE", "maybe", "save_rng_state"),
])
def test_bad_env_value_names_field(monkeypatch, var, value, field):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"^{field}='{value}'"):
        CheckpointConfig.from_env()


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


def test_min_interval_cannot_exceed_max_interval():
    with pytest.raises(ConfigError, match="min_interval='2h'.*max_interval='1h'"):
        CheckpointConfig(min_interval="2h", max_interval="1h")
