"""The lock on ``lease.lock``: proof, on one kernel, that a lease's owner in another PID namespace is gone.

The end-to-end case (a container restarted in place, real PID namespaces) is in test_lease.py; here, leases as a
pod of another PID namespace writes them, and what a lock held, missing, or of the wrong kind makes of them.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import LeaseError
from ft_checkpoint.run.lease import LEASE, process_space
from ft_checkpoint.run.owner_lock import LOCK, OwnerLock
from ft_checkpoint.store.storage import Storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPACE = process_space()
pytestmark = pytest.mark.skipif(SPACE is None, reason="no /proc: no process space to compare")


def write_pod_lease(url: str, *, lock: bool | None, boot: str | None = None, pid: int = 1,
                    same_namespace: bool = False) -> None:
    """The lease of ``pid`` in another PID namespace of this host (or of the kernel ``boot``; or in this namespace),
    heartbeat just now."""
    this_boot, _, namespace = str(SPACE).partition("/")
    os.makedirs(url, exist_ok=True)
    space = SPACE if same_namespace else f"{boot or this_boot}/{int(namespace) + 1}"
    record = {"attempt": "old-pod", "host": socket.gethostname(), "pid": pid, "job": None, "restarts": {},
              "space": space, "heartbeat": time.time()}
    if lock is not None:
        record["lock"] = lock
    with open(os.path.join(url, LEASE), "w") as f:
        json.dump(record, f)


def test_a_lease_whose_owner_held_the_lock_is_taken_over_at_once_once_the_lock_is_free(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    write_pod_lease(url, lock=True)
    with caplog.at_level(logging.INFO, logger="ft_checkpoint.run.lease"), CheckpointManager(url) as ckpt:
        assert ckpt.lease.owner["lock"] is True and json.loads(ckpt.storage.read_bytes(LEASE))["lock"] is True
        assert ckpt.lease._quiet_until < time.monotonic(), "its owner is gone: no wait before the first save"
    assert "the lock on lease.lock it held while it lived is free" in caplog.text
    assert not os.path.exists(os.path.join(url, LEASE)) and os.path.isfile(os.path.join(url, LOCK))


def test_a_dead_owner_whose_pid_another_process_took_is_taken_over_at_once(tmp_path, caplog):
    """Same host, same PID namespace, and the dead owner's pid now names another process (pids are few and soon
    reused in a container): the pid looked alive, and the job was refused until the heartbeat was 2 min old."""
    import subprocess
    import sys

    url = str(tmp_path / "ckpt")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_pod_lease(url, lock=True, pid=other.pid, same_namespace=True)  # its pid taken by a live process
        with caplog.at_level(logging.INFO, logger="ft_checkpoint.run.lease"), CheckpointManager(url) as ckpt:
            assert ckpt.lease._quiet_until < time.monotonic()
        assert f"its process {other.pid} on this host is gone: the lock on lease.lock" in caplog.text
    finally:
        other.kill()
        other.wait()


def test_a_lease_whose_owner_still_holds_the_lock_is_refused_and_says_the_owner_is_alive(tmp_path):
    url = str(tmp_path / "ckpt")
    write_pod_lease(url, lock=True)
    fd = os.open(os.path.join(url, LOCK), os.O_RDONLY | os.O_CREAT, 0o644)  # the old pod, alive
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LeaseError, match=r"pid 1 \(attempt old-pod.* in another PID namespace .*alive: it "
                                             r"holds lease\.lock"):
            CheckpointManager(url)
    finally:
        os.close(fd)


def test_a_job_that_found_the_lock_held_takes_it_at_a_later_heartbeat_and_says_so(tmp_path):
    """A job that starts while the previous owner is between removing ``lease.json`` and unlocking finds the lease
    free and the lock held: it runs with ``"lock": false`` (its restart in another PID namespace could prove nothing)
    until a heartbeat finds the lock free, takes it, and writes ``"lock": true``."""
    from ft_checkpoint.run.lease import Lease

    storage = Storage(str(tmp_path))
    previous = OwnerLock(storage)
    assert previous.try_hold()
    lease = Lease(storage, attempt="new", refresh=0.2)
    lease.acquire()
    try:
        assert json.loads(storage.read_bytes(LEASE))["lock"] is False
        previous.release()
        deadline = time.monotonic() + 30
        while not json.loads(storage.read_bytes(LEASE))["lock"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(storage.read_bytes(LEASE))["lock"] is True
        assert not OwnerLock(storage).try_hold(), "the owner holds the lock its lease says it holds"
    finally:
        lease.release()


def test_a_lock_that_cannot_be_taken_says_nothing_of_its_owner(tmp_path):
    """A FIFO in place of ``lease.lock``: nobody holds a lock on it, so the refusal must not say the owner is alive."""
    url = str(tmp_path / "ckpt")
    write_pod_lease(url, lock=True)
    os.mkfifo(os.path.join(url, LOCK))
    with pytest.raises(LeaseError, match="in another PID namespace") as refused:
        CheckpointManager(url)
    assert "holds lease.lock" not in str(refused.value) and "cannot be seen from here" in str(refused.value)


@pytest.mark.parametrize("case", ["earlier-version", "owner-found-it-held", "another-kernel"])
def test_a_free_lock_proves_nothing_for_an_owner_that_did_not_hold_it_or_ran_on_another_kernel(tmp_path, case):
    """An earlier version's lease (no ``lock``), an owner that found the lock held (``false``), or one on another
    kernel (a pod moved to another node; a network filesystem may drop a lock while its owner lives, cut off): the
    lock being free here says nothing about it. Judged as before: a live heartbeat, refused."""
    url = str(tmp_path / "ckpt")
    write_pod_lease(url, lock={"earlier-version": None, "owner-found-it-held": False, "another-kernel": True}[case],
                    boot="another-boot-id" if case == "another-kernel" else None)
    with pytest.raises(LeaseError, match="another job is writing checkpoints"):
        CheckpointManager(url)
    assert OwnerLock(Storage(url)).try_hold(), "the refused job let the lock go"


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_lease_lock_that_is_no_regular_file_is_neither_followed_nor_waited_on(tmp_path, kind, caplog):
    url = str(tmp_path / "ckpt")
    os.makedirs(url)
    target = tmp_path / "elsewhere"
    path = os.path.join(url, LOCK)
    {"fifo": lambda: os.mkfifo(path), "symlink": lambda: os.symlink(target, path),
     "directory": lambda: os.mkdir(path)}[kind]()
    with caplog.at_level(logging.WARNING), CheckpointManager(url) as ckpt:
        assert ckpt.lease.owner["lock"] is False  # the lease as before: judged by heartbeat and pid
    assert not target.exists(), "nothing was created through the link"
    assert "lease.lock" in caplog.text and "HINT: remove it" in caplog.text


FORK_AND_DIE = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from ft_checkpoint.run.owner_lock import OwnerLock
from ft_checkpoint.store.storage import Storage
assert OwnerLock(Storage({url!r})).try_hold()
child = os.fork()
if child == 0:  # the worker: lives on, its output away from the test's pipe
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1); os.dup2(null, 2)
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_child_does_not_keep_the_lock_of_a_parent_that_died(tmp_path):
    """A DataLoader worker forked by the owner shares its open ``lease.lock``: had it kept the descriptor, the lock
    would outlive a trainer killed before its workers, and a restarted container would wait out the heartbeat."""
    import subprocess
    import sys

    owner = subprocess.run([sys.executable, "-c", FORK_AND_DIE.format(root=ROOT, url=str(tmp_path))],
                           capture_output=True, text=True, timeout=60)
    assert owner.returncode == -9 and owner.stdout.strip().isdigit(), owner.stdout + owner.stderr
    worker = int(owner.stdout)
    try:
        assert os.path.exists(f"/proc/{worker}"), "the forked worker outlived its parent"
        lock = OwnerLock(Storage(str(tmp_path)))
        assert lock.try_hold(), "the forked worker still holds the lock of its dead parent"
        lock.release()
    finally:
        os.kill(worker, 9)
