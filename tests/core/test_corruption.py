"""A corrupt newest step: resume falls back to the previous one, with a warning naming step and reason."""

from __future__ import annotations

import logging
import random

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import CheckpointCorruptError
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from tests.helpers.toy import assert_same, make, train_step


def truncate_shard(s: Storage, rel: str) -> None:
    data = s.read_bytes(f"{rel}/__0_0.distcp")
    s.write_bytes(f"{rel}/__0_0.distcp", data[: len(data) // 2])


def flip_byte(s: Storage, rel: str) -> None:
    """One flipped bit in the first tensor chunk of the file (on local disk chunks are padded to whole pages;
    a flip in the padding changes no tensor: ``ft-checkpoint verify`` reports it, a resume loads correctly)."""
    data = bytearray(s.read_bytes(f"{rel}/__0_0.distcp"))
    data[100] ^= 0xFF
    s.write_bytes(f"{rel}/__0_0.distcp", bytes(data))


def delete_manifest(s: Storage, rel: str) -> None:
    s.delete_file(f"{rel}/{layout.MANIFEST}")


def delete_shard(s: Storage, rel: str) -> None:
    s.delete_file(f"{rel}/__0_0.distcp")


def garbage_manifest(s: Storage, rel: str) -> None:
    s.write_bytes(f"{rel}/{layout.MANIFEST}", random.Random(0).randbytes(512))


def stray_shard(s: Storage, rel: str) -> None:
    """A shard the manifest does not list (left over, or copied in from elsewhere)."""
    s.write_bytes(f"{rel}/__0_7.distcp", s.read_bytes(f"{rel}/__0_0.distcp"))


def stray_rank_file(s: Storage, rel: str) -> None:
    """The file rank 1 would load if the job grew to 2 ranks (rank files are found by listing)."""
    s.write_bytes(f"{rel}/rank_00001.pt", s.read_bytes(f"{rel}/rank_00000.pt"))


CORRUPTIONS = {
    truncate_shard: "__0_0.distcp: has",
    flip_byte: "__0_0.distcp: bytes [",
    delete_manifest: "manifest.json is missing",
    delete_shard: "__0_0.distcp: missing",
    garbage_manifest: "manifest.json: not valid JSON",
    stray_shard: "__0_7.distcp: not listed in the manifest",
    stray_rank_file: "rank_00001.pt: not listed in the manifest",
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=lambda f: f.__name__)
def test_falls_back_to_previous_step(backend, corrupt, caplog):
    state = make()
    with CheckpointManager(backend.url, storage_options=backend.storage_options, interval=1) as ckpt:
        train_step(state)
        ckpt.save(1, state, block=True)
        step1 = make(seed=3)
        ckpt.resume(step1)  # a copy of what step 1 holds
        train_step(state)
        ckpt.save(2, state, block=True)
    storage = Storage(backend.url, backend.storage_options)
    corrupt(storage, layout.step_dir(2))

    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    resumed = make(seed=9)
    with CheckpointManager(backend.url, storage_options=backend.storage_options) as ckpt:
        assert ckpt.resume(resumed) == 1
    assert_same(resumed, step1)
    warning = next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())
    assert CORRUPTIONS[corrupt] in warning and "trying the previous one" in warning
    if corrupt is not delete_manifest:  # the bad step is quarantined, not taken again
        assert layout.MANIFEST not in storage.listdir(layout.step_dir(2))
        assert layout.MANIFEST + ".skipped" in storage.listdir(layout.step_dir(2))


def test_nothing_verifies_means_fresh_start(local_backend, caplog):
    """A corrupt rank file is found before anything is loaded: the resume starts fresh with the state untouched."""
    with CheckpointManager(local_backend.url, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
    s = Storage(local_backend.url)
    s.write_bytes(f"{layout.step_dir(1)}/rank_00000.pt", b"x" * len(s.read_bytes(f"{layout.step_dir(1)}/rank_00000.pt")))
    fresh = make()
    with CheckpointManager(local_backend.url) as ckpt:
        assert ckpt.resume(fresh) is None
    assert "skipping step 1" in caplog.text and "rank_00000.pt: does not match its checksum" in caplog.text
    assert_same(fresh, make())


def test_corruption_found_while_loading_in_place_never_starts_fresh_with_half_loaded_state(local_backend):
    """Bytes are checked as they are read into the state's own tensors: if the only step fails halfway, the
    state may be half overwritten, so the resume raises (once: the step is set aside, and the next start is
    fresh) instead of training on from a mix of old and new weights."""
    with CheckpointManager(local_backend.url, interval=1) as ckpt:
        ckpt.save(1, make(seed=1), block=True)
    flip_byte(Storage(local_backend.url), layout.step_dir(1))
    with CheckpointManager(local_backend.url) as ckpt:
        with pytest.raises(CheckpointCorruptError, match="may now be partly overwritten.*start the job again"):
            ckpt.resume(make())
    fresh = make()
    with CheckpointManager(local_backend.url) as ckpt:
        assert ckpt.resume(fresh) is None
    assert_same(fresh, make())


def test_manifest_naming_paths_outside_its_step_is_refused(local_backend, caplog):
    with CheckpointManager(local_backend.url, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
        ckpt.save(2, make(), block=True)
    s = Storage(local_backend.url)
    rel = f"{layout.step_dir(2)}/{layout.MANIFEST}"
    s.write_bytes(rel, s.read_bytes(rel).replace(b'"rank_00000.pt"', b'"../../etc/passwd"'))
    with CheckpointManager(local_backend.url) as ckpt:
        assert ckpt.resume(make()) == 1
    assert "not a plain name inside the step directory" in caplog.text


@pytest.mark.parametrize("garbage", [b"[" * 100_000, b'{"format": ' + b"9" * 5000 + b"}", b"\xff\xfe\x00"],
                         ids=["deep-nesting", "endless-number", "not-utf8"])
def test_any_garbage_manifest_is_corrupt_never_a_crash(garbage):
    """What json.loads raises besides JSONDecodeError (RecursionError, ValueError) is corruption too."""
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        layout.Manifest.from_json(garbage)


def test_stray_metadata_makes_the_step_corrupt(local_backend, caplog):
    """A file the manifest does not list (DCP's rank-local ``__0.metadata``, notes) makes the step corrupt."""
    with CheckpointManager(local_backend.url, interval=1) as ckpt:
        ckpt.save(1, make(), block=True)
        ckpt.save(2, make(), block=True)
    s = Storage(local_backend.url)
    rel = layout.step_dir(2)
    s.write_bytes(f"{rel}/__0.metadata", s.read_bytes(f"{rel}/metadata.json"))
    s.write_bytes(f"{rel}/notes.txt", b"hello")
    with CheckpointManager(local_backend.url) as ckpt:
        assert ckpt.resume(make()) == 1
    assert "__0.metadata, notes.txt: not listed in the manifest" in caplog.text
