"""Acceptance for plain DeepSpeed loops (``state={"engine": engine}``), ZeRO 1, 2 and 3 on 2 ranks, ZeRO 1 on 1.

Per configuration, two launches of ``ds_train.py`` under torchrun: an uninterrupted run that also runs
the checks (a save whose write is held back while training goes on restores its own step; a flipped
byte in an optimizer partition and a pickle payload in a DeepSpeed file each make the resume fall back
one step, and the payload never runs), and a run SIGKILLed twice (at a random step, seed
``FT_TEST_SEED``; then during a background write), restarted by torchrun each time, that must end
bit-exact with the uninterrupted one.
"""

from __future__ import annotations

import os
import random

import pytest

from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from tests.deepspeed.conftest import INTERVAL, SEED, STEPS, assert_bit_exact, final, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIGS = [pytest.param(zero, ranks, id=f"zero{zero}-{ranks}rank") for zero, ranks in ((1, 1), (1, 2), (2, 2), (3, 2))]
"""Every stage on 2 ranks, where its partitions are split; on 1 rank, stage 1 (2 and 3 on 1 rank hold their
state whole, like stage 1: they cost the suite 100 s on a loaded 2-core machine for no path of their own)."""


@pytest.mark.parametrize("zero,ranks", CONFIGS)
def test_a_delayed_write_restores_its_own_step_and_bad_files_fall_back(uninterrupted, zero, ranks):
    base, run = uninterrupted(zero, ranks)
    for rank in range(ranks):
        assert run.where(rank=rank, delayed_write_waited=True), f"the write was not held back\n{run.explain()}"
        checks = {r["check"]: r for r in run.where(rank=rank) if "check" in r}
        assert checks["snapshot"]["ok"], f"the delayed save did not hold the state of its own step: {checks}"
        assert checks["flipped"]["ok"], f"a flipped byte in an optimizer partition was not caught: {checks}"
        assert checks["forged"]["ok"] and checks["forged"]["payload_ran"] is False, f"pickle payload: {checks}"
    assert not os.path.exists(os.path.join(base, "out", "payload-ran")), "the pickle payload ran"


@pytest.mark.parametrize("zero,ranks", CONFIGS)
def test_sigkill_at_a_random_step_and_during_a_write_resumes_bit_exact(uninterrupted, zero, ranks, tmp_path):
    ref, _ = uninterrupted(zero, ranks)
    rng = random.Random(f"{SEED}-{zero}-{ranks}")
    first = rng.randint(5, STEPS - 3)                       # after maybe_save of this step (a save may be in flight)
    writing = first + 2 - first % 2                        # the next even step: a save of the second attempt
    kills = f"0:{ranks - 1}:{first}:batch_end,1:0:{writing}:writing"
    run = torchrun("ds_train.py", ranks, "--zero", zero, "--dir", tmp_path / "ckpt", "--out", tmp_path / "out",
                   "--steps", STEPS, "--interval", INTERVAL, "--kill", kills, out=tmp_path / "out", restarts=2)
    assert run.returncode == 0, run.explain()
    plan = f"seed {SEED}: killed after step {first}, then while writing step {writing}"
    assert run.where(killed=f"after step {first}") and run.where(killed=f"writing step {writing}"), run.explain()
    for rank in range(ranks):
        resumed = [r["resumed_from"] for r in run.where(rank=rank) if "resumed_from" in r]
        last_even = first - first % 2
        assert resumed[0] is None and resumed[1] in (last_even - INTERVAL, last_even), (plan, resumed)
        assert resumed[2] == writing - INTERVAL, (plan, resumed)  # the save killed mid-write never committed
        assert_bit_exact(final(str(tmp_path / "out"), rank), final(os.path.join(ref, "out"), rank), plan)
    assert layout.committed_steps(Storage(str(tmp_path / "ckpt")))[-1] == STEPS
