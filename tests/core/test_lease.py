"""Concurrent writers: a second job on the same dirpath refuses to start; crashed owners are taken over."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import LeaseError
from ft_checkpoint.run import lease as lease_module
from ft_checkpoint.run.lease import LEASE, Lease
from ft_checkpoint.store.storage import Storage
from tests.helpers.toy import make

HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from ft_checkpoint import CheckpointManager
m = CheckpointManager({url!r}, interval=1)
print("HOLDING", flush=True)
time.sleep(600)
"""
@contextmanager
def env(values: dict[str, str]):
    """Set environment variables for the duration of the block."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_holder(url: str, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(root=ROOT, url=url)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **env})
    assert proc.stdout.readline().strip() == "HOLDING"
    return proc


def test_second_job_refuses_while_first_is_alive_then_takes_over_after_a_crash(tmp_path):
    url = str(tmp_path / "ckpt")
    holder = start_holder(url)
    try:
        with pytest.raises(LeaseError, match=rf"another job is writing checkpoints to {url}: host .* pid {holder.pid}"):
            CheckpointManager(url)
        assert len(os.listdir(os.path.join(url, "journal"))) == 1, "a refused job writes no journal"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with CheckpointManager(url, interval=1) as ckpt:  # the owner died: its restart takes over
        ckpt.save(1, make(), block=True)
    assert not os.path.exists(os.path.join(url, LEASE)), "released at close"


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_force_takeover_and_a_launcher_restart_of_the_same_job(tmp_path):
    url = str(tmp_path / "ckpt")
    job = {"TORCHELASTIC_RUN_ID": "job-43", "TORCHELASTIC_RESTART_COUNT": "0"}
    holder = start_holder(url, TORCHELASTIC_RUN_ID="job-42")
    try:
        with CheckpointManager(url, force_takeover=True):
            pass
        holder2 = start_holder(url, **job)
        try:
            with pytest.raises(LeaseError, match="another job is writing"):  # same id, same start: not a restart
                with env(job):
                    CheckpointManager(url)
            with env({**job, "TORCHELASTIC_RESTART_COUNT": "1"}):  # torchrun restarted the worker group
                with CheckpointManager(url):
                    pass
        finally:
            holder2.send_signal(signal.SIGKILL)
            holder2.wait()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_stale_heartbeat_from_another_host_is_taken_over(tmp_path):
    url = str(tmp_path / "ckpt")
    os.makedirs(url)
    with open(os.path.join(url, LEASE), "w") as f:
        json.dump({"attempt": "old", "host": "other-host", "pid": 1, "job": None, "heartbeat": time.time() - 3600}, f)
    with CheckpointManager(url):
        pass
    with open(os.path.join(url, LEASE), "w") as f:
        json.dump({"attempt": "old", "host": "other-host", "pid": 1, "job": None, "heartbeat": time.time()}, f)
    with pytest.raises(LeaseError, match="host other-host pid 1"):
        CheckpointManager(url)


# -- fencing: a job taken over after a stale heartbeat stops writing ---------------------------------
def wait_until(condition, what: str, deadline: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``deadline`` seconds (a hang, not a timing)."""
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


def holder_of(storage: Storage) -> dict:
    return json.loads(storage.read_bytes(LEASE))


def wait_for_a_heartbeat(storage: Storage) -> None:
    """Return right after the owner's heartbeat thread rewrote the lease: it now waits a full ``refresh``."""
    first = holder_of(storage)["heartbeat"]
    wait_until(lambda: holder_of(storage)["heartbeat"] != first, "a heartbeat")


def test_old_owner_never_overwrites_the_lease_of_the_job_that_took_it_over():
    """Two Lease objects in one process on memory:// (whose writes are atomic and instant)."""
    storage = Storage(f"memory://fencing-{uuid.uuid4().hex[:8]}")
    old = Lease(storage, attempt="old", refresh=0.5)
    old.owner["host"] = "node-a"  # another host: only a stale heartbeat lets a new job in
    old.acquire()
    # The new job sees the old heartbeat as stale (timeout 0: any age is too old), as it would after the
    # old job hung for the real timeout. It takes over between two of the old job's heartbeats.
    new = Lease(storage, attempt="new", timeout=0.0)
    wait_for_a_heartbeat(storage)
    new.acquire()
    try:
        wait_until(lambda: old.lost, "the old owner notices it lost the lease")
        old._thread.join(timeout=60)
        assert not old._thread.is_alive(), "the old owner's heartbeat stops"
        assert holder_of(storage)["attempt"] == "new", "the old owner's heartbeat overwrote the new owner"
        with pytest.raises(LeaseError, match=r"lost the checkpoint lease.*now holds host .* \(attempt new\).*HINT"):
            old.check_owned()
        new.check_owned()
        assert not new.lost
        old.release()
        assert holder_of(storage)["attempt"] == "new", "a job that lost its lease does not remove the new one"
    finally:
        new.release()
    assert not storage.exists(LEASE)


HUNG_OWNER = """
import json, sys, time
sys.path.insert(0, {root!r})
from ft_checkpoint.errors import LeaseError
from ft_checkpoint.run.lease import Lease
from ft_checkpoint.store.storage import Storage
lease = Lease(Storage({url!r}, json.loads({options!r})), attempt="hung", refresh=1.0)
lease.acquire()
print("HOLDING", flush=True)
deadline = time.monotonic() + 120
while not lease.lost and time.monotonic() < deadline:
    time.sleep(0.01)
try:
    lease.check_owned()
    print("STILL OWNER", flush=True)
except LeaseError as e:
    print("LOST", e, flush=True)
lease.release()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
def test_a_hung_job_taken_over_stops_writing_when_it_wakes(kind, request, tmp_path):
    """A real process holds the lease, hangs (SIGSTOP) between two heartbeats, is taken over, and wakes."""
    from tests.conftest import _make_backend

    backend = _make_backend(kind, request, tmp_path)
    script = HUNG_OWNER.format(root=ROOT, url=backend.url, options=json.dumps(backend.storage_options))
    env = backend.env()
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "HOLDING"
        storage = Storage(backend.url, backend.storage_options)
        wait_for_a_heartbeat(storage)
        proc.send_signal(signal.SIGSTOP)  # hung right after a heartbeat: its lease goes stale
        new = Lease(storage, attempt="new", timeout=0.0)
        new.acquire()  # its process is alive (stopped), on this host: only staleness lets it in
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
        assert out.startswith("LOST this job lost the checkpoint lease"), out
        assert "(attempt new)" in out and "HINT" in out
        assert holder_of(storage)["attempt"] == "new", "the old owner's heartbeat overwrote the new owner"
        new.check_owned()
        new.release()
        assert not storage.exists(LEASE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_takeover_right_after_a_gcs_heartbeat_is_not_overwritten_by_its_retry(request, tmp_path):
    """On GCS a write is followed by a comparison with the store's CRC-32C of the object, retried on a
    mismatch. Where the upload's response carries no CRC (here: only the object's generation), that comparison
    reads the object's metadata, which is the new owner's when a takeover lands right after our heartbeat's
    write: it is not ours to compare (another generation), and a retry would write the old owner's lease over it."""
    from tests.conftest import _make_backend

    backend = _make_backend("gcs", request, tmp_path)
    old_storage, new_storage = (Storage(backend.url, backend.storage_options) for _ in range(2))
    old = Lease(old_storage, attempt="old", refresh=3600)
    old.acquire()
    new = Lease(new_storage, attempt="new", timeout=0.0)
    pipe_file = old_storage.fs.pipe_file

    def heartbeat_then_takeover(path, data, **kwargs):  # the takeover lands between our write and any check
        response = pipe_file(path, data, **kwargs)
        if b'"old"' in data:
            new.acquire()
        return {"generation": response["generation"]}

    old_storage.fs.pipe_file = heartbeat_then_takeover
    old._refresh()  # read: still ours; write; the takeover; no retry over it
    assert holder_of(new_storage)["attempt"] == "new", "the old owner's heartbeat retry overwrote the new owner"
    old_storage.fs.pipe_file = pipe_file
    assert not old._refresh() and old.lost, "the next heartbeat sees the takeover"
    new.release()


def test_s3_heartbeat_is_a_write_conditional_on_its_own_last_write(request, tmp_path):
    """On S3 the check and the write are one request: a takeover landing between them makes it fail."""
    from tests.conftest import _make_backend

    backend = _make_backend("s3", request, tmp_path)
    storage = Storage(backend.url, backend.storage_options)
    old = Lease(storage, attempt="old", refresh=3600)
    old.acquire()
    assert old.fencing == "etag"
    ours = old._etag
    new = Lease(Storage(backend.url, backend.storage_options), attempt="new")
    new._put()  # the new owner's write lands right after the old owner looked
    with pytest.raises(lease_module._Changed):
        old._put(if_match=ours)
    assert holder_of(storage)["attempt"] == "new"
    assert old._refresh() is False and old.lost
    assert holder_of(storage)["attempt"] == "new", "the old owner's heartbeat overwrote the new owner"


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_new_lease_whose_answer_was_lost_is_taken_on_the_retry_not_refused(kind, request, tmp_path, monkeypatch):
    """A job creates the lease of an empty directory (``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS);
    the object lands but the answer is lost (a connection reset), and the storage layer's retry is refused: the
    object exists. Before: "changed while this job was taking it over: another job started at the same moment", and
    the job did not start. Now the lease read back names this attempt: taken, and its heartbeats go on."""
    from tests.conftest import _make_backend

    backend = _make_backend(kind, request, tmp_path)
    storage = Storage(backend.url, backend.storage_options, retries=3, backoff=0.01)
    pipe_file, lost = storage.fs.pipe_file, []

    def lands_then_the_answer_is_lost(path: str, data: bytes, **kwargs):
        out = pipe_file(path, data, **kwargs)
        if path.endswith(LEASE) and not lost:
            lost.append(path)
            raise ConnectionResetError(104, "Connection reset by peer")
        return out

    monkeypatch.setattr(storage.fs, "pipe_file", lands_then_the_answer_is_lost)
    lease = Lease(storage, attempt="mine", refresh=3600)
    lease.acquire()
    try:
        assert lost and holder_of(storage)["attempt"] == "mine"
        assert lease._refresh() and not lease.lost  # a heartbeat: S3's on the condition of the write that landed
    finally:
        lease.release()
    assert not storage.exists(LEASE)


# -- takeover rules -------------------------------------------------------------------------------
def other_host_lease(url: str, attempt: str = "old", **variables: str) -> Lease:
    """A live job on another host holding the lease of ``url`` (a fresh heartbeat), started with ``variables``."""
    with env(variables):
        lease = Lease(Storage(url), attempt=attempt)
    lease.owner["host"] = "node-a"
    lease.acquire()
    return lease


@pytest.mark.parametrize("placeholder", ["none", "", "None", "  null "])
def test_a_placeholder_job_id_is_no_job_id(placeholder):
    url = f"memory://placeholder-{uuid.uuid4().hex[:8]}"
    holder = other_host_lease(url, TORCHELASTIC_RUN_ID=placeholder)
    try:
        assert holder.owner["job"] is None or not holder.owner["job"].startswith("TORCHELASTIC_RUN_ID")
        with env({"TORCHELASTIC_RUN_ID": placeholder, "TORCHELASTIC_RESTART_COUNT": "1"}):
            with pytest.raises(LeaseError, match="another job is writing checkpoints.*HINT"):
                Lease(Storage(url), attempt="new").acquire()
    finally:
        holder.release()


@pytest.mark.parametrize("before,after,taken", [
    ({}, {}, False),  # an equal id alone: both alive
    ({"TORCHELASTIC_RESTART_COUNT": "0"}, {"TORCHELASTIC_RESTART_COUNT": "0"}, False),
    ({"TORCHELASTIC_RESTART_COUNT": "2"}, {"TORCHELASTIC_RESTART_COUNT": "1"}, False),
    ({"TORCHELASTIC_RESTART_COUNT": "0"}, {"TORCHELASTIC_RESTART_COUNT": "1"}, True),  # torchrun restart
    ({"SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "3"},
     {"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "0"}, True),  # Slurm requeue of torchrun
    ({}, {"TORCHELASTIC_RESTART_COUNT": "1"}, False),  # nothing recorded to compare with
])
def test_the_same_job_takes_over_a_live_lease_only_as_a_later_launcher_restart(before, after, taken):
    url = f"memory://restart-{uuid.uuid4().hex[:8]}"
    job = {"TORCHELASTIC_RUN_ID": "job-7", "SLURM_JOB_ID": "", "FT_CHECKPOINT_RUN_ID": ""}
    holder = other_host_lease(url, **job, **before)
    try:
        assert holder.owner["job"] == "TORCHELASTIC_RUN_ID=job-7"
        with env({**job, "SLURM_RESTART_COUNT": "", "TORCHELASTIC_RESTART_COUNT": "", **after}):
            new = Lease(Storage(url), attempt="new")
        if taken:
            new.acquire()
            new.release()
        else:
            with pytest.raises(LeaseError, match="host node-a .*job TORCHELASTIC_RUN_ID=job-7.*HINT"):
                new.acquire()
    finally:
        holder.release()


# -- garbage lease.json ---------------------------------------------------------------------------
def lease_bytes(**changes) -> bytes:
    record = {"attempt": "old", "host": "node-a", "pid": 1, "job": None, "heartbeat": time.time(), **changes}
    return json.dumps(record).encode()


GARBAGE = {
    "not json": b"owner: node-a",
    "empty": b"",
    "a list": b'[{"attempt": "old"}]',
    "null": b"null",
    "heartbeat noon": lease_bytes(heartbeat="noon"),
    "heartbeat NaN": lease_bytes(heartbeat=float("nan")),
    "heartbeat Infinity": lease_bytes(heartbeat=float("inf")),
    "heartbeat 1e400": lease_bytes().replace(b'"heartbeat": ', b'"heartbeat": 1e400, "x": '),
    "heartbeat a bool": lease_bytes(heartbeat=True),
    "pid x": lease_bytes(pid="x"),
    "pid 2.0": lease_bytes(pid=2.0),
    "pid huge": lease_bytes(pid=10**30),
    "pid negative": lease_bytes(pid=-1),
    "pid of 5000 digits": lease_bytes().replace(b'"pid": 1', b'"pid": ' + b"9" * 5000),
    "attempt missing": json.dumps({"host": "node-a", "pid": 1, "heartbeat": time.time()}).encode(),
    "host a list": lease_bytes(host=["node-a"]),
    "restarts garbage": lease_bytes(restarts=[1]),
    "nested deep": b"[" * 100_000,
    "not utf-8": b'{"attempt": "\xff\xfe"}',
    "huge": b'{"attempt": "' + b"x" * (2 << 20) + b'"}',
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_garbage_lease_warns_blocks_while_recent_and_yields_to_force(name, kind, tmp_path, caplog):
    url = str(tmp_path / "ckpt") if kind == "local" else f"memory://garbage-{uuid.uuid4().hex[:8]}"
    storage = Storage(url)
    storage.ensure_root()
    storage.write_bytes(LEASE, GARBAGE[name])
    new = Lease(storage, attempt="new")
    with pytest.raises(LeaseError, match=r"lease.json is unreadable .*HINT: .*force_takeover=True") as e:
        new.acquire()
    assert storage.url_of(LEASE) in str(e.value)
    assert any(storage.url_of(LEASE) in r.getMessage() and "unreadable" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    new.acquire(force=True)
    try:
        assert holder_of(storage)["attempt"] == "new"
        new.check_owned()
    finally:
        new.release()


@pytest.mark.parametrize("name", ["not json", "heartbeat NaN", "huge", "pid x"])
def test_a_garbage_lease_nobody_rewrites_is_taken_over_once_older_than_the_timeout(name, tmp_path):
    url = str(tmp_path / "ckpt")
    storage = Storage(url)
    storage.ensure_root()
    storage.write_bytes(LEASE, GARBAGE[name])
    an_hour_ago = time.time() - 3600
    os.utime(os.path.join(url, LEASE), (an_hour_ago, an_hour_ago))
    new = Lease(storage, attempt="new")
    new.acquire()
    assert holder_of(storage)["attempt"] == "new"
    new.release()


def test_a_heartbeat_slightly_ahead_is_clock_skew_not_garbage(tmp_path):
    storage = Storage(str(tmp_path / "ckpt"))
    storage.ensure_root()
    storage.write_bytes(LEASE, lease_bytes(heartbeat=time.time() + 30))  # within the 120 s timeout
    with pytest.raises(LeaseError, match="another job is writing checkpoints.*host node-a pid 1"):
        Lease(storage, attempt="new").acquire()


def test_manager_with_a_garbage_lease_refuses_clearly_then_takes_it_by_force(short_wait_after_takeover, tmp_path):
    url = str(tmp_path / "ckpt")
    os.makedirs(url)
    with open(os.path.join(url, LEASE), "wb") as f:
        f.write(GARBAGE["pid x"])
    with pytest.raises(LeaseError, match="pid='x': expected an integer.*HINT"):
        CheckpointManager(url)
    with CheckpointManager(url, force_takeover=True, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)


def test_a_job_whose_directory_was_taken_over_commits_and_deletes_nothing_more(tmp_path):
    """After a takeover the old job's save fails at its commit check, whatever ``on_save_error`` says, and its
    next ``maybe_save`` raises LeaseError: it never writes a manifest or runs retention there again."""
    import torch

    from ft_checkpoint import CheckpointManager, LeaseError, SaveError
    from ft_checkpoint.format import layout

    url = str(tmp_path / "ckpt")
    old = CheckpointManager(url, interval=1, keep_last=1, on_save_error="warn")
    old.save(1, {"w": torch.ones(2)}, block=True)
    new = CheckpointManager(url, interval=1, keep_last=1, force_takeover=True)
    new.save(5, {"w": torch.zeros(2)}, block=True)
    new.wait(retention=True)  # its keep_last=1 deletes step 1 on a thread of its own: not a race with the check
    old.save(2, {"w": torch.ones(2)})
    with pytest.raises(SaveError) as e:
        old.wait()
    assert isinstance(e.value.__cause__, LeaseError), repr(e.value.__cause__)
    assert old.lease.lost
    with pytest.raises(LeaseError, match="another job took over"):
        old.maybe_save(3, {"w": torch.ones(2)})
    assert layout.committed_steps(new.storage) == [5], "the old job committed or deleted after losing the lease"
    new.close()
    old.close(clean=False)


ZOMBIE_WRITER = """
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
import torch
from ft_checkpoint import CheckpointManager
from ft_checkpoint.run.lease import Lease
Lease.recent = property(lambda self: 0.5)  # a sight of the lease is good for 0.5 s here (30 s by default)
def hook(phase, step):
    if (phase, step) == ("writing", 4):
        print("STOPPED", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # hung with its step directory cleared, before any file is written
        time.sleep(0.5)  # the stop lands on every thread a moment later: this one writes nothing before it
with CheckpointManager({url!r}, interval=2, keep_last=1, storage_options=json.loads({options!r})) as ckpt:
    ckpt.engine.phase_hook = hook
    for step in (2, 4):
        ckpt.maybe_save(step, {{"w": torch.full((1000,), float(step)), "note": "zombie"}})
    ckpt.wait()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_hung_writer_taken_over_never_writes_over_the_step_the_new_owner_committed(kind, request, tmp_path,
                                                                                   short_wait_after_takeover):
    """A real job hangs (SIGSTOP) in the save of step 4, its step directory cleared; another job takes the
    directory over, commits its own step 4 and retention deletes step 2; then the hung job wakes. Before: it wrote
    its rank file, shard and metadata over the new owner's committed step 4, and was refused only at its commit:
    the newest step no longer verified, and with step 2 deleted a resume started from scratch (the red team's run
    on S3, GCS and local disk). Now a writer that saw its lease too long ago reads it again before each file, finds
    it lost and writes nothing more."""

    from tests.conftest import _make_backend

    backend = _make_backend(kind, request, tmp_path)
    url, options = backend.url, backend.storage_options
    script = ZOMBIE_WRITER.format(root=ROOT, url=url, options=json.dumps(options))
    env = backend.env()
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    # the hang outlasts the 0.5 s a sight of the lease is good for (a takeover waits 120 s)
    new_owner_commits_step_4_then_the_zombie_wakes(proc, url, options, force=True, pause=1.0)


def new_owner_commits_step_4_then_the_zombie_wakes(proc: subprocess.Popen, url: str, options: dict, *, force: bool,
                                                  pause: float, meanwhile: Callable[[], None] = lambda: None) -> None:
    """The zombie (``ZOMBIE_WRITER``) stopped in its save of step 4: a new owner takes the directory over, resumes step
    2, commits its own step 4 (retention deletes step 2); ``pause`` seconds later the zombie wakes while the new owner
    still runs. Then the zombie must have failed on its lost lease, and a resume must load the new owner's step 4."""
    import torch

    try:
        assert proc.stdout.readline().strip() == "STOPPED"
        meanwhile()
        with CheckpointManager(url, interval=2, keep_last=1, force_takeover=force, storage_options=options) as new:
            state = {"w": torch.zeros(1000), "note": ""}
            assert new.resume(state) == 2 and state["note"] == "zombie"
            new.save(4, {"w": torch.full((1000,), -4.0), "note": "new owner"}, block=True)
            new.wait(retention=True)
            time.sleep(pause)
            proc.send_signal(signal.SIGCONT)
            _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "LeaseError" in err, err[-2000:]
    with CheckpointManager(url, interval=2, force_takeover=True, storage_options=options) as again:
        state = {"w": torch.zeros(1000), "note": ""}
        assert again.resume(state) == 4, "the new owner's step 4 was written over"
        assert state["note"] == "new owner" and bool((state["w"] == -4.0).all())


FROZEN_MID_UPLOAD = """
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
import torch
from ft_checkpoint import CheckpointManager
from ft_checkpoint.run.lease import Lease
Lease.recent = property(lambda self: 0.5)  # a sight of the lease is good for 0.5 s here (30 s by default)
def freeze(name):
    if name.endswith("step_000000000004/__0_0.distcp"):
        print("STOPPED", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen in the upload: the fence passed, the PUT not yet at the server
        time.sleep(0.5)  # the stop lands on every thread a moment later: the PUT leaves only after it
def freeze_uploads():
    if ckpt.storage.url.startswith("s3://"):
        ckpt.storage.fs.s3.meta.events.register("before-send.s3.PutObject", lambda request, **_: freeze(request.url))
        return
    import gcsfs.core
    upload = gcsfs.core.simple_upload
    async def frozen_upload(fs, bucket, key, *args, **kwargs):
        freeze(key)
        return await upload(fs, bucket, key, *args, **kwargs)
    gcsfs.core.simple_upload = frozen_upload
def hook(phase, step):
    if (phase, step) == ("writing", 4):
        freeze_uploads()
with CheckpointManager({url!r}, interval=2, keep_last=1, storage_options=json.loads({options!r})) as ckpt:
    ckpt.engine.phase_hook = hook
    for step in (2, 4):
        ckpt.maybe_save(step, {{"w": torch.full((1000,), float(step)), "note": "zombie"}})
    ckpt.wait()
"""


def _frozen_mid_upload(kind, request, tmp_path):
    """A real job saving into a bucket of the S3 server or the GCS emulator, frozen (SIGSTOP) in the upload of its
    step 4's data file."""
    from tests.conftest import _make_backend

    backend = _make_backend(kind, request, tmp_path)
    script = FROZEN_MID_UPLOAD.format(root=ROOT, url=backend.url, options=json.dumps(backend.storage_options))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=backend.env())
    assert proc.stdout.readline().strip() == "STOPPED"
    return backend, proc


def _wake(proc: subprocess.Popen) -> str:
    """SIGCONT the frozen job and wait for it to end; its stderr."""
    time.sleep(1.0)  # the hang outlasts the 0.5 s a sight of the lease is good for (a takeover waits 120 s)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    return err


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_an_upload_in_flight_when_its_job_froze_never_lands_over_the_new_owners_committed_step(
        kind, request, tmp_path, short_wait_after_takeover):
    """A real job freezes (SIGSTOP) in the upload of step 4's data file, past the check of its lease; another job
    takes the directory over and commits its own step 4 (retention deletes step 2); then the frozen job wakes and its
    upload completes. Before: it landed over the new owner's committed data file; the step no longer verified, and
    with step 2 deleted a resume started from scratch (the red team's two-rank runs on S3, 2 of 2; on GCS until this
    version). Now a step's files are created with ``If-None-Match: *`` (S3) or ``ifGenerationMatch=0`` (GCS): the
    late upload is refused, and its job stops on its lost lease."""
    import torch

    backend, proc = _frozen_mid_upload(kind, request, tmp_path)
    url, options = backend.url, backend.storage_options
    try:
        with CheckpointManager(url, interval=2, keep_last=1, force_takeover=True, storage_options=options) as new:
            state = {"w": torch.zeros(1000), "note": ""}
            assert new.resume(state) == 2 and state["note"] == "zombie"
            new.save(4, {"w": torch.full((1000,), -4.0), "note": "new owner"}, block=True)
            new.wait(retention=True)
            err = _wake(proc)  # while the new owner still runs
    finally:
        _stop(proc)
    assert proc.returncode != 0 and "LeaseError" in err, err[-2000:]
    with CheckpointManager(url, interval=2, force_takeover=True, storage_options=options) as again:
        state = {"w": torch.zeros(1000), "note": ""}
        assert again.resume(state) == 4, "the new owner's step 4 was written over"
        assert state["note"] == "new owner" and bool((state["w"] == -4.0).all())


QUICK_ZOMBIE = ZOMBIE_WRITER.replace("property(lambda self: 0.5)", "property(lambda self: 10.0)")


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "takeover"), [("local", "launcher restart"), ("local", "force"),
                                                ("s3", "launcher restart")])
def test_a_writer_taken_over_without_waiting_for_its_heartbeat_never_writes_over_the_new_owner_s_step(
        kind, takeover, request, tmp_path, monkeypatch):
    """A launcher restart (a higher restart counter of the same job id) or a forced takeover does not wait for the
    old owner's heartbeat to go stale: the old process may still be alive. Here it hangs (SIGSTOP) in the save of
    step 4, its directory cleared, and wakes right after the new owner committed its own step 4, less than the
    10 s (30 s by default) that its last sight of the lease is good for. Before: it wrote its files over that step
    (helper-43, local disk and S3, core, Lightning and Accelerate): the newest step no longer verified, and with
    keep_last=1 a resume started from scratch. Now the new owner's first save waits out those seconds."""

    from tests.conftest import _make_backend

    monkeypatch.setattr(Lease, "recent", property(lambda self: 10.0))
    backend = _make_backend(kind, request, tmp_path)
    url, options = backend.url, backend.storage_options
    job = {"FT_CHECKPOINT_RUN_ID": "job-7", "TORCHELASTIC_RESTART_COUNT": "0"} if takeover != "force" else {}
    env = {**backend.env(), **job}
    proc = subprocess.Popen([sys.executable, "-c", QUICK_ZOMBIE.format(root=ROOT, url=url, options=json.dumps(options))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for name, value in job.items():  # this process is the launcher's next start of the same job
        monkeypatch.setenv(name, "1" if name == "TORCHELASTIC_RESTART_COUNT" else value)
    new_owner_commits_step_4_then_the_zombie_wakes(proc, url, options, force=takeover == "force", pause=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_an_upload_that_lands_between_the_new_owners_clear_and_its_own_write_is_deleted_and_written_again(
        kind, request, tmp_path, caplog, short_wait_after_takeover):
    """The frozen job of the test above wakes while the new owner saves step 4, after its clear of the step and before
    its data file: the late upload lands first. The new owner's create of that file is then refused; it finds the
    lease its own, deletes the file with a warning naming it, writes its own, and commits."""
    import torch

    backend, proc = _frozen_mid_upload(kind, request, tmp_path)
    url, options = backend.url, backend.storage_options
    errors: list[str] = []

    def wake_the_frozen_job(phase: str, step: int) -> None:
        if (phase, step) == ("writing", 4):  # the new owner cleared step 4 and writes nothing before this returns
            errors.append(_wake(proc))

    try:
        with CheckpointManager(url, interval=2, keep_last=1, force_takeover=True, storage_options=options) as new:
            state = {"w": torch.zeros(1000), "note": ""}
            assert new.resume(state) == 2
            new.engine.phase_hook = wake_the_frozen_job
            new.save(4, {"w": torch.full((1000,), -4.0), "note": "new owner"}, block=True)
            new.wait(retention=True)
    finally:
        _stop(proc)
    assert proc.returncode != 0 and "LeaseError" in errors[0], errors[0][-2000:]
    assert any(r.levelname == "WARNING" and "step_000000000004/__0_0.distcp was there already" in r.getMessage()
               for r in caplog.records), caplog.text
    with CheckpointManager(url, interval=2, force_takeover=True, storage_options=options) as again:
        state = {"w": torch.zeros(1000), "note": ""}
        assert again.resume(state) == 4
        assert state["note"] == "new owner" and bool((state["w"] == -4.0).all())


TWO_RANKS = """
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from ft_checkpoint import CheckpointManager
from ft_checkpoint.run.lease import Lease
Lease.recent = property(lambda self: 0.5)  # a sight of the lease is good for 0.5 s here (30 s by default)
dist.init_process_group("gloo")
def freeze(request, **kwargs):
    if "step_000000000004/__" in request.url and request.url.endswith(".distcp"):
        os.write(1, f"STOPPED {{os.getpid()}}\\n".encode())  # one write: the two ranks' lines never interleave
        os.kill(os.getpid(), signal.SIGSTOP)  # each rank frozen in the upload of its data file of step 4
        time.sleep(0.5)
def hook(phase, step):
    if (phase, step) == ("writing", 4) and sys.argv[1] == "zombie":
        ckpt.storage.fs.s3.meta.events.register("before-send.s3.PutObject", freeze)
with CheckpointManager({url!r}, interval=2, keep_last=1, force_takeover=sys.argv[1] == "owner",
                       storage_options=json.loads({options!r})) as ckpt:
    ckpt.engine.phase_hook = hook
    mark = -1.0 if sys.argv[1] == "owner" else 1.0
    state = {{"a": torch.zeros(100_000), "b": torch.zeros(100_000)}}
    for step in ((4,) if ckpt.resume(state) == 2 else (2, 4)):
        ckpt.maybe_save(step, {{"a": torch.full((100_000,), mark * step), "b": torch.full((100_000,), mark * step)}})
    ckpt.wait(retention=True)
"""


def _reading(job: subprocess.Popen) -> tuple[list[str], threading.Thread]:
    """The lines the ``job`` prints, collected as they come by a thread of their own (started, returned to join)."""
    output: list[str] = []

    def read() -> None:
        for line in job.stdout:
            output.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return output, reader


def _frozen_ranks(output: list[str], n: int, timeout: float = 120.0) -> list[int]:
    """The pids in the job's lines ``STOPPED <pid>``, once there are ``n`` (AssertionError with the output if not
    within ``timeout`` seconds). Found anywhere in the output: another rank's line may be cut by one of them."""
    deadline = time.monotonic() + timeout
    while len(pids := [int(pid) for pid in re.findall(r"STOPPED (\d+)\n", "".join(output))]) < n:
        assert time.monotonic() < deadline, f"{len(pids)} of {n} ranks froze:\n{''.join(output)[-3000:]}"
        time.sleep(0.1)
    return pids


def _end_job(job: subprocess.Popen, stopped: list[int]) -> None:
    """Wake the ranks still stopped, then end the job (its launcher and its ranks) if it still runs."""
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    if job.poll() is None:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.kill()
        job.wait()


@pytest.mark.slow
def test_two_ranks_frozen_in_their_uploads_never_land_over_the_step_a_two_rank_owner_committed(s3_server, request,
                                                                                               tmp_path):
    """The red team's run: a two-rank job freezes (SIGSTOP) with each rank in the S3 upload of its data file of step
    4; another two-rank job takes the directory over, resumes from step 2 and commits its own step 4 (retention
    deletes step 2); then the frozen ranks wake. Before, their uploads landed over the new owner's data files and a
    resume started from scratch (2 of 2 runs); now they are refused."""
    import torch

    from ft_checkpoint.testing import jobs
    from tests.conftest import _make_backend

    backend = _make_backend("s3", request, tmp_path)
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(root=ROOT, url=backend.url, options=json.dumps(backend.storage_options)))
    env = s3_server.env()
    zombie = jobs.start(str(script), "zombie", launcher="torchrun", nproc=2, env=env, stderr=subprocess.STDOUT)
    output, reader = _reading(zombie)
    try:
        pids = _frozen_ranks(output, 2)
        jobs.run(str(script), "owner", launcher="torchrun", nproc=2, env=env, timeout=300).expect(0)
        time.sleep(1.0)  # the hang outlasts the 0.5 s a sight of the lease is good for (a takeover waits 120 s)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        zombie.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        _end_job(zombie, _frozen_ranks(output, 0))
    assert zombie.returncode != 0 and "LeaseError" in "".join(output), "".join(output)[-3000:]
    with CheckpointManager(backend.url, interval=2, force_takeover=True, storage_options=backend.storage_options) as m:
        state = {"a": torch.zeros(100_000), "b": torch.zeros(100_000)}
        assert m.resume(state) == 4, "the new owner's step 4 was written over"
        assert bool((state["a"] == -4.0).all()) and bool((state["b"] == -4.0).all())


RACER = """
import json, sys, time
sys.path.insert(0, {root!r})
from ft_checkpoint.errors import LeaseError
from ft_checkpoint.run.lease import Lease
from ft_checkpoint.store.storage import Storage
prefix, trials, me, start, options = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
for i in range(trials):
    lease = Lease(Storage(f"{{prefix}}/t{{i}}", json.loads(options)), attempt=f"{{me}}-{{i}}")
    while time.time() < start + i * 0.3:
        pass  # both processes start trial i at the same moment
    try:
        lease.acquire()
        print(i, "owns", flush=True)
    except LeaseError as e:
        print(i, "refused", "at the same moment" in str(e) or "another job is writing" in str(e), flush=True)
    time.sleep(0.1)
    lease._stop.set()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "gcs"])
def test_two_jobs_starting_at_once_on_an_empty_directory_never_both_own_it(kind, request, tmp_path):
    """Two processes take the lease of one empty directory at the same moment, 30 times. Before: both read "no lease",
    both wrote theirs (the second over the first) and both read their own back: 7 of 40 trials gave two owners on
    local disk (helper-43), and the loser trained until its next heartbeat or save, then stopped with a message
    blaming a stale heartbeat; on GCS until this version too. Now a new lease is created, never written over one (on
    local disk a hard link of the complete file, on GCS ``ifGenerationMatch=0``): exactly one owns the directory, the
    other is refused at once with an error that says why."""
    from tests.conftest import _make_backend

    backend = _make_backend(kind, request, tmp_path)
    env = backend.env()
    trials = 30
    start = time.time() + 3  # both started and imported by then
    procs = [subprocess.Popen([sys.executable, "-c", RACER.format(root=ROOT), backend.url, str(trials), who,
                               str(start), json.dumps(backend.storage_options)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for who in "AB"]
    outcomes = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outcomes]
    lines = [dict(line.split(" ", 1) for line in out.splitlines()) for out, _ in outcomes]
    owners = [sum(lines[k][str(i)] == "owns" for k in range(2)) for i in range(trials)]
    assert owners == [1] * trials, f"trials with two owners: {[i for i, n in enumerate(owners) if n != 1]}"
    assert all(v in ("owns", "refused True") for both in lines for v in both.values()), lines


@pytest.mark.slow
def test_a_writer_alive_through_two_takeovers_never_writes_over_the_third_owner_s_step(tmp_path, monkeypatch):
    """The old job (alive, stopped in its save of step 4) is taken over by force by a second job that ends without
    saving (its lease released); a third job finds no lease, waits for nothing and commits step 4; the old job wakes
    within its 10 s (30 s by default) sight of the lease. Before: it wrote its files over the third job's step 4
    (helper-45, local disk; S3 refused them). Now each file of a save is created, never written over (``O_EXCL``; the
    manifest goes into the directory the save made): the old job's first create meets the new owner's file, it reads the lease and
    stops."""
    monkeypatch.setattr(Lease, "recent", property(lambda self: 10.0))
    url = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-c", QUICK_ZOMBIE.format(root=ROOT, url=url, options="{}")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # once the old job stopped: a second job takes over by force and ends without a save (its lease released)
    new_owner_commits_step_4_then_the_zombie_wakes(
        proc, url, {}, force=False, pause=0.0,
        meanwhile=lambda: CheckpointManager(url, interval=2, force_takeover=True).close())


def test_a_sight_of_the_lease_dates_from_before_the_read_that_showed_it(monkeypatch):
    """A process stands still (SIGSTOP, a paused VM) inside its read of ``lease.json``, the answer (its own lease)
    received; another job takes the directory over meanwhile; it wakes. Before: the sight was dated when the read
    returned, at the waking, and for the next ``recent`` seconds ``check_recent`` let it write on without reading the
    lease again. Now a sight dates from before the read: long gone, so the lease is read again, and found lost."""
    clock = [1000.0]
    monkeypatch.setattr(lease_module, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0]),
                                                                  "time": staticmethod(time.time),
                                                                  "sleep": staticmethod(time.sleep)}))
    storage = Storage(f"memory://test/sight-{uuid.uuid4().hex}")
    old, new = Lease(storage, attempt="old"), Lease(storage, attempt="new")
    old.acquire()
    read = old._read

    def stood_still_inside_the_read():
        seen = read()  # the lease is its own...
        new.acquire(force=True)  # ...then the process stands still: taken over meanwhile
        clock[0] += 2 * old.recent
        return seen

    old._read = stood_still_inside_the_read
    try:
        old.check_now()  # the answer showed the lease its own: no error here
    finally:
        del old._read
    try:
        with pytest.raises(LeaseError, match="lost the checkpoint lease"):
            old.check_recent()
    finally:
        old.release()
        new.release()


LATE_RANK = """
import os, signal, sys, threading
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from ft_checkpoint import CheckpointManager
from ft_checkpoint.run.dist import Groups
dist.init_process_group("gloo")
rank, saving = dist.get_rank(), threading.Event()
def telling(collective):
    def call(self, *args, **kwargs):
        if rank == 0 and kwargs.get("writer") and saving.is_set():
            saving.clear()
            os.write(1, b"RANK0 WAITS\\n")  # its save's first collective, where it waits for rank 1
        return collective(self, *args, **kwargs)
    return call
Groups.all_gather, Groups.barrier = telling(Groups.all_gather), telling(Groups.barrier)
def hook(phase, step):
    if (phase, step) == ("staged", 4):
        saving.set()
        if rank == 1:
            os.write(1, f"STOPPED {{os.getpid()}}\\n".encode())  # one write: never interleaved with rank 0's
            os.kill(os.getpid(), signal.SIGSTOP)  # stood still before its writer thread joins the save of step 4
with CheckpointManager({url!r}, interval=2, final_save=False) as ckpt:
    ckpt.engine.phase_hook = hook
    ckpt.save(4, {{"w": torch.full((1000,), 1.0)}}, per_rank={{"rank": rank}})
    ckpt.wait()
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_stood_still_before_its_save_s_first_collective_writes_nothing_into_the_new_owner_s_step(
        tmp_path, monkeypatch):
    """A two-rank job saves step 4: rank 1 stands still (SIGSTOP) before its writer thread joins the save, rank 0
    reaches the save's first collective and waits there for it. Another job takes the directory over by force and
    commits its own step 4 with one rank (no ``rank_00001.pt``); then rank 1 wakes. Before: rank 0 had checked the
    lease before that collective, and rank 1, joining it after the takeover, took the check for a sight of the lease
    just now: it wrote its ``rank_00001.pt`` into the new owner's committed step (a file its manifest does not list).
    Now every rank meets once more before rank 0 checks the lease, and counts a sight from before it joined: rank 0's
    check comes after the takeover, the save stops with a LeaseError on every rank, and nothing is written."""
    import torch

    from ft_checkpoint.format import layout
    from ft_checkpoint.testing import jobs

    monkeypatch.setattr(Lease, "recent", property(lambda self: 0.5))  # the new owner waits 0.5 s, not 30 s, to save
    url = str(tmp_path / "ckpt")
    script = tmp_path / "late_rank.py"
    script.write_text(LATE_RANK.format(root=ROOT, url=url))
    old = jobs.start(str(script), launcher="torchrun", nproc=2, stderr=subprocess.STDOUT)
    output, reader = _reading(old)
    try:
        stopped = _frozen_ranks(output, 1)
        wait_until(lambda: "RANK0 WAITS\n" in "".join(output), "rank 0 of the old job in its save's first collective")
        with CheckpointManager(url, interval=2, force_takeover=True, final_save=False) as new:
            new.save(4, {"w": torch.full((1000,), -4.0)}, block=True)
            os.kill(stopped[0], signal.SIGCONT)  # rank 1 wakes while the new owner still holds the directory
            old.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        _end_job(old, _frozen_ranks(output, 0))
    assert old.returncode != 0 and "LeaseError" in "".join(output), "".join(output)[-3000:]
    step = tmp_path / "ckpt" / layout.step_dir(4)
    assert "rank_00001.pt" not in os.listdir(step), (
        f"the old job's rank 1 wrote into the new owner's committed step 4: {sorted(os.listdir(step))}")
    with CheckpointManager(url, interval=2, force_takeover=True, final_save=False) as again:
        state = {"w": torch.zeros(1000)}
        assert again.resume(state) == 4 and bool((state["w"] == -4.0).all())


# -- a container recreated under its old host name: pids of another PID namespace ------------------------
def in_own_pid_namespace(code: str, *, without_proc: bool = False) -> subprocess.Popen:
    """A Python process as PID 1 of a PID namespace of its own (a container's entrypoint), same host name; with
    ``without_proc``, in a container whose ``/proc`` is not mounted (an empty tmpfs over it)."""
    prelude = "mount -t tmpfs none /proc && " if without_proc else ""
    return subprocess.Popen(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child",
                             "sh", "-c", prelude + 'exec "$0" -c "$1"', sys.executable, code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def skip_without_pid_namespaces() -> None:
    """Skip the test where this user cannot make a PID namespace of its own (``unshare`` refused)."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged PID namespaces here: {probe.stderr.decode().strip()}")


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
@pytest.mark.parametrize("without_proc", [False, True], ids=["proc", "no-proc"])
def test_a_job_recreated_in_a_new_pid_namespace_under_the_same_host_name_never_takes_a_live_lease(tmp_path,
                                                                                                  without_proc):
    """A Kubernetes pod recreated under its name (or a restarted container) has the same host name and, as its
    entrypoint, the same pid 1 as the old one, which may still be alive (a node cut off): its lease is not "this
    process's own" nor "a process of this host that is gone". Nor where the new one cannot tell its process space
    (no ``/proc``): that was taken for "the same"."""
    skip_without_pid_namespaces()
    url = str(tmp_path / "ckpt")
    old = in_own_pid_namespace(HOLD.format(root=ROOT, url=url))
    try:
        assert old.stdout.readline().strip() == "HOLDING", old.stderr.read()
        assert holder_of(Storage(url))["pid"] == 1
        new = in_own_pid_namespace(without_proc=without_proc, code=f"""
import sys
sys.path.insert(0, {ROOT!r})
from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import LeaseError
try:
    CheckpointManager({url!r}, interval=1)
except LeaseError as e:
    print("REFUSED", e)
else:
    print("TOOK IT")
""")
        out, err = new.communicate(timeout=120)
        assert out.startswith("REFUSED another job is writing checkpoints"), out + err
        assert "pid 1 (attempt" in out and ("cannot be compared" if without_proc else "in another PID namespace") in out, out
    finally:
        old.kill()
        old.wait()
    with CheckpointManager(url, force_takeover=True):  # the documented way out once the old pod is known dead
        pass


TRAIN_AND_HOLD = """
import sys, time
sys.path.insert(0, {root!r})
import torch
from ft_checkpoint import CheckpointManager
ckpt = CheckpointManager({url!r}, interval=4, **{config!r})
for step in range(1, 7):
    ckpt.maybe_save(step, {{"w": torch.full((10,), float(step))}})
ckpt.wait()
print("HOLDING", flush=True)
time.sleep(600)
"""

TAKE_OVER = """
import logging, sys, time
sys.path.insert(0, {root!r})
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
import torch
from ft_checkpoint import CheckpointManager
with CheckpointManager({url!r}, interval=4, **{config!r}) as ckpt:
    state = {{"w": torch.zeros(10)}}
    print("RESUMED", ckpt.resume(state), float(state["w"][0]), flush=True)
    print("QUIET", ckpt.lease._quiet_until < time.monotonic(), flush=True)
    ckpt.save(7, state, block=True)
print("SAVED", flush=True)
"""


def _pid_one_of(launcher: subprocess.Popen) -> int:
    """The host's pid of the process ``unshare --fork`` runs as pid 1 of its namespace (its only child)."""
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
        return int(f.read().split()[0])


@pytest.mark.slow
@pytest.mark.parametrize("fast", [False, True], ids=["durable", "fast-tier"])
def test_a_container_restarted_in_place_takes_over_the_lease_its_killed_predecessor_held_at_once(tmp_path, fast):
    """A container restarted in place (``docker restart``, a pod's container after an OOM kill): same host name and
    kernel, a new PID namespace, where the old owner's pid 1 is this process's own. Its pid proves nothing, so the
    new start was refused until the old heartbeat was 2 min old, and then waited 30 s before its first save. The old
    owner held the lock on ``lease.lock`` while it lived; the kernel dropped it with the process (killed from outside:
    pid 1 of a namespace ignores a SIGKILL of its own): taken over at once, no wait before the first save, and with a
    fast tier the newest step comes from it (``/dev/shm`` outlives a container's restart)."""
    skip_without_pid_namespaces()
    url = str(tmp_path / "ckpt")
    config = {"fast_dirpath": str(tmp_path / "shm"), "fast_interval": 1} if fast else {}
    old = in_own_pid_namespace(TRAIN_AND_HOLD.format(root=ROOT, url=url, config=config))
    try:
        assert old.stdout.readline().strip() == "HOLDING", old.stderr.read()
        assert holder_of(Storage(url))["lock"] is True
        os.kill(_pid_one_of(old), signal.SIGKILL)  # the container's main process dies (its files close with it)
        old.wait(timeout=60)
    finally:
        old.kill()
        old.wait()
    assert holder_of(Storage(url))["heartbeat"] > time.time() - 60, "the dead owner's heartbeat is recent"
    new = in_own_pid_namespace(TAKE_OVER.format(root=ROOT, url=url, config=config))
    out, err = new.communicate(timeout=120)
    assert new.returncode == 0 and "SAVED" in out, out + err
    assert "its process 1 on this host is gone: the lock on lease.lock it held while it lived is free" in out, out
    assert ("RESUMED 6 6.0" if fast else "RESUMED 4 4.0") in out, out + err
    assert "QUIET True" in out and "before this job's first save" not in out + err, out + err


SLOW_RANK = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from ft_checkpoint import CheckpointManager
from ft_checkpoint.run.lease import Lease
Lease.recent = property(lambda self: 0.3)  # a sight of the lease is good for 0.3 s here (30 s by default)
dist.init_process_group("gloo")
def slow_storage(phase, step):
    if phase == "writing" and dist.get_rank() == 1:
        time.sleep(1.0)  # this rank's writes start after the sight of the lease its save began with is old
with CheckpointManager({url!r}, interval=1, keep_last=2) as ckpt:
    ckpt.engine.phase_hook = slow_storage
    for step in (1, 2):
        ckpt.save(step, {{"w": torch.full((1000,), float(step)), "rank": dist.get_rank()}}, block=True)
    os.write(1, f"SAVED {{dist.get_rank()}} {{ckpt.lease.owner['attempt']}}\\n".encode())  # one write per line
"""


@pytest.mark.slow
def test_a_rank_whose_writes_outlast_a_sight_of_the_lease_still_finds_it_its_own(tmp_path):
    """Every rank reads the lease before a file of a save once its last sight is older than ``recent`` (30 s by
    default; a large shard to slow storage). Each rank had an attempt id of its own, and only rank 0's is in the
    lease: rank 1 found another attempt there, took the lease for lost ("Another job took the directory over"), and
    every save of the job failed from then on. The job's ranks now share rank 0's attempt."""
    import torch

    from ft_checkpoint.testing import jobs

    url = str(tmp_path / "ckpt")
    script = tmp_path / "slow_rank.py"
    script.write_text(SLOW_RANK.format(root=ROOT, url=url))
    result = jobs.run(str(script), launcher="torchrun", nproc=2, timeout=300)
    assert result.returncode == 0 and "lost the checkpoint lease" not in result.output, result.output[-3000:]
    saved = sorted(re.findall(r"SAVED (\d+) (\S+)\n", result.output))  # another rank's line may be cut by one
    assert [rank for rank, _ in saved] == ["0", "1"] and saved[0][1] == saved[1][1], saved  # one attempt
    with CheckpointManager(url) as ckpt:
        state = {"w": torch.zeros(1000), "rank": None}
        assert ckpt.resume(state) == 2 and float(state["w"][0]) == 2.0


def test_a_lease_of_an_earlier_version_with_this_process_s_pid_is_never_taken_for_this_process_s_own(tmp_path):
    """A rolling upgrade: the old pod (an earlier version, no ``space`` in its lease) is alive as pid 1; the new pod,
    same host name, is pid 1 too. This process writes its process space, so a lease without one is not its own."""
    import socket

    url = str(tmp_path / "ckpt")
    os.makedirs(url)
    with open(os.path.join(url, LEASE), "w") as f:
        json.dump({"attempt": "0.1-owner", "host": socket.gethostname(), "pid": os.getpid(), "job": None,
                   "heartbeat": time.time()}, f)
    with pytest.raises(LeaseError, match=rf"another job is writing checkpoints .* pid {os.getpid()} \(attempt 0.1-owner"):
        CheckpointManager(url)


def test_a_lease_that_names_its_process_space_pids_is_judged_by_it(tmp_path):
    """Development builds before 0.2 wrote the process space as ``pids``: read as an earlier version's lease (the host
    name alone), a live owner in another PID namespace whose pid is free here was "a process of this host that is
    gone", taken over at once with no wait: two jobs writing one directory."""
    import socket

    url = str(tmp_path / "ckpt")
    os.makedirs(url)
    free_pid = next(pid for pid in range(4242, 10**6) if not os.path.exists(f"/proc/{pid}"))
    with open(os.path.join(url, LEASE), "w") as f:
        json.dump({"attempt": "dev-owner", "host": socket.gethostname(), "pid": free_pid, "job": None,
                   "pids": "another-boot-id/4026531836", "heartbeat": time.time()}, f)
    with pytest.raises(LeaseError, match=r"another job is writing checkpoints .* in another PID namespace"):
        CheckpointManager(url)
