"""The run journal: one object per event, per attempt, readable in order."""

from __future__ import annotations

import uuid

import pytest

from ft_checkpoint import CheckpointManager, read_journal
from ft_checkpoint.run.journal import attempt_summaries
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.tools.goodput import goodput_report
from tests.helpers import garbage_journal as garbage
from tests.helpers.toy import make


def test_events_of_two_attempts(backend):
    for _ in range(2):
        with CheckpointManager(backend.url, storage_options=backend.storage_options, interval=1) as ckpt:
            state = make()
            start = ckpt.resume(state) or 0
            ckpt.save(start + 1, state)
            ckpt.save(start + 2, state)
    events = read_journal(Storage(backend.url, backend.storage_options))
    attempts = sorted({e["attempt"] for e in events})
    assert len(attempts) == 2
    first = [e["event"] for e in events if e["attempt"] == attempts[0]]
    second = [e["event"] for e in events if e["attempt"] == attempts[1]]
    assert first == ["attempt_start", "save_started", "commit", "save_started", "commit", "clean_end"]
    assert second == ["attempt_start", "resume", "save_started", "commit", "save_started", "commit", "clean_end"]
    commit = next(e for e in events if e["event"] == "commit")
    assert commit["bytes"] > 0 and commit["duration"] >= commit["stall"] >= 0
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["step"] == 2
    assert "pid" in events[0] and "host" in events[0]


def test_progress_notes_how_far_each_attempt_got(tmp_path):
    url = str(tmp_path / "c")
    with CheckpointManager(url, interval=5, progress_interval=0) as ckpt:
        state = make()
        for step in range(1, 13):
            ckpt.maybe_save(step, state)
    (summary,) = attempt_summaries(Storage(url))
    assert summary["last_step"] == 12 and summary["ended"] and summary["end"] >= summary["start"]


# -- garbage in the journal never stops training -------------------------------------------------
@pytest.mark.parametrize("kind", sorted(garbage.bad_events("20261129T000000.000000Z-abc123")))
def test_a_garbage_event_is_skipped_with_a_warning_naming_it(kind, caplog):
    storage = Storage(f"memory://garbage-event-{uuid.uuid4().hex[:8]}")
    attempt = garbage.failed_attempt(storage)
    name = f"journal/{attempt}/000099-commit.json"  # the newest event: its time would be the attempt's end
    storage.write_bytes(name, garbage.bad_events(attempt)[kind])
    (summary,) = attempt_summaries(storage)
    assert summary["attempt"] == attempt and not summary["ended"] and summary["last_step"] == 12
    assert [e["event"] for e in read_journal(storage)] == ["attempt_start", "save_started", "commit"]
    assert goodput_report(storage).attempts[0].saves[0][1] == 10
    assert warned_about(caplog, storage.url_of(name))


@pytest.mark.parametrize("kind", sorted(garbage.bad_progress("20261129T000000.000000Z-abc123")))
def test_a_garbage_progress_note_is_ignored_with_a_warning_naming_it(kind, caplog):
    storage = Storage(f"memory://garbage-progress-{uuid.uuid4().hex[:8]}")
    attempt = garbage.failed_attempt(storage)
    name = f"journal/{attempt}/progress.json"
    storage.write_bytes(name, garbage.bad_progress(attempt)[kind])
    (summary,) = attempt_summaries(storage)
    assert summary["last_step"] is None and summary["save_cost"] is None
    assert warned_about(caplog, storage.url_of(name))


def test_the_adaptive_manager_starts_on_a_garbled_journal_and_learns_from_what_is_readable(tmp_path, caplog):
    url = str(tmp_path / "run")
    what = garbage.garble(Storage(url))
    with CheckpointManager(url, interval="adaptive") as ckpt:  # reads the journal at start
        assert ckpt.adaptive.failures == 1, "the one real failed attempt; the garbled ones count for nothing"
        ckpt.save(1, make(), block=True)
    for url_of_garbage, kind in what.items():
        assert warned_about(caplog, url_of_garbage), kind
    assert warned_about(caplog, f"{url}/journal/not-an-attempt")
    assert warned_about(caplog, f"{url}/journal/29991231T000000.000000Z-future")


def warned_about(caplog, url: str) -> bool:
    return any(url in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
