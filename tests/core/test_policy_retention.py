"""Save policies and retention rules, and retention on a real directory."""

from __future__ import annotations

import os

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import Preempted
from ft_checkpoint.format import layout
from ft_checkpoint.policies.policy import EveryInterval, EveryNSteps, OnPreemption, SaveContext
from ft_checkpoint.run.retention import plan_deletions
from tests.helpers.toy import make


def test_every_n_steps_is_deterministic():
    p = EveryNSteps(5)
    assert p.deterministic
    assert [s for s in range(1, 21) if p.should_save(SaveContext(step=s))] == [5, 10, 15, 20]
    assert not p.should_save(SaveContext(step=10, last_save_step=10))


def test_every_interval_waits_for_time_and_for_the_save_in_flight():
    p = EveryInterval("10s")
    assert not p.deterministic
    assert not p.should_save(SaveContext(step=3, now=105.0, last_save_time=100.0))
    assert p.should_save(SaveContext(step=3, now=111.0, last_save_time=100.0))
    assert not p.should_save(SaveContext(step=3, now=111.0, last_save_time=100.0, save_in_flight=True))


def test_preemption_and_combination():
    p = EveryNSteps(100) | OnPreemption()
    assert p.deterministic
    assert p.should_save(SaveContext(step=7, preempted=True))
    assert not p.should_save(SaveContext(step=7))
    assert not (EveryNSteps(100) | EveryInterval(5)).deterministic


@pytest.mark.parametrize("steps,keep_last,every,expected", [
    ({1: True, 2: True, 3: True, 4: True}, 2, None, [1, 2]),
    ({1: True, 2: False, 3: True, 5: False}, 1, None, [1, 2]),  # partial 5 is newer than the newest commit
    ({100: True, 200: True, 300: True, 400: True}, 1, 200, [100, 300]),
    ({1: False, 2: False}, 1, None, []),  # nothing committed: delete nothing
])
def test_plan_deletions(steps, keep_last, every, expected):
    assert plan_deletions(steps, keep_last=keep_last, keep_every_n_steps=every) == expected


def test_retention_on_disk_keeps_newest_and_milestones(tmp_path):
    url = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(url, layout.step_dir(2)))  # an interrupted save, older than the commits
    with CheckpointManager(url, interval=1, keep_last=2, keep_every_n_steps=4) as ckpt:
        state = make()
        for step in range(3, 10):
            ckpt.save(step, state, block=True)
    steps = sorted(layout.parse_step(n) for n in os.listdir(url) if layout.parse_step(n) is not None)
    assert steps == [4, 8, 9]


def test_maybe_save_follows_the_policy(tmp_path):
    with CheckpointManager(str(tmp_path / "c"), interval=3, keep_last=10) as ckpt:
        state = make()
        saved = [s for s in range(1, 10) if ckpt.maybe_save(s, state)]
        ckpt.wait()
        assert saved == [3, 6, 9] and ckpt.latest() == 9
        ckpt.preempted = True  # a notice of the program's own: the final save, then a clean exit
        with pytest.raises(Preempted) as exc:
            ckpt.maybe_save(10, state)
        assert (exc.value.code, exc.value.step, exc.value.reason) == (0, 10, "preempted set by the program")
