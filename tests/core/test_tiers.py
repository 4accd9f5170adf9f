"""The fast tier on one node (one process): saves, resume from the fastest source, fallbacks, room, hygiene, and
folders another user of the node prepared.

The multi-node behaviour (peer copies, a replaced node, a node killed during a transfer) is in
``tests/core/test_tiers_nodes.py``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import traceback

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from ft_checkpoint import CheckpointManager
from ft_checkpoint.config import CheckpointConfig
from ft_checkpoint.errors import CheckpointCorruptError, ConfigError, StorageError
from ft_checkpoint.format import layout
from ft_checkpoint.run.dist import Groups
from ft_checkpoint.run.journal import first_attempt, read_journal
from ft_checkpoint.run.lease import job_id
from ft_checkpoint.save.engine import CheckpointEngine
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.tiers.folder import FastFolder, run_key, runs_in
from ft_checkpoint.tiers.transfer import Incoming, Outgoing
from ft_checkpoint.tiers.write import write_rank_step
from tests.helpers.toy import assert_same, flat, make, train_step

DATA_FILES = ["*.distcp", "rank_*.pt", "metadata.json"]
"""The durable tier's step data: reading any of it fails (``faulty://``'s ``refuse_reads``)."""


def snapshot(state: dict) -> dict:
    """A copy of every leaf of the state as it is now (tensors cloned)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in flat(state).items()}


def run(url: str, fast: str, steps: int, *, interval: int = 4, fast_interval: int = 1, keep: tuple[int, ...] = (),
        seed: int = 0, **config) -> tuple[dict, dict[int, dict]]:
    """Train ``steps`` steps saving on both tiers, then stop without a clean end (as a crash would); the state
    at the end, and snapshots at the steps in ``keep``."""
    state, kept = make(seed=seed), {}
    ckpt = CheckpointManager(url, interval=interval, fast_dirpath=fast, fast_interval=fast_interval, **config)
    for step in range(1, steps + 1):
        train_step(state)
        ckpt.maybe_save(step, state)
        if step in keep:
            kept[step] = snapshot(state)
    ckpt.wait()
    ckpt.close(clean=False)
    return state, kept


def resumes(url: str, fast: str, **config) -> tuple[int | None, dict, CheckpointManager]:
    state = make(seed=1)
    ckpt = CheckpointManager(url, interval=4, fast_dirpath=fast, fast_interval=1, **config)
    return ckpt.resume(state), state, ckpt


def resume_events(url: str, **options) -> list[dict]:
    return [e for e in read_journal(Storage(url, options)) if e["event"] == "resume"]


def test_a_crash_resumes_from_the_fast_tier_without_reading_the_durable_tier(tmp_path):
    url, fast, refuse = f"faulty://{tmp_path}/ckpt", str(tmp_path / "fast"), {"refuse_reads": DATA_FILES}
    state, _ = run(url, fast, 6, storage_options=refuse)
    expected, rand = snapshot(state), torch.rand(4)
    step, resumed, ckpt = resumes(url, fast, storage_options=refuse)
    assert step == 6, "the fast tier's step 6 is newer than the durable tier's step 4"
    assert_same(flat(resumed), expected)
    assert torch.equal(torch.rand(4), rand), "each rank's RNG comes back from its fast-tier part"
    event = resume_events(url, **refuse)[-1]
    assert (event["tier"], event["source"]) == ("fast", "fast tier, own node")
    ckpt.close()


def test_a_flipped_byte_in_the_fast_tier_falls_back_to_the_durable_tier_and_sets_the_part_aside(tmp_path, caplog):
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    _, kept = run(url, fast, 6, keep=(4,))
    folder = runs_in(fast)[0]
    shard = os.path.join(folder.storage(0).path(layout.step_dir(6)), "__0_0.distcp")
    with open(shard, "r+b") as f:  # one flipped bit of a tensor (fast-tier files are not padded)
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0x01]))
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        step, resumed, ckpt = resumes(url, fast)
    assert step == 4
    assert_same(flat(resumed), kept[4])
    assert "fast-tier step 6 (own node) is not used" in caplog.text and "do not match their checksum" in caplog.text
    assert layout.list_steps(folder.storage(0)) == {}, "the corrupt part is deleted: no later start tries it again"
    assert resume_events(url)[-1]["tier"] == "durable"
    ckpt.close()


def test_a_durable_step_newer_than_the_fast_tier_wins(tmp_path):
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    _, kept = run(url, fast, 7, interval=3, fast_interval=4, keep=(6,))
    step, resumed, ckpt = resumes(url, fast)
    assert step == 6
    assert_same(flat(resumed), kept[6])
    assert resume_events(url)[-1]["tier"] == "durable"
    ckpt.close()


def own_key(url: str) -> str:
    """The run key a job with the durable directory ``url`` uses (once its journal records a start)."""
    return run_key(os.path.abspath(url), job_id(), first_attempt(Storage(url)))


def flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("durable", ["an older step", "no step", "an older step, the fast one corrupt too"])
def test_a_corrupt_newest_durable_step_falls_back_to_a_newer_fast_tier_step_first(tmp_path, durable):
    """Durable steps 4 and 8, fast-tier step 6; step 8's data corrupt. The fast tier's 6 was ruled out as older than
    the durable tier's newest (8), and the resume fell back to the durable 4 (or, with 4 corrupt too, to a fresh
    start): two steps of work lost, though 6 was there and intact."""
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    _, kept = run(url, fast, 8, interval=4, fast_interval=3, keep=(4, 6))
    assert layout.committed_steps(Storage(url)) == [4, 8]
    for step in (8, 4) if durable == "no step" else (8,):
        flip_a_byte(os.path.join(url, layout.step_dir(step), "__0_0.distcp"))
    if durable == "an older step, the fast one corrupt too":  # it fails while loaded: step 4 is loaded again
        flip_a_byte(os.path.join(runs_in(fast)[0].storage(0).path(layout.step_dir(6)), "__0_0.distcp"))
    step, resumed, ckpt = resumes(url, fast)
    expected = 4 if durable.endswith("corrupt too") else 6
    assert step == expected, "the newest step that checks and loads"
    assert_same(flat(resumed), kept[expected])
    assert resume_events(url)[-1]["tier"] == ("durable" if expected == 4 else "fast")
    ckpt.close()


def test_a_new_or_emptied_durable_directory_never_resumes_a_deleted_runs_fast_tier(tmp_path):
    """``rm -rf`` of the checkpoint directory after a crash, to start over: the fast tier (same dirpath, no launcher
    run id, so the same run key) still held step 6, and the new run resumed it as if nothing had been deleted."""
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    run(url, fast, 6)
    deleted = FastFolder(fast, own_key(url))
    shutil.rmtree(url)
    step, _, ckpt = resumes(url, fast)
    assert step is None, "a fresh start"
    assert FastFolder(fast, own_key(url)).root != deleted.root, "the emptied directory's run has a key of its own"
    assert deleted.committed(0) is not None, "its owner (this process) is alive: left alone, never read"
    ckpt.close(clean=False)
    step, _, again = resumes(url, fast)  # a crash of the new run before its first durable save: its journal
    assert step is None  # vouches for the directory, and its fast tier holds nothing yet
    again.close()


def test_a_node_away_when_the_durable_directory_was_emptied_never_brings_the_deleted_run_back(tmp_path):
    """The deleted run's parts are removed from the nodes present at the new run's first start only. A node away
    then (here: the fast tier ``away``) came back after the new run's crash with the deleted run's step 12, newer
    than the new run's durable step 5: the new run resumed the deleted run's weights, with no warning."""
    url, away, other = str(tmp_path / "ckpt"), str(tmp_path / "away"), str(tmp_path / "other")
    run(url, away, 12, interval=5, seed=0)  # the deleted run: durable 5 and 10, fast tier 12
    shutil.rmtree(url)
    _, kept = run(url, other, 8, interval=5, seed=7, keep=(5,))  # the new run, on another node: durable 5, fast 8
    step, resumed, ckpt = resumes(url, away)  # restarted on the node that was away
    assert step == 5, "the new run's own durable step, not the deleted run's fast-tier step 12"
    assert_same(flat(resumed), kept[5])
    assert resume_events(url)[-1]["tier"] == "durable"
    ckpt.close()


def test_a_crash_before_the_first_durable_save_resumes_from_the_fast_tier(tmp_path):
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    state, _ = run(url, fast, 3, interval=10)
    assert layout.list_steps(Storage(url)) == {}
    step, resumed, ckpt = resumes(url, fast)
    assert step == 3, "the journal records the crashed start: the fast tier's parts are this directory's"
    assert_same(flat(resumed), snapshot(state))
    ckpt.close()


def test_a_step_due_on_both_tiers_is_staged_once_and_committed_in_both(tmp_path):
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    phases: list[tuple[str, int]] = []
    state = make(seed=0)
    with CheckpointManager(url, interval=2, fast_dirpath=fast, fast_interval=1) as ckpt:
        ckpt.engine.phase_hook = lambda phase, step: phases.append((phase, step))
        for step in (1, 2):
            train_step(state)
            ckpt.maybe_save(step, state)
        ckpt.wait()
        assert [p for p in phases if p[0] == "staging"] == [("staging", 1), ("staging", 2)]
        assert ckpt.latest() == 2 and ckpt.fast is not None and ckpt.fast.committed == 2
        assert ckpt.last_save is not None and ckpt.last_save.durable


def test_retention_keeps_the_committed_step_and_the_one_being_written_only(tmp_path):
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    run(url, fast, 5, interval=100)
    assert list(layout.list_steps(runs_in(fast)[0].storage(0))) == [5]


def test_a_clean_end_deletes_the_runs_fast_tier(tmp_path):
    fast = str(tmp_path / "fast")
    state = make(seed=0)
    with CheckpointManager(str(tmp_path / "ckpt"), interval=100, fast_dirpath=fast, fast_interval=1) as ckpt:
        train_step(state)
        ckpt.maybe_save(1, state)
        ckpt.wait()
        assert len(runs_in(fast)) == 1
    assert os.listdir(fast) == []


def test_another_runs_files_are_never_used_and_are_removed_once_its_processes_are_gone(tmp_path, monkeypatch):
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    monkeypatch.setenv("FT_CHECKPOINT_RUN_ID", "first-job")
    run(url, fast, 3, interval=100)
    first = FastFolder(fast, own_key(url))
    assert first.committed(0) is not None
    monkeypatch.setenv("FT_CHECKPOINT_RUN_ID", "second-job")
    step, _, ckpt = resumes(url, fast)
    assert step is None, "another run's fast-tier step is never loaded"
    assert os.path.isdir(first.root), "its owner (this process) is alive: left alone"
    ckpt.close()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    first.write_owner(os.path.abspath(url), [int(gone.stdout)])  # as if written by a process that has exited
    _, _, ckpt = resumes(url, fast)
    assert not os.path.exists(first.root)
    ckpt.close()


def test_a_run_whose_ranks_died_keeps_its_folder_while_torchruns_agent_lives(tmp_path, monkeypatch):
    """Under torchrun the agent outlives its ranks: it restarts them, or waits for a lost node to join again (minutes).
    Another run starting on the node meanwhile took the ranks' dead pids for a run that was gone, and deleted the
    fast tier the restart was to resume from. Each rank records the agent's pid (its parent) beside its own."""
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    monkeypatch.setenv("FT_CHECKPOINT_RUN_ID", "first-job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # what torchrun sets in its ranks
    run(url, fast, 3, interval=100)
    first = FastFolder(fast, own_key(url))
    assert os.getppid() in first.owner()["pids"]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    first.write_owner(os.path.abspath(url), [int(gone.stdout), os.getpid()])  # a dead rank, a live agent
    monkeypatch.setenv("FT_CHECKPOINT_RUN_ID", "second-job")
    _, _, ckpt = resumes(url, fast)
    ckpt.close()
    assert first.committed(0) is not None, "the first job's fast tier is there for its restart"


HOLDER = """
import sys, time
from ft_checkpoint import CheckpointManager
from tests.helpers.toy import make
ckpt = CheckpointManager(sys.argv[1], interval=100, fast_dirpath=sys.argv[2], fast_interval=1)
ckpt.save(1, make(), block=True)
print("saved", flush=True)
time.sleep(300)
"""


def test_a_live_run_whose_pids_name_no_process_here_keeps_its_folder(tmp_path, monkeypatch):
    """A job in another PID namespace (a container sharing /dev/shm and the host name) writes pids into its
    owner.json that name no process here: another run's start took it for gone and deleted its fast tier under it.
    Each of a run's processes holds a lock on its folder; the kernel drops it when the process ends."""
    fast = str(tmp_path / "fast")
    monkeypatch.setenv("FT_CHECKPOINT_RUN_ID", "live-job")
    live = str(tmp_path / "live")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, live, fast], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "saved"
        folder = FastFolder(fast, own_key(live))
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        folder.write_owner(os.path.abspath(live), [int(gone.stdout)])  # its pids, as seen from this namespace
        monkeypatch.setenv("FT_CHECKPOINT_RUN_ID", "other-job")
        run(str(tmp_path / "other"), fast, 1)
        assert folder.committed(0) is not None and list(layout.list_steps(folder.storage(0))) == [1], "deleted"
    finally:
        holder.kill()
        holder.wait()
    run(str(tmp_path / "other"), fast, 1)  # its process is gone now: its folder is removed
    assert not os.path.exists(folder.root)


def tree(path: str) -> dict[str, bytes]:
    """Every file under ``path`` and its bytes."""
    return {os.path.relpath(os.path.join(here, name), path): open(os.path.join(here, name), "rb").read()
            for here, _, names in os.walk(path) for name in names}


def plant(fast: str, key: str, target: str, how: str) -> str:
    """What another user of the node can put where a run's fast-tier folder goes, ``<fast>/run-<key>`` (its key
    computed from the dirpath and the job id, as the job does), so that rank 0's folder leads to ``target``."""
    root, lure = os.path.join(fast, key), os.path.join(os.path.dirname(fast), "lure")
    os.makedirs(fast, exist_ok=True)
    if how == "a link":  # the run folder itself links to a folder holding rank_00000 -> target
        os.makedirs(lure)
        os.symlink(target, os.path.join(lure, "rank_00000"))
        os.symlink(lure, root)
        return root
    os.mkdir(root, 0o700)
    os.symlink(target, os.path.join(root, "rank_00000"))
    if how == "writable by all":
        os.chmod(root, 0o777)
    elif how == "another user's":
        os.chown(root, 65534, 65534)
        os.lchown(os.path.join(root, "rank_00000"), 65534, 65534)
    return root


@pytest.mark.parametrize("how", ["writable by all", "a link", "a rank link", "another user's"])
def test_a_run_folder_another_user_prepared_is_refused_and_what_it_links_to_is_untouched(tmp_path, monkeypatch,
                                                                                       caplog, how):
    """Another user of the node computes the run's key and prepares ``<fast>/run-<key>`` with ``rank_00000`` linking
    to another run of the victim: the job used to write its parts there, then delete that run's steps. The folder
    is refused (a warning naming it and what to do), the other run is untouched, and the job trains and saves to
    its durable tier."""
    if how == "another user's" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    monkeypatch.setenv("FT_CHECKPOINT_RUN_ID", "job-1234")
    url, fast, other = str(tmp_path / "ckpt"), str(tmp_path / "fast"), str(tmp_path / "other-run")
    run(other, str(tmp_path / "other-fast"), 3, interval=1, fast_interval=100)
    before = tree(other)
    assert layout.committed_steps(Storage(other)) == [1, 2, 3]
    CheckpointManager(url, interval=2).close()  # the job's first start: its journal names the directory's run
    root = plant(fast, own_key(url), other, how)
    state = make(seed=0)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        with CheckpointManager(url, interval=2, fast_dirpath=fast, fast_interval=1) as ckpt:
            for step in range(1, 4):
                train_step(state)
                ckpt.maybe_save(step, state)
    assert tree(other) == before, "nothing is written into, or deleted from, what the folder links to"
    assert ckpt.fast is None
    assert "the fast tier is not used" in caplog.text and f"only): {root}" in caplog.text and "HINT:" in caplog.text
    assert layout.committed_steps(Storage(url)) == [2, 3], "the job trains and saves to its durable tier"


@pytest.mark.parametrize(("mode", "used"), [(0o777, False), (0o1777, True)])
def test_a_fast_dirpath_others_can_write_is_used_only_with_the_sticky_bit(tmp_path, caplog, mode, used):
    """In a folder others can write, without the sticky bit (``/dev/shm``'s), another user can rename the run's
    folder away and put a link in its place at any time: the fast tier is not used there."""
    fast = tmp_path / "shared"
    fast.mkdir()
    fast.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        with CheckpointManager(str(tmp_path / "ckpt"), interval=100, fast_dirpath=str(fast), fast_interval=1) as ckpt:
            assert (ckpt.fast is not None) == used
    assert ("sticky bit" in caplog.text) != used


def repoint(link: str, target: str, uid: int | None = None) -> None:
    """Point the symbolic link ``link`` at ``target`` (atomically), a link of user ``uid`` (default: this one)."""
    os.symlink(target, link + ".new")
    if uid is not None:
        os.lchown(link + ".new", uid, uid)
    os.rename(link + ".new", link)


def test_a_fast_dirpath_that_is_another_users_link_is_refused_and_never_followed_later(tmp_path, monkeypatch, caplog):
    """Another user makes the README's ``/dev/shm/ft`` a link of theirs to a folder that passes the checks (root's,
    sticky), then, once the job has claimed its folder there, points it at a folder of theirs whose ``rank_00000``
    links to another run of the victim: every later fast-tier operation went by the path, through the link, and the
    first fast save's retention deleted that run's steps. The link is refused now; and the fast tier works in the
    real path resolved at its start, whatever a link on the way points to later."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's link needs root")
    shm, sticky = tmp_path / "shm", tmp_path / "sticky"
    for folder in (shm, sticky):
        folder.mkdir()
        folder.chmod(0o1777)  # as /dev/shm and /tmp: root's, anyone writes, sticky
    victim = str(tmp_path / "precious")
    run(victim, str(tmp_path / "victim-fast"), 2, interval=1, fast_interval=100)
    before = tree(victim)
    fast = str(shm / "ft")
    repoint(fast, str(sticky), uid=65534)
    claim = FastFolder.claim

    def claim_then_repoint(self):  # the other user's swap, right after the checks
        problem = claim(self)
        evil = os.path.join(shm, "evil")
        os.makedirs(os.path.join(evil, self.key))
        os.symlink(victim, os.path.join(evil, self.key, "rank_00000"))
        for path in (evil, os.path.join(evil, self.key), os.path.join(evil, self.key, "rank_00000")):
            os.lchown(path, 65534, 65534)
        repoint(fast, evil, uid=65534)
        return problem

    monkeypatch.setattr(FastFolder, "claim", claim_then_repoint)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        with CheckpointManager(str(tmp_path / "ckpt"), interval=100, fast_dirpath=fast, fast_interval=1) as ckpt:
            for step in (5, 6):
                ckpt.save(step, make(), block=True)
    assert tree(victim) == before, "nothing is written into, or deleted from, what the link leads to"
    assert ckpt.fast is None and f"{fast} is a symbolic link of nobody (uid 65534)" in caplog.text


def test_the_fast_tier_stays_in_the_folder_it_resolved_at_its_start(tmp_path):
    """A link of the user's own on the way to ``fast_dirpath`` is followed once, at the start: pointed elsewhere
    later, it no longer moves the fast tier."""
    real, other = tmp_path / "real", tmp_path / "other"
    real.mkdir()
    other.mkdir()
    link = str(tmp_path / "fast")
    os.symlink(real, link)
    with CheckpointManager(str(tmp_path / "ckpt"), interval=100, fast_dirpath=link, fast_interval=1) as ckpt:
        assert ckpt.fast is not None and ckpt.fast.folder.root.startswith(str(real))
        repoint(link, str(other))
        ckpt.save(1, make(), block=True)
        assert ckpt.fast.committed == 1 and runs_in(str(real)) and not os.listdir(other)


@pytest.mark.parametrize(("mode", "used"), [(0o777, False), (0o1777, True), (0o755, True)])
def test_a_fast_dirpath_below_a_folder_others_can_write_is_used_only_with_the_sticky_bit(tmp_path, caplog, mode, used):
    """``<open>/ft`` may be this user's own, but whoever can write ``<open>`` (without its sticky bit) can rename
    ``ft`` away and put a link in its place: every folder on the way is checked, as ``fast_dirpath`` itself is."""
    above = tmp_path / "open"
    above.mkdir()
    above.chmod(mode)
    (above / "ft").mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        with CheckpointManager(str(tmp_path / "ckpt"), interval=100, fast_dirpath=str(above / "ft"),
                               fast_interval=1) as ckpt:
            assert (ckpt.fast is not None) == used
    assert (f"{above} can be written by other users" in caplog.text) != used


def test_another_runs_folder_that_others_can_write_is_never_deleted(tmp_path):
    """Deleting a folder others can write would race them (a rank folder swapped for a link between the check and
    the delete): another run's folder is removed only if it is this user's own."""
    fast = str(tmp_path / "fast")
    other = FastFolder(fast, run_key("/elsewhere", "job-0", "20261128T000000.000000Z-def456"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other.write_owner("/elsewhere", [int(gone.stdout)])  # written by a process that has exited
    os.makedirs(other.storage(0).path())
    os.chmod(other.root, 0o777)
    _, _, ckpt = resumes(str(tmp_path / "ckpt"), fast)
    assert os.path.isdir(other.storage(0).path()), "left alone"
    ckpt.close()


def finishes(fn, seconds: float = 30.0):
    """``fn()``'s result, or a failure if it is still running after ``seconds`` (blocked opening a FIFO: a writer
    is opened on each FIFO under the test's folder then, so that the thread ends before the test does)."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        for here, _, names in os.walk(os.environ["FT_TEST_FIFOS"]):
            for name in names:
                path = os.path.join(here, name)
                if os.path.exists(path) and not os.path.isfile(path):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail(f"still blocked after {seconds} s")
    return out[0] if out else None


@pytest.mark.parametrize("whose", ["another user's", "this user's"])
def test_a_fifo_for_owner_json_in_a_folder_named_like_a_run_never_blocks_a_start_nor_ls(tmp_path, monkeypatch,
                                                                                        whose):
    """Any user of a node can make a folder named like a run's in a shared ``fast_dirpath`` (``/dev/shm``): every
    start read each such folder's ``owner.json`` (to remove the folders of runs that are gone) with a plain
    ``open``, and a FIFO there blocked it forever, as it did ``ft-checkpoint ls --fast``. Another user's folder is
    not read at all now; this user's own is read without waiting, and a FIFO in it is ignored."""
    if whose == "another user's" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    fast = tmp_path / "shm"
    fast.mkdir()
    fast.chmod(0o1777)  # as /dev/shm
    forged = fast / "run-0123456789abcdef"
    forged.mkdir(0o700)
    os.mkfifo(forged / "owner.json")
    if whose == "another user's":
        os.chown(forged, 65534, 65534)
    monkeypatch.setenv("FT_TEST_FIFOS", str(fast))
    url = str(tmp_path / "ckpt")

    def start_and_save() -> int | None:
        with CheckpointManager(url, interval=1, fast_dirpath=str(fast), fast_interval=1) as ckpt:
            assert ckpt.fast is not None, "the fast tier is used: the forged folder is another run's, not this one's"
            ckpt.save(1, make(), block=True)
            return ckpt.fast.committed

    assert finishes(start_and_save) == 1
    assert forged.is_dir() and (forged / "owner.json").is_fifo(), "left alone"
    from ft_checkpoint.tools.catalog import fast_tier_steps

    assert finishes(lambda: fast_tier_steps(os.path.abspath(url), str(fast))) == {}, "a clean end emptied its own"


def test_ls_never_counts_another_users_copy_of_a_runs_fast_tier_folder(tmp_path):
    """A resume uses only this user's own folders; ``ls --fast`` listed every folder whose owner.json names the run,
    so another user's copy of one (its owner.json and parts intact) showed as a second holder of the step."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    from ft_checkpoint.tools.catalog import fast_tier_steps

    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    run(url, fast, 1, interval=100)
    (own,) = runs_in(fast)
    forged = os.path.join(fast, "run-0123456789abcdef")
    shutil.copytree(own.root, forged, symlinks=True)
    for here, dirs, names in os.walk(forged):
        for name in [".", *dirs, *names]:
            os.lchown(os.path.join(here, name), 65534, 65534)
    held = fast_tier_steps(os.path.abspath(url), fast)
    assert held[1]["folders"] == [own.storage(0).url]


def test_another_world_size_falls_back_to_the_durable_tier_saying_why(tmp_path, caplog):
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    _, kept = run(url, fast, 6, keep=(4,))
    folder = runs_in(fast)[0]
    mark = folder.committed(0)
    assert mark is not None
    folder.commit(0, step=6, world_size=2, save=mark.save)  # what a job of 2 ranks writes there
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        step, resumed, ckpt = resumes(url, fast)
    assert step == 4
    assert_same(flat(resumed), kept[4])
    assert "fast-tier step 6 was saved by 2 ranks and this job has 1" in caplog.text
    ckpt.close()


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(options)``: a new tmpfs mounted with ``options`` (``"size=1m"``), as a container's small /dev/shm
    (needs root; skipped otherwise), unmounted at the end."""
    mounted: list[str] = []

    def mount(options: str) -> str:
        where = tmp_path / f"shm{len(mounted)}"
        where.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(str(where))
        return str(where)

    yield mount
    for where in mounted:
        subprocess.run(["umount", where], check=True)


@pytest.fixture
def small_tmpfs(tmpfs):
    """A 1 MiB tmpfs."""
    return tmpfs("size=1m")


def take_files(where: str, *, leave: int) -> None:
    """Another process takes all but ``leave`` of the files (inodes) the filesystem of ``where`` can hold."""
    os.makedirs(f"{where}/other_job")
    n = 0
    with pytest.raises(OSError, match="No space left"):
        while True:
            open(f"{where}/other_job/{n}", "wb").close()
            n += 1
    for i in range(leave):
        os.remove(f"{where}/other_job/{n - 1 - i}")


def remount_read_only(where: str, *, leave: int) -> None:
    subprocess.run(["mount", "-o", "remount,ro", where], check=True)


@pytest.mark.parametrize("fault, error", [(take_files, "no space left on device"),
                                          (remount_read_only, "Read-only file system")])
def test_a_fast_tier_write_that_fails_midrun_never_stops_training_and_leaves_no_partial_step(tmp_path, tmpfs, caplog,
                                                                                              fault, error):
    fast, state = tmpfs("size=8m,nr_inodes=64"), make(seed=0)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"), \
            CheckpointManager(str(tmp_path / "ckpt"), interval=2, fast_dirpath=fast, fast_interval=1) as ckpt:
        for step in range(1, 6):
            train_step(state)
            ckpt.maybe_save(step, state)
            ckpt.wait()
            if step == 3:  # step 4's write fails inside DCP's save, after its directory and a data file (take_files)
                fault(fast, leave=2)
        assert ckpt.latest() == 4, "the durable save of the step due on both tiers commits"
        assert ckpt.fast is not None and ckpt.fast.committed == 3
        assert layout.list_steps(ckpt.fast.folder.storage(0)) == {3: True}, "no partial step 4 or 5 stays"
    assert "fast-tier step 4 not committed (not written everywhere)" in caplog.text and error in caplog.text


def test_a_fast_tier_too_small_for_the_non_tensor_state_is_not_filled(tmp_path, tmpfs, caplog):
    fast, state = tmpfs("size=4m"), {"model": torch.nn.Linear(4, 4), "order": list(range(600_000))}  # ~3 MB pickled
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"), \
            CheckpointManager(str(tmp_path / "ckpt"), interval=2, fast_dirpath=fast, fast_interval=1) as ckpt:
        for step in (1, 2):
            ckpt.maybe_save(step, state)
            ckpt.wait()
            assert shutil.disk_usage(fast).free > 4_000_000, "the fast tier is left with its room"
        assert ckpt.latest() == 2 and ckpt.fast is not None and ckpt.fast.committed is None
        assert layout.list_steps(ckpt.fast.folder.storage(0)) == {}
    assert re.search(r"fast-tier step 1 not committed .*has 4.\d+ MB free, and needs [6-9].\d+ MB .*HINT: give it more "
                     "room", caplog.text)


def test_whatever_the_fast_tiers_write_raises_the_durable_write_of_the_same_step_commits(tmp_path, caplog):
    def fails(staged: dict) -> None:  # DCP's exception is a BaseException
        raise CheckpointException("fast tier", {0: (StorageError("write x: no space left on device"),
                                                    traceback.extract_stack())})

    engine = CheckpointEngine(Storage(str(tmp_path / "ckpt")), Groups())
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        engine.save(7, {"w": torch.arange(3.0)}, tier_write=fails)
        stats = engine.wait()
    engine.close()
    assert stats is not None and stats.committed and layout.list_steps(engine.storage) == {7: True}
    assert "no space left on device" in caplog.text


def test_a_fast_tier_too_small_fails_at_the_first_save_with_free_and_needed_bytes(tmp_path, small_tmpfs):
    state = make(seed=0, width=4096)
    with CheckpointManager(str(tmp_path / "ckpt"), interval=100, fast_dirpath=small_tmpfs, fast_interval=1,
                           final_save=False) as ckpt:
        train_step(state)
        with pytest.raises(ConfigError, match=r"has 1.0\d MB free, and needs 4.\d+ MB .*HINT: give it more room"):
            ckpt.maybe_save(1, state)
        assert ckpt.fast is not None and layout.list_steps(ckpt.fast.folder.storage(0)) == {}


def test_a_copy_whose_bytes_do_not_match_the_senders_manifest_is_refused_and_left_nowhere(tmp_path):
    sender, receiver = Storage(str(tmp_path / "a"), fsync=False), Storage(str(tmp_path / "b"), fsync=False)
    write_rank_step(sender, 7, {"w": torch.arange(1000.0)}, b"rank file", rank=0, world_size=1, save="a1b2")
    path = sender.path(f"{layout.step_dir(7)}/__0_0.distcp")
    data = bytearray(open(path, "rb").read())
    data[10] ^= 0x01
    open(path, "wb").write(data)  # damaged after its manifest was written: the sender does not know
    stream = Outgoing(sender, 7)
    copy_ = Incoming(receiver, 7, stream.header, sender="rank 0")
    chunk = bytearray(stream.total)
    stream.fill(memoryview(chunk))
    copy_.drain(memoryview(chunk))
    with pytest.raises(CheckpointCorruptError, match="do not match the sender's checksum"):
        copy_.finish()
    assert layout.list_steps(receiver) == {}


def test_a_copy_never_writes_through_a_link_in_place_of_its_step_directory(tmp_path):
    """A peer's part is received into this node's folder as a save writes its own: a link where the step directory
    goes is removed itself, and the copy lands in a real directory; what the link pointed to is untouched."""
    sender, receiver = Storage(str(tmp_path / "a"), fsync=False), Storage(str(tmp_path / "b"), fsync=False)
    write_rank_step(sender, 7, {"w": torch.arange(1000.0)}, b"rank file", rank=0, world_size=1, save="a1b2")
    outside = tmp_path / "outside"
    outside.mkdir()
    receiver.ensure_root()
    os.symlink(outside, receiver.path(layout.step_dir(7)))
    stream = Outgoing(sender, 7)
    copy_ = Incoming(receiver, 7, stream.header, sender="rank 0")
    chunk = bytearray(stream.total)
    stream.fill(memoryview(chunk))
    copy_.drain(memoryview(chunk))
    copy_.finish()
    assert os.listdir(outside) == []
    assert not os.path.islink(receiver.path(layout.step_dir(7))) and layout.check_step(receiver, 7).ok


@pytest.mark.parametrize("swap", ["a FIFO", "a link to another run's file"])
def test_a_file_swapped_after_its_manifest_is_sent_as_zeros_never_blocks_nor_reads_elsewhere(tmp_path, swap):
    """The sender opened each file of its part by its path: a FIFO in its place blocked the transfer (and every
    rank waiting on it) forever; a link sent another file's bytes. It is opened as a resume opens one now."""
    sender, receiver = Storage(str(tmp_path / "a"), fsync=False), Storage(str(tmp_path / "b"), fsync=False)
    write_rank_step(sender, 7, {"w": torch.arange(1000.0)}, b"rank file", rank=0, world_size=1, save="a1b2")
    path = sender.path(f"{layout.step_dir(7)}/__0_0.distcp")
    size = os.path.getsize(path)
    os.unlink(path)
    if swap == "a FIFO":
        os.mkfifo(path)
    else:
        other = tmp_path / "other.bin"
        other.write_bytes(b"x" * size)
        os.symlink(other, path)
    stream = Outgoing(sender, 7)
    chunk = bytearray(stream.total)
    filler = threading.Thread(target=stream.fill, args=(memoryview(chunk),), daemon=True)
    filler.start()
    filler.join(30)  # a guard, not a measure
    assert not filler.is_alive(), "the sender blocked on the file"
    stream.close()
    copy_ = Incoming(receiver, 7, stream.header, sender="rank 0")
    copy_.drain(memoryview(chunk))
    with pytest.raises(CheckpointCorruptError, match="do not match the sender's checksum"):
        copy_.finish()
    assert stream.problems and layout.list_steps(receiver) == {}


def test_a_copy_never_writes_through_a_link_planted_in_place_of_one_of_its_files(tmp_path, monkeypatch):
    """Between the clear of the step directory and the write of a file, a link to another run's file takes the
    file's name: the receiver opened the name and wrote through the link. Now it writes a new file in its place."""
    sender, receiver = Storage(str(tmp_path / "a"), fsync=False), Storage(str(tmp_path / "b"), fsync=False)
    write_rank_step(sender, 7, {"w": torch.arange(1000.0)}, b"rank file", rank=0, world_size=1, save="a1b2")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"other run")
    stream = Outgoing(sender, 7)
    copy_ = Incoming(receiver, 7, stream.header, sender="rank 0")
    os.makedirs(receiver.path(layout.step_dir(7)), exist_ok=True)
    os.symlink(victim, receiver.path(f"{layout.step_dir(7)}/__0_0.distcp"))
    chunk = bytearray(stream.total)
    stream.fill(memoryview(chunk))
    copy_.drain(memoryview(chunk))
    copy_.finish()
    assert victim.read_bytes() == b"other run" and layout.check_step(receiver, 7).ok


def test_fast_tier_settings_come_from_the_environment_and_are_checked(monkeypatch):
    monkeypatch.setenv("FT_CHECKPOINT_FAST_DIRPATH", "/dev/shm/ft")
    monkeypatch.setenv("FT_CHECKPOINT_FAST_INTERVAL", "50")
    monkeypatch.setenv("FT_CHECKPOINT_FAST_REPLICAS", "0")
    monkeypatch.setenv("FT_CHECKPOINT_NODE_ID", "rack3-node7")
    c = CheckpointConfig.from_env(dirpath="gs://b/run")
    assert (c.fast_dirpath, c.fast_interval, c.fast_replicas, c.node_id) == ("/dev/shm/ft", 50, 0, "rack3-node7")
    with pytest.raises(ConfigError, match="fast_dirpath='gs://b/fast' is invalid: expected a node-local path"):
        CheckpointConfig(dirpath="gs://b/run", fast_dirpath="gs://b/fast")
    with pytest.raises(ConfigError, match="fast_replicas=2 is invalid"):
        CheckpointConfig(dirpath="gs://b/run", fast_replicas=2)


def test_ls_shows_which_tiers_hold_each_step_and_inspect_shows_a_fast_tier_part(tmp_path, capsys):
    from ft_checkpoint.tools.cli import main

    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    run(url, fast, 5)  # durable step 4, fast step 5 (4 was deleted from the fast tier when 5 committed)
    assert main(["ls", url, "--fast", fast]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["4"], ["5"])}
    assert "newest committed here: step 4; a resume tries the fast tier's step 5 first" in out.splitlines()[0], out
    assert "durable" in rows["4"] and "fast" not in rows["4"]
    assert "committed" in rows["5"] and "fast (1 rank here)" in rows["5"]
    assert main(["ls", url, "--fast", fast, "--json"]) == 0
    held = json.loads(capsys.readouterr().out)["fast"]["5"]
    assert held["ranks"] == [0] and held["committed"] and held["bytes"] > 0
    assert main(["inspect", held["folders"][0], "--step", "5"]) == 0
    assert "fast tier: rank 0's part of a step of 1 ranks" in capsys.readouterr().out


def test_ls_with_a_key_no_step_verifies_with_says_a_resume_stops_whatever_the_fast_tier_holds(tmp_path, capsys,
                                                                                               monkeypatch):
    """The fast tier's newer step took the first line's place, "a resume would stop with an error" gone, where a
    resume with that key does stop: no step of the durable tier verifies with it."""
    from ft_checkpoint.errors import SignatureError
    from ft_checkpoint.tools.cli import main

    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    run(url, fast, 5, signing_key="a" * 64)  # durable step 4, fast step 5, both signed with another key
    monkeypatch.setenv("FT_CHECKPOINT_SIGNING_KEY", "b" * 64)
    assert main(["ls", url, "--fast", fast]) == 0
    assert "no step verifies with the key: a resume would stop with an error" in capsys.readouterr().out.splitlines()[0]
    ckpt = CheckpointManager(url, interval=4, fast_dirpath=fast, fast_interval=1, signing_key="b" * 64)
    try:
        with pytest.raises(SignatureError, match="no step .* verifies with this job's signing key"):
            ckpt.resume(make(seed=1))
    finally:
        ckpt.close(clean=False)


def test_a_resume_never_mixes_the_parts_of_two_saves_of_the_same_step():
    """Step 10 committed by save s1; after a resume from an older step, save s2 rewrote rank 0's part of step 10 on
    node a and crashed before its commit. Rank 0 must take s1's copy from node b, never s2's part."""
    from ft_checkpoint.tiers.folder import Mark
    from ft_checkpoint.tiers.node import Ring
    from ft_checkpoint.tiers.sources import Holding, plan_steps

    ring = Ring(("a", "b"))
    a = Holding("a", marks={0: Mark(10, 2, "s1")}, steps={10: {0: "s2", 1: "s1"}})
    b = Holding("b", marks={1: Mark(10, 2, "s1")}, steps={10: {0: "s1", 1: "s1"}})
    plan = plan_steps([a, b], ring)[0]
    assert (plan.step, plan.save, plan.holders) == (10, "s1", (1, 1)), "rank 0's part comes from node b's copy"
    b_lost = Holding("b", marks={}, steps={})
    assert plan_steps([a, b_lost], ring) == [], "no complete s1 without node b: the durable tier, not a mixture"


def test_a_clean_end_saves_its_last_step_to_the_durable_tier_even_when_the_fast_tier_has_it(tmp_path):
    """A final save is skipped only for a step the durable tier has: the fast tier had step 3 (saved every step),
    and a clean end deletes the fast tier, so skipping it there would have left the finished run at step 0."""
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    state = make(seed=0)
    with CheckpointManager(url, interval=100, fast_dirpath=fast, fast_interval=1) as ckpt:
        for step in range(1, 4):
            train_step(state)
            ckpt.maybe_save(step, state)
    assert layout.committed_steps(Storage(url)) == [3]
    resumed = make(seed=1)
    with CheckpointManager(url, interval=100, fast_dirpath=fast, fast_interval=1) as ckpt:
        assert ckpt.resume(resumed) == 3 and not ckpt.resumed_source.startswith("fast tier")
    assert_same(flat(resumed), flat(state))


def test_a_final_save_of_a_step_the_fast_tier_has_writes_the_durable_tier_only(tmp_path, monkeypatch):
    """The clean end's final save of step 3, which the fast tier had committed, wrote the fast tier again first:
    that write deletes the committed copy before writing the new one, so a crash there (SIGKILL) left the fast
    tier without step 3 and, the durable tier not written yet, a restart started fresh. Each save of the fast tier
    has a name of its own (a part of another save of the step is never taken for it), and the final save of a
    step the fast tier has writes the durable tier only: the fast tier's copy stays until the clean end."""
    from ft_checkpoint.tiers import fast_tier

    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    written: list[int] = []
    real = fast_tier.write_rank_step
    monkeypatch.setattr(fast_tier, "write_rank_step", lambda storage, step, *a, **k: written.append(step)
                        or real(storage, step, *a, **k))
    state, names = make(seed=0), []
    with CheckpointManager(url, interval=100, fast_dirpath=fast, fast_interval=1) as ckpt:
        for step in range(1, 4):
            train_step(state)
            ckpt.maybe_save(step, state)
            ckpt.wait()
            names.append(ckpt.fast.folder.committed(0).save)
        assert ckpt.save(3, state, block=True).committed  # an explicit save of the same step: durable only, too
    assert written == [1, 2, 3] and len(set(names)) == 3, (written, names)
    assert layout.committed_steps(Storage(url)) == [3]


def test_a_finished_runs_last_step_resumed_from_the_fast_tier_reaches_the_durable_tier(tmp_path):
    """A crash after the last step's fast save: the restart resumes step 5 from the fast tier and has nothing left to
    train. Its clean close saved nothing (no step given to maybe_save) and deleted the fast tier; a save of step 5
    was refused ("step 5 is committed there already": the fast-tier resume counted as the directory's newest), so a
    restart under torchrun failed the same way every time. The close now saves step 5 to the durable tier."""
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    _, kept = run(url, fast, 5, interval=100, keep=(5,))
    assert layout.committed_steps(Storage(url)) == []
    step, _, ckpt = resumes(url, fast)
    assert step == 5 and ckpt.resumed_source.startswith("fast tier")
    ckpt.close()
    assert layout.committed_steps(Storage(url)) == [5]
    step, resumed, ckpt = resumes(url, fast)
    assert step == 5 and not ckpt.resumed_source.startswith("fast tier")
    assert_same(flat(resumed), kept[5])
    ckpt.close(clean=False)


KEY = "5f0c9e2a7d41b8363ac2e9f17b0d4c5a" * 2


def test_a_restart_with_the_wrong_signing_key_keeps_the_fast_tiers_step(tmp_path):
    """A restart given another key than the run's refuses every step, and says the durable steps are kept for the
    right key; the fast tier's newest step, taken for a corrupt part, was deleted: the restart with the right key
    resumed from the durable step 4, not the fast tier's 6."""
    from ft_checkpoint.errors import SignatureError

    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    _, kept = run(url, fast, 6, keep=(6,), signing_key=KEY)
    with pytest.raises(SignatureError):
        resumes(url, fast, signing_key=KEY[::-1])
    step, resumed, ckpt = resumes(url, fast, signing_key=KEY)
    assert step == 6 and ckpt.resumed_source.startswith("fast tier")
    assert_same(flat(resumed), kept[6])
    ckpt.close(clean=False)


def test_with_a_signing_key_a_fast_tier_part_forged_with_valid_checksums_is_not_loaded(tmp_path, caplog):
    """Someone who can write the node's fast-tier folder (``/dev/shm`` is writable by every user of the node) puts a
    self-consistent part of another run in place of step 6, its manifest's checksums all correct and its ownership
    fields copied from the real one: with the key, the unsigned part is refused and the durable step 4 is resumed
    instead (a job without the key refuses to start on the signed run)."""
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    _, kept = run(url, fast, 6, keep=(4, 6), signing_key=KEY)
    part = runs_in(fast)[0].storage(0)
    real = json.loads(part.read_bytes(f"{layout.step_dir(6)}/{layout.MANIFEST}"))
    assert real["signature"]["mac"], "a fast-tier part's manifest is signed as a durable one is"
    step, resumed, ckpt = resumes(url, fast, signing_key=KEY)
    assert step == 6 and ckpt.resumed_source.startswith("fast tier"), "a signed part verifies and loads"
    assert_same(flat(resumed), kept[6])
    ckpt.close(clean=False)

    evil_fast = str(tmp_path / "evil")
    run(str(tmp_path / "evil-ckpt"), evil_fast, 6, seed=5)
    evil = runs_in(evil_fast)[0].storage(0)
    forged = json.loads(evil.read_bytes(f"{layout.step_dir(6)}/{layout.MANIFEST}"))
    forged["metadata"]["fast_tier"] = real["metadata"]["fast_tier"]
    for name in forged["files"]:
        part.write_bytes(f"{layout.step_dir(6)}/{name}", evil.read_bytes(f"{layout.step_dir(6)}/{name}"))
    part.write_bytes(f"{layout.step_dir(6)}/{layout.MANIFEST}", json.dumps(forged).encode())

    with pytest.raises(ConfigError, match="is signed, and this job has no signing key"):  # nor a job without the key
        resumes(url, fast)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        step, resumed, ckpt = resumes(url, fast, signing_key=KEY)
    assert step == 4 and not ckpt.resumed_source.startswith("fast tier")
    assert_same(flat(resumed), kept[4])
    assert "fast-tier step 6 (own node) is not used" in caplog.text and "not signed" in caplog.text
    ckpt.close()
