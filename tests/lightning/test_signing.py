"""Signed manifests under Lightning (issue 21, point 10): the key comes from the environment, as a launcher
sets it; a fit resumes its own signed steps bit-exactly and skips a step forged with recomputed checksums."""

from __future__ import annotations

import json
import logging

from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from lightning_ft import FaultTolerantCheckpoint
from lightning_ft.testing import assert_same, final_state, fit

KEY = "5f0c9e2a7d41b8363ac2e9f17b0d4c5a" * 2


def swap_rank_file(url: str, into: int, source: int) -> None:
    """Put step ``source``'s rank file (loop position, RNG) into step ``into``, its manifest entry recomputed."""
    s = Storage(url)
    name = layout.rank_file(0)
    s.write_bytes(f"{layout.step_dir(into)}/{name}", s.read_bytes(f"{layout.step_dir(source)}/{name}"))
    manifest = json.loads(s.read_bytes(f"{layout.step_dir(into)}/{layout.MANIFEST}"))
    manifest["files"][name] = layout.read_manifest(s, source).files[name].__dict__
    s.write_bytes(f"{layout.step_dir(into)}/{layout.MANIFEST}", json.dumps(manifest).encode())


def test_a_fit_with_the_key_from_the_env_resumes_signed_steps_and_skips_a_forged_one(tmp_path, monkeypatch, caplog):
    key_file = tmp_path / "secret" / "ft.key"
    key_file.parent.mkdir()
    key_file.write_text(KEY + "\n")
    monkeypatch.setenv("FT_CHECKPOINT_SIGNING_KEY_FILE", str(key_file))
    model, _, trainer, _ = fit([FaultTolerantCheckpoint(str(tmp_path / "reference"), interval=4)])
    reference = final_state(model, trainer)

    url = str(tmp_path / "ckpt")
    assert fit([FaultTolerantCheckpoint(url, interval=4)], crash_at=22)[3]
    assert all(layout.read_manifest(Storage(url), s).signature for s in (16, 20))
    swap_rank_file(url, 20, 16)

    cb = FaultTolerantCheckpoint(url, interval=4)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        model, _, trainer, _ = fit([cb])
    assert cb.resumed_from == 16
    skipped = next(r.getMessage() for r in caplog.records if "skipping step 20" in r.getMessage())
    assert "does not verify" in skipped, skipped
    assert_same(reference, final_state(model, trainer))
