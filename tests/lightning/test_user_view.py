"""Issue 14, "what the user sees": the resume, the checkpoint directory and when the first save is due are
shown where Lightning's own messages go (they show with no logging configured), and
``Trainer(enable_checkpointing=False)`` takes the callback.
"""

from __future__ import annotations

import re

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_ft import FaultTolerantCheckpoint
from lightning_ft.testing import fit
from tests.lightning.test_kill_resume import read_runs

pytestmark = pytest.mark.slow


def test_resume_and_checkpoint_dir_are_shown_by_default(job, tmp_path):
    ckpt, out = tmp_path / "ckpt", str(tmp_path / "out")
    args = ("--interval", 4, "--epochs", 1)
    first = job.run(str(ckpt), out, *args, "--kill-at", 6, "--kill-after-commit", killed=True)
    second = job.run(str(ckpt), out, *args, env={"PYTHONWARNINGS": "default"})
    assert [r["resumed_from"] for r in read_runs(out)] == [None, 4]
    assert f"FaultTolerantCheckpoint: checkpoints go to {ckpt}" in first, first[-3000:]
    assert f"FaultTolerantCheckpoint: no checkpoint in {ckpt} yet: starting fresh; first save at step 4 " \
           "(every 4 steps)" in first, first[-3000:]
    assert f"FaultTolerantCheckpoint: checkpoints go to {ckpt}" in second, second[-3000:]
    assert re.search(r"FaultTolerantCheckpoint: resuming from step 4 \(epoch 0, 4 batches of it done; [\d.]+ kB "
                     r"verified and loaded in [\d.]+ m?s\); next save at step 8 \(every 4 steps\)", second), second[-3000:]
    assert "saved by" not in second  # the world size did not change: no warning


def test_adaptive_interval_says_when_the_first_save_is_due_and_that_none_came(job, tmp_path):
    output = job.run(str(tmp_path / "ckpt"), str(tmp_path / "out"), "--interval", "adaptive", "--epochs", 1,
                     env={"FT_CHECKPOINT_FINAL_SAVE": "0"})  # a clean end saves otherwise (issue 22)
    # one process, no history: the prior MTBF is years, so the first save is due at FIRST_SAVE_BY (30 min)
    assert "; first save due in about 30 min (adaptive interval, planned for a save cost of 1 min (a guess until " \
           "a save measures it)" in output, output[-3000:]
    assert "a run that fails sooner has nothing to resume from" in output, output[-3000:]
    assert "FaultTolerantCheckpoint: this fit saved no checkpoint in its " in output, output[-3000:]
    assert f"there is no checkpoint in {tmp_path / 'ckpt'}" in output, output[-3000:]
    output = job.run(str(tmp_path / "ckpt"), str(tmp_path / "out"), "--interval", "adaptive", "--epochs", 1)
    assert "this fit saved no checkpoint" not in output and "resuming from" not in output  # saved at its end


def test_enable_checkpointing_false_takes_the_callback_alone(tmp_path):
    cb = FaultTolerantCheckpoint(str(tmp_path / "ckpt"), interval=4)
    _, _, trainer, _ = fit([cb], max_steps=5, enable_checkpointing=False)
    assert [s.step for s in cb.saves] == [4, 5]  # step 5: the final save of a clean end
    assert not [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]  # Lightning added none


def test_enable_checkpointing_false_still_refuses_a_model_checkpoint(tmp_path):
    cbs = [FaultTolerantCheckpoint(str(tmp_path / "ckpt")), ModelCheckpoint(dirpath=tmp_path / "mc")]
    with pytest.raises(MisconfigurationException, match="enable_checkpointing=False"):
        fit(cbs, max_steps=1, enable_checkpointing=False)
