"""How a run ends (issue 22): a final save at a clean end, ``maybe_save(per_rank=...)``, and an end after an
exception that adds one line, not a traceback of ours, to the training's own."""

from __future__ import annotations

import logging

import pytest
import torch

from ft_checkpoint import CheckpointManager
from ft_checkpoint.format.layout import committed_steps
from ft_checkpoint.store.storage import Storage
from tests.helpers.toy import assert_same, make, train_step

TOTAL = 10


def train(url: str, **config) -> tuple[dict, int | None, int]:
    """The README's plain loop to step TOTAL (a save every 4 steps); returns the state, the step resumed
    from and how many steps this run trained."""
    state, trained = make(seed=0), 0
    with CheckpointManager(url, interval=4, announce=False, **config) as ckpt:
        start = ckpt.resume(state)
        for step in range((start or 0) + 1, TOTAL + 1):
            train_step(state)
            trained += 1
            ckpt.maybe_save(step, state)
    return state, start, trained


def test_a_clean_end_saves_the_last_step_and_a_restart_trains_no_step(tmp_path):
    """Before: the newest step was 8 of 10, and a restart of the finished job trained steps 9 and 10 again."""
    url = str(tmp_path / "ckpt")
    finished, _, trained = train(url)
    assert trained == TOTAL and committed_steps(Storage(url)) == [4, 8, 10]
    again, start, trained = train(url)
    assert (start, trained) == (TOTAL, 0)
    assert_same(again, finished)
    again, start, trained = train(url)  # the restart saved nothing new
    assert (start, trained) == (TOTAL, 0) and committed_steps(Storage(url)) == [4, 8, 10]


def test_the_final_save_can_be_turned_off(tmp_path, monkeypatch):
    train(str(tmp_path / "off"), final_save=False)
    assert committed_steps(Storage(str(tmp_path / "off"))) == [4, 8]
    monkeypatch.setenv("FT_CHECKPOINT_FINAL_SAVE", "0")
    train(str(tmp_path / "env"))
    assert committed_steps(Storage(str(tmp_path / "env"))) == [4, 8]
    monkeypatch.delenv("FT_CHECKPOINT_FINAL_SAVE")
    url = str(tmp_path / "close")
    ckpt = CheckpointManager(url, interval=4, announce=False)
    for step in range(1, 7):
        ckpt.maybe_save(step, {"step": step})
    ckpt.close(final=False)
    assert committed_steps(Storage(url)) == [4]


def test_no_final_save_after_an_exception(tmp_path):
    url = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="loss is nan"):
        with CheckpointManager(url, interval=4, announce=False) as ckpt:
            for step in range(1, 7):
                ckpt.maybe_save(step, {"step": step})
            raise ValueError("loss is nan")
    assert committed_steps(Storage(url)) == [4]


def test_maybe_save_takes_per_rank_as_save_and_resume_do(tmp_path):
    """nanoGPT keeps the batch it drew for the next iteration; before, ``maybe_save(per_rank=...)`` was a TypeError."""
    url = str(tmp_path / "ckpt")
    state, batch = make(seed=0), torch.randn(4, 16)
    with CheckpointManager(url, interval=2, announce=False) as ckpt:
        for step in (1, 2):
            train_step(state)
            batch = torch.randn(4, 16)  # drawn at the end of the iteration, trained on in the next one
            ckpt.maybe_save(step, state, per_rank={"batch": batch})
    mine = {"batch": torch.zeros(4, 16)}
    with CheckpointManager(url, announce=False) as ckpt:
        assert ckpt.resume(make(seed=1), per_rank=mine) == 2
    assert torch.equal(mine["batch"], batch)


@pytest.mark.parametrize(("fast", "resumes"), [
    (False, "a restart resumes from step 2, the newest committed"),
    (True, "a restart resumes from step 3, the fast tier's newest (from step 2 where its copies are lost)")])
def test_an_exception_that_says_a_peer_is_gone_ends_in_one_line(tmp_path, caplog, fast, resumes):
    """The training's error is what a rank sees when another rank died inside a gloo collective. The real
    case, with a rank SIGKILLed under ``accelerate launch``, is tests/accelerate/test_launch.py. With a fast tier
    (every step), the line named the durable tier's step 2 while a restart resumes the fast tier's step 3."""
    url = str(tmp_path / "ckpt")
    tier = {"fast_dirpath": str(tmp_path / "shm"), "fast_interval": 1} if fast else {}
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:53893: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    caplog.set_level(logging.INFO, logger="ft_checkpoint")
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        with CheckpointManager(url, interval=2, announce=False, **tier) as ckpt:
            for step in range(1, 4):
                ckpt.maybe_save(step, {"w": torch.full((3,), float(step))})
            ckpt.wait()
            raise gloo
    ours = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in ours] == [
        "rank 0 stops: a peer rank is gone (RuntimeError: Read error [127.0.0.1]:53893: Connection reset by peer); "
        f"{resumes}"]
    assert all(r.exc_info is None for r in caplog.records)
