"""A journal garbled in every way a careless or hostile writer could: for the tests of its readers."""

from __future__ import annotations

import json
import time

from ft_checkpoint.format.layout import JOURNAL_DIR
from ft_checkpoint.run.journal import Journal, new_attempt_id
from ft_checkpoint.store.storage import Storage


def event(of: str, name: str = "commit", seq: int = 50, **changes) -> bytes:
    """An event of attempt ``of``, with ``changes`` to its fields."""
    body = {"event": name, "time": time.time(), "attempt": of, "seq": seq, "step": 10, **changes}
    return json.dumps(body).encode()


def bad_events(attempt: str) -> dict[str, bytes]:
    """Event files that must be skipped, by what is wrong with them."""
    now = time.time()
    return {
        "a list": b'[{"event": "commit"}]',
        "time noon": event(attempt, time="noon"),
        "step x": event(attempt, step="x"),
        "step 2.0": event(attempt, step=2.0),
        "time NaN": event(attempt, time=float("nan")),
        "time Infinity": event(attempt, time=float("inf")),
        "time 1e400": event(attempt).replace(b'"time": ', b'"time": 1e400, "t": '),
        "time far in the future": event(attempt, time=now + 30 * 86400),
        "time before the epoch": event(attempt, time=-1e12),
        "time a bool": event(attempt, time=True),
        "seq of 5000 digits": event(attempt).replace(b'"seq": 50', b'"seq": ' + b"7" * 5000),
        "missing time": json.dumps({"event": "commit", "attempt": attempt, "seq": 1}).encode(),
        "missing event": json.dumps({"time": now, "attempt": attempt, "seq": 1}).encode(),
        "stall a string": event(attempt, name="save_started", stall="long"),
        "seconds NaN": event(attempt, name="resume", seconds=float("nan")),
        "another attempt's": event(attempt, attempt="20200101T000000.000000Z-zzzzzz"),
        "not json": b"\x00\x01 not json",
        "not utf-8": b'{"event": "\xff"}',
        "nested deep": b"[" * 100_000,
        "empty": b"",
    }


def bad_progress(attempt: str) -> dict[str, bytes]:
    """Progress notes that must be ignored (the attempt still counts, with its progress unknown)."""
    now = time.time()

    def note(**changes) -> bytes:
        return json.dumps({"step": 12, "time": now, "attempt": attempt, "save_cost": 3.0, **changes}).encode()

    return {
        "a list": b"[12]",
        "time noon": note(time="noon"),
        "step x": note(step="x"),
        "step a bool": note(step=True),
        "save_cost Infinity": note(save_cost=float("inf")),
        "save_cost huge": note(save_cost=1e300),
        "save_cost 0": note(save_cost=0),
        "save_cost negative": note(save_cost=-5.0),
        "not json": b"step: 12",
    }


def failed_attempt(storage: Storage) -> str:
    """A real attempt that saved step 10 and died (no clean end): one failure to learn from."""
    journal = Journal(storage, attempt=new_attempt_id())
    journal.record("attempt_start", world_size=1)
    journal.record("save_started", step=10, stall=0.5)
    journal.record("commit", step=10, stall=0.5)
    journal.progress(12, force=True)
    journal.close()
    time.sleep(0.002)  # the next attempt id sorts after this one
    return journal.attempt


def garble(storage: Storage) -> dict[str, str]:
    """A journal with one real failed attempt among garbage of every kind; returns what each garbage file is."""
    attempt = failed_attempt(storage)
    where = f"{JOURNAL_DIR}/{attempt}"
    what = {}
    for seq, (kind, data) in enumerate(bad_events(attempt).items(), start=10):
        name = f"{where}/{seq:06d}-commit.json"
        storage.write_bytes(name, data)
        what[storage.url_of(name)] = kind
    storage.write_bytes(f"{where}/{99:06d}-clean_end.json", b'["clean_end"]')  # a garbled clean end is no end
    storage.write_bytes(f"{where}/progress.json", b'{"step": "twelve"}')
    only_garbage = new_attempt_id()
    storage.write_bytes(f"{JOURNAL_DIR}/{only_garbage}/000000-attempt_start.json", b'{"time": "noon"}')
    storage.write_bytes(f"{JOURNAL_DIR}/not-an-attempt/000000-attempt_start.json", event("not-an-attempt"))
    storage.write_bytes(f"{JOURNAL_DIR}/29991231T000000.000000Z-future/000000-attempt_start.json",
                        event("29991231T000000.000000Z-future", name="attempt_start", seq=0))
    storage.write_bytes(f"{JOURNAL_DIR}/stray.json", b"{}")
    return what
