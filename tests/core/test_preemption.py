"""Preemption notices and launcher restarts, with real signals, real processes and real torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ft_checkpoint import CheckpointConfig, CheckpointManager, ConfigError, read_journal
from ft_checkpoint.errors import Preempted
from ft_checkpoint.policies.adaptive.failures import count_failures
from ft_checkpoint.run.journal import attempt_summaries
from ft_checkpoint.run.preemption import PreemptionWatcher
from ft_checkpoint.run.slurm import SlurmJob
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.testing import jobs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "preempt_train.py")
TIMEOUT = 300


ABORT_AT_EXIT = "terminate called without an active exception"
"""torch 2.13's gloo, now and then, at a process's exit, whatever the script does: a 2-rank script that only
initializes gloo, gathers once and exits aborted so in 8 of 30 runs under torchrun here, 2 of 30 with
``destroy_process_group()`` first (a ``pt_gloo_runloop`` thread ends in ``pthread_exit`` while the interpreter
finalizes: gdb). torchrun then restarts a job that had ended; a test of the restarts allows that one."""


def run(dirpath, out, *args, torchrun=False) -> jobs.Finished:
    """The script alone, or with ``torchrun``: 2 ranks, up to 3 restarts."""
    return jobs.run(SCRIPT, dirpath, out, *args, launcher="torchrun" if torchrun else "python", nproc=2, restarts=3,
                    env={"PYTHONWARNINGS": "ignore"}, timeout=TIMEOUT)


def run_and_signal(dirpath, out, sig, after_step, *args):
    """Start the job, send ``sig`` once it printed ``STEP after_step``; returns (returncode, output)."""
    proc = jobs.start(SCRIPT, dirpath, out, *args, env={"PYTHONWARNINGS": "ignore"}, stderr=subprocess.STDOUT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == f"STEP {after_step}":
            proc.send_signal(sig)
    return proc.wait(timeout=TIMEOUT), "".join(lines)


def same_weights(a, b):
    wa, wb = torch.load(a), torch.load(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    proc = run(root / "ckpt", root / "out", "--steps", 40)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root / "out" / "final.pt"


def test_watcher_only_sets_a_flag_and_chains_the_previous_handler():
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        watcher = PreemptionWatcher(["SIGUSR2"])
        assert not watcher.check()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert watcher.check() and watcher.reason == "SIGUSR2" and seen == [signal.SIGUSR2]
        watcher.close()
        os.kill(os.getpid(), signal.SIGUSR2)  # closed: only the previous handler
        assert seen == [signal.SIGUSR2] * 2
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_closed_watcher_chained_by_a_newer_one_does_nothing():
    """A closed watcher still reachable (a framework put it back, a newer one chained it) never kills."""
    before = signal.getsignal(signal.SIGUSR2)
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        old = PreemptionWatcher(["SIGUSR2"])
        old.close()
        signal.signal(signal.SIGUSR2, old._handle)  # as Lightning's teardown does with the handlers it found
        newer = PreemptionWatcher(["SIGUSR2"])
        os.kill(os.getpid(), signal.SIGUSR2)  # the default action would end this test process
        assert newer.check() and not old.requested
        newer.close()
    finally:
        signal.signal(signal.SIGUSR2, before)


CLOSED_CHAIN = """
import os, signal, sys, time
from ft_checkpoint.run.preemption import PreemptionWatcher
for _ in range(int(sys.argv[1])):  # one watcher per fit, Lightning's handler over it, put back at the fit's end
    watcher = PreemptionWatcher(["SIGTERM"])
    installed = signal.signal(signal.SIGTERM, lambda *_: None)
    watcher.close()
    signal.signal(signal.SIGTERM, installed)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("the SIGTERM was swallowed")
"""


@pytest.mark.parametrize("fits", [1, 2, 3, 1500])
def test_closed_watchers_put_back_after_each_fit_let_a_sigterm_end_the_process(fits):
    """After two fits in one process, each with its own watcher, the second one chained the first one's closed
    handler, which acted as the default only while installed itself: a SIGTERM with no handler of the user's was
    swallowed; and each fit added a link, a RecursionError after ~1000 fits. A new watcher chains what the closed
    ones before it would pass the signal on to."""
    proc = subprocess.run([sys.executable, "-c", CLOSED_CHAIN, str(fits)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr


SECOND_NOTICE = """
import atexit, os, signal, sys, time
import torch
from ft_checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1], interval=100)
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.5)))  # a second notice while exiting
os.kill(os.getpid(), signal.SIGTERM)
manager.maybe_save(1, {"w": torch.ones(4)})
"""


def test_a_second_sigterm_while_a_preempted_process_exits_ends_it_and_loses_nothing(tmp_path):
    """The preemption's exit is under way (``Preempted``, step 1 committed): a second SIGTERM takes the default
    action (README: exit -15, not 0), and the step is committed and journaled all the same."""
    proc = subprocess.run([sys.executable, "-c", SECOND_NOTICE, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    events = read_journal(Storage(str(tmp_path)))
    assert [(e["event"], e.get("step")) for e in events if e["event"] in ("commit", "preempted")] == [
        ("commit", 1), ("preempted", 1)]


def test_end_time_within_margin_is_a_notice():
    watcher = PreemptionWatcher([], end_time=time.time() + 600, margin=60)
    assert not watcher.check()
    assert watcher.check(now=time.time() + 550) and watcher.reason == "job end time"


@pytest.mark.parametrize("bad", [["SIGKILL"], ["SIGNOPE"], 7.5])
def test_bad_signal_config_names_the_field(bad):
    with pytest.raises(ConfigError, match="preemption_signals"):
        CheckpointConfig(preemption_signals=bad)


def test_signals_from_env(monkeypatch):
    monkeypatch.setenv("FT_CHECKPOINT_PREEMPTION_SIGNALS", "usr2,SIGTERM")
    monkeypatch.setenv("FT_CHECKPOINT_REQUEUE", "false")
    cfg = CheckpointConfig.from_env()
    assert cfg.preemption_signals == ("SIGUSR2", "SIGTERM") and cfg.requeue is False


def test_slurm_job_from_env():
    job = SlurmJob.detect({"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "1",
                           "SLURM_RESTART_COUNT": "2", "SLURM_JOB_END_TIME": "1900000000"}, query=False)
    assert (job.job_id, job.restart_count, job.end_time) == ("6_1", 2, 1900000000.0)


def test_slurm_time_limit_makes_the_final_save(tmp_path, monkeypatch):
    """A Slurm job whose time limit is within the margin: the next step is saved, then Preempted (exit 0)."""
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 60))
    state = {"w": torch.arange(4.0)}
    ckpt = CheckpointManager(str(tmp_path), interval=100, end_time_margin="5m", requeue=False,
                             preemption_signals=[])
    assert ckpt.slurm.job_id == "424242"
    with pytest.raises(Preempted) as exc:
        ckpt.maybe_save(3, state)
    assert (exc.value.code, exc.value.step, exc.value.reason) == (0, 3, "job end time")
    events = [e for e in read_journal(Storage(str(tmp_path))) if e["event"] == "preempted"]
    assert [(e["step"], e["requeue"]) for e in events] == [(3, False)]
    assert CheckpointManager(str(tmp_path), preemption_signals=[]).resume(state) == 3


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_mid_run_saves_that_step_exits_0_and_resumes_exactly(tmp_path, reference, sig):
    marker = tmp_path / "user-handler-ran"
    code, output = run_and_signal(tmp_path / "ckpt", tmp_path / "out", sig, 13, "--steps", 40,
                                  "--step-time", 0.05, "--user-sigterm-marker", marker)
    assert code == 0, output
    assert marker.exists() == (sig == signal.SIGTERM)  # the user's own SIGTERM handler still ran
    storage = Storage(str(tmp_path / "ckpt"))
    preempted = [e for e in read_journal(storage) if e["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["reason"] == sig.name, preempted
    final_step = preempted[0]["step"]
    last_printed = max(int(line.split()[1]) for line in output.splitlines() if line.startswith("STEP "))
    assert 13 <= final_step == last_printed < 40  # the step boundary right after the signal, nothing later

    proc = run(tmp_path / "ckpt", tmp_path / "out", "--steps", 40)
    assert proc.returncode == 0 and f"RESUMED {final_step}" in proc.stdout, proc.stdout + proc.stderr
    assert same_weights(reference, tmp_path / "out" / "final.pt")
    assert count_failures(attempt_summaries(storage))[0] == 0  # an announced preemption is no failure




@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchrun-reference")
    proc = run(root / "ckpt", root / "out", "--steps", 40, torchrun=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root / "out" / "final.pt"


def test_torchrun_signal_to_one_rank_stops_both_at_the_same_step(tmp_path, torchrun_reference):
    """SIGUSR1 to rank 1 only: the ranks agree, save that step together, torchrun exits 0; the restart is exact."""
    proc = run(tmp_path / "ckpt", tmp_path / "out", "--steps", 40, "--signal-rank", 1, "--signal-at", 12,
               torchrun=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = read_journal(Storage(str(tmp_path / "ckpt")))
    assert [(e["step"], e["reason"]) for e in events if e["event"] == "preempted"] == [(12, "SIGUSR1 on rank 1")]
    if ABORT_AT_EXIT in proc.stderr:  # gloo aborted a rank at its exit after the preemption: torchrun restarted
        first, resumed, _ = proc.stdout.partition("RESUMED 12")
        assert "STEP 12" in first and "STEP 13" not in first and resumed, proc.stdout
    else:
        assert "STEP 12" in proc.stdout and "STEP 13" not in proc.stdout and not os.path.exists(tmp_path / "out")
        proc = run(tmp_path / "ckpt", tmp_path / "out", "--steps", 40, torchrun=True)
        assert proc.returncode == 0 and "RESUMED 12" in proc.stdout, proc.stdout + proc.stderr
    assert same_weights(torchrun_reference, tmp_path / "out" / "final.pt")


def test_torchrun_max_restarts_resumes_after_a_rank_is_killed(tmp_path, torchrun_reference):
    """torchrun --nproc-per-node 2 --max-restarts 3, rank 1 SIGKILLed: the group restarts, resumes, ends exact."""
    proc = run(tmp_path / "ckpt", tmp_path / "out", "--steps", 40, "--kill-rank", 1, "--kill-at", 25,
               torchrun=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RESUMED")]
    assert resumed[:2] in (["none", "10"], ["none", "20"]), proc.stdout  # step 20 if its write beat the kill
    assert resumed[2:] == ["40"] * len(resumed[2:]) and len(resumed) <= 2 + proc.stderr.count(ABORT_AT_EXIT)
    assert same_weights(torchrun_reference, tmp_path / "out" / "final.pt")
    failures, _ = count_failures(attempt_summaries(Storage(str(tmp_path / "ckpt"))))
    assert failures == 1  # the journal counts the restart as a failure (one after gloo's abort follows a clean end)
