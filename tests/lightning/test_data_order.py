"""Issue 14, point 1: seeded shuffling survives a SIGKILL: the same batches, step by step, and the same weights.

Each case trains ``train_script.py`` with one way of making the shuffle reproducible (``models.LOADERS``),
SIGKILLs the job twice (once in epoch 0, once in epoch 1, each time after a save committed), restarts it,
and compares every training batch (sample indices and a hash of the input, augmentation included) and
the final state with an uninterrupted run without the callback. Single process, and DDP on 2 CPU
ranks, where Lightning replaces the sampler with a ``DistributedSampler`` (seeded from
``seed_everything``) and keeps the loader's generator for the workers' seeds.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_ft.testing import assert_same
from tests.lightning.test_kill_resume import read_runs

pytestmark = pytest.mark.slow


def read_batches(out: str, rank: int) -> dict[int, dict]:
    """Each step's batch on ``rank``; a step trained again after a resume replaces the killed attempt's."""
    with open(os.path.join(out, f"batches.rank{rank}.jsonl")) as f:
        return {row["step"]: row for row in map(json.loads, f)}


def assert_same_batches(reference: str, out: str, ranks: int) -> None:
    for rank in range(ranks):
        ref, got = read_batches(reference, rank), read_batches(out, rank)
        assert sorted(ref) == sorted(got), f"rank {rank}: steps {sorted(set(ref) ^ set(got))} differ"
        wrong = [step for step in sorted(ref) if ref[step] != got[step]]
        assert not wrong, f"rank {rank}: {len(wrong)} batches differ, first at step {wrong[0]}: " \
                          f"{got[wrong[0]]} != {ref[wrong[0]]} (uninterrupted)"


def kill_twice_and_finish(job, tmp_path, kills: tuple[int, int], args: tuple, restart_args: tuple = ()) -> str:
    """Run with ``args``, SIGKILL after each step of ``kills`` (its save committed), then run to the end."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    job.run(ckpt, out, *args, "--kill-at", kills[0], "--kill-after-commit", killed=True)
    job.run(ckpt, out, *args, *restart_args, "--kill-at", kills[1], "--kill-after-commit", killed=True)
    job.run(ckpt, out, *args, *restart_args)
    return out


def reference_run(job, tmp_path, args: tuple) -> str:
    ref = str(tmp_path / "ref")
    job.run(str(tmp_path / "unused"), ref, *args, "--no-callback")
    return ref


SINGLE = {  # the loader's generator without workers: a part of the case with workers (it also seeds them)
    "sampler_generator": ("--loader", "sampler_generator"),
    "loader_generator_workers_augment": ("--loader", "generator", "--workers", 2, "--augment"),
    "shuffle_workers_augment": ("--loader", "shuffle", "--workers", 2, "--augment"),
}


@pytest.mark.parametrize("case", list(SINGLE))
def test_single_process_seeded_shuffle_resumes_exactly_in_epoch_0_and_later(job, tmp_path, case):
    args = ("--interval", 4, *SINGLE[case])  # 12 batches per epoch; saves at 4, 8, 13 (12 ends the epoch), ...
    out = kill_twice_and_finish(job, tmp_path, (7, 22), args)
    assert [r["resumed_from"] for r in read_runs(out)] == [None, 4, 20]  # epoch 0 (batch 4), epoch 1 (batch 8)
    ref = reference_run(job, tmp_path, args)
    assert_same_batches(ref, out, ranks=1)
    assert_same(torch.load(os.path.join(ref, "final.pt"), weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))


DDP = {
    # the loader's generator seeds the workers; a restart with another seed_everything seed must not change
    # the DistributedSampler's seed (the checkpoint's order wins)
    "loader_generator_workers_augment_new_seed": (("--loader", "generator", "--workers", 2, "--augment"),
                                                  ("--seed", 1)),
    # Lightning wraps a custom sampler with its own generator in a DistributedSamplerWrapper (a RandomSampler
    # it replaces by a DistributedSampler, dropping its generator)
    "weighted_generator": (("--loader", "weighted_generator"), ()),
    # shuffle from the global RNG, workers, randomness in __getitem__: reported exact already; confirmed here
    "shuffle_workers_augment": (("--loader", "shuffle", "--workers", 2, "--augment"), ()),
}


@pytest.mark.parametrize("case", list(DDP))
def test_ddp_seeded_shuffle_resumes_exactly_in_epoch_0_and_later(job, tmp_path, case):
    loader_args, restart_args = DDP[case]
    args = ("--devices", 2, "--interval", 2, *loader_args)  # 6 batches per rank and epoch; saves at 2, 4, 7, ...
    out = kill_twice_and_finish(job, tmp_path, (5, 11), args, restart_args)
    assert [r["resumed_from"] for r in read_runs(out)][::2] == [None, 4, 10]  # epoch 0 (batch 4), epoch 1 (batch 4)
    ref = reference_run(job, tmp_path, args)
    assert_same_batches(ref, out, ranks=2)
    assert_same(torch.load(os.path.join(ref, "final.pt"), weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))
