"""Accelerate's DeepSpeed plugin: ``accelerate launch --use_deepspeed --zero_stage {2,3} --num_processes 2
--max_restarts 1`` on CPU, rank 1 SIGKILLed mid-epoch in the first attempt; the restarted group resumes
and ends bit-exact with an uninterrupted run (engine state, schedule, next random numbers, samples)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.testing import jobs
from tests.deepspeed.conftest import ENV, TIMEOUT, Run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

pytest.importorskip("accelerate")
if importlib.util.find_spec("transformers") is None:  # Accelerate's DeepSpeed plugin imports it
    pytest.skip("transformers is not installed", allow_module_level=True)
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_train.py")
KILL_AT = 17  # epoch 1 of 6 steps per epoch and rank; saves every 3 steps


def launch(zero: int, out, *args: str, tmp_path) -> Run:
    return jobs.run(SCRIPT, out, *args, out=out, launcher="accelerate", nproc=2, restarts=1, timeout=TIMEOUT,
                    launcher_args=["--use_deepspeed", "--zero_stage", str(zero)],
                    env={**ENV, "HF_HOME": str(tmp_path / "hf_home"), "FT_TEST_TRANSFORMERS": "1"})


@pytest.mark.parametrize("zero", [2, 3])
def test_a_killed_rank_is_restarted_by_accelerate_launch_and_ends_bit_exact(zero, tmp_path):
    ref = launch(zero, tmp_path / "ref", "--dirpath", str(tmp_path / "ref_ckpt"), tmp_path=tmp_path)
    assert ref.returncode == 0, ref.explain()
    run = launch(zero, tmp_path / "out", "--dirpath", str(tmp_path / "ckpt"), "--kill-at", str(KILL_AT),
                 tmp_path=tmp_path)
    assert run.returncode == 0, run.explain()
    assert run.where(rank=1, killed=KILL_AT), run.explain()
    for rank in (0, 1):
        starts = [r for r in run.where(rank=rank) if "resumed_from" in r]
        assert starts[0]["engine"] == "DeepSpeedEngine" and starts[0]["resumed_from"] is None, starts
        assert starts[-1]["attempt"] == 1 and 0 < starts[-1]["resumed_from"] < KILL_AT, starts
        got = torch.load(tmp_path / "out" / f"final_rank{rank}.pt", weights_only=True)
        want = torch.load(tmp_path / "ref" / f"final_rank{rank}.pt", weights_only=True)
        assert got["global_step"] == want["global_step"] and got["lr"] == want["lr"]
        assert set(got["fingerprint"]) == set(want["fingerprint"])
        for key, tensor in want["fingerprint"].items():
            assert torch.equal(got["fingerprint"][key], tensor), f"rank {rank}: {key} differs from the reference"
        assert torch.equal(got["probe"], want["probe"]), "the next random numbers differ"
        n = len(got["seen"])
        assert got["seen"] == want["seen"][-n:], "the resumed run trained on other samples or in another order"
    storage = Storage(str(tmp_path / "ckpt"))
    manifest = layout.read_manifest(storage, layout.committed_steps(storage)[-1])
    assert manifest.metadata["model"]["zero_stage"] == zero and manifest.metadata["model"]["dp_world_size"] == 2
