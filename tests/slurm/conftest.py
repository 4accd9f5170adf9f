"""The ``slurm_cluster`` fixture: a real one-node Slurm cluster on this machine, brought up by ``.ci/slurm-up``.

If it cannot come up, a test using it fails with the reason in CI (``CI=true``), always. Elsewhere it is
skipped, with the reason, only when the cause is ours to accept: not root, or slurm-wlm/munge cannot be
installed; any other failure (the daemons do not start, the node never gets idle) fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM_UP = os.path.join(ROOT, ".ci", "slurm-up")
NOT_ROOT, CANNOT_INSTALL = 3, 4  # .ci/slurm-up's exit codes for the two causes a local run may skip on


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


class SlurmCluster:
    """Slurm's commands on the running cluster, with timeouts, and a job's state as a dict."""

    def run(self, *args: object, timeout: float = 30, **popen: Any) -> str:
        """Run a Slurm command (``popen``: ``cwd``, ``env``); fail with its output if it fails."""
        cmd = [str(a) for a in args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **popen)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc.stdout

    def sbatch(self, *args: object, **popen: Any) -> int:
        """Submit; returns the job id."""
        return int(self.run("sbatch", "--parsable", *args, **popen).strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict: ``JobState``, ``Restarts``, ``ExitCode``, ``Reason``, ..."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", "--oneliner", job_id)))

    def release(self, job_id: int) -> None:
        """Start a requeued job now instead of after Slurm's requeue delay.

        Not before the node is idle and the second of the requeue has passed: slurmd refuses to launch a
        job id it killed in the same second ("Job N already killed, do not launch batch job"), and the
        job then fails with exit code 1 before its script runs. Slurm's own delay exists to avoid that.
        """
        requeued = datetime.fromisoformat(self.job(job_id)["SubmitTime"])  # reset to the requeue's time
        deadline = time.monotonic() + 60
        while self.run("sinfo", "-h", "-N", "-o", "%T").split() != ["idle"] and time.monotonic() < deadline:
            time.sleep(0.25)
        while datetime.now() < requeued + timedelta(seconds=2):
            time.sleep(0.25)
        self.run("scontrol", "update", f"jobid={job_id}", "StartTime=now")

    def describe(self, job_id: int) -> str:
        """The job's ``scontrol show job`` and the lines of the daemons' logs that name it, for a failure."""
        proc = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True, timeout=30)
        text = proc.stdout + proc.stderr
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(os.environ.get("FT_SLURM_DIR", "/tmp/ft-slurm"), "log", name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    lines = [line for line in f if re.search(rf"(?i)(jobid=|job |\[){job_id}\b", line)]
                text += f"--- {path}, lines naming job {job_id}\n" + "".join(lines[-40:])
        return text

    def wait(self, job_id: int, until: Callable[[dict[str, str]], bool], what: str, timeout: float) -> dict[str, str]:
        """Poll the job until ``until(job)``; fail naming ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout:.0f} s for {what}; the job is {job.get('JobState')} "
                                     f"(Reason={job.get('Reason')}, Restarts={job.get('Restarts')})")
            time.sleep(0.25)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node Slurm cluster (``.ci/slurm-up``); stopped at the end if this session started it."""
    try:
        proc = subprocess.run(["bash", SLURM_UP], capture_output=True, text=True, timeout=600)
        rc, output = proc.returncode, (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        rc, output = None, repr(e)
    if rc != 0:
        reason = f".ci/slurm-up exited with {rc}:\n{output}"
        if not in_ci() and rc in (NOT_ROOT, CANNOT_INSTALL):
            pytest.skip(reason)
        pytest.fail(reason, pytrace=False)
    yield SlurmCluster()
    if "already up" not in output:
        subprocess.run(["bash", SLURM_UP, "--down"], capture_output=True, timeout=120)
