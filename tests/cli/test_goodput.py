"""The goodput accounting on journals written by real Journal objects: failures, preemptions, fresh
restarts, and attempts whose progress is unknown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ft_checkpoint.run.journal import Journal, new_attempt_id
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.tools.goodput import goodput_report
from tests.cli.conftest import cli
from tests.helpers import garbage_journal as garbage


def attempt(storage: Storage, *events: tuple, progress: int | None = None, every: float = 10.0) -> str:
    """Write one attempt's journal: ``(event, fields)`` pairs, then its progress note (noted every ``every`` s)."""
    time.sleep(0.002)  # attempt ids sort by start time
    journal = Journal(storage, attempt=new_attempt_id())
    journal.record("attempt_start", world_size=1, progress_interval=every)
    for event, fields in events:
        time.sleep(0.002)
        journal.record(event, **fields)
    if progress is not None:
        journal.progress(progress, force=True)
    journal.close()
    return journal.attempt


def test_failure_then_preemption_then_clean_end(tmp_path):
    s = Storage(str(tmp_path / "run"))
    attempt(s, ("save_started", {"step": 10, "stall": 0.1}), ("commit", {"step": 10, "stall": 0.1}),
            ("save_started", {"step": 20, "stall": 0.2}), progress=25)
    attempt(s, ("resume", {"step": 10, "seconds": 0.5}), ("save_started", {"step": 30, "stall": 0.3}),
            ("commit", {"step": 30}), ("preempted", {}), progress=30)
    attempt(s, ("resume", {"step": 30, "seconds": 0.25}), ("clean_end", {}), progress=40)
    report = goodput_report(s)
    failed, preempted, clean = report.attempts
    assert [a.outcome for a in report.attempts] == ["failed", "preempted", "clean_end"]
    assert report.failures == 1 and report.preemptions == 1
    assert failed.recomputed_steps == 15 and failed.recomputed_since == failed.saves[0][0]
    assert failed.recomputed_s == pytest.approx(failed.end - failed.saves[0][0])
    assert preempted.recomputed_steps == 0 and preempted.recomputed_s == 0
    assert clean.recomputed_steps is None and clean.gap_after_s is None
    assert report.stall_s == pytest.approx(0.6) and report.load_s == pytest.approx(0.75)
    assert report.recomputed_steps == 15

    text = cli("report", s.url).stdout
    assert "3 attempts, 1 failure, 1 preemption" in text and ">=15 steps" in text
    assert "recomputed at least 15 steps" in text, "progress noted every 10 s: the count is a lower bound"
    assert "may have run up to 10 s of training past its last progress note" in text, "and how far off it can be"
    assert report.may_miss_s == 10.0


def test_recomputed_steps_are_exact_when_every_step_was_noted(tmp_path):
    s = Storage(str(tmp_path / "run"))
    attempt(s, ("save_started", {"step": 10, "stall": 0.1}), progress=16, every=0)
    attempt(s, ("resume", {"step": 10, "seconds": 0.5}), ("clean_end", {}), progress=20, every=0)
    report = goodput_report(s)
    assert report.attempts[0].recomputed_steps == 6 and report.recomputed_exact
    text = cli("report", s.url).stdout
    assert "recomputed 6 steps" in text and ">=" not in text and "lower bound" not in text
    assert report.may_miss_s == 0.0


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_a_killed_job_on_a_filesystem_is_counted_exactly_with_the_default_settings(tmp_path):
    """The README's main job killed 6 steps after its save at step 61 reported "at least 0"; on a filesystem every
    step is now noted in place (issue 22, point 9). A real job, SIGKILLed right after step 67."""
    url = str(tmp_path / "run")
    code = ("import os, signal, sys, torch; from ft_checkpoint import CheckpointManager\n"
            "ckpt = CheckpointManager(sys.argv[1], interval=10, announce=False)\n"
            "state = {'w': torch.zeros(3)}; start = ckpt.resume(state) or 0\n"
            "for step in range(start + 1, 80):\n"
            "    state['w'] += 1; ckpt.maybe_save(step, state)\n"
            "    if step == 67 and start == 0: os.kill(os.getpid(), signal.SIGKILL)\n"
            "ckpt.close()\n")
    killed = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    report = goodput_report(Storage(url))
    failed, again = report.attempts
    recomputed = 67 - again.resumed_from  # 60, or 50 if the save of 60 was still in flight at the kill
    assert failed.outcome == "failed" and failed.recomputed_steps == recomputed and failed.recomputed_exact
    text = cli("report", url).stdout
    assert f"recomputed {recomputed} steps" in text and ">=" not in text, text


def test_a_fresh_restart_recomputes_everything_and_unknown_progress_stays_unknown(tmp_path):
    s = Storage(str(tmp_path / "run"))
    first = attempt(s, progress=7)
    attempt(s)  # died before any progress note, restarted fresh
    attempt(s, ("clean_end", {}), progress=12)
    lost, unknown, _ = goodput_report(s).attempts
    assert lost.attempt == first and lost.recomputed_steps == 7 and lost.recomputed_since == lost.start
    assert unknown.outcome == "failed" and unknown.recomputed_steps is None and unknown.last_step is None
    from ft_checkpoint.tools.cli import _report_lines

    row = _report_lines(goodput_report(s))[3]
    assert "0->(none noted)" in row, row  # it showed "0->?"


def test_no_journal(tmp_path):
    assert goodput_report(Storage(str(tmp_path))).goodput is None
    proc = cli("report", str(tmp_path))
    assert proc.returncode == 0 and "no journal" in proc.stdout


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_report_names_a_journal_that_is_no_directory(tmp_path, kind):
    """A FIFO (or a file) named ``journal`` was reported as "the unreadable journal entry DIR/journal/journal"."""
    journal = tmp_path / "journal"
    os.mkfifo(journal) if kind == "fifo" else journal.write_text("x")
    proc = cli("report", tmp_path)
    assert proc.returncode == 0 and "no journal" in proc.stdout, proc.stderr
    assert f"ft-checkpoint: warning: skipping the unreadable journal entry {journal}: it is not a directory" \
        in proc.stderr and "journal/journal" not in proc.stderr, proc.stderr


def test_report_on_a_garbled_journal_warns_naming_each_file_and_reports_the_rest(tmp_path):
    url = str(tmp_path / "run")
    what = garbage.garble(Storage(url))
    text = cli("report", url)
    assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
    for path, kind in what.items():
        assert f"ft-checkpoint: warning: skipping the unreadable journal entry {path}" in text.stderr, kind
    assert "1 attempt, 0 failures" in text.stdout and "unreadable journal file" in text.stdout
    proc = cli("report", url, "--json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["attempts"]) == 1 and report["attempts"][0]["saves"] == [
        {"time": report["attempts"][0]["saves"][0]["time"], "step": 10}]
    assert set(what) <= set(report["skipped"])
