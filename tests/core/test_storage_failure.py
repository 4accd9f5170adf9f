"""Storage failing during a background save: a clear error at the next save or at close; commits intact."""

from __future__ import annotations

import os
import subprocess

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import SaveError
from ft_checkpoint.format import layout
from ft_checkpoint.testing import servers
from tests.helpers.toy import assert_same, make, train_step


def set_immutable(path: str, on: bool) -> None:
    """Make a directory refuse new entries, for root too (chattr), or by mode bits for other users."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if on else "-i", path], check=True)
    else:
        os.chmod(path, 0o555 if on else 0o755)


def refuse_writes(url: str, step: int) -> None:
    """From now on ``url`` and the directory of ``step``, if the save made it as it cleared it, refuse new entries."""
    for path in (url, os.path.join(url, layout.step_dir(step))):
        if os.path.isdir(path):
            set_immutable(path, True)


def allow_writes(url: str) -> None:
    """Undo :func:`refuse_writes` for ``url`` and every step directory in it."""
    set_immutable(url, False)
    for name in os.listdir(url):
        if name.startswith("step_"):
            set_immutable(os.path.join(url, name), False)


def saved_state():
    state = make()
    train_step(state)
    return state


def test_read_only_directory_fails_next_save_and_keeps_commits(tmp_path):
    url = str(tmp_path / "ckpt")
    state = saved_state()
    ckpt = CheckpointManager(url, interval=1)
    ckpt.save(1, state, block=True)
    ckpt.engine.phase_hook = lambda phase, step: phase == "writing" and step == 2 and refuse_writes(url, step)
    try:
        ckpt.save(2, state)  # returns once staged; the write fails in the background
        with pytest.raises(SaveError, match=f"background save to {url} failed.*permission denied"):
            ckpt.save(3, state)
    finally:
        allow_writes(url)
    ckpt.engine.phase_hook = None
    ckpt.save(4, state, block=True)  # storage is back: saving works again
    ckpt.close()
    resumed = make(seed=7)
    with CheckpointManager(url) as again:
        assert again.resume(resumed) == 4
    assert_same(resumed, state)
    assert sorted(os.listdir(url)) == ["journal", "lease.lock", "step_000000000001", "step_000000000004"]


def test_read_only_directory_fails_at_close(tmp_path):
    url = str(tmp_path / "ckpt")
    ckpt = CheckpointManager(url, interval=1)
    ckpt.save(1, saved_state(), block=True)
    ckpt.engine.phase_hook = lambda phase, step: phase == "writing" and refuse_writes(url, step)
    try:
        ckpt.save(2, saved_state())
        with pytest.raises(SaveError, match="permission denied"):
            ckpt.close()
    finally:
        allow_writes(url)
    with CheckpointManager(url) as again:
        assert again.latest() == 1


@pytest.mark.slow  # a storage server is stopped and restarted: about 40 s
def test_server_stopped_during_background_save(tmp_path):
    """A real GCS emulator (objects on disk) is killed mid-save, then restarted: step 1 is intact."""
    server = servers.start("gcs", data_dir=str(tmp_path))
    try:
        server.make_bucket("bucket")
        url, options = "gs://bucket/run", server.storage_options
        state = saved_state()
        ckpt = CheckpointManager(url, storage_options=options, interval=1, retries=1)
        ckpt.save(1, state, block=True)
        ckpt.engine.phase_hook = lambda phase, step: phase == "writing" and server.stop()
        ckpt.save(2, state)
        with pytest.raises(SaveError, match="gs://bucket/run.*(down or unreachable|Cannot connect)"):
            ckpt.save(3, state)
        ckpt.engine.phase_hook = None
    finally:
        server.stop()
    server = servers.start("gcs", port=server.port, data_dir=str(tmp_path))
    try:
        ckpt.close()
        resumed = make(seed=7)
        with CheckpointManager(url, storage_options=options) as again:
            assert again.resume(resumed) == 1
        assert_same(resumed, state)
    finally:
        server.stop()


def test_on_save_error_warn_keeps_training_and_commits(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    state = saved_state()
    ckpt = CheckpointManager(url, interval=1, on_save_error="warn")
    ckpt.save(1, state, block=True)
    ckpt.engine.phase_hook = lambda phase, step: phase == "writing" and step in (2, 3) and refuse_writes(url, step)
    try:
        ckpt.save(2, state)
        ckpt.save(3, state)  # warns about step 2, then fails again in the background
        ckpt.wait()  # warns about step 3
    finally:
        allow_writes(url)
    assert ckpt.failed_saves == 2 and ckpt.metrics()["failed_saves"] == 2
    assert caplog.text.count("CHECKPOINT SAVE FAILED") == 2 and "resume would use step 1" in caplog.text
    ckpt.engine.phase_hook = None
    ckpt.save(4, state, block=True)
    ckpt.close()
    with CheckpointManager(url) as again:
        assert again.resume(saved_state()) == 4
