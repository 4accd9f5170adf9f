"""Fixtures for the Lightning tests: real training processes (killed or not) and in-process fits."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("lightning")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_script.py")
TIMEOUT = 300  # one training process; generous, the machine is shared


@dataclasses.dataclass
class Job:
    """Runs ``train_script.py`` as a job of its own (a new session, so a SIGKILL takes all its ranks)."""

    python: str

    def run(self, dirpath: str, out: str, *args: Any, killed: bool = False, env: dict[str, str] | None = None) -> str:
        """Run to the end (or, with ``killed``, until the job SIGKILLs itself); returns its output."""
        cmd = [self.python, SCRIPT, dirpath, out, *map(str, args)]
        proc = subprocess.run(cmd, start_new_session=True, capture_output=True, text=True, timeout=TIMEOUT,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
        output = proc.stdout + proc.stderr
        expected = -9 if killed else 0
        assert proc.returncode == expected, f"{' '.join(cmd)} exited {proc.returncode}, expected {expected}:\n{output[-4000:]}"
        return output


@pytest.fixture(scope="session")
def job() -> Job:
    return Job(sys.executable)


@pytest.fixture(scope="session")
def single_reference(job: Job, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``final.pt`` of an uninterrupted single-process run with the callback (interval 4, 3 epochs)."""
    root = tmp_path_factory.mktemp("single-reference")
    job.run(str(root / "ckpt"), str(root / "out"), "--interval", 4)
    return str(root / "out" / "final.pt")
