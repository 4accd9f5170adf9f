"""Untrusted and accidental input: whoever can write the checkpoint directory may be careless or hostile, and
can recompute every checksum. Loading never runs code, never reads outside the step, never loads a state
that differs silently; deleting touches only what the run committed; a restarted counter never resurrects
an old run. Each test builds the attack or accident for real and asserts the safe outcome."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle

import pytest
import torch

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import CheckpointCorruptError, StateMismatchError
from ft_checkpoint.format import layout
from ft_checkpoint.run.retention import apply_retention
from ft_checkpoint.store.storage import Storage
from tests.helpers.legacy import replace_legacy_file, write_legacy_step
from tests.helpers.toy import assert_same, make, train_step


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def dotted_payload(marker: str) -> bytes:
    """Protocol 4 lets a global name be dotted: ``os.system`` looked up *through* DCP's metadata module (which
    imports os). An allowlist of whole modules lets it through."""
    def text(b: bytes) -> bytes:
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE

    return (b"\x80\x04" + text(b"torch.distributed.checkpoint.metadata") + text(b"os.system") + b"\x93"
            + text(f"touch {marker}".encode()) + b"\x85R.")


def replace_with_checksum(storage: Storage, step: int, name: str, data: bytes) -> None:
    """Replace a file of a step and recompute its manifest entry, as an attacker can."""
    rel = layout.step_dir(step)
    storage.write_bytes(f"{rel}/{name}", data)
    manifest = json.loads(storage.read_bytes(f"{rel}/{layout.MANIFEST}"))
    manifest["files"][name] = {"size": len(data), "checksum": layout.checksum([data])}
    storage.write_bytes(f"{rel}/{layout.MANIFEST}", json.dumps(manifest).encode())


def two_steps(url: str) -> dict:
    """Steps 1 and 2 of a toy run; returns a copy of what step 1 holds."""
    state = make()
    with CheckpointManager(url, interval=1) as ckpt:
        train_step(state)
        ckpt.save(1, state, block=True)
        step1 = make(seed=3)
        ckpt.resume(step1)
        train_step(state)
        ckpt.save(2, state, block=True)
    return step1


def resumes_step_1(url: str, step1: dict, caplog, reason: str) -> None:
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    resumed = make(seed=9)
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(resumed) == 1
    assert_same(resumed, step1)
    warning = next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())
    assert reason in warning, warning


# -- 1. no code execution ------------------------------------------------------------------------
def test_pickle_payload_in_a_rank_file_is_not_executed(tmp_path, caplog):
    url, marker = str(tmp_path / "ckpt"), str(tmp_path / "pwned")
    step1 = two_steps(url)
    buf = io.BytesIO()
    torch.save({"skeleton": Payload(marker), "per_rank": {}}, buf)
    replace_with_checksum(Storage(url), 2, "rank_00000.pt", buf.getvalue())
    resumes_step_1(url, step1, caplog, "cannot be loaded safely")
    assert not os.path.exists(marker), "pickled code ran"


@pytest.mark.parametrize("payload", ["reduce", "dotted-name"])
def test_forged_format1_metadata_never_runs_code(tmp_path, caplog, payload):
    """Checkpoints in format 1 (pickled ``.metadata``) keep loading, through an allowlist of exact names."""
    url, marker = str(tmp_path / "ckpt"), str(tmp_path / "pwned")
    step1 = make(seed=1)
    write_legacy_step(url, 1, step1)
    write_legacy_step(url, 2, make(seed=2))
    evil = pickle.dumps(Payload(marker)) if payload == "reduce" else dotted_payload(marker)
    replace_legacy_file(url, 2, ".metadata", evil)
    resumes_step_1(url, step1, caplog, "refusing to load it")
    assert not os.path.exists(marker), "pickled code ran"


def test_a_format1_checkpoint_keeps_loading_bit_exact(tmp_path):
    url = str(tmp_path / "ckpt")
    state = make(seed=4)
    train_step(state)
    write_legacy_step(url, 7, state, epoch=1)
    expected_rand = torch.rand(3)  # the rank file holds the RNG state from before this draw
    resumed = make(seed=5)
    with CheckpointManager(url, interval=1) as ckpt:
        assert ckpt.resume(resumed) == 7
        assert torch.equal(torch.rand(3), expected_rand)
        train_step(resumed)
        ckpt.save(8, resumed, block=True)  # saves go on in format 2, beside the old step
        assert layout.read_manifest(ckpt.storage, 8).format_version == 2
    assert_same(resumed["model"], resumed["model"])


# -- 2. no tensor data from outside the step, no silent partial tensors ------------------------------
def forge_metadata(url: str, edit) -> None:
    """Rewrite step 2's metadata.json through ``edit(doc)`` and recompute its manifest entry."""
    s = Storage(url)
    doc = json.loads(s.read_bytes(f"{layout.step_dir(2)}/{layout.METADATA}"))
    edit(doc)
    replace_with_checksum(s, 2, layout.METADATA, json.dumps(doc).encode())


def _first(doc: dict, key: str = "model/0.weight") -> dict:
    return doc["tensors"][key]["chunks"][0]


FORGERIES = {
    "absolute-path": (lambda d: _first(d).update(file="/etc/passwd"), "is not a data file listed in the manifest"),
    "dot-dot-path": (lambda d: _first(d).update(file="../step_000000000001/__0_0.distcp"),
                     "is not a data file listed in the manifest"),
    "another-listed-file": (lambda d: _first(d).update(file="rank_00000.pt"), "is not a data file listed"),
    "range-past-the-end": (lambda d: _first(d).update(offset=10**9), "lie outside __0_0.distcp"),
    "half-a-tensor": (lambda d: _first(d).update(sizes=[16, 16], length=16 * 16 * 4),
                      "do not cover the whole tensor"),
    "overlapping-ranges": (lambda d: _first(d, "model/0.bias").update(offset=_first(d)["offset"]),
                           "two chunks share bytes"),
    "huge-tensor": (lambda d: d["tensors"]["model/0.weight"].update(
        size=[10**6, 10**6], chunks=[{**_first(d), "sizes": [10**6, 10**6], "length": 4 * 10**12}]),
        "lie outside __0_0.distcp"),
    "object-dtype": (lambda d: d["tensors"]["model/0.weight"].update(dtype="object"), "is not one this format stores"),
    "wrong-rank": (lambda d: _first(d).update(offsets=[0]), "must be lists of 2 integers"),
    "bool-offset": (lambda d: _first(d).update(offset=True), "offset and length must be integers"),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_tensor_metadata_is_refused_before_anything_is_read(tmp_path, caplog, forgery):
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    edit, reason = FORGERIES[forgery]
    forge_metadata(url, edit)
    resumes_step_1(url, step1, caplog, reason)


def test_format1_relative_path_outside_the_step_is_refused(tmp_path, caplog):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from ft_checkpoint.format.legacy import load_metadata

    url = str(tmp_path / "ckpt")
    step1 = make(seed=1)
    write_legacy_step(url, 1, step1)
    write_legacy_step(url, 2, make(seed=2))
    path = os.path.join(url, layout.step_dir(2), ".metadata")
    with open(path, "rb") as f:
        metadata = load_metadata(f.read())
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = _StorageInfo("../step_000000000001/__0_0.distcp", info.offset, info.length)
    replace_legacy_file(url, 2, ".metadata", pickle.dumps(metadata))
    resumes_step_1(url, step1, caplog, "which is not a data file listed in the manifest")


# -- 3. a step that checked but cannot be loaded is skipped, not fatal ---------------------------
@pytest.mark.parametrize("field,value", [("step", 2.0), ("step", True), ("time", "noon"), ("epoch", -1),
                                         ("world_size", 0), ("versions", {"torch": 2})])
def test_manifest_fields_of_the_wrong_type_are_corrupt(tmp_path, caplog, field, value):
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    s = Storage(url)
    rel = f"{layout.step_dir(2)}/{layout.MANIFEST}"
    manifest = json.loads(s.read_bytes(rel))
    manifest[field] = value
    s.write_bytes(rel, json.dumps(manifest).encode())
    resumes_step_1(url, step1, caplog, f"field {field!r} is")


def test_a_file_size_that_is_a_string_is_corrupt(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    s = Storage(url)
    rel = f"{layout.step_dir(2)}/{layout.MANIFEST}"
    manifest = json.loads(s.read_bytes(rel))
    manifest["files"]["__0_0.distcp"]["size"] = str(manifest["files"]["__0_0.distcp"]["size"])
    s.write_bytes(rel, json.dumps(manifest).encode())
    resumes_step_1(url, step1, caplog, "the size of __0_0.distcp is")


def test_a_step_that_does_not_fit_the_state_is_skipped_but_kept(tmp_path, caplog):
    """Another shape (the model changed, or the step was forged) or a missing key: the previous step is tried;
    the unfit step is not quarantined, since the state, not the step, may be what changed."""
    url = str(tmp_path / "ckpt")
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    small = make(width=32)
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, small, block=True)
        ckpt.save(2, make(width=64), block=True)
    resumed = make(seed=5, width=32)
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(resumed) == 1
    assert_same(resumed, small)
    assert "saved [64, 16] torch.float32, the state has [32, 16]" in caplog.text
    assert layout.MANIFEST in Storage(url).listdir(layout.step_dir(2)), "an unfit step must not be set aside"


def test_no_step_fits_the_state_raises_instead_of_starting_fresh(tmp_path):
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, make(width=32), block=True)
    with CheckpointManager(url) as ckpt:
        with pytest.raises(StateMismatchError, match="fits the state.*HINT"):
            ckpt.resume(make(width=64))
        with pytest.raises(StateMismatchError, match=r"state keys \['extra'\] are not in the checkpoint"):
            ckpt.resume({**make(width=32), "extra": 1})


def test_keys_in_the_checkpoint_that_the_state_lacks_are_named(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, {**make(), "ema": torch.ones(3)}, block=True)
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(make()) == 1
    assert "also holds state keys ['ema']" in caplog.text


# -- 4. deletion is literal and confined to the run's own steps -----------------------------------
def test_a_symlinked_step_directory_is_neither_resumed_nor_deleted_through(tmp_path, caplog):
    other, ours = str(tmp_path / "other"), str(tmp_path / "ours")
    with CheckpointManager(other, interval=1) as ckpt:
        ckpt.save(50, make(seed=7), block=True)
    victim = os.path.join(other, layout.step_dir(50))
    os.makedirs(ours)
    os.symlink(victim, os.path.join(ours, layout.step_dir(1)))
    before = sorted(os.listdir(victim))
    state = make()
    with CheckpointManager(ours, interval=1, keep_last=1) as ckpt:
        assert ckpt.resume(state) is None
        for step in (2, 3, 4):
            ckpt.save(step, state, block=True)
    apply_retention(Storage(ours), keep_last=1)
    assert sorted(os.listdir(victim)) == before, "retention deleted through a symbolic link"
    assert os.path.islink(os.path.join(ours, layout.step_dir(1)))
    assert "named like a step directory but it is a symbolic link" in caplog.text


def test_a_file_named_like_a_step_is_ignored(tmp_path):
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    with open(os.path.join(url, layout.step_dir(99)), "w") as f:
        f.write("not a directory")
    resumed = make(seed=9)
    with CheckpointManager(url, interval=1) as ckpt:
        assert ckpt.resume(resumed) == 2
        assert resumed is not None and step1 is not None
        train_step(resumed)
        ckpt.save(3, resumed, block=True)
    assert os.path.isfile(os.path.join(url, layout.step_dir(99)))


def test_steps_named_with_non_ascii_digits_are_not_steps(tmp_path):
    """``\\d`` matches Arabic-Indic digits too: such a directory parsed as a huge step made retention delete
    every real step."""
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1, keep_last=2) as ckpt:
        ckpt.save(1, make(), block=True)
    s = Storage(url)
    fake = "step_" + "\u0669" * 12  # ٩٩٩٩٩٩٩٩٩٩٩٩
    for name, data in (("manifest.json", s.read_bytes(f"{layout.step_dir(1)}/manifest.json")), ("x", b"x")):
        s.write_bytes(f"{fake}/{name}", data)
    with CheckpointManager(url, interval=1, keep_last=2) as ckpt:
        assert ckpt.resume(make()) == 1
        ckpt.save(2, make(), block=True)
    assert sorted(layout.list_steps(s)) == [1, 2] and s.exists(f"{fake}/x")


# -- 5. retention never deletes what was just saved; a restarted counter never resurrects an old run ---
def test_a_save_below_committed_steps_stops_with_a_hint(tmp_path):
    """A new run pointed at an old directory (or a phase that restarts its step count) would have each new
    save deleted by retention right after its commit, and a crash would resume the old run."""
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1) as ckpt:
        for step in (100, 110, 120):
            ckpt.save(step, make(), block=True)
    with CheckpointManager(url, interval=1, keep_last=1) as ckpt:
        with pytest.raises(StateMismatchError, match="step 120 is committed there already.*HINT"):
            ckpt.save(5, make())
    assert sorted(layout.list_steps(Storage(url))) == [100, 110, 120]


def test_a_save_below_newer_steps_that_did_not_fit_names_the_fallback(tmp_path):
    """A resume that fell back past steps that did not fit its state (a key the training adds as it goes) crash-looped
    at its first save below them with the general causes only; the refusal names the fallback and its reason."""
    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(5, {**make(), "grown": torch.ones(4)}, block=True)
        ckpt.save(10, {**make(), "grown": torch.ones(8)}, block=True)  # grown after step 5
    with CheckpointManager(url, interval=1) as ckpt:
        assert ckpt.resume({**make(), "grown": torch.ones(4)}) == 5
        with pytest.raises(StateMismatchError, match="this run resumed from step 5 because the newer steps did not fit"):
            ckpt.save(10, {**make(), "grown": torch.ones(4)})


def test_a_garbage_manifest_does_not_count_as_committed_for_retention(tmp_path):
    url = str(tmp_path / "ckpt")
    s = Storage(url)
    s.write_bytes(f"{layout.step_dir(10**11)}/{layout.MANIFEST}", b'{"format": "ft-checkpoint"}')
    with CheckpointManager(url, interval=1, keep_last=1) as ckpt:
        ckpt.save(1, make(), block=True)
        ckpt.save(2, make(), block=True)
    assert layout.committed_steps(s) == [2], "retention kept a garbage step and deleted the real one"


def test_corrupt_steps_are_skipped_then_the_step_count_goes_on(tmp_path):
    url = str(tmp_path / "ckpt")
    two_steps(url)
    with pytest.raises(CheckpointCorruptError):
        layout.Manifest.from_json(b'{"format": "ft-checkpoint", "format_version": 2, "step": 1, "world_size": 1, '
                                  b'"files": {"../x": {"size": 1, "checksum": "crc32c:00000000"}}}')
