"""A short run of the chaos benchmark per framework: real training processes (the core loop, a Lightning
Trainer, an Accelerate loop) SIGKILLed at random instants, restarted to the end, compared bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHAOS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "benchmarks", "chaos.py")


@pytest.mark.parametrize("framework", ["core", "lightning", "accelerate"])
def test_chaos_short(framework):
    if framework != "core":
        pytest.importorskip(framework)
    cmd = [sys.executable, CHAOS, "--trials", "2", "--max-kills", "2", "--framework", framework, "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith(f"{framework} "))
    trials, kills, resumes, exact, lost, corrupt = map(int, row.split()[1:])
    assert (trials, exact, lost, corrupt) == (2, 2, 0, 0) and kills >= 2 and resumes >= 1, row


def test_chaos_with_transient_storage_errors():
    cmd = [sys.executable, CHAOS, "--trials", "1", "--max-kills", "3", "--framework", "core", "--seed", "2",
           "--transient-rate", "0.1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "with 10% of storage calls failing" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("core "))
    trials, kills, resumes, exact, lost, corrupt = map(int, row.split()[1:])
    assert (trials, exact, lost, corrupt) == (1, 1, 0, 0) and kills >= 1, row
