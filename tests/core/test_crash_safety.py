"""SIGKILL a saving process at random moments: resume always finds a committed, bit-exact step."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.format.layout import list_steps
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.testing import jobs
from ft_checkpoint.tools.catalog import check_step
from tests.helpers.crash_child import expected_state
from tests.helpers.toy import assert_same

pytestmark = pytest.mark.slow

CHILD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "crash_child.py")

# (how the kill is aimed, number of trials): 24 trials in all.
PLAN = [("random", 8), ("writing", 8), ("data_written", 8)]


def run_until_killed(url: str, aim: str, rng: random.Random) -> list[str]:
    """Start the child, kill it with SIGKILL at the aimed moment, return what it printed."""
    pause = "data_written" if aim == "data_written" else None
    proc = jobs.start(CHILD, url, *([pause] if pause else []))
    lines = []
    try:
        deadline = time.monotonic() + 120
        kill_at = None
        saves_to_skip = rng.randint(0, 3)
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if aim == "random" and line.startswith("RESUMED"):
                kill_at = time.monotonic() + rng.uniform(0.0, 1.5)
            if aim != "random" and line.startswith(f"PHASE {aim} "):
                if saves_to_skip == 0:
                    time.sleep(rng.uniform(0.0, 0.02 if aim == "writing" else 0.2))
                    break
                saves_to_skip -= 1
            if kill_at is not None and time.monotonic() >= kill_at:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert any(line.startswith("RESUMED") for line in lines), lines[:5]
    return lines


def check_directory(url: str) -> int | None:
    """Every committed step verifies; resume loads the newest bit-exact. Returns its step."""
    storage = Storage(url)
    for step, committed in list_steps(storage).items():
        if committed:
            assert check_step(storage, step).ok, check_step(storage, step).problems  # every file named is intact
    state = expected_state(0)
    with CheckpointManager(url) as ckpt:
        step = ckpt.resume(state)
    if step is not None:
        assert_same(state, expected_state(step))
    return step


@pytest.mark.parametrize("aim,trials", PLAN)
def test_sigkill_never_leaves_a_broken_commit(tmp_path, aim, trials):
    url = str(tmp_path / "ckpt")
    rng = random.Random(f"{aim}-{trials}")
    resumed = []
    for _ in range(trials):
        lines = run_until_killed(url, aim, rng)
        step = check_directory(url)
        resumed.append(step)
        started = int(next(line for line in lines if line.startswith("RESUMED")).split()[1])
        assert step is None or step >= started, "a commit was lost"
        if aim == "data_written":
            killed_step = int(next(line for line in reversed(lines) if line.startswith("PHASE data_written")).split()[2])
            assert step != killed_step, "a step with data but no manifest was taken as committed"
    assert resumed[-1] is not None and resumed[-1] > 0, f"no progress across kills: {resumed}"
