"""Exact resume of the patterns real Accelerate scripts use (issue 14), each killed with SIGKILL and restarted.

Each test runs ``train_script.py`` with one pattern, kills it mid-run, restarts it until it finishes,
and compares the final weights, buffers, optimizer state, schedule, next random numbers and every
batch trained on after the resume (indices and inputs) with an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from ft_checkpoint import read_journal
from ft_checkpoint.format import layout
from ft_checkpoint.policies.adaptive.failures import count_failures
from ft_checkpoint.run.journal import attempt_summaries
from ft_checkpoint.run.lease import LEASE
from ft_checkpoint.store.storage import Storage
from tests.accelerate.conftest import STEPS, assert_bit_identical, final, launch, run_script
from tests.accelerate.test_launch import run_pair
from tests.accelerate.test_resume import INTERVAL, assert_skipped_not_loaded, run_until_done

pytestmark = pytest.mark.slow

SYNC_SAVES = {"FT_CHECKPOINT_ASYNC_SAVE": "0"}  # the step saved before a kill is committed: resume lands on it


def manifest(ckpt: str, step: int) -> dict:
    with open(os.path.join(ckpt, layout.step_dir(step), layout.MANIFEST)) as f:
        return json.load(f)


@pytest.mark.parametrize("workers", [0, 2])
def test_random_augmentation_in_getitem_resumes_exactly(tmp_path, reference, workers):
    """Point 2: ``__getitem__`` draws from torch's, Python's and NumPy's RNGs, in the main process (the
    prepared loader has already fetched the next batch when a save happens) or in 2 workers."""
    args = ["--augment", "--workers", str(workers)]
    out = str(tmp_path / "out")
    attempts = run_until_done(out, str(tmp_path / "ckpt"), [10, 33, 50], *args)

    assert attempts[-1].resumed_from() is not None
    assert_bit_identical(final(out), reference("--interval", INTERVAL, *args))
    if workers == 0:
        assert_skipped_not_loaded(attempts[-1])
    assert "ft-checkpoint: resuming from step" in attempts[-1].stderr, attempts[-1].explain()


def test_resume_on_an_epoch_end_keeps_the_next_epochs_shuffle(tmp_path, reference):
    """Point 3, one process: the shuffle comes from ``DataLoader(generator=...)``; the resume lands on the
    save after the last batch of epoch 0, so the next epoch must draw its order after epoch 0's."""
    args = ["--loader-generator"]
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    first = run_script(out, "--dirpath", ckpt, "--interval", INTERVAL, "--kill-at", "26", *args, env=SYNC_SAVES)
    assert first.returncode == -9, first.explain()
    per_epoch = STEPS // 3
    assert manifest(ckpt, per_epoch)["metadata"] == {"epoch": 0, "batches_done": per_epoch}
    second = run_script(out, "--dirpath", ckpt, "--interval", INTERVAL, *args)
    assert second.returncode == 0, second.explain()

    assert second.resumed_from() == per_epoch, second.explain()
    assert second.summary()["ran"] == STEPS - per_epoch
    assert_bit_identical(final(out), reference("--interval", INTERVAL, *args))


def test_two_ranks_resume_on_an_epoch_end_keeps_the_next_epochs_shuffle(tmp_path):
    """Point 3, 2 ranks: ``accelerate launch`` shuffles with a generator shared by the ranks."""
    args = ("--interval", "3")
    ref = launch(str(tmp_path / "ref"), "--dirpath", str(tmp_path / "ref_ckpt"), *args, tmp_path=tmp_path)
    assert ref.returncode == 0, ref.explain()
    out = str(tmp_path / "out")
    kill = ("--kill-at", "14", "--kill-rank", "1", "--kill-first-attempt")  # 12 batches per rank and epoch
    run = launch(out, "--dirpath", str(tmp_path / "ckpt"), *args, *kill, tmp_path=tmp_path, env=SYNC_SAVES)
    assert run.returncode == 0 and run.where(event="killed", rank=1), run.explain()
    for rank in (0, 1):
        assert run.resumed_from(rank) == 12, run.explain()
        assert_bit_identical(final(out, rank), final(str(tmp_path / "ref"), rank))


def test_batchnorm_buffers_under_ddp_are_rank_0s(tmp_path):
    """Point 4: BatchNorm's running statistics differ per rank until DDP's next forward broadcasts rank
    0's; the checkpoint must hold rank 0's on every rank."""
    run_pair(tmp_path, "--batchnorm")


def test_manual_gradient_accumulation_resumes_exactly(tmp_path, reference):
    """Point 6: ``if step % accum == 0: optimizer.step()`` without ``accelerator.accumulate``, the loop's
    index from ``ft.enumerate``; kills fall in the middle of accumulations."""
    args = ["--manual-accum", "4"]
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    attempts = run_until_done(out, ckpt, [10, 31, 47], *args)

    assert attempts[-1].resumed_from() is not None
    assert_bit_identical(final(out), reference("--interval", INTERVAL, *args))
    for path in glob.glob(os.path.join(ckpt, "step_*", "manifest.json")):
        position = json.loads(open(path).read())["metadata"]
        assert (position["batches_done"] - 1) % 4 == 0, f"saved in the middle of an accumulation: {position}"


def test_an_iterable_dataset_resumes_exactly(tmp_path, reference):
    """An ``IterableDataset`` (no sampler, no len): the hook crashed at the first epoch (``object of type
    '_InfiniteConstantSampler' has no len()``). A resume skips the stream's consumed batches; kills fall in the
    first and in the third epoch."""
    args = ["--iterable"]
    out = str(tmp_path / "out")
    attempts = run_until_done(out, str(tmp_path / "ckpt"), [10, 55], *args)

    assert attempts[-1].resumed_from() is not None
    assert_bit_identical(final(out), reference("--interval", INTERVAL, *args))


def test_dispatch_batches_on_two_ranks_resumes_exactly(tmp_path):
    """``DataLoaderConfiguration(dispatch_batches=True)``: rank 0 loads both ranks' batches of each step.
    ``skip_first_batches(loader, n)`` skips n batches of its sampler, half the 2n the ranks had consumed: the
    resumed run trained again on batches it had trained on, with no warning."""
    run_pair(tmp_path, "--dispatch-batches")


def test_two_optimizers_stepping_at_different_rates_resume_exactly(tmp_path):
    """A GAN: the discriminator steps every batch, the generator every 2 (its gradients accumulate between). A save
    after a batch where the generator held one batch's gradients (in no checkpoint) resumed without them: the
    generator, its Adam state and then the discriminator ended otherwise. Kills at batches 8 and 25 (the second in
    epoch 1, whose windows are shifted: 15 batches per epoch)."""
    from ft_checkpoint.testing import jobs

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gan_script.py")
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    jobs.run(script, str(tmp_path / "ref_ckpt"), ref, out=ref, timeout=300).expect(0)
    for kill in (8, 25):
        jobs.run(script, str(tmp_path / "ckpt"), out, "--kill-at", str(kill), out=out, timeout=300).expect(-9)
    restarted = jobs.run(script, str(tmp_path / "ckpt"), out, out=out, timeout=300)
    restarted.expect(0)
    assert "resuming from step" in restarted.output
    got, want = (torch.load(os.path.join(d, "final.pt"), weights_only=True) for d in (out, ref))
    for part in ("gen", "disc"):
        assert all(torch.equal(got[part][k], want[part][k]) for k in want[part]), f"{part} weights differ"
    for part in ("opt_g", "opt_d"):
        for index, state in want[part]["state"].items():
            assert all(torch.equal(got[part]["state"][index][k], v) for k, v in state.items()), f"{part} differs"


def journal_ends(ckpt: str) -> list[list[str]]:
    """Per attempt, oldest first, its events."""
    attempts: dict[str, list[str]] = {}
    for event in read_journal(Storage(ckpt)):
        attempts.setdefault(event["attempt"], []).append(event["event"])
    return [attempts[a] for a in sorted(attempts)]


def test_quickstart_without_close_ends_cleanly(tmp_path):
    """Point 8: the README's form (no ``with``, no ``close()``): a clean exit is journaled as a clean end, the
    lease is released, and the failure-rate estimate counts no failure."""
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    attempts = [run_script(out, "--dirpath", ckpt, "--interval", "5", "--epochs", "1", "--no-close") for _ in range(2)]
    assert [a.returncode for a in attempts] == [0, 0], attempts[-1].explain()
    assert [events[-1] for events in journal_ends(ckpt)] == ["clean_end", "clean_end"]
    assert not Storage(ckpt).exists(LEASE)
    assert count_failures(attempt_summaries(Storage(ckpt)))[0] == 0

    first, second = (a.stderr for a in attempts)  # printed on stderr whatever the logging setup, once
    assert first.count("ft-checkpoint: ") == 1 and f"ft-checkpoint: checkpoints go to {ckpt}, a save every 5 steps\n" \
        in first, first
    assert second.count("ft-checkpoint: ") == 1 and f"ft-checkpoint: resuming from step 24 (epoch 1, 0 batches of " \
        f"it done) of {ckpt}, a save every 5 steps (" in second, second  # the end of epochs() saved step 24


def test_quickstart_ending_in_an_exception_is_no_clean_end(tmp_path):
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    attempt = run_script(out, "--dirpath", ckpt, "--interval", "5", "--epochs", "1", "--no-close", "--fail-at-end")
    assert attempt.returncode == 1 and "the script failed after training" in attempt.stderr, attempt.explain()
    events = journal_ends(ckpt)[0]
    assert "clean_end" not in events and "commit" in events, events
    assert not Storage(ckpt).exists(LEASE)
