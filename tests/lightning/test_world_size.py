"""Issue 14, point 7: a DDP run restarted on another number of ranks resumes, and says what is not exact.

The model, optimizer, scheduler and step counters load on any world size (DCP reshards), but the
position inside the resumed epoch cannot: a ``DistributedSampler`` splits the data by rank count.
"""

from __future__ import annotations

import os

import pytest

from tests.lightning.test_kill_resume import read_runs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WARNING = "FaultTolerantCheckpoint: resuming from step 4, saved by 2 ranks, on 1 rank."


def test_ddp_two_ranks_restarted_on_one_warns_what_is_not_exact(job, tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    args = ("--interval", 2, "--loader", "generator", "--epochs", 2)
    job.run(ckpt, out, *args, "--devices", 2, "--kill-at", 5, "--kill-after-commit", killed=True)
    output = job.run(ckpt, out, *args, "--devices", 1, env={"PYTHONWARNINGS": "default"})
    assert [r["resumed_from"] for r in read_runs(out)] == [None, None, 4]
    assert WARNING in output, output[-3000:]
    message = output[output.index(WARNING):]
    for part in ("Exact: the model, optimizer and LR scheduler states, the step and epoch counters",
                 "Not exact: the data of epoch 0", "HINT: restart on 2 ranks"):
        assert part in message, message[:1500]
    assert os.path.exists(os.path.join(out, "final.pt"))  # it trained to the end

