"""Save and resume a model + Adam + scheduler on every backend: bit-exact, RNG included."""

from __future__ import annotations

import logging
import re

import torch

from ft_checkpoint import CheckpointManager
from tests.helpers.toy import assert_same, make, train_step


def test_roundtrip_is_bit_exact(backend):
    state = make(seed=0)
    for _ in range(4):
        train_step(state)
    with CheckpointManager(backend.url, storage_options=backend.storage_options, interval=1) as ckpt:
        assert ckpt.resume(make(seed=5)) is None
        ckpt.save(4, state, epoch=1, metadata={"note": "hi"}, block=True)
    after_save = [torch.rand(3) for _ in range(2)]
    for _ in range(3):
        train_step(state)

    resumed = make(seed=1)  # different weights, and an Adam with no state yet
    with CheckpointManager(backend.url, storage_options=backend.storage_options) as ckpt:
        assert ckpt.resume(resumed) == 4
        for a, b in zip([torch.rand(3) for _ in range(2)], after_save):
            assert torch.equal(a, b), "RNG state not restored"
        for _ in range(3):
            train_step(resumed)
    assert_same(resumed, state)


def test_manifest_records_step_epoch_and_metadata(local_backend):
    from ft_checkpoint.format.layout import read_manifest
    from ft_checkpoint.store.storage import Storage

    with CheckpointManager(local_backend.url, interval=1) as ckpt:
        ckpt.save(7, make(), epoch=2, metadata={"run": "a"}, block=True)
    m = read_manifest(Storage(local_backend.url), 7)
    assert (m.step, m.epoch, m.world_size, m.metadata) == (7, 2, 1, {"run": "a"})
    assert set(m.files) == {"rank_00000.pt", "metadata.json", "__0_0.distcp", "__0_1.distcp"}  # writers=2
    assert m.format_version == 2
    assert all(f.checksum.startswith("crc32c:") and f.size > 0 for f in m.files.values())
    assert m.versions["torch"] == torch.__version__


def test_a_start_and_a_resume_are_one_line_each_with_logging_on(local_backend, caplog, capsys):
    """Issue 22: the stderr line and a log record said the same (two lines in a job's output); the log has it at
    DEBUG now."""
    caplog.set_level(logging.INFO)
    url = local_backend.url
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.resume(make())
        ckpt.save(3, make(), block=True)
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.resume(make())
    lines = capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "fresh" in line or "checkpoints go to" in line] == [
        f"ft-checkpoint: checkpoints go to {url}, a save every step"]
    resumed = [line for line in lines if "resuming from" in line or "resumed" in line]
    assert len(resumed) == 1 and re.fullmatch(rf"ft-checkpoint: resuming from step 3 of {re.escape(url)}, a save every "
                                              r"step \([\d.]+ kB verified and loaded in [\d.]+ m?s\)", resumed[0]), lines


def test_a_transaction_on_the_shared_local_filesystem_does_not_defer_our_writes(local_backend):
    """Lightning's ModelCheckpoint writes inside ``fs.transaction`` on fsspec's cached LocalFileSystem, on
    the main thread, while our writer thread may be saving: every file opened on that instance meanwhile
    is deferred to a temporary file until the transaction ends, so DCP's ``.metadata.tmp`` rename failed.
    The storage's own filesystem instance keeps our writes out of anyone else's transaction."""
    import fsspec

    state = make(seed=0)
    shared = fsspec.filesystem("file")
    with shared.transaction, shared.open(f"{local_backend.url}/other.ckpt", "wb") as f:
        with CheckpointManager(local_backend.url, interval=1) as ckpt:
            ckpt.save(4, state, block=True)
        f.write(b"ModelCheckpoint's file")
    with CheckpointManager(local_backend.url) as ckpt:
        assert ckpt.resume(make(seed=1)) == 4
