"""Progress where people wait (issue 22, point 7): a resume, ``verify`` and ``gc`` that take longer than a few
seconds show bytes, MB/s and the time left: a ``tqdm`` bar in a terminal, lines otherwise.

End to end once, on real slow storage: ``faulty://`` (local disk, ``ft_checkpoint.testing.faults``) sleeping on
every open, listing and delete, so that verify takes longer than ``progress.DELAY`` on any machine. The other
tests run the CLI's ``main`` in this process with DELAY and EVERY at 0, standing for long work.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from ft_checkpoint import CheckpointManager, progress
from ft_checkpoint.tools.cli import main
from tests.cli.conftest import ROOT, drawn, open_terminal

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


@pytest.fixture
def long_work(monkeypatch, caplog):
    """Work that takes longer than DELAY, with a line at every update (DELAY and EVERY at 0); the CLI's stderr
    handler taken off again after the test."""
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setattr(progress, "EVERY", 0.0)
    handlers = list(logging.getLogger("ft_checkpoint").handlers)
    caplog.set_level("INFO", logger="ft_checkpoint.progress")
    yield caplog
    logging.getLogger("ft_checkpoint").handlers[:] = handlers


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ft_checkpoint.progress"]


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_verify_writes_progress_lines_on_slow_storage(tmp_path):
    """End to end, with the real DELAY: the CLI as a process on faulty:// storage that sleeps a second on every
    call, no terminal: lines on stderr."""
    path = str(tmp_path / "run")
    with CheckpointManager(path, interval=1, writers=2, announce=False) as ckpt:
        ckpt.save(10, state(10), block=True)
    env = {**os.environ, "FT_CHECKPOINT_STORAGE_OPTIONS": json.dumps(SLOW)}
    proc = subprocess.run([sys.executable, "-c", CLI, "verify", f"faulty://{path}"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ft-checkpoint: verifying:")]
    assert lines, proc.stderr
    assert re.fullmatch(r"ft-checkpoint: verifying: [\d.]+ [kM]?B of 6.02 MB \(\d+%\), [\d.]+ [kM]?B/s, about .+ left",
                        lines[0]), lines
    assert lines[-1].endswith(", done") and "6.02 MB of 6.02 MB (100%)" in lines[-1], lines


def test_verify_shows_a_bar_in_a_terminal(run, long_work, monkeypatch, capsys):
    """On faulty:// sleeping 0.15 s per call, so that tqdm (which redraws at most every 0.1 s) redraws."""
    monkeypatch.setenv("FT_CHECKPOINT_STORAGE_OPTIONS", json.dumps({"latency": 0.15, "latency_rate": 1.0}))
    leader, follower = open_terminal()
    terminal = os.fdopen(follower, "w")
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["verify", f"faulty://{run}"]) == 0
    terminal.close()
    text = drawn(leader)
    bar = re.search(r"verifying:.*?\|.*?\| *[\d.]+[kMG]?B?/[\d.]+[kMG]?B? \[\d\d:\d\d<\d\d:\d\d, *[\d.]+[kMG]?B/s\]", text)
    assert bar, f"no tqdm bar with bytes, rate and time left:\n{text!r}"
    assert "intact" in capsys.readouterr().out and not progress_lines(long_work), "a bar, not lines"


def test_gc_shows_its_progress(run, tmp_path, long_work):
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy)
    assert main(["gc", copy, "--keep", "1"]) == 0
    lines = progress_lines(long_work)
    assert any(re.match(r"gc: verifying the newest step: [\d.]+ [kM]?B of 6.02 MB", line) for line in lines), lines
    assert "gc: deleting: 1 step of 2 steps (50%)" in "\n".join(lines), lines
    assert any(line.startswith("gc: deleting: 2 steps of 2 steps (100%)") and line.endswith("done") for line in lines)
    assert sorted(os.listdir(copy)) == ["journal", "lease.lock", "step_000000000030"]


def test_gc_progress_never_goes_past_its_total_when_the_newest_step_is_corrupt(run, tmp_path, long_work):
    """The newest step fails its checksums, so gc verifies the one before it too: the total was the newest step's
    bytes alone, and the lines went on past it ("12 MB of 6.02 MB (200%)"), with a time left that meant nothing."""
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy)
    data = os.path.join(copy, "step_000000000030", "__0_0.distcp")
    with open(data, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["gc", copy, "--keep", "1"]) == 0
    amounts = [re.match(r"gc: verifying[^:]*: ([\d.]+ [kM]?B) of ([\d.]+ [kM]?B) ", line)
               for line in progress_lines(long_work) if line.startswith("gc: verifying")]
    assert amounts and all(amounts), progress_lines(long_work)
    assert all(in_bytes(m.group(1)) <= in_bytes(m.group(2)) for m in amounts), [m.group(0) for m in amounts]
    assert amounts[-1].group(1) == amounts[-1].group(2) == "12 MB", amounts[-1].group(0)  # both steps, all of them
    assert sorted(os.listdir(copy)) == ["journal", "lease.lock", "step_000000000020", "step_000000000030"]


def in_bytes(amount: str) -> float:
    """``"6.02 MB"`` as 6_020_000 (how ``Progress`` lines show bytes)."""
    number, unit = amount.split()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6}[unit]


def test_a_resume_shows_its_progress(run, long_work):
    """As log records (INFO, ft_checkpoint.progress) where logging shows them, as here."""
    target = state(0)
    with CheckpointManager(run, announce=False) as ckpt:
        assert ckpt.resume(target) == 30
    assert torch.equal(target["a"], state(30)["a"])
    lines = progress_lines(long_work)
    assert lines and all(line.startswith("loading step 30: ") for line in lines), lines
    assert re.search(r"[\d.]+ MB of 6 MB \(\d+%\), [\d.]+ [kMG]?B/s", lines[0]), lines  # the tensors' bytes
    assert lines[-1].startswith("loading step 30: 6 MB of 6 MB (100%)") and lines[-1].endswith("done"), lines


def test_quick_work_shows_nothing(run):
    proc = subprocess.run([sys.executable, "-m", "ft_checkpoint.tools.cli", "verify", run], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
