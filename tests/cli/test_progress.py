"""Progress where people wait (issue 22, point 7): a resume, ``verify`` and ``gc`` that take longer than a few
seconds show bytes, MB/s and the time left: a ``tqdm`` bar in a terminal, lines otherwise.

The slow storage is real: ``faulty://`` (local disk, ``ft_checkpoint.testing.faults``) sleeping on every open,
listing and delete, so the work takes longer than ``progress.DELAY`` on any machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from ft_checkpoint import CheckpointManager, progress
from tests.cli.conftest import ROOT, run_in_terminal

SLOW = {"latency": 1.0, "latency_rate": 1.0}
"""Every storage call of faulty:// sleeps a second: verify and gc of a few files take longer than DELAY (3 s)."""
CLI = "import sys, ft_checkpoint.testing.faults; from ft_checkpoint.tools.cli import main; sys.exit(main(sys.argv[1:]))"
"""The real CLI, in a process where faulty:// exists (a user's install has no such protocol)."""


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(1_000_000, generator=g), "b": torch.randn(500_000, generator=g)}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    """Three committed steps of 6.02 MB each, in 2 shard files per step."""
    path = str(tmp_path_factory.mktemp("progress") / "run")
    with CheckpointManager(path, interval=1, keep_last=3, writers=2, announce=False) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, state(step), block=True)
    return path


def slow_cli(*args: str, terminal: bool = False) -> tuple[int, str]:
    """The CLI on faulty:// (slow); its exit code and its stderr (what it drew, on a pseudo-terminal, with
    ``terminal``)."""
    env = {"FT_CHECKPOINT_STORAGE_OPTIONS": json.dumps(SLOW)}
    cmd = [sys.executable, "-c", CLI, *args]
    if terminal:
        return run_in_terminal(cmd, env)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=300)
    return proc.returncode, proc.stderr


def test_verify_shows_a_bar_in_a_terminal(run):
    rc, out = slow_cli("verify", f"faulty://{run}", terminal=True)
    assert rc == 0, out
    bar = re.search(r"verifying:.*?\|.*?\| *[\d.]+[kMG]?B?/[\d.]+[kMG]?B? \[\d\d:\d\d<\d\d:\d\d, *[\d.]+[kMG]?B/s\]", out)
    assert bar, f"no tqdm bar with bytes, rate and time left:\n{out!r}"


def test_verify_writes_progress_lines_without_a_terminal(run):
    rc, err = slow_cli("verify", f"faulty://{run}")
    assert rc == 0, err
    lines = [line for line in err.splitlines() if line.startswith("ft-checkpoint: verifying:")]
    assert lines, err
    assert re.fullmatch(r"ft-checkpoint: verifying: [\d.]+ [kM]?B of 6.02 MB \(\d+%\), [\d.]+ [kM]?B/s, about .+ left",
                        lines[0]), lines
    assert lines[-1].endswith(", done") and "6.02 MB of 6.02 MB (100%)" in lines[-1], lines


def test_gc_shows_its_progress(run, tmp_path):
    copy = str(tmp_path / "copy")
    subprocess.run(["cp", "-r", run, copy], check=True)
    rc, err = slow_cli("gc", f"faulty://{copy}", "--keep", "1")
    assert rc == 0, err
    assert re.search(r"ft-checkpoint: gc: verifying the newest step: [\d.]+ [kM]?B of 6.02 MB", err), err
    assert re.search(r"ft-checkpoint: gc: deleting: \d steps? of 2 steps \(\d+%\)", err), err
    left = {name: os.listdir(os.path.join(copy, name)) for name in os.listdir(copy) if name.startswith("step_")}
    assert [name for name, files in left.items() if files] == ["step_000000000030"]  # faulty:// leaves empty dirs


def test_a_resume_shows_its_progress(run, monkeypatch, caplog):
    """As log records (INFO, ft_checkpoint.progress) where logging shows them, as here; DELAY and EVERY at 0
    stand for a resume long enough to be shown."""
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setattr(progress, "EVERY", 0.0)
    target = state(0)
    with caplog.at_level("INFO", logger="ft_checkpoint.progress"), CheckpointManager(run, announce=False) as ckpt:
        assert ckpt.resume(target) == 30
    assert torch.equal(target["a"], state(30)["a"])
    lines = [r.getMessage() for r in caplog.records if r.name == "ft_checkpoint.progress"]
    assert lines and all(line.startswith("loading step 30: ") for line in lines), lines
    assert re.search(r"[\d.]+ MB of 6 MB \(\d+%\), [\d.]+ [kMG]?B/s", lines[0]), lines  # the tensors' bytes
    assert lines[-1].startswith("loading step 30: 6 MB of 6 MB (100%)") and lines[-1].endswith("done"), lines


def test_quick_work_shows_nothing(run):
    proc = subprocess.run([sys.executable, "-m", "ft_checkpoint.tools.cli", "verify", run], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
