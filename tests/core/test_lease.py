"""Concurrent writers: a second job on the same dirpath refuses to start; crashed owners are taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import LeaseError
from ft_checkpoint.lease import LEASE
from tests.helpers.toy import make

HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from ft_checkpoint import CheckpointManager
m = CheckpointManager({url!r}, interval=1)
print("HOLDING", flush=True)
time.sleep(600)
"""
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


def test_force_takeover_and_same_job_restart(tmp_path):
    url = str(tmp_path / "ckpt")
    holder = start_holder(url, TORCHELASTIC_RUN_ID="job-42")
    try:
        with CheckpointManager(url, force_takeover=True):
            pass
        holder2 = start_holder(url, TORCHELASTIC_RUN_ID="job-43")
        try:
            os.environ["TORCHELASTIC_RUN_ID"] = "job-43"  # a restart of the same torchrun job
            with CheckpointManager(url):
                pass
        finally:
            del os.environ["TORCHELASTIC_RUN_ID"]
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
