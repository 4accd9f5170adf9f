"""Lightning ``strategy=DeepSpeedStrategy(stage=...)`` on 2 CPU ranks with FaultTolerantCheckpoint: the job is
SIGKILLed mid-epoch (every rank at once, at a step drawn with ``FT_TEST_SEED``), started again, resumes by
itself and ends bit-exact with an uninterrupted run: engine state, schedule, next random numbers, and the
same batches step by step. Lightning refuses DeepSpeed on CPU; ``lightning_cpu.py`` bypasses that here only."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import random

import pytest
import torch

from ft_checkpoint.testing import jobs
from tests.deepspeed.conftest import ENV, SEED, TIMEOUT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

pytest.importorskip("lightning")
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_train.py")


def job(tmp_path, name: str, stage: int, *args, killed: bool = False, env: dict[str, str] | None = None) -> None:
    jobs.run(SCRIPT, tmp_path / f"{name}-ckpt", tmp_path / name, "--stage", stage, *args, new_session=True,
             env={**ENV, "PYTHONWARNINGS": "ignore", **(env or {})}, timeout=TIMEOUT).expect(-9 if killed else 0)


def batches(out, rank: int) -> dict[int, list[int]]:
    """Step -> sample indices of the batch trained at that step (a resumed attempt's lines replace the killed one's)."""
    with open(out / f"batches.rank{rank}.jsonl") as f:
        return {row["step"]: row["idx"] for row in map(json.loads, f)}


def test_the_cpu_bypass_still_matches_lightning():
    """``lightning_cpu.py`` replaces these; if Lightning changes them, the bypass (tests only) must change too."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
    from lightning.pytorch.strategies import deepspeed as lightning_deepspeed

    from tests.deepspeed.lightning_cpu import CUDA_CHECK

    setup_environment = inspect.getsource(DeepSpeedStrategy.setup_environment)
    assert CUDA_CHECK in setup_environment and "super().setup_environment()" in setup_environment, \
        "tests/deepspeed/lightning_cpu.py: DeepSpeedStrategy.setup_environment changed"
    assert DeepSpeedStrategy.__mro__[1] is DDPStrategy, "tests/deepspeed/lightning_cpu.py: the base class changed"
    assert "_validate_device_index_selection(self.parallel_devices)" in inspect.getsource(
        DeepSpeedStrategy.setup_distributed), "tests/deepspeed/lightning_cpu.py: setup_distributed changed"
    assert list(inspect.signature(lightning_deepspeed._validate_device_index_selection).parameters) == \
        ["parallel_devices"], "tests/deepspeed/lightning_cpu.py: _validate_device_index_selection changed"
    assert "parallel_devices" in inspect.signature(DeepSpeedStrategy).parameters


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of each stage (its output folder), run once for the tests that compare with it."""
    runs: dict[int, pathlib.Path] = {}

    def run(stage: int) -> pathlib.Path:
        if stage not in runs:
            root = tmp_path_factory.mktemp(f"reference-stage{stage}")
            job(root, "ref", stage)
            runs[stage] = root / "ref"
        return runs[stage]
    return run


@pytest.mark.parametrize("stage,fast", [(2, False), (3, False), (2, True)],  # stage 1 saves as 2: see test_plain.py
                         ids=["stage2", "stage3", "stage2-fast-tier"])
def test_deepspeed_strategy_killed_mid_epoch_resumes_bit_exact(tmp_path, reference, stage, fast):
    """With ``fast``: a fast tier saved at every step (the durable tier every 3): the resume takes the killed step
    from it."""
    kill_at = random.Random(f"{SEED}-lightning-{stage}").randint(8, 15)  # epoch 1 of 6 steps per epoch
    env = {"FT_CHECKPOINT_FAST_DIRPATH": str(tmp_path / "fast"), "FT_CHECKPOINT_FAST_INTERVAL": "1"} if fast else {}
    ref = reference(stage)
    job(tmp_path, "out", stage, "--kill-at", kill_at, killed=True, env=env)
    job(tmp_path, "out", stage, env=env)
    with open(tmp_path / "out" / "runs.jsonl") as f:
        runs = [json.loads(line) for line in f]
    resumed = [r["resumed_from"] for r in runs if r["resumed_from"] is not None]
    assert len(runs) == 4 and len(resumed) == 2 and len(set(resumed)) == 1, (kill_at, runs)
    assert 0 < resumed[0] <= kill_at, (kill_at, runs)
    if fast:
        sources = {r["source"] for r in runs if r["resumed_from"] is not None}
        assert resumed[0] > kill_at - 3 and sources == {"fast tier, own node"}, (kill_at, runs)
    for rank in (0, 1):
        got = torch.load(tmp_path / "out" / f"final.rank{rank}.pt", weights_only=True)
        want = torch.load(ref / f"final.rank{rank}.pt", weights_only=True)
        assert set(got) == set(want)
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), f"seed {SEED}, killed after step {kill_at}: rank {rank} {key} differs"
        assert batches(tmp_path / "out", rank) == batches(ref, rank), "other batches after the resume"
