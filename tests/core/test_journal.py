"""The run journal: one object per event, per attempt, readable in order."""

from __future__ import annotations

from ft_checkpoint import CheckpointManager, read_journal
from ft_checkpoint.storage import Storage
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
    from ft_checkpoint.journal import attempt_summaries

    url = str(tmp_path / "c")
    with CheckpointManager(url, interval=5, progress_interval=0) as ckpt:
        state = make()
        for step in range(1, 13):
            ckpt.maybe_save(step, state)
    (summary,) = attempt_summaries(Storage(url))
    assert summary["last_step"] == 12 and summary["ended"] and summary["end"] >= summary["start"]
