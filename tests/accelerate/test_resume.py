"""End to end, one process: a real Accelerate loop SIGKILLed and restarted ends bit-identical to an uninterrupted run.

Each attempt is a new ``python train_script.py`` process; ``--kill-at N`` makes it SIGKILL itself at
the top of micro-batch N (counted over all epochs), possibly while a save is in flight.
"""

from __future__ import annotations

import glob
import json
import os
import random
import uuid

import fsspec
import pytest

from tests.accelerate.conftest import BATCH, STEPS, assert_bit_identical, final, run_script

pytestmark = pytest.mark.slow

INTERVAL = "3"


def kill_positions(seed: int, count: int = 5) -> list[int]:
    """``count`` increasing micro-batch positions: mid-epoch, and one right after a save started."""
    rng = random.Random(seed)
    per_epoch = STEPS // 3
    while True:
        picks = sorted(rng.sample(range(2, STEPS - 2), count))
        mid_epoch = [p for p in picks if 1 < p % per_epoch < per_epoch - 1]
        after_save = [p for p in picks if p % int(INTERVAL) == 0]  # global_step p was just saved
        if len(mid_epoch) >= 3 and after_save and len({p // per_epoch for p in picks}) >= 2:
            return picks


def run_until_done(out: str, ckpt: str, kills: list[int], *args: str, env: dict[str, str] | None = None) -> list:
    """One killed attempt per position, then one to the end; returns the attempts."""
    attempts = []
    for position in [*kills, None]:
        extra = ["--kill-at", str(position)] if position is not None else []
        dirpath = ["--dirpath", ckpt] if ckpt else []
        attempt = run_script(out, *dirpath, "--interval", INTERVAL, *args, *extra, env=env)
        expected = 0 if position is None else -9
        assert attempt.returncode == expected, attempt.explain()
        attempts.append(attempt)
    return attempts


def assert_skipped_not_loaded(attempt) -> None:
    """The resumed attempt loaded and trained exactly the batches after the resume point."""
    summary = attempt.summary()
    assert summary["loaded"] == BATCH * summary["ran"], summary


def test_sigkill_at_random_steps_then_restart_is_bit_identical(tmp_path, reference):
    seed = int(os.environ.get("FT_TEST_SEED", random.randrange(10**6)))
    kills = kill_positions(seed)
    print(f"FT_TEST_SEED={seed} kill positions {kills}")
    attempts = run_until_done(str(tmp_path / "out"), str(tmp_path / "ckpt"), kills)

    resumed = [a.resumed_from() for a in attempts]
    assert resumed[-1] is not None and resumed[-1] > 0, f"the last attempt did not resume: {resumed}"
    assert attempts[-1].summary()["ran"] == STEPS - resumed[-1], "consumed batches were run again"
    assert_skipped_not_loaded(attempts[-1])
    assert_bit_identical(final(str(tmp_path / "out")), reference("--interval", INTERVAL))


def test_gradient_accumulation_resumes_exactly(tmp_path, reference):
    ga = ["--ga", "4", "--seedable"]
    kills = [9, 26, 45]  # all in the middle of an accumulation of 4 micro-batches (sync after 3, 7, 11, ...)
    attempts = run_until_done(str(tmp_path / "out"), str(tmp_path / "ckpt"), kills, *ga)

    assert attempts[-1].resumed_from() is not None
    assert_bit_identical(final(str(tmp_path / "out")), reference("--interval", INTERVAL, *ga))
    for path in glob.glob(str(tmp_path / "ckpt" / "step_*" / "manifest.json")):
        manifest = json.loads(open(path).read())
        assert manifest["metadata"]["batches_done"] % 4 == 0, f"saved mid-accumulation: {manifest['metadata']}"
        assert manifest["step"] * 4 == manifest["metadata"]["epoch"] * 24 + manifest["metadata"]["batches_done"]


def test_newest_checkpoint_corrupted_falls_back_to_the_previous(tmp_path, reference):
    args = ["--loader-generator"]
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    first = run_script(out, "--dirpath", ckpt, "--interval", INTERVAL, "--kill-at", "40", *args)
    assert first.returncode == -9, first.explain()
    committed = sorted(glob.glob(os.path.join(ckpt, "step_*", "manifest.json")))
    assert len(committed) >= 2, committed
    newest = os.path.dirname(committed[-1])
    with open(os.path.join(newest, "__0_0.distcp"), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))

    second = run_script(out, "--dirpath", ckpt, "--interval", INTERVAL, *args)
    assert second.returncode == 0, second.explain()
    newest_step = int(os.path.basename(newest).split("_")[1])
    assert f"skipping step {newest_step}" in second.stderr and "checksum" in second.stderr, second.explain()
    assert second.resumed_from() == int(os.path.basename(os.path.dirname(committed[-2])).split("_")[1])
    assert_bit_identical(final(out), reference("--interval", INTERVAL, *args))


def test_s3_configured_only_through_env_vars(tmp_path, reference, s3_server):
    bucket = f"accelerate-{uuid.uuid4().hex[:8]}"
    s3_server.make_bucket(bucket)
    env = {"FT_CHECKPOINT_DIRPATH": f"s3://{bucket}/run", "FT_CHECKPOINT_INTERVAL": INTERVAL,
           "FT_CHECKPOINT_STORAGE_OPTIONS": json.dumps(s3_server.storage_options), **s3_server.env()}
    out = str(tmp_path / "out")
    attempts = run_until_done(out, "", [31], env=env)

    assert attempts[-1].resumed_from() is not None, attempts[-1].explain()
    assert "s3://" in attempts[-1].stderr, "the checkpoint directory did not come from FT_CHECKPOINT_DIRPATH"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3_server.storage_options)
    steps = [p for p in fs.ls(f"{bucket}/run") if os.path.basename(p).startswith("step_")]
    assert steps and all(fs.exists(f"{p}/manifest.json") for p in steps), steps
    assert_bit_identical(final(out), reference("--interval", INTERVAL))


def test_a_crash_resumes_from_the_fast_tier_without_the_durable_tier_bit_identical(tmp_path, reference):
    """Fast tier every step, durable every 3rd, whose step data refuses to be read: the resume is the fast tier's."""
    fast = tmp_path / "fast"
    env = {"FT_CHECKPOINT_FAST_DIRPATH": str(fast), "FT_CHECKPOINT_FAST_INTERVAL": "1",
           "FT_CHECKPOINT_STORAGE_OPTIONS": json.dumps({"refuse_reads": ["*.distcp", "rank_*.pt", "metadata.json"]})}
    attempts = run_until_done(str(tmp_path / "out"), f"faulty://{tmp_path}/ckpt", [20], env=env)
    start = attempts[-1].where(event="start")[-1]
    assert start["resumed_from"] in (18, 19) and start["source"] == "fast tier, own node", start
    assert_skipped_not_loaded(attempts[-1])
    assert_bit_identical(final(str(tmp_path / "out")), reference("--interval", INTERVAL))
    assert os.listdir(fast) == [], "a clean end cleans the run's fast tier"
