"""Acceptance 1: SIGKILL a real training job at random steps, restart it each time: the final state is
bit-identical to an uninterrupted run. Single process, and DDP with 2 CPU ranks (gloo).

The step of each kill is drawn at random (seed ``FT_TEST_SEED``, default 7, shown on failure) from
windows that make sure every kind of moment is hit: mid-epoch between saves, just after a save
started (its write in flight), while a save's data is written but not committed, across an epoch end,
and after a resume. Each restart resumes from whatever the previous kill left committed.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from ft_checkpoint import read_journal
from ft_checkpoint.store.storage import Storage
from lightning_ft.testing import assert_same

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SEED = int(os.environ.get("FT_TEST_SEED", "7"))


def kill_plan(rng: random.Random, interval: int, batches: int, epochs: int) -> list[tuple[int, str]]:
    """Five (step, how) kills in increasing steps; see the module docstring."""
    saves = [s for s in range(interval, batches * epochs, interval) if s % batches]  # not deferred ones
    first = rng.randint(1, saves[0] + interval - 1)                                # mid-epoch, early
    after_save = min(s for s in saves if s > first)                                # a save just started
    writing = min(s for s in saves if s > after_save)                              # killed mid-write
    crossing = rng.randint(max(writing + 1, batches + 1), 2 * batches - 1)         # in epoch 1
    late = rng.randint(max(crossing + 1, 2 * batches + 1), batches * epochs - 1)   # in the last epoch
    return [(first, "batch_end"), (after_save, "batch_end"), (writing, "writing"), (crossing, "batch_end"),
            (late, "batch_end")]


def read_runs(out: str) -> list[dict]:
    with open(os.path.join(out, "runs.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_resumes(plan: list[tuple[int, str]], resumed: list[int | None]) -> None:
    """Each start resumed from a step no later than the previous kill, never going back; most resumed."""
    steps = [-1 if r is None else r for r in resumed]
    assert len(resumed) == len(plan) + 1 and resumed[0] is None, (SEED, plan, resumed)
    assert steps == sorted(steps) and sum(r is not None for r in resumed) >= 3, (SEED, plan, resumed)
    assert all(r <= killed_at for (killed_at, _), r in zip(plan, steps[1:])), (SEED, plan, resumed)


def kill_and_resume(job, tmp_path, plan, *args) -> str:
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    for step, how in plan:
        job.run(ckpt, out, *args, "--kill-at", step, "--kill-how", how, killed=True)
    job.run(ckpt, out, *args)
    return out


def test_single_process_sigkill_resume_is_bit_exact(job, tmp_path, single_reference):
    plan = kill_plan(random.Random(SEED), interval=4, batches=12, epochs=3)
    out = kill_and_resume(job, tmp_path, plan, "--interval", 4)
    check_resumes(plan, [r["resumed_from"] for r in read_runs(out)])
    assert_same(torch.load(single_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


def test_callback_does_not_change_training(job, tmp_path, single_reference):
    job.run(str(tmp_path / "unused"), str(tmp_path / "out"), "--no-callback")
    plain = torch.load(tmp_path / "out" / "final.pt", weights_only=False)
    assert_same(torch.load(single_reference, weights_only=False), plain)


def test_ddp_two_ranks_sigkill_resume_is_bit_exact(job, tmp_path):
    args = ("--devices", 2, "--interval", 2)
    job.run(str(tmp_path / "ref-ckpt"), str(tmp_path / "ref"), *args)
    plan = kill_plan(random.Random(SEED), interval=2, batches=6, epochs=3)
    out = kill_and_resume(job, tmp_path, plan, *args)
    runs = read_runs(out)
    by_attempt = [runs[i:i + 2] for i in range(0, len(runs), 2)]
    for pair in by_attempt:
        assert {r["rank"] for r in pair} == {0, 1} and pair[0]["resumed_from"] == pair[1]["resumed_from"], runs
    check_resumes(plan, [pair[0]["resumed_from"] for pair in by_attempt])
    assert_same(torch.load(tmp_path / "ref" / "final.pt", weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


def test_sigterm_after_a_batch_saves_the_next_and_is_no_exception(job, tmp_path, single_reference):
    """A preemption notice (SIGTERM) to the whole job between saves, after every hook of step 10's batch: the next
    batch is saved and resumed from (Lightning's loops raised at the end of step 10's batch before, and only
    ``save_on_exception`` saved it)."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    job.run(ckpt, out, "--interval", 4, "--sigterm-at", 10, "--save-on-exception")
    assert [(e["step"], e["reason"]) for e in read_journal(Storage(ckpt)) if e["event"] == "preempted"] == [
        (11, "SIGTERM")]
    job.run(ckpt, out, "--interval", 4)
    assert [r["resumed_from"] for r in read_runs(out)] == [None, 11]
    assert_same(torch.load(single_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


def test_a_crash_resumes_from_the_fast_tier_without_the_durable_tier_bit_exact(job, tmp_path, single_reference):
    """The fast tier (a folder of this "node") holds every step; the durable tier every 4th, and refuses to be read.
    (A kill at step 6 comes before that step's save: step 5 is the newest.)"""
    ckpt, out, fast = f"faulty://{tmp_path}/ckpt", str(tmp_path / "out"), tmp_path / "fast"
    args = ("--interval", 4, "--storage-options", json.dumps({"refuse_reads": ["*.distcp", "rank_*.pt", "metadata.json"]}))
    env = {"FT_CHECKPOINT_FAST_DIRPATH": str(fast), "FT_CHECKPOINT_FAST_INTERVAL": "1"}
    job.run(ckpt, out, *args, "--kill-at", 6, "--kill-after-commit", killed=True, env=env)
    job.run(ckpt, out, *args, env=env)
    last = read_runs(out)[-1]
    assert (last["resumed_from"], last["source"]) == (5, "fast tier, own node")
    assert_same(torch.load(single_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))
    assert os.listdir(fast) == [], "a clean end cleans the run's fast tier"
