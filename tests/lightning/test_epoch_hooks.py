"""A resume inside an epoch, with a schedule that epoch-level hooks drive: Lightning calls no
``on_train_epoch_start`` in the resumed epoch (the interrupted process did) and steps no ``ReduceLROnPlateau`` at
its end (its fit loop is still ``restarting``), and a fit that stopped early inside an epoch keeps that epoch's batch
count. Each case is SIGKILLed twice (epoch 0 and a later epoch, after a save committed), restarted, and compared
with an uninterrupted run without the callback: every batch (step, learning rate, inputs) and the final state.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from ft_checkpoint.testing import jobs
from lightning_ft.testing import assert_same

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "epoch_hooks_script.py")


def train(tmp_path, name: str, *args, killed: bool = False) -> str:
    out = str(tmp_path / name)
    job = jobs.run(SCRIPT, str(tmp_path / f"ckpt-{name.split('-')[0]}"), out, *args, new_session=True, timeout=300,
                   env={"PYTHONWARNINGS": "ignore"})
    return job.expect(-9 if killed else 0).output


def batches(out: str) -> dict[int, dict]:
    """Each step's batch; a step trained again after a resume replaces the killed attempt's."""
    with open(os.path.join(out, "batches.jsonl")) as f:
        return {row["step"]: row for row in map(json.loads, f)}


@pytest.mark.parametrize(("pattern", "kills"), [("plateau", (7, 22)), ("swa", (7, 31)), ("module_hooks", (8, 23)),
                                                  ("finetuning", (8, 23))])
def test_a_resume_inside_an_epoch_keeps_its_epoch_level_schedule_exact(tmp_path, pattern, kills):
    """``plateau``: the resumed epochs' plateau steps were skipped (learning rate 0.05 where the uninterrupted run
    had halved it); ``swa``: the resumed epoch ran without its SWALR scheduler (its annealing step lost);
    ``module_hooks``: what the LightningModule's ``on_train_batch_end`` did at a saved step (an EMA update, a random
    draw, a weight decay by hand) was missing from the save: Lightning calls it after every callback's hook;
    ``finetuning``: a resume after BackboneFinetuning's unfreeze epoch left the backbone frozen to the end (its
    optimizer param group restored, its parameters never trained)."""
    train(tmp_path, "ref", "--pattern", pattern, "--no-callback")
    train(tmp_path, "out", "--pattern", pattern, "--kill-at", kills[0], killed=True)
    output = train(tmp_path, "out", "--pattern", pattern, "--kill-at", kills[1], killed=True)  # resumes in epoch 0
    train(tmp_path, "out", "--pattern", pattern)
    ref, got = batches(str(tmp_path / "ref")), batches(str(tmp_path / "out"))
    wrong = [step for step in sorted(ref) if ref[step] != got.get(step)]
    assert not wrong, f"{len(wrong)} batches differ, first at step {wrong[0]}: {got.get(wrong[0])} != {ref[wrong[0]]}"
    assert_same(torch.load(str(tmp_path / "ref" / "final.pt"), weights_only=False),
                torch.load(str(tmp_path / "out" / "final.pt"), weights_only=False))
    if pattern == "plateau":  # train_loss is logged on_epoch too: the resumed epoch's mean covers fewer batches
        assert "the epoch-level training metrics train_loss of epoch 0 are aggregated over the batches since the " \
               "resume only" in " ".join(output.split())


def test_a_restart_of_a_fit_that_stopped_early_inside_an_epoch_skips_no_batch_of_the_next(tmp_path):
    """EarlyStopping ended the fit inside an epoch; the epoch counter moved on while the batch counter kept the
    stopped epoch's count, and a restart of the finished job skipped as many batches of the next epoch, never
    trained on. It decides again from the first batch of the next epoch (as Lightning's own ``ckpt_path`` resume)."""
    train(tmp_path, "out", "--pattern", "early_stop")
    first = batches(str(tmp_path / "out"))
    last = first[max(first)]
    assert last["batch_idx"] < 11, "the fit stopped inside an epoch"
    output = train(tmp_path, "out", "--pattern", "early_stop")
    assert f"(epoch {last['epoch'] + 1}, 0 batches of it done;" in output
    restarted = batches(str(tmp_path / "out"))[last["step"] + 1]
    assert (restarted["epoch"], restarted["batch_idx"]) == (last["epoch"] + 1, 0)


def test_torchmetrics_accumulated_over_a_resumed_epoch_are_exact(tmp_path):
    """A ``torchmetrics`` metric updated in ``training_step`` and computed at the epoch's end (by hand, monitored by
    ``ReduceLROnPlateau``; and one logged as an object with ``on_epoch=True``): its running state lives in the metric
    (non-persistent buffers, in no checkpoint), so the resumed epoch's value covered the batches since the resume
    only, and the plateau decided otherwise, with no warning. The callback saves and restores each metric's state."""
    train(tmp_path, "ref", "--pattern", "torchmetrics", "--no-callback")
    train(tmp_path, "out", "--pattern", "torchmetrics", "--kill-at", 7, killed=True)
    output = train(tmp_path, "out", "--pattern", "torchmetrics", "--kill-at", 22, killed=True)
    train(tmp_path, "out", "--pattern", "torchmetrics")
    with open(tmp_path / "ref" / "metrics.jsonl") as f:
        want = [json.loads(line) for line in f]
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        got = [json.loads(line) for line in f]
    assert got == want, f"the epochs' metric values differ: {got} != {want}"
    ref, out = batches(str(tmp_path / "ref")), batches(str(tmp_path / "out"))
    assert all(ref[step] == out.get(step) for step in ref), "the batches or learning rates differ"
    assert_same(torch.load(str(tmp_path / "ref" / "final.pt"), weights_only=False),
                torch.load(str(tmp_path / "out" / "final.pt"), weights_only=False))
    assert "aggregated over the batches since the resume only" not in " ".join(output.split())
