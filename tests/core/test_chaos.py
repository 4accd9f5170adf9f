"""A short run of the chaos benchmark per framework: real training processes (the core loop, a Lightning
Trainer, an Accelerate loop) SIGKILLed at random instants, restarted to the end, compared bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CHAOS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "benchmarks", "chaos.py")


def chaos(framework: str, *args: str) -> tuple[str, dict[str, int]]:
    """Run the chaos script on one framework; its output and its table row, which it must end with rc 0."""
    cmd = [sys.executable, CHAOS, "--framework", framework, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith(f"{framework} "))
    columns = ("trials", "kills", "resumes", "exact", "lost", "corrupt")
    return proc.stdout, dict(zip(columns, map(int, row.split()[1:])))


@pytest.mark.parametrize("framework", ["core", "lightning", "accelerate"])
def test_chaos_short(framework):
    if framework != "core":
        pytest.importorskip(framework)
    _, t = chaos(framework, "--trials", "1", "--max-kills", "2", "--seed", "1")  # longer runs: benchmarks/chaos.py
    assert (t["trials"], t["exact"], t["lost"], t["corrupt"]) == (1, 1, 0, 0), t
    assert t["kills"] >= 1 and t["resumes"] >= 1, t


def test_chaos_with_transient_storage_errors():
    out, t = chaos("core", "--trials", "1", "--max-kills", "3", "--seed", "2", "--transient-rate", "0.1")
    assert "with 10% of storage calls failing" in out
    assert (t["trials"], t["exact"], t["lost"], t["corrupt"]) == (1, 1, 0, 0) and t["kills"] >= 1, t
