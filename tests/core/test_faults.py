"""Storage faults injected by a real (faulty) fsspec filesystem: saves still commit, nothing is damaged."""

from __future__ import annotations

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import SaveError, StorageError
from tests.helpers.toy import assert_same, make, train_step


def faulty(tmp_path, **faults) -> tuple[str, dict]:
    return f"faulty://{tmp_path}/ckpt", {"seed": 7, **faults}


def test_ten_percent_transient_errors_every_save_commits(tmp_path):
    url, options = faulty(tmp_path, transient_rate=0.10)
    state = make()
    with CheckpointManager(url, storage_options=options, interval=1, retries=8) as ckpt:
        ckpt.storage.backoff = 0.001
        for step in range(1, 11):
            train_step(state)
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.failed_saves == 0 and ckpt.latest() == 10
        assert ckpt.storage.fs.injected > 10, "faults were injected"
    for _ in range(3):  # resume through the same faults, several times
        resumed = make(seed=3)
        with CheckpointManager(url, storage_options=options, retries=8) as ckpt:
            ckpt.storage.backoff = 0.001
            assert ckpt.resume(resumed) == 10
        assert_same(resumed, state)


def test_permanent_outage_warns_and_training_goes_on(tmp_path, caplog):
    url, options = faulty(tmp_path)
    state = make()
    ckpt = CheckpointManager(url, storage_options=options, interval=1, retries=2, on_save_error="warn")
    ckpt.storage.backoff = 0.001
    ckpt.save(1, state, block=True)
    ckpt.storage.fs.outage = True
    for step in (2, 3):
        train_step(state)
        ckpt.save(step, state)  # training goes on
    ckpt.wait()
    assert ckpt.failed_saves == 2 and caplog.text.count("CHECKPOINT SAVE FAILED") == 2
    assert "storage service may be down" in caplog.text or "injected outage" in caplog.text
    ckpt.storage.fs.outage = False
    ckpt.close()
    with CheckpointManager(url, storage_options=options) as again:
        assert again.latest() == 1, "the committed step is untouched"


def test_permanent_outage_raises_by_default(tmp_path):
    url, options = faulty(tmp_path, seed=8)
    ckpt = CheckpointManager(url, storage_options=options, interval=1, retries=2)
    ckpt.storage.backoff = 0.001
    ckpt.save(1, make(), block=True)
    ckpt.storage.fs.outage = True
    ckpt.save(2, make())
    with pytest.raises(SaveError, match="injected outage"):
        ckpt.wait()
    ckpt.storage.fs.outage = False
    ckpt.close()
    with pytest.raises(StorageError, match="injected outage"):
        CheckpointManager(url, storage_options={**options, "outage": True}, retries=1)


def test_a_step_left_half_written_is_saved_again_on_a_filesystem_with_directories(tmp_path):
    """A job killed while writing step 2 leaves its directory with a partial shard; the restarted job, resuming
    from step 1, saves step 2 again over it. On a filesystem with directories other than local disk (``faulty://``
    here; SFTP, HDFS) the emptied directory must be removed too, or the save refused to write "over" it forever."""
    url, options = faulty(tmp_path)
    state = make()
    with CheckpointManager(url, storage_options=options, interval=1) as ckpt:
        ckpt.save(1, state, block=True)
    left = tmp_path / "ckpt" / "step_000000000002"
    left.mkdir()
    (left / "__0_0.distcp").write_bytes(b"half a shard")
    with CheckpointManager(url, storage_options=options, interval=1) as ckpt:
        assert ckpt.resume(make(seed=3)) == 1
        train_step(state)
        ckpt.save(2, state, block=True)
        assert ckpt.latest() == 2 and ckpt.failed_saves == 0
    resumed = make(seed=4)
    with CheckpointManager(url, storage_options=options) as ckpt:
        assert ckpt.resume(resumed) == 2
    assert_same(resumed, state)
