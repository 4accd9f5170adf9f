"""Fixtures for the Lightning tests: real training processes (killed or not) and in-process fits."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import pytest

from ft_checkpoint.testing import jobs

pytest.importorskip("lightning")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_script.py")
TIMEOUT = 300  # one training process; generous, the machine is shared


@dataclasses.dataclass
class Job:
    """Runs ``train_script.py`` as a job of its own (a new session, so a SIGKILL takes all its ranks)."""

    python: str

    def run(self, dirpath: str, out: str, *args: Any, killed: bool = False, env: dict[str, str] | None = None) -> str:
        """Run to the end (or, with ``killed``, until the job SIGKILLs itself); returns its output."""
        job = jobs.run(SCRIPT, dirpath, out, *args, new_session=True, timeout=TIMEOUT,
                       env={"PYTHONWARNINGS": "ignore", **(env or {})})
        return job.expect(-9 if killed else 0).output


@pytest.fixture(scope="session")
def job() -> Job:
    return Job(sys.executable)


@pytest.fixture(scope="session")
def single_reference(job: Job, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``final.pt`` of an uninterrupted single-process run with the callback (interval 4, 3 epochs)."""
    root = tmp_path_factory.mktemp("single-reference")
    job.run(str(root / "ckpt"), str(root / "out"), "--interval", 4)
    return str(root / "out" / "final.pt")
