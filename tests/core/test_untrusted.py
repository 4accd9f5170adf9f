"""Loading a checkpoint never runs pickled code, even when an attacker also fixed the checksums."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from ft_checkpoint import CheckpointManager, layout
from ft_checkpoint.storage import Storage
from tests.helpers.toy import make


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def replace_with_checksum(storage: Storage, step: int, name: str, data: bytes) -> None:
    rel = layout.step_dir(step)
    storage.write_bytes(f"{rel}/{name}", data)
    manifest = json.loads(storage.read_bytes(f"{rel}/{layout.MANIFEST}"))
    manifest["files"][name] = {"size": len(data), "checksum": layout.checksum([data])}
    storage.write_bytes(f"{rel}/{layout.MANIFEST}", json.dumps(manifest).encode())


@pytest.mark.parametrize("target", ["rank_00000.pt", ".metadata"])
def test_pickle_payload_is_not_executed(tmp_path, target, caplog):
    url, marker = str(tmp_path / "ckpt"), str(tmp_path / "pwned")
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
        ckpt.save(2, make(), block=True)
    payload = pickle.dumps(Payload(marker))
    if target == "rank_00000.pt":  # a torch.save-format file whose pickle carries the payload
        import io

        import torch

        buf = io.BytesIO()
        torch.save({"skeleton": Payload(marker), "per_rank": {}}, buf)
        payload = buf.getvalue()
    replace_with_checksum(Storage(url), 2, target, payload)
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(make()) == 1  # step 2 refused, step 1 used
    assert not os.path.exists(marker), "pickled code ran"
    assert "skipping step 2" in caplog.text or "cannot be loaded safely" in caplog.text
