"""What a restart does before its first step: the steps listed and the newest manifest read once, reused by the resume."""

from __future__ import annotations

import collections
import itertools
import os

from ft_checkpoint import CheckpointManager
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from tests.core.test_corruption import flip_byte
from tests.helpers.toy import assert_same, make, train_step

_instances = itertools.count()


def faulty(tmp_path) -> tuple[str, dict]:
    """A local directory through ``faulty://`` (no faults), on a filesystem instance of its own, whose ``reads``
    then lists what one manager read."""
    return f"faulty://{tmp_path}/ckpt", {"seed": next(_instances)}


def saved(url: str, options: dict, steps: int) -> dict[int, dict]:
    """Save steps 1..``steps``, then stop without a clean end (as a crash would); what each step holds."""
    state, kept = make(seed=0), {}
    ckpt = CheckpointManager(url, storage_options=options, interval=1, keep_last=steps, announce=False)
    for step in range(1, steps + 1):
        train_step(state)
        ckpt.save(step, state, block=True)
        kept[step] = make(seed=step + 10)
        ckpt.close(clean=False) if step == steps else None
    return kept


def manifest_reads(ckpt: CheckpointManager) -> dict[int, int]:
    """How often ``ckpt``'s filesystem opened each step's manifest for reading."""
    reads = ckpt.storage.fs.reads  # faulty://'s own record of every read
    names = [r for r in reads if os.path.basename(r) == layout.MANIFEST]
    return dict(collections.Counter(layout.parse_step(os.path.basename(os.path.dirname(r))) for r in names))


def test_a_restart_reads_each_manifest_once(tmp_path):
    url, options = faulty(tmp_path)
    saved(url, options, 3)
    _, options = faulty(tmp_path)  # a new filesystem instance: its reads are the restart's alone
    resumed = make(seed=9)
    with CheckpointManager(url, storage_options=options, announce=False) as ckpt:
        assert ckpt.resume(resumed) == 3
        assert manifest_reads(ckpt) == {3: 1}, "the start reads the newest manifest only, and the resume reuses it"
        assert ckpt.latest() == 3


def test_a_fall_back_past_a_corrupt_newest_step_lets_the_run_save_that_step_again(tmp_path):
    """The newest committed step is listed again after a fall-back (the corrupt one is set aside): saving its step
    number again is allowed, not refused as a step at or below the newest."""
    url, options = str(tmp_path / "ckpt"), {}
    saved(url, options, 2)
    flip_byte(Storage(url), layout.step_dir(2))
    state = make(seed=9)
    with CheckpointManager(url, storage_options=options, interval=1, announce=False) as ckpt:
        assert ckpt.resume(state) == 1
        train_step(state)
        ckpt.save(2, state, block=True)
        assert ckpt.latest() == 2
    again = make(seed=5)
    with CheckpointManager(url, storage_options=options, announce=False) as ckpt:
        assert ckpt.resume(again) == 2
    assert_same(again, state)


def test_a_resume_after_a_save_lists_the_steps_again(tmp_path):
    """The start's listing predates this manager's own saves: a resume after a save finds them."""
    url = str(tmp_path / "ckpt")
    state = make(seed=0)
    with CheckpointManager(url, interval=1, announce=False) as ckpt:
        train_step(state)
        ckpt.save(1, state, block=True)
        resumed = make(seed=9)
        assert ckpt.resume(resumed) == 1
    assert_same(resumed, state)
