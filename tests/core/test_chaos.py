"""A short run of the chaos benchmark: real processes, SIGKILLed at random moments, restarted to the end."""

from __future__ import annotations

import os
import subprocess
import sys

CHAOS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "benchmarks", "chaos.py")


def test_chaos_core_short():
    proc = subprocess.run([sys.executable, CHAOS, "--trials", "2", "--framework", "core", "--seed", "1"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("core "))
    trials, kills, resumes, exact, lost, corrupt = map(int, row.split()[1:])
    assert (trials, exact, lost, corrupt) == (2, 2, 0, 0) and kills >= 2 and resumes >= 1
