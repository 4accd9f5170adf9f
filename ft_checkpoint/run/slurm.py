"""Slurm: what the job is (id, restart count, requeue-able, end time) and requeueing it.

Detected from ``SLURM_JOB_ID``. The job's facts come from ``scontrol show job`` (one call, rank 0
only); ``SLURM_JOB_END_TIME``, where Slurm sets it, wins for the end time. ``scontrol requeue`` puts
the job back in the queue after its final save; Slurm restarts it with ``SLURM_RESTART_COUNT`` + 1.

Example:
    >>> SlurmJob.detect({}) is None          # not a Slurm job
    True
    >>> job = SlurmJob.detect({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}, query=False)
    >>> job.job_id, job.restart_count
    ('42', 1)
    >>> parse_show_job("JobId=42 Requeue=1 Restarts=1 EndTime=Unknown")
    {'JobId': '42', 'Requeue': '1', 'Restarts': '1', 'EndTime': 'Unknown'}
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import subprocess
from collections.abc import Mapping

log = logging.getLogger(__name__)

TIMEOUT = 20.0
"""Seconds to wait for ``scontrol``."""


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """The Slurm job this process runs in."""

    job_id: str
    """``SLURM_JOB_ID``, or ``<array job id>_<task id>`` for an array task."""
    restart_count: int = 0
    """``SLURM_RESTART_COUNT``: how many times this job was requeued."""
    requeue: bool = False
    """Whether the job may be requeued (``sbatch --requeue``, or the cluster's default)."""
    end_time: float | None = None
    """When the time limit stops the job (``time.time()`` scale), if known."""

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None, *, query: bool = True) -> SlurmJob | None:
        """The job, or None outside Slurm. ``query`` asks ``scontrol`` for requeue and end time."""
        env = os.environ if env is None else env
        if "SLURM_JOB_ID" not in env:
            return None
        job_id = env["SLURM_JOB_ID"]
        if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
            job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        facts = _show_job(job_id) if query else {}
        end_time = _epoch(env.get("SLURM_JOB_END_TIME")) or _timestamp(facts.get("EndTime"))
        return cls(job_id=job_id, restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
                   requeue=facts.get("Requeue") == "1", end_time=end_time)


def parse_show_job(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of ``scontrol show job -o`` (values without spaces; others are cut)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _show_job(job_id: str) -> dict[str, str]:
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             timeout=TIMEOUT, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("Slurm job %s: `scontrol show job` failed (%s); requeue and the end time are unknown", job_id, e)
        return {}
    return parse_show_job(out)


def _epoch(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _timestamp(text: str | None) -> float | None:
    """Slurm's local ``2026-11-29T20:45:00`` as epoch seconds; None for ``Unknown``, ``None``, ..."""
    try:
        return datetime.datetime.fromisoformat(text).timestamp() if text else None
    except ValueError:
        return None


def requeue(job_id: str) -> bool:
    """Run ``scontrol requeue JOB_ID``; returns whether it worked (a failure is logged, not raised).

    Example:
        >>> requeue("not-a-job")    # doctest: +SKIP
        False
    """
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.SubprocessError) as e:
        log.error("could not requeue Slurm job %s: %s. HINT: resubmit the job; it resumes by itself", job_id, e)
        return False
    if proc.returncode != 0:
        log.error("`scontrol requeue %s` failed: %s. HINT: submit with --requeue, or resubmit the job; it resumes "
                  "by itself", job_id, (proc.stderr or proc.stdout).strip())
        return False
    log.info("requeued Slurm job %s", job_id)
    return True
