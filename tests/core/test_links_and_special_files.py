"""A hostile or broken checkpoint directory, round 2 (issue 21): deleting never goes through a symbolic link,
even one swapped in between the listing and the delete; special files (FIFOs, directories, links to devices)
in the place of a control file never block; a lease from the future is stale. Each test builds the attack
for real (real links, real FIFOs, a real manager) and asserts the safe outcome."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import CheckpointCorruptError, LeaseError, SaveError
from ft_checkpoint.format import layout
from ft_checkpoint.load import loading
from ft_checkpoint.run import retention
from ft_checkpoint.run.journal import PROGRESS, Journal, read_journal
from ft_checkpoint.save.engine import CheckpointEngine
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.tools import catalog
from ft_checkpoint.tools.catalog import apply_gc, plan_gc
from tests.cli.conftest import cli
from tests.helpers.legacy import write_legacy_step
from tests.helpers.toy import make

HANG_GUARD = 30.0
"""Seconds a call that must not block may take before the test fails (far more than any of them needs)."""


@contextlib.contextmanager
def memory_guard(extra: int = 2 << 30):
    """Cap this process's address space at its current size plus ``extra`` bytes: a regression that reads
    ``/dev/zero`` whole fails with MemoryError instead of exhausting a shared machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        size = int(next(line for line in f if line.startswith("VmSize:")).split()[1]) * 1024
    cap = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def within_guard(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a daemon thread; fails the test if it has not returned after HANG_GUARD (or
    if it reads gigabytes: see memory_guard)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test's thread below
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    with memory_guard():
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
    assert deleted == {2: []}, "gc says it deleted a step it did not"
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


# -- 5. special files never block ---------------------------------------------------------------
def plant(path: str, kind: str, target: str = "/dev/zero") -> None:
    """Put a special file named ``path`` in place of whatever is there (a link: to ``target``)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind in ("link to /dev/zero", "symbolic link"):
        os.symlink(target, path)
    elif kind == "hard link":
        os.link(target, path)
    elif kind == "directory":
        os.makedirs(os.path.join(path, "kept"))
    elif kind == "sparse 1 GiB":
        with open(path, "wb") as f:
            f.truncate(1 << 30)


def two_saved_steps(url: str) -> None:
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
        ckpt.save(2, make(), block=True)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "directory", "sparse 1 GiB"])
def test_a_manifest_that_is_no_small_regular_file_is_skipped_by_ls_verify_inspect_and_resume(tmp_path, kind, caplog):
    url = str(tmp_path / "ckpt")
    two_saved_steps(url)
    plant(os.path.join(url, layout.step_dir(2), layout.MANIFEST), kind)
    reason = "larger than" if kind.startswith("sparse") else "not a regular file"

    ls = cli("ls", url, "--json", timeout=HANG_GUARD)
    assert ls.returncode == 0, ls.stderr
    steps = {s["step"]: s for s in json.loads(ls.stdout)["steps"]}
    assert steps[1]["status"] == "committed" and steps[2]["status"] == "corrupt"
    assert reason in steps[2]["reason"]
    verify = cli("verify", url, "--all", timeout=HANG_GUARD)
    assert verify.returncode == 1 and reason in verify.stdout, verify.stdout + verify.stderr
    inspect = cli("inspect", url, "--step", "2", timeout=HANG_GUARD)
    assert inspect.returncode == 2 and reason in inspect.stderr, inspect.stderr
    assert cli("inspect", url, timeout=HANG_GUARD).returncode == 0

    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    with within_guard(CheckpointManager, url) as ckpt:
        assert within_guard(ckpt.resume, make(seed=9)) == 1
    assert reason in next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())


UNPRIVILEGED = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps", "-all"]
"""Runs a command as this user without the capabilities that let root read and write what it has no permission to
(as any other user runs)."""

RESUME_SAVE_LS = """
import sys, torch
from ft_checkpoint import CheckpointManager
from ft_checkpoint.tools.cli import main
from tests.helpers.toy import make
with CheckpointManager(sys.argv[1], interval=1, keep_last=1) as ckpt:
    print("resumed", ckpt.resume(make(seed=9)), flush=True)
    ckpt.save(4, make(), block=True)
print("ls", main(["ls", sys.argv[1]]), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
@pytest.mark.parametrize("unreadable", ["step directory", "manifest"])
def test_a_step_this_user_cannot_read_is_ignored_not_fatal(tmp_path, unreadable):
    """Whoever can write a shared checkpoint directory can plant a step, or a manifest, that the job's user cannot
    read (mode 000): its permission error stopped every start and ``ls``. Such a step is not one of the run's: it
    is ignored (a warning), never read, and retention leaves it alone."""
    url = str(tmp_path / "ckpt")
    two_saved_steps(url)
    planted = os.path.join(url, layout.step_dir(3))
    os.mkdir(planted)
    if unreadable == "manifest":
        with open(os.path.join(planted, layout.MANIFEST), "w") as f:
            f.write("{}")
        os.chmod(os.path.join(planted, layout.MANIFEST), 0)
        os.chmod(planted, 0o555)  # as another user's: nothing in it can be deleted
    else:
        os.chmod(planted, 0)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([*UNPRIVILEGED, sys.executable, "-c", RESUME_SAVE_LS, url], capture_output=True, text=True,
                          cwd=repo, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed 2" in done.stdout and "ls 0" in done.stdout, done.stdout
    assert "cannot be read by this user" in done.stderr, done.stderr[-2000:]
    assert os.path.isdir(planted)


@pytest.mark.slow  # a subprocess (over 5 s on a loaded machine): the quick tier stays under 3 minutes
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_verify_all_reports_a_file_this_user_cannot_read_and_checks_the_other_steps(tmp_path):
    """A rank file of mode 000 in step 1: ``verify --all`` stopped at it (exit 2, no step reported) with a HINT
    to check that the location is writable."""
    url = str(tmp_path / "ckpt")
    two_saved_steps(url)
    os.chmod(os.path.join(url, layout.step_dir(1), layout.rank_file(0)), 0)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([*UNPRIVILEGED, sys.executable, "-m", "ft_checkpoint.tools.cli", "verify", url, "--all"],
                          capture_output=True, text=True, cwd=repo, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "step 1: UNREADABLE by this user (not checked)" in done.stdout and "step 2: ok" in done.stdout, done.stdout
    assert "permission denied" in done.stdout and "may read the location" in done.stdout, done.stdout


def test_a_control_file_is_never_read_through_a_step_directory_swapped_for_a_link(tmp_path):
    """A manifest (or a journal entry) was opened by its whole path, ``O_NOFOLLOW`` on its last name only: a step
    directory swapped for a link after the listing had its manifest read from wherever the link led (here another
    run's step). Every directory below the root is opened without following a link now, as for the data files."""
    victim, _ = victim_run(tmp_path)
    ours = str(tmp_path / "ours")
    two_saved_steps(ours)
    swap_for_link(ours, 2, victim)
    storage, rel = Storage(ours), f"{layout.step_dir(2)}/{layout.MANIFEST}"
    with pytest.raises(CheckpointCorruptError, match="a directory on its way is a symbolic link"):
        storage.read_control(rel, max_bytes=1 << 20)
    with pytest.raises(CheckpointCorruptError, match="a directory on its way is a symbolic link"):
        storage.read_control_once(rel, json.loads, max_bytes=1 << 20, parsed={})
    assert json.loads(storage.read_control(f"{layout.step_dir(1)}/{layout.MANIFEST}", max_bytes=1 << 20))["step"] == 1


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "directory"])
def test_a_lease_that_is_no_regular_file_refuses_clearly_and_force_takeover_replaces_it(short_wait_after_takeover,
                                                                                         tmp_path, kind):
    url = str(tmp_path / "ckpt")
    os.makedirs(url)
    lease = os.path.join(url, "lease.json")
    plant(lease, kind)
    with pytest.raises(LeaseError, match=r"not a regular file.*HINT: .*force_takeover=True"):
        within_guard(CheckpointManager, url)
    with within_guard(CheckpointManager, url, interval=1, force_takeover=True) as ckpt:
        ckpt.save(1, make(), block=True)
        with open(lease) as f:
            assert json.load(f)["attempt"] == ckpt.journal.attempt
    if kind == "directory":  # moved aside, never deleted
        aside = [n for n in os.listdir(url) if n.startswith("lease.json.")]
        assert len(aside) == 1 and os.listdir(os.path.join(url, aside[0])) == ["kept"]


def test_fifos_in_the_journal_are_skipped_with_a_warning(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
        attempt = ckpt.journal.attempt
    where = os.path.join(url, layout.JOURNAL_DIR, attempt)
    for name in ("000099-commit.json", "progress.json"):
        plant(os.path.join(where, name), "fifo")
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    events = within_guard(read_journal, Storage(url))
    assert [e["event"] for e in events][:1] == ["attempt_start"] and "commit" in [e["event"] for e in events]
    warned = [r.getMessage() for r in caplog.records if "skipping the unreadable journal entry" in r.getMessage()]
    assert any("000099-commit.json" in w and "not a regular file" in w for w in warned), warned
    with within_guard(CheckpointManager, url, interval="adaptive"):  # reads the journal's attempts at start
        pass
    report = cli("report", url, timeout=HANG_GUARD)
    assert report.returncode == 0 and "not a regular file" in report.stderr, report.stderr


# -- 6. hard links: a manifest is parsed once per file, however many names it has -------------------
def link_manifest(url: str, step: int, into: range) -> None:
    """Hard-link step ``step``'s manifest as the manifest of each step directory of ``into`` (one file on disk:
    the finding's was 60 MB, linked 20 times, and every start parsed it 20 times)."""
    source = os.path.join(url, layout.step_dir(step), layout.MANIFEST)
    for other in into:
        os.makedirs(os.path.join(url, layout.step_dir(other)))
        os.link(source, os.path.join(url, layout.step_dir(other), layout.MANIFEST))


def count_parses(monkeypatch) -> list[int]:
    """The size of each manifest parsed from now on (the real parse, counted)."""
    parsed: list[int] = []
    original = layout.Manifest.from_json

    def counted(data: bytes, *, where: str = "manifest") -> layout.Manifest:
        parsed.append(len(data))
        return original(data, where=where)

    monkeypatch.setattr(layout.Manifest, "from_json", staticmethod(counted))
    return parsed


def test_a_manifest_hard_linked_into_many_steps_is_parsed_once_per_listing(tmp_path, monkeypatch, caplog):
    url = str(tmp_path / "ckpt")
    two_saved_steps(url)
    link_manifest(url, 2, range(100, 150))  # above the run: a start and a resume meet them first
    storage, parses = Storage(url), count_parses(monkeypatch)
    assert layout.committed_steps(storage) == [1, 2]
    assert len(parses) == 2, "one parse per file (steps 1 and 2), not one per name"
    parses.clear()
    assert retention.apply_retention(storage, keep_last=1, dry_run=True) == [1]
    assert len(parses) == 2, "a retention pass parses each file once"
    parses.clear()
    with CheckpointManager(url, interval=1) as ckpt:
        assert ckpt.resume(make()) == 2
    assert len(parses) == 1, "the start read the newest manifests (one file), and the resume reused them"
    assert os.path.isfile(os.path.join(url, layout.step_dir(2), layout.MANIFEST)), "step 2 is intact"
    assert "manifest.json says step 2, the directory says 149" in caplog.text


def test_a_run_copied_with_hard_links_resumes_and_keeps_its_steps(tmp_path):
    """``cp -al run backup``: every file of the backup is a hard link to the run's; both resume as before."""
    url, backup = str(tmp_path / "run"), str(tmp_path / "backup")
    two_saved_steps(url)
    subprocess.run(["cp", "-al", url, backup], check=True)
    for directory in (backup, url):
        with CheckpointManager(directory, interval=1, keep_last=2) as ckpt:
            assert ckpt.resume(make()) == 2
            ckpt.save(3, make(), block=True)
        assert sorted(layout.list_steps(Storage(directory))) == [2, 3]


# -- 7. a lease from the future is no lock forever ----------------------------------------------
YEAR_2100 = 4102444800.0


def plant_lease(url: str, *, heartbeat: float, mtime: float | None = None, garbage: bool = False) -> None:
    """Another host's lease in ``url`` (or an unreadable one), written at ``mtime``."""
    os.makedirs(url, exist_ok=True)
    path = os.path.join(url, "lease.json")
    record = {"attempt": "old", "host": "node-a", "pid": 1, "job": None, "heartbeat": heartbeat}
    with open(path, "w") as f:
        f.write("owner: node-a" if garbage else json.dumps(record))
    if mtime is not None:
        os.utime(path, (mtime, mtime))


@pytest.mark.parametrize("case", ["heartbeat in 2100", "heartbeat and mtime in 2100", "unreadable, mtime in 2100"])
def test_a_lease_from_the_future_is_stale_and_the_takeover_says_why(short_wait_after_takeover, tmp_path, case, caplog):
    url = str(tmp_path / "ckpt")
    plant_lease(url, heartbeat=YEAR_2100, mtime=None if case == "heartbeat in 2100" else YEAR_2100,
                garbage=case.startswith("unreadable"))
    caplog.set_level(logging.INFO, logger="ft_checkpoint.run.lease")
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
    taken = next(r.getMessage() for r in caplog.records if "taking over the checkpoint lease" in r.getMessage())
    assert "in the future, beyond the clock-skew tolerance of 60 s: stale" in taken, taken


def test_a_heartbeat_a_little_ahead_is_clock_skew_and_the_refusal_never_says_minus_seconds_ago(tmp_path):
    url = str(tmp_path / "ckpt")
    plant_lease(url, heartbeat=time.time() + 40)  # another host's clock, 40 s ahead: its owner may be alive
    with pytest.raises(LeaseError, match=r"last heartbeat \d+ s in the future \(clock skew") as e:
        CheckpointManager(url)
    assert "-" not in str(e.value).split("last heartbeat")[1].split("s in the future")[0]


def test_a_resume_never_sets_aside_the_manifest_of_a_step_swapped_for_a_link_after_its_check(tmp_path, monkeypatch,
                                                                                               caplog):
    victim, files = victim_run(tmp_path)
    ours = str(tmp_path / "ours")
    two_saved_steps(ours)
    with open(os.path.join(ours, layout.step_dir(2), layout.MANIFEST), "w") as f:
        f.write("{garbled")  # step 2 is corrupt now: a resume skips it and sets it aside
    quarantine = layout.quarantine

    def swap_then_quarantine(storage, steps):  # the attacker's swap, between the check and the rename
        steps = list(steps)
        if 2 in steps:
            swap_for_link(ours, 2, victim)
        quarantine(storage, steps)

    monkeypatch.setattr(layout, "quarantine", swap_then_quarantine)
    with CheckpointManager(ours) as ckpt:
        assert ckpt.resume(make(seed=9)) == 1
    assert_intact(victim, files)
    assert "nothing is renamed through it" in caplog.text


def test_a_save_never_writes_through_a_link_planted_in_place_of_its_step_directory(tmp_path):
    """Someone who can write the directory links ``step_000000000002`` to a directory of another run before the
    save of step 2: the save used to write its shard, rank and manifest files through the link (into the victim's
    directory). Now the link itself is removed (never its target) and the step is written in a real directory."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("other run")
    url = str(tmp_path / "ckpt")
    state = make(seed=0)
    with CheckpointManager(url, interval=1, announce=False) as ckpt:
        ckpt.save(1, state, block=True)
        os.symlink(victim, os.path.join(url, layout.step_dir(2)))
        ckpt.save(2, state, block=True)
    assert sorted(os.listdir(victim)) == ["keep.txt"] and (victim / "keep.txt").read_text() == "other run"
    step2 = os.path.join(url, layout.step_dir(2))
    assert not os.path.islink(step2) and layout.check_step(Storage(url), 2).ok


def test_a_link_planted_between_the_clear_and_the_writes_of_a_save_is_never_written_through(tmp_path, monkeypatch):
    """The race of an attacker who re-creates the link in a loop: it is back right after the save's clear removed
    it. The save used to write its files through it, into another run's step, and report success."""
    victim, files = victim_run(tmp_path)
    ours = str(tmp_path / "ours")
    clear = layout.delete_step

    def clear_then_plant(storage, step, *, before_write=False):
        cleared = clear(storage, step, before_write=before_write)
        if before_write and step == 2:
            os.symlink(victim, os.path.join(ours, layout.step_dir(2)))
        return cleared

    monkeypatch.setattr(layout, "delete_step", clear_then_plant)
    step_2_is_refused(ours, r"step_000000000002.*nothing is written", victim, files)


@pytest.mark.parametrize("swap", ["link to another run's step", "another directory"])
def test_a_step_directory_swapped_after_the_clear_is_never_written_through_nor_committed(tmp_path, monkeypatch, swap):
    """The step directory the save created is renamed away and its name given to a link (the writes refuse to go
    through it) or to another directory (the writes land there, inside the run, but the commit refuses it)."""
    victim, files = victim_run(tmp_path)
    ours = str(tmp_path / "ours")
    clear = CheckpointEngine._clear

    def clear_then_swap(self, stats, listener):
        made = clear(self, stats, listener)
        path = os.path.join(ours, layout.step_dir(stats.step))
        if stats.step == 2:
            if os.path.isdir(path):
                os.rename(path, path + ".aside")  # kept: a new directory cannot reuse its inode
            os.symlink(victim, path) if swap.startswith("link") else os.mkdir(path)
        return made

    monkeypatch.setattr(CheckpointEngine, "_clear", clear_then_swap)
    reason = "symbolic link" if swap.startswith("link") else "no longer the directory this save created"
    step_2_is_refused(ours, reason, victim, files)


def step_2_is_refused(ours: str, reason: str, victim: str, files: dict[str, bytes]) -> None:
    """Step 1 saves; the save of step 2 raises SaveError matching ``reason``; the victim's files are intact and
    only step 1 is committed."""
    with CheckpointManager(ours, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
        with pytest.raises(SaveError, match=rf"step 2 not committed: .*{reason}"):
            ckpt.save(2, make(), block=True)
    assert_intact(victim, files)
    assert layout.committed_steps(Storage(ours)) == [1]


def test_a_link_or_hard_link_planted_in_place_of_a_file_of_a_step_is_replaced_never_written_through(tmp_path):
    """A file of a step is written as a new file: a symbolic or a hard link to another run's file under its name is
    removed itself (the other run's file keeps its bytes), on every path a save writes by."""
    victim, files = victim_run(tmp_path)
    storage = Storage(str(tmp_path / "ours"))
    rel = layout.step_dir(1)
    os.makedirs(storage.path(rel))
    for name in files:
        os.symlink(os.path.join(victim, name), storage.path(f"{rel}/{name}"))
    os.link(os.path.join(victim, layout.METADATA), storage.path(f"{rel}/hard.json"))
    writes = [lambda rel: storage.write_bytes(rel, b"ours", atomic=False), lambda rel: storage.write_bytes(rel, b"ours"),
              lambda rel: storage.write_views(rel, [memoryview(b"ours")]),
              lambda rel: storage.write_stream(rel, lambda f: f.write(b"ours"))]
    names = sorted([*files, "hard.json"])
    for i, name in enumerate(names):
        writes[i % len(writes)](f"{rel}/{name}")
    assert_intact(victim, files)
    for name in names:
        assert storage.read_bytes(f"{rel}/{name}") == b"ours" and not os.path.islink(storage.path(f"{rel}/{name}"))


def swap_after_the_check(monkeypatch, url: str, step: int, name: str, kind: str) -> None:
    """Plant a ``kind`` special file in place of ``name`` of ``step`` right after ``layout.check_step`` looked at
    the step (its listing found a regular file of the right size), once."""
    check = layout.check_step
    swapped = []

    def check_then_swap(storage, checked, **kwargs):
        result = check(storage, checked, **kwargs)
        if checked == step and not swapped:
            swapped.append(name)
            plant(os.path.join(url, layout.step_dir(step), name), kind)
        return result

    monkeypatch.setattr(layout, "check_step", check_then_swap)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
@pytest.mark.parametrize(("version", "name"), [(2, "__0_0.distcp"), (2, layout.METADATA), (2, "rank_00000.pt"),
                                               (1, "__0_0.distcp")])
def test_a_file_swapped_for_a_special_file_after_the_check_is_corrupt_and_the_resume_falls_back(
        tmp_path, monkeypatch, caplog, kind, version, name):
    """The files of a step are checked from a listing, then opened by name: a FIFO renamed over one in between
    blocked the resume forever (a format-1 step's checksum pass, a format-2 shard, metadata or rank file), and a
    link to /dev/zero was read as zeros. Each is opened without following a link and without waiting now."""
    url = str(tmp_path / "ckpt")
    if version == 1:
        write_legacy_step(url, 1, make(seed=1))
        write_legacy_step(url, 2, make(seed=2))
    else:
        two_saved_steps(url)
    swap_after_the_check(monkeypatch, url, 2, name, kind)
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    with within_guard(CheckpointManager, url) as ckpt:
        assert within_guard(ckpt.resume, make(seed=9)) == 1
    skipped = next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())
    assert f"{name} is {'a FIFO' if kind == 'fifo' else 'a symbolic link'}, not a regular file" in skipped, skipped


@pytest.mark.parametrize("kind", ["fifo", "link to another run's shard"])
def test_a_format1_shard_swapped_after_its_checksum_pass_is_never_read_through_a_link_nor_blocks(
        tmp_path, monkeypatch, caplog, kind):
    """A format-1 step's shards are hashed when the step is opened, then DCP's reader opened them again by path
    through fsspec: a FIFO swapped in between blocked the resume forever, and a link had the step's tensors read
    from another run's file. They are opened the way every data file is now (no link, no wait)."""
    url, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    write_legacy_step(url, 1, make(seed=1))
    write_legacy_step(url, 2, make(seed=2))
    write_legacy_step(other, 5, make(seed=7))
    shard = "__0_0.distcp"
    open_step = loading.StepLoader.open_step

    def open_then_swap(self, manifest):
        opened = open_step(self, manifest)
        if manifest.step == 2:
            plant(os.path.join(url, layout.step_dir(2), shard), "fifo" if kind == "fifo" else "symbolic link",
                  os.path.join(other, layout.step_dir(5), shard))
        return opened

    monkeypatch.setattr(loading.StepLoader, "open_step", open_then_swap)
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    with within_guard(CheckpointManager, url) as ckpt:
        assert within_guard(ckpt.resume, make(seed=9)) == 1
    skipped = next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())
    assert f"{shard} is {'a FIFO' if kind == 'fifo' else 'a symbolic link'}, not a regular file" in skipped, skipped


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_verify_reports_a_file_swapped_for_a_special_file_after_the_listing(tmp_path, monkeypatch, kind):
    url = str(tmp_path / "ckpt")
    two_saved_steps(url)
    storage = Storage(url)
    entries = storage.entries

    def list_then_swap(rel=""):
        found = entries(rel)
        if rel == layout.step_dir(2):
            plant(os.path.join(url, rel, "__0_0.distcp"), kind)
        return found

    monkeypatch.setattr(storage, "entries", list_then_swap)
    check = within_guard(catalog.check_step, storage, 2)
    assert not check.ok
    assert any("__0_0.distcp is a" in p and "not a regular file" in p for p in check.problems), check.problems


@pytest.mark.parametrize("swap", ["fifo", "symbolic link", "hard link"])
def test_a_progress_note_swapped_after_its_first_write_is_never_written_through_nor_blocks(tmp_path, monkeypatch,
                                                                                          caplog, swap):
    """The journal writes its progress note whole once, then opened it again by its path to rewrite it in place at
    every step: swapped for a FIFO in between, that open blocked the training forever; for a symbolic or a hard
    link to another run's file, each step's note overwrote that file's first bytes."""
    victim, files = victim_run(tmp_path)
    target = os.path.join(victim, layout.METADATA)
    url = str(tmp_path / "ours")
    write_whole = Journal._write_progress

    def write_then_swap(self, step):
        write_whole(self, step)
        path = Storage(url).path(f"{layout.JOURNAL_DIR}/{self.attempt}/{PROGRESS}")
        if not getattr(self, "swapped", False):
            self.swapped = True
            plant(path, swap, target)

    monkeypatch.setattr(Journal, "_write_progress", write_then_swap)

    def train():
        with CheckpointManager(url, interval=2) as ckpt:
            state = make()
            for step in range(1, 6):
                ckpt.maybe_save(step, state)
            ckpt.wait()
            return ckpt.latest()

    assert within_guard(train) == 4
    assert_intact(victim, files)
    assert "progress note is written whole from now on" in caplog.text
