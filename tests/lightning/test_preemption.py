"""Preemption under Lightning: a real signal inside a training step, the final save, exit 0, exact resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from ft_checkpoint import read_journal
from ft_checkpoint.store.storage import Storage
from lightning_ft.testing import assert_same
from tests.lightning.test_kill_resume import read_runs

pytestmark = pytest.mark.slow


def preempted_events(ckpt: str) -> list[dict]:
    return [e for e in read_journal(Storage(ckpt)) if e["event"] == "preempted"]


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_signal_saves_the_next_step_exits_0_and_resumes_exactly(job, tmp_path, single_reference, sig):
    ckpt, out, marker = str(tmp_path / "ckpt"), str(tmp_path / "out"), tmp_path / "user-handler-ran"
    job.run(ckpt, out, "--interval", 4, "--signal-in-step", 9, "--signal", sig, "--user-sigterm-marker", marker)
    assert marker.exists() == (sig == "SIGTERM")  # the user's own SIGTERM handler still ran
    assert [(e["step"], e["reason"]) for e in preempted_events(ckpt)] == [(10, sig)]  # the step the signal hit
    assert not os.path.exists(os.path.join(out, "final.pt"))  # it exited, it did not train on
    job.run(ckpt, out, "--interval", 4)
    assert [r["resumed_from"] for r in read_runs(out)] == [None, 10]
    assert_same(torch.load(single_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


DDP = ("--devices", 2, "--interval", 5)


@pytest.fixture(scope="module")
def ddp_reference(job, tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp-reference")
    job.run(str(root / "ckpt"), str(root / "out"), *DDP)
    return str(root / "out" / "final.pt")


@pytest.mark.parametrize("sig", ["SIGUSR1"])  # SIGTERM to rank 0 on DDP: "rank 0 in a validation" below
def test_ddp_signal_to_rank_0_stops_both_ranks_at_one_step(job, tmp_path, ddp_reference, sig):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    job.run(ckpt, out, *DDP, "--signal-in-step", 0, "--signal", sig)  # rank 0 alone: the ranks agree
    assert [(e["step"], e["reason"]) for e in preempted_events(ckpt)] == [(1, f"{sig} on rank 0")]
    job.run(ckpt, out, *DDP)
    assert [r["resumed_from"] for r in read_runs(out)] == [None, None, 1, 1]
    assert_same(torch.load(ddp_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


def test_ddp_notice_at_a_batch_followed_by_validation_saves_the_next_step(job, tmp_path, ddp_reference):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    job.run(ckpt, out, *DDP, "--signal-in-step", 2)  # validation follows step 3: the final save is step 4
    assert [(e["step"], e["reason"]) for e in preempted_events(ckpt)] == [(4, "SIGUSR1 on rank 0")]
    job.run(ckpt, out, *DDP)
    assert [r["resumed_from"] for r in read_runs(out)] == [None, None, 4, 4]
    assert_same(torch.load(ddp_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


@pytest.mark.parametrize("where", ["step", "validation"])
def test_sigterm_at_a_batch_a_validation_follows_or_during_the_validation_saves_the_next_step(
        job, tmp_path, single_reference, where):
    """D3: Lightning turns a SIGTERM into an exception at the end of the batch it came in, or of the validation batch,
    and a resume cannot start after a batch a validation follows (it would skip the validation): such a SIGTERM
    saved nothing newer than the last committed step. The SIGTERM is ours now, as SIGUSR1 is: the validation runs to
    its end, the next batch is saved, and the job exits 0 and resumes exactly."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    signal_at = ("--signal-in-step", 5) if where == "step" else ("--signal-in-validation", 6)  # validation after 6
    job.run(ckpt, out, "--interval", 4, *signal_at, "--signal", "SIGTERM")
    assert [(e["step"], e["reason"]) for e in preempted_events(ckpt)] == [(7, "SIGTERM")]
    assert not os.path.exists(os.path.join(out, "final.pt"))
    job.run(ckpt, out, "--interval", 4)
    assert [r["resumed_from"] for r in read_runs(out)] == [None, 7]
    assert_same(torch.load(single_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


@pytest.mark.parametrize("how", ["rank 1 alone", "the group, twice", "rank 0 in a validation"])
def test_ddp_sigterm_to_any_rank_or_repeated_saves_the_next_step_a_resume_can_start_after(
        job, tmp_path, ddp_reference, how):
    """Lightning's SIGTERM handler broadcasts rank 0's flag inside the signal handler, a collective its loops match
    once a batch: a SIGTERM to rank 1 alone, or a second one to every rank while they are apart, desynchronised
    the ranks' collectives (gloo's size mismatch, a hang), and one during a validation ended the fit at its first
    batch's end, where no resume can start. The SIGTERM is ours under DDP too: every rank agrees at
    the next batch a resume can start after (validation follows step 3: step 4), saves it and exits 0."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    sender = {"rank 1 alone": ("--signal-in-step", 2, "--signal-rank", 1),
              "the group, twice": ("--signal-in-step", 2, "--signal-group", "--signal-times", 2),
              "rank 0 in a validation": ("--signal-in-validation", 3)}[how]
    job.run(ckpt, out, *DDP, "--signal", "SIGTERM", *sender)
    rank = 1 if how == "rank 1 alone" else 0
    assert [(e["step"], e["reason"]) for e in preempted_events(ckpt)] == [(4, f"SIGTERM on rank {rank}")]
    assert not os.path.exists(os.path.join(out, "final.pt"))
    job.run(ckpt, out, *DDP)
    assert [r["resumed_from"] for r in read_runs(out)] == [None, None, 4, 4]
    assert_same(torch.load(ddp_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


TWO_FITS = """
import os, signal, sys, time
from lightning_ft import FaultTolerantCheckpoint
from lightning_ft.testing import fit
for run in ("a", "b"):
    fit([FaultTolerantCheckpoint(os.path.join(sys.argv[1], run), interval=4)], max_steps=5)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("the SIGTERM was swallowed")
"""


def test_a_sigterm_after_two_fits_in_one_process_ends_it(tmp_path):
    """Each fit's callback watches SIGTERM and Lightning puts its watcher back at the fit's end; the second chained
    the first, closed: a SIGTERM after both, with no handler of the user's, was swallowed."""
    proc = subprocess.run([sys.executable, "-c", TWO_FITS, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr


def test_a_sigterm_to_every_process_with_dataloader_workers_saves_the_next_step(job, tmp_path, single_reference):
    """README (Slurm): a SIGTERM to every process of the job ends the DataLoader workers too (PyTorch's own handler);
    at a batch a resume can start after the step is saved all the same, and the resume is exact."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    job.run(ckpt, out, "--interval", 4, "--workers", 2, "--signal-in-step", 2, "--signal", "SIGTERM", "--signal-group")
    assert [(e["step"], e["reason"]) for e in preempted_events(ckpt)] == [(3, "SIGTERM")]
    job.run(ckpt, out, "--interval", 4, "--workers", 2)
    assert [r["resumed_from"] for r in read_runs(out)] == [None, 3]
    assert_same(torch.load(single_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))
