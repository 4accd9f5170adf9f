"""LightningCLI (issue 22): the callback's settings are keyword arguments LightningCLI's YAML and
``--print_config`` see, and a job configured from YAML, killed and started again, resumes bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from ft_checkpoint.config import FIELDS
from lightning_ft import FaultTolerantCheckpoint
from lightning_ft.testing import assert_same
from tests.helpers.settings import assert_takes_every_setting

pytest.importorskip("jsonargparse")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli_script.py")
TIMEOUT = 300


def config(tmp_path, *extra: dict, **settings) -> str:
    """A LightningCLI config: the quiet CPU trainer of ``lightning_ft.testing``, ``logger: false`` (so the log
    dir, where SaveConfigCallback writes config.yaml, is the same on every start), FaultTolerantCheckpoint
    configured by ``init_args`` (with ``settings`` over them), and ``extra`` callbacks."""
    callbacks = [{"class_path": "lightning_ft.FaultTolerantCheckpoint",
                  "init_args": {"dirpath": str(tmp_path / "ckpt"), "interval": 4, "keep_last": 3, **settings}},
                 *extra]
    trainer = {"accelerator": "cpu", "devices": 1, "max_epochs": 3, "logger": False, "enable_progress_bar": False,
               "enable_model_summary": False, "num_sanity_val_steps": 0, "deterministic": True,
               "val_check_interval": 0.5, "default_root_dir": str(tmp_path / "root"), "callbacks": callbacks}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.yaml"
    path.write_text(yaml.safe_dump({"seed_everything": 0, "trainer": trainer}))
    return str(path)


def test_every_setting_is_a_typed_keyword_argument():
    """Before: ``**config``, which LightningCLI refused ("Option 'interval' is not accepted")."""
    assert_takes_every_setting(FaultTolerantCheckpoint.__init__)


def test_print_config_lists_every_setting(tmp_path, capsys):
    from lightning.pytorch.cli import LightningCLI

    from lightning_ft.testing import Data, Net

    with pytest.raises(SystemExit) as stop, pytest.warns(UserWarning, match="args parameter"):  # pytest's own argv
        LightningCLI(Net, Data, args=["fit", "--config", config(tmp_path), "--print_config"])
    assert stop.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    ours = printed["trainer"]["callbacks"][0]
    assert ours["class_path"] == "lightning_ft.FaultTolerantCheckpoint"
    assert (ours["init_args"]["interval"], ours["init_args"]["keep_last"]) == (4, 3)
    assert set(FIELDS) <= set(ours["init_args"]), sorted(set(FIELDS) - set(ours["init_args"]))


def run(tmp_path, *callbacks: dict, killed: bool = False, **settings) -> str:
    proc = subprocess.run([sys.executable, SCRIPT, "fit", "--config", config(tmp_path, *callbacks, **settings)], text=True,
                          capture_output=True, timeout=TIMEOUT, start_new_session=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == (-9 if killed else 0), proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_job_configured_from_yaml_killed_and_restarted_resumes_bit_exact(tmp_path):
    """Before: the restart stopped in SaveConfigCallback ("expected .../config.yaml to NOT exist") before it
    could resume. Now the restart that resumes has it write its config.yaml again, and says so."""
    reference = tmp_path / "reference"
    run(reference, {"class_path": "cli_script.Record", "init_args": {"out": str(reference / "out")}})
    out = tmp_path / "out"
    record = {"class_path": "cli_script.Record", "init_args": {"out": str(out)}}
    first = run(tmp_path, record, {"class_path": "cli_script.KillAt", "init_args": {"step": 10}}, killed=True)
    assert "starting fresh; first save at step 4 (every 4 steps)" in first, first[-3000:]
    second = run(tmp_path, record)
    assert "SaveConfigCallback writes config.yaml in" in second and "again" in second, second[-3000:]
    with open(out / "runs.jsonl") as f:
        assert [json.loads(line)["resumed_from"] for line in f] == [None, 8]
    assert_same(torch.load(reference / "out" / "final.pt", weights_only=False),
                torch.load(out / "final.pt", weights_only=False))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fast tier only", "no step yet"])
def test_a_job_killed_before_its_first_durable_save_restarts(tmp_path, case):
    """Killed at step 5 with its first durable save due at step 7 (the end of the first epoch): with fast-tier saves
    every 2 steps, or with no save yet. The restart's check of whether the job resumes (so SaveConfigCallback may
    write its config.yaml again) looked for a committed step in the durable directory alone: it found none,
    SaveConfigCallback refused the first start's config.yaml, and every restart stopped there. Now the restart
    resumes the fast tier's step 4, or starts afresh."""
    out = tmp_path / "out"
    record = {"class_path": "cli_script.Record", "init_args": {"out": str(out)}}
    settings: dict = {"interval": 100}
    if case == "fast tier only":
        (tmp_path / "fast").mkdir(mode=0o700)
        settings.update(fast_dirpath=str(tmp_path / "fast"), fast_interval=2)
    run(tmp_path, record, {"class_path": "cli_script.KillAt", "init_args": {"step": 5}}, killed=True, **settings)
    second = run(tmp_path, record, **settings)
    assert "SaveConfigCallback writes config.yaml in" in second and "again" in second, second[-3000:]
    with open(out / "runs.jsonl") as f:
        assert [json.loads(line)["resumed_from"] for line in f] == [None, 4 if case == "fast tier only" else None]
