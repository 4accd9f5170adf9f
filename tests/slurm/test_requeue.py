"""A real Slurm job, preempted: it commits a final checkpoint, requeues itself, exits 0, and its second
run resumes from exactly that checkpoint and ends bit for bit where an uninterrupted run ends.

The job is ``examples/slurm/train.sbatch`` (the Lightning example's training job), submitted as root
with ``--export=ALL`` so that it runs this venv's python on this checkout, in a working directory under
``tmp_path``. The preemption notice is what ``#SBATCH --signal=B:USR1@120`` sends before the time
limit, sent at once: ``scancel --signal=USR1 --batch JOBID``. A requeued job waits for a begin time;
``scontrol update jobid=N StartTime=now`` releases it (``SlurmCluster.release``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ft_checkpoint.run.journal import read_journal
from ft_checkpoint.store.storage import Storage
from tests.slurm.conftest import ROOT

pytestmark = pytest.mark.slow

pytest.importorskip("lightning")

SBATCH = os.path.join(ROOT, "examples", "slurm", "train.sbatch")
EXAMPLE = os.path.join(ROOT, "examples", "lightning_resume.py")
STEPS = 300  # about 7 s of training on an idle core, plus ~5 s to start python and Lightning
SIGNAL_AFTER = 40  # the steps the job reports before it gets the notice
RUN_TIMEOUT = 180  # for one training run, on a shared 2-core machine


def runs(path: str) -> list[tuple[int, list[dict]]]:
    """The job's stdout, one entry per run: (SLURM_RESTART_COUNT, its JSON events)."""
    out: list[tuple[int, list[dict]]] = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            start = re.match(r"slurm job \d+ restart (\d+)", line)
            if start:
                out.append((int(start.group(1)), []))
            elif line.startswith("{") and line.rstrip().endswith("}") and out:
                out[-1][1].append(json.loads(line))
    return out


def last_step(events: list[dict]) -> int:
    return max((e["step"] for e in events if e["event"] == "step"), default=0)


def one(events: list[dict], kind: str) -> dict:
    found = [e for e in events if e["event"] == kind]
    assert len(found) == 1, f"expected one {kind!r} event, got {found}"
    return found[0]


def environment(**extra: str) -> dict[str, str]:
    """This process's environment less any Slurm job's variables (should the tests run inside one), and one
    thread for torch in both runs: the one CPU the job is given, and the same float sums in both."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1", **extra}


def reference_run(workdir: str) -> dict:
    """The same training, uninterrupted and outside Slurm: its ``done`` event."""
    os.makedirs(workdir)
    proc = subprocess.run([sys.executable, EXAMPLE, "--train", "--steps", str(STEPS)], cwd=workdir, text=True,
                          capture_output=True, timeout=RUN_TIMEOUT, env=environment(PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return one([json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], "done")


def test_preempted_job_saves_requeues_itself_and_resumes_bit_exact(slurm_cluster, tmp_path):
    reference = reference_run(str(tmp_path / "reference"))
    assert reference["step"] == STEPS and reference["resumed_from"] is None

    workdir = tmp_path / "job"
    workdir.mkdir()
    job_id = slurm_cluster.sbatch("--export=ALL", f"--chdir={workdir}", SBATCH, "--steps", STEPS, cwd=ROOT,
                                  env=environment(PYTHON=sys.executable, FT_REPO=ROOT))
    out, err = str(workdir / f"slurm-{job_id}.out"), str(workdir / f"slurm-{job_id}.err")
    ckpt = str(workdir / "ft_checkpoints")
    done = False
    try:
        slurm_cluster.wait(job_id, lambda job: job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED")
                           or (runs(out) and last_step(runs(out)[0][1]) >= SIGNAL_AFTER),
                           f"the job to start and report step {SIGNAL_AFTER}", RUN_TIMEOUT)
        assert slurm_cluster.job(job_id)["JobState"] == "RUNNING", "the job ended before the preemption notice"
        noticed_at = last_step(runs(out)[0][1])
        slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)

        # The first run: final save committed and journaled, job requeued, exit 0.
        job = slurm_cluster.wait(job_id, lambda job: job["Restarts"] == "1" and job["JobState"] == "PENDING"
                                 or job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"),
                                 "the job to save, requeue itself and wait as PENDING", 60)
        assert job["JobState"] == "PENDING", f"the job ended ({job['JobState']}) without requeueing itself"
        (restart, first), = runs(out)
        assert restart == 0 and not [e for e in first if e["event"] == "done"]
        preempted = one(first, "preempted")
        assert preempted["reason"] == "SIGUSR1" and preempted["exit_code"] == 0
        final = preempted["step"]
        assert noticed_at <= final <= last_step(first) + 1  # the step boundary right after the notice
        steps = {int(d) for d in re.findall(r"step_(\d+)", " ".join(os.listdir(ckpt)))}
        assert max(steps) == final, f"the newest checkpoint is step {max(steps)}, the final save was {final}"
        journaled = [e for e in read_journal(Storage(ckpt)) if e["event"] == "preempted"]
        assert [(e["step"], e["reason"], e["requeue"]) for e in journaled] == [(final, "SIGUSR1", True)]

        # The second run: SLURM_RESTART_COUNT=1, resumed from the final checkpoint, the reference's weights.
        slurm_cluster.release(job_id)
        job = slurm_cluster.wait(job_id, lambda job: job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"),
                                 "the requeued job to run to its end", RUN_TIMEOUT)
        done = True
        assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0"
        assert [restart for restart, _ in runs(out)] == [0, 1]
        second = runs(out)[1][1]
        assert one(second, "start")["resumed_from"] == final
        end = one(second, "done")
        assert end["step"] == STEPS and end["resumed_from"] == final
        assert end["weights_sha256"] == reference["weights_sha256"], "the resumed run is not bit-exact"
    except BaseException:
        print(f"--- scontrol show job {job_id}\n{slurm_cluster.describe(job_id)}")
        for path in (out, err):
            if os.path.exists(path):
                with open(path) as f:
                    print(f"--- {path}\n{f.read()[-20000:]}")
        raise
    finally:
        if not done:
            subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)
