"""A hostile or broken checkpoint directory, round 2 (issue 21): deleting never goes through a symbolic link,
even one swapped in between the listing and the delete; special files (FIFOs, directories, links to devices)
in the place of a control file never block; a lease from the future is stale. Each test builds the attack
for real (real links, real FIFOs, a real manager) and asserts the safe outcome."""

from __future__ import annotations

import os
import shutil
import threading

from ft_checkpoint import CheckpointManager, layout, retention
from ft_checkpoint.storage import Storage
from ft_checkpoint.tools.catalog import apply_gc, plan_gc
from tests.helpers.toy import make

HANG_GUARD = 30.0
"""Seconds a call that must not block may take before the test fails (far more than any of them needs)."""


def within_guard(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a daemon thread; fails the test if it has not returned after HANG_GUARD."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test's thread below
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still blocked after {HANG_GUARD:.0f} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# -- 1. deletion never goes through a link, even in a race ---------------------------------------
def victim_run(tmp_path) -> tuple[str, dict[str, bytes]]:
    """Another run's committed step, outside our directory: its path and every file it holds."""
    other = str(tmp_path / "other-run")
    with CheckpointManager(other, interval=1) as ckpt:
        ckpt.save(50, make(seed=7), block=True)
    victim = os.path.join(other, layout.step_dir(50))
    files = {}
    for name in os.listdir(victim):
        with open(os.path.join(victim, name), "rb") as f:
            files[name] = f.read()
    return victim, files


def swap_for_link(url: str, step: int, target: str) -> None:
    """Replace the step directory ``step`` of ``url`` by a symbolic link to ``target``."""
    path = os.path.join(url, layout.step_dir(step))
    shutil.rmtree(path)
    os.symlink(target, path)


def assert_intact(victim: str, files: dict[str, bytes]) -> None:
    assert sorted(os.listdir(victim)) == sorted(files), "files of the other run were deleted through the link"
    for name, data in files.items():
        with open(os.path.join(victim, name), "rb") as f:
            assert f.read() == data, f"{name} of the other run was changed"


def test_gc_never_deletes_through_a_step_directory_swapped_for_a_link_after_its_plan(tmp_path, caplog):
    victim, files = victim_run(tmp_path)
    ours = str(tmp_path / "ours")
    with CheckpointManager(ours, interval=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, make(), block=True)
    storage = Storage(ours)
    plan = plan_gc(storage, keep_last=1)
    assert plan.delete == [1, 2]
    swap_for_link(ours, 1, victim)  # between the plan and the delete
    deleted = apply_gc(storage, plan)
    assert_intact(victim, files)
    assert deleted == [2], "gc says it deleted a step it did not"
    assert os.path.islink(os.path.join(ours, layout.step_dir(1))), "the link itself is not ours to delete either"
    assert not os.path.exists(os.path.join(ours, layout.step_dir(2)))
    assert "symbolic link" in caplog.text


def test_retention_after_a_commit_never_deletes_through_a_link_swapped_in_after_its_plan(tmp_path, monkeypatch,
                                                                                           caplog):
    victim, files = victim_run(tmp_path)
    ours = str(tmp_path / "ours")
    plan = retention.plan_deletions

    def plan_then_swap(*args, **kwargs):  # the real plan; then the attacker's swap, before the deletes
        doomed = plan(*args, **kwargs)
        if 1 in doomed:
            swap_for_link(ours, 1, victim)
        return doomed

    monkeypatch.setattr(retention, "plan_deletions", plan_then_swap)
    with CheckpointManager(ours, interval=1, keep_last=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, make(), block=True)
            ckpt.wait(retention=True)
    assert_intact(victim, files)
    assert sorted(layout.list_steps(Storage(ours))) == [3]
    assert "symbolic link" in caplog.text


def test_delete_step_removes_links_and_fifos_inside_a_step_but_never_their_targets(tmp_path):
    victim, files = victim_run(tmp_path)
    ours = str(tmp_path / "ours")
    with CheckpointManager(ours, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
    step = os.path.join(ours, layout.step_dir(1))
    for name in files:
        os.symlink(os.path.join(victim, name), os.path.join(step, "link-" + name))
    os.symlink(victim, os.path.join(step, "link-to-dir"))
    os.mkfifo(os.path.join(step, "fifo"))
    assert layout.delete_step(Storage(ours), 1)
    assert not os.path.lexists(step)
    assert_intact(victim, files)
