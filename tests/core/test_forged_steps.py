"""A forged step (every checksum recomputed, as whoever can write the directory can) is answered once: the
resume skips it with a warning and uses the previous step, on this start and on every later one. Never a
raw error on every start, never a silent partial load, never minutes of CPU or gigabytes for a small file.

Issue 21, points 2 (sizes, RNG states, format-1 field types), 3 (a tensor left out of the metadata, claimed
sizes bounded by the bytes stored) and 4 (the exact-cover check of many chunks)."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import threading
import time
import tracemalloc
import zipfile
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from ft_checkpoint import CheckpointManager
from ft_checkpoint.errors import StateMismatchError
from ft_checkpoint.format import layout, tensor_metadata
from ft_checkpoint.format.legacy import load_metadata
from ft_checkpoint.store import checksum, nofollow
from ft_checkpoint.store.storage import Storage
from tests.core.test_untrusted import forge_metadata, replace_with_checksum, resumes_step_1, two_steps
from tests.helpers.legacy import replace_legacy_file, write_legacy_step
from tests.helpers.toy import assert_same, make, train_step

HANG_GUARD = 30.0
"""Seconds after which a resume counts as hung (a guard, not a measure: the machine is shared)."""


def resumed_twice(url: str, step1: dict, caplog, reason: str) -> None:
    """The forged step 2 is skipped for step 1 (with ``reason``), and the next start is not stopped by it."""
    resumes_step_1(url, step1, caplog, reason)
    goes_on_past_step_2(url)


def goes_on_past_step_2(url: str) -> None:
    """A second start resumes step 1 again and saves step 2: the forged step was set aside."""
    again = make(seed=11)
    with CheckpointManager(url, interval=1) as ckpt:
        assert ckpt.resume(again) == 1
        train_step(again)
        ckpt.save(2, again, block=True)


def add_tensor(doc: dict, name: str, dtype: str, size: list[int], chunks: list[dict]) -> None:
    doc["tensors"][name] = {"dtype": dtype, "size": size, "chunks": chunks}


def add_data_file(url: str, name: str, size: int, data: bytes = b"") -> None:
    """A data file of ``size`` bytes (sparse beyond ``data``: it costs the attacker nothing), listed in
    step 2's manifest with the CRC of its bytes."""
    path = os.path.join(url, layout.step_dir(2), name)
    with open(path, "wb") as f:
        f.write(data)
        f.truncate(size)
    crc = checksum.crc32c_of(data + bytes(size - len(data))) if size <= 1 << 24 else 0
    rel = f"{layout.step_dir(2)}/{layout.MANIFEST}"
    s = Storage(url)
    manifest = json.loads(s.read_bytes(rel))
    manifest["files"][name] = {"size": size, "checksum": checksum.format_crc(crc)}
    s.write_bytes(rel, json.dumps(manifest).encode())


def chunk(offsets: list[int], sizes: list[int], file: str, offset: int, length: int, crc: int = 0) -> dict:
    return {"offsets": offsets, "sizes": sizes, "file": file, "offset": offset, "length": length,
            "crc32c": f"{crc:08x}"}


# -- 2. sizes, RNG states and field types are validated before they are used ------------------------
@pytest.mark.parametrize("size", [[0, 2**64], [2**62, 2**62, 0]], ids=["2**64", "overflow"])
def test_a_size_torch_cannot_hold_skips_the_step(tmp_path, caplog, size):
    """An empty tensor the state lacks, whose size makes ``torch.empty`` raise (TypeError, overflow)."""
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    forge_metadata(url, lambda doc: add_tensor(doc, "model/extra", "float32", size, []))
    resumed_twice(url, step1, caplog, "too large")


def test_a_tensor_larger_than_memory_on_a_sparse_file_skips_the_step(tmp_path, caplog):
    """[2**40] float32 (4 TiB) backed by a sparse file of that size: the sizes check, the memory does not."""
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    n = 2**40
    add_data_file(url, "__9_0.distcp", 4 * n)
    forge_metadata(url, lambda doc: add_tensor(doc, "model/extra", "float32", [n],
                                               [chunk([0], [n], "__9_0.distcp", 0, 4 * n)]))
    resumed_twice(url, step1, caplog, "more than this machine's memory")


def forge_rank_file(url: str, edit) -> None:
    s = Storage(url)
    rel = f"{layout.step_dir(2)}/{layout.rank_file(0)}"
    rank_state = torch.load(io.BytesIO(s.read_bytes(rel)), weights_only=True)
    edit(rank_state["per_rank"]["rng"])
    buf = io.BytesIO()
    torch.save(rank_state, buf)
    replace_with_checksum(s, 2, layout.rank_file(0), buf.getvalue())


RNG_FORGERIES = {
    "torch-5-bytes": (lambda rng: rng.update(torch=torch.zeros(5, dtype=torch.uint8)), "torch RNG state"),
    "python-[1]": (lambda rng: rng.update(python=[1]), "Python RNG state"),
    "numpy-no-keys": (lambda rng: rng.update(numpy=("MT19937", [], 0, 0, 0.0)), "NumPy RNG state"),
}


@pytest.mark.parametrize("forgery", list(RNG_FORGERIES))
def test_a_bad_rng_state_skips_the_step_before_anything_is_set(tmp_path, caplog, forgery):
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    edit, reason = RNG_FORGERIES[forgery]
    forge_rank_file(url, edit)
    resumes_step_1(url, step1, caplog, reason)
    saved = torch.load(io.BytesIO(Storage(url).read_bytes(f"{layout.step_dir(1)}/{layout.rank_file(0)}")),
                       weights_only=True)["per_rank"]["rng"]
    assert torch.equal(torch.get_rng_state(), saved["torch"]), "step 1's RNG states are the ones restored"
    assert random.getstate() == saved["python"]
    goes_on_past_step_2(url)


def deeply_nested_rank_file(depth: int) -> bytes:
    """A rank file (torch.save's zip) whose skeleton is a list nested ``depth`` deep: 200 kB, and
    ``torch.load(weights_only=True)`` loads it (pickle's stack is not Python's)."""
    body = (b"\x80\x02}q\x00(X\x08\x00\x00\x00skeletonq\x01" + b"]" * depth + b"N" + b"a" * depth
            + b"X\x08\x00\x00\x00per_rankq\x02}u.")
    genuine = io.BytesIO()
    torch.save({"skeleton": None, "per_rank": {}}, genuine)
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    with zipfile.ZipFile(io.BytesIO(genuine.getvalue())) as z:
        for name in z.namelist():
            record = name.split("/", 1)[1]
            data = body if record == "data.pkl" else z.read(name)
            if record != ".data/serialization_id":
                writer.write_record(record, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


@pytest.mark.parametrize("forgery", ["torch-5-bytes", "random bytes"])
def test_verify_and_gc_refuse_a_rank_file_a_resume_refuses(tmp_path, forgery):
    """A rank file forged with its checksum recomputed: before, ``verify`` called the step intact (it checked sizes and
    checksums only) while every resume skipped it, and ``gc`` kept it as the newest step that verifies and deleted
    the steps a resume could load (the red team's run then resumed from scratch). Now both check each rank file as a
    resume loads it."""
    from ft_checkpoint.tools.catalog import check_step, plan_gc

    url = str(tmp_path / "ckpt")
    two_steps(url)
    if forgery == "random bytes":
        replace_with_checksum(Storage(url), 2, layout.rank_file(0), random.Random(0).randbytes(5000))
    else:
        forge_rank_file(url, RNG_FORGERIES[forgery][0])
    problems = check_step(Storage(url), 2).problems
    assert len(problems) == 1 and f"{layout.step_dir(2)}/{layout.rank_file(0)}: " in problems[0], problems
    assert ("torch RNG state" if forgery == "torch-5-bytes" else "not a zip archive") in problems[0], problems
    plan = plan_gc(Storage(url), keep_last=1)
    assert plan.protected == 1 and plan.delete == [], plan


def test_a_state_file_nested_too_deep_skips_the_step(tmp_path, caplog):
    """Walking the skeleton raised RecursionError on every start."""
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    replace_with_checksum(Storage(url), 2, layout.rank_file(0), deeply_nested_rank_file(100_000))
    resumed_twice(url, step1, caplog, "nests deeper than 200 levels")


def test_a_state_file_of_shared_parts_skips_the_step_at_once(tmp_path, caplog):
    """A 2 kB rank file whose per-rank state nests one list twice in the next, 60 times (pickle keeps one copy
    of each): walking it as a tree meets 2**60 objects, and the resume spun at 100% CPU forever."""
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    shared: list = []
    for _ in range(60):
        shared = [shared, shared]

    def forge() -> None:
        s = Storage(url)
        rel = f"{layout.step_dir(2)}/{layout.rank_file(0)}"
        rank_state = torch.load(io.BytesIO(s.read_bytes(rel)), weights_only=True)
        rank_state["per_rank"]["state"] = {"loader": shared}
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        assert len(buf.getvalue()) < 100_000
        replace_with_checksum(s, 2, layout.rank_file(0), buf.getvalue())

    forge()
    error, _ = under_hang_guard(lambda: resumed_twice(url, step1, caplog, "repeats its parts"))
    assert error is None, error


def rank_file_written_as(url: str, how: str) -> bytes:
    """Step 2's rank file, with 64 MB of zeros added to its per-rank state, written ``how``: its zip records
    DEFLATE-compressed (65 kB on disk; ``torch.load`` inflates them), or in torch's legacy format (not a zip)."""
    rank_state = torch.load(io.BytesIO(Storage(url).read_bytes(f"{layout.step_dir(2)}/{layout.rank_file(0)}")),
                            weights_only=True)
    rank_state["per_rank"]["state"] = {"bomb": torch.zeros(16 << 20)}
    plain = io.BytesIO()
    torch.save(rank_state, plain, _use_new_zipfile_serialization=how == "deflated")
    if how != "deflated":
        return plain.getvalue()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(plain.getvalue())) as src, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    assert len(out.getvalue()) < 1e6
    return out.getvalue()


@pytest.mark.parametrize(("how", "reason"), [("deflated", "compressed"), ("legacy", "not a zip archive")])
def test_a_rank_file_that_is_not_what_torch_save_writes_is_refused_before_it_is_loaded(tmp_path, caplog, monkeypatch,
                                                                                        how, reason):
    """``torch.load`` inflates DEFLATE-compressed records, which ``torch.save`` never writes: a rank file of 65 kB
    (its checksum recomputed) made every start allocate its 64 MB (a 16 MB file, tens of GB); and torch's legacy
    format allocates each storage at the size its pickle declares. Both are refused before ``torch.load``."""
    url = str(tmp_path / "ckpt")
    step1 = two_steps(url)
    replace_with_checksum(Storage(url), 2, layout.rank_file(0), rank_file_written_as(url, how))
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: loads.append(len(f.getvalue())) or real_load(f, *a, **k))
    resumed_twice(url, step1, caplog, reason)
    assert all(size < 1e6 for size in loads), "the forged rank file was given to torch.load"


def make_sparse_with_checksum(url: str, step: int, name: str, size: int) -> None:
    """Extend a file of a step to ``size`` bytes with holes (a few kB on disk) and list it in the manifest at
    that size, with the CRC of what it now reads as: what anyone who can write the directory can do."""
    path = os.path.join(url, layout.step_dir(step), name)
    with open(path, "rb") as f:
        data = f.read()
    os.truncate(path, size)
    pad = size - len(data)
    crc = checksum.combine(checksum.crc32c_of(data), checksum.zeros(pad), pad)
    rel = f"{layout.step_dir(step)}/{layout.MANIFEST}"
    s = Storage(url)
    manifest = json.loads(s.read_bytes(rel))
    manifest["files"][name] = {"size": size, "checksum": checksum.format_crc(crc)}
    s.write_bytes(rel, json.dumps(manifest).encode())


@pytest.mark.parametrize("name", [layout.METADATA, layout.rank_file(0)])
def test_a_sparse_small_file_of_a_gigabyte_is_refused_unread(tmp_path, caplog, name):
    """metadata.json or a rank file made a 1 GiB sparse file (4 kB on disk) with its checksum recomputed: each
    start read it whole (1 GiB of memory per rank; past the memory limit a MemoryError, taken for an outage,
    stopped every start)."""
    url = str(tmp_path / "ckpt")
    two_steps(url)
    make_sparse_with_checksum(url, 2, name, 1 << 30)
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    answer, _, peak = guarded_resume(url)
    assert answer == 1 and peak < 100e6, f"peak {peak / 1e6:.1f} MB"
    assert "a sparse file" in next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())
    goes_on_past_step_2(url)


def test_inspect_refuses_a_sparse_metadata_file_unread(tmp_path):
    """``ft-checkpoint inspect`` read ``metadata.json`` with the manifest's size as its cap: made a 1 GiB sparse
    file, it was read whole (1 GiB of memory, more for a larger forged size)."""
    from ft_checkpoint.errors import CheckpointCorruptError
    from ft_checkpoint.tools.catalog import inspect_step

    url = str(tmp_path / "ckpt")
    two_steps(url)
    make_sparse_with_checksum(url, 2, layout.METADATA, 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptError, match="a sparse file"):
            inspect_step(Storage(url), 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100e6, f"peak {peak / 1e6:.1f} MB"


def test_a_file_swapped_for_a_sparse_one_after_its_listing_is_refused_at_the_read(tmp_path, caplog, monkeypatch):
    """The rank file is 1 GiB with 17 MiB stored when the step is listed and checked (over 1/64: it passes), and
    is swapped for a 1 GiB file of holes just before the read opens it: the check made on an ``lstat`` of the
    path, before the read opened the file again, let the read take the holes (1 GiB of memory). The check is
    made on the descriptor that is read."""
    url = str(tmp_path / "ckpt")
    two_steps(url)
    name = layout.rank_file(0)
    path = os.path.join(url, layout.step_dir(2), name)
    holes = str(tmp_path / "holes")
    make_sparse_with_checksum(url, 2, name, 1 << 30)
    os.rename(path, holes)
    with open(path, "wb") as f:  # the decoy: listed at the same size, 17 MiB of it stored
        f.write(os.urandom(17 << 20))
        f.truncate(1 << 30)
    real_open = nofollow.open_regular_file

    def swapped_at_the_open(root: str, rel: str, *, url: str) -> int:
        if rel.endswith(name) and os.path.exists(holes):
            os.replace(holes, path)
        return real_open(root, rel, url=url)

    monkeypatch.setattr(nofollow, "open_regular_file", swapped_at_the_open)
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    answer, _, peak = guarded_resume(url)
    assert not os.path.exists(holes), "the swap never happened"
    assert answer == 1 and peak < 100e6, f"peak {peak / 1e6:.1f} MB"
    assert "a sparse file" in next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())


def test_format1_a_sparse_shard_is_refused_unhashed(tmp_path, caplog):
    """A format-1 shard made an 8 GiB sparse file: its SHA-256 over the holes took 18 s (40 min a TiB)."""
    url = str(tmp_path / "ckpt")
    step1 = make(seed=1)
    write_legacy_step(url, 1, step1)
    write_legacy_step(url, 2, make(seed=2))
    shard = next(n for n in os.listdir(os.path.join(url, layout.step_dir(2))) if n.endswith(".distcp"))
    os.truncate(os.path.join(url, layout.step_dir(2), shard), 8 << 30)
    manifest_path = os.path.join(url, layout.step_dir(2), layout.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"][shard]["size"] = 8 << 30
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    error, _ = under_hang_guard(lambda: resumes_step_1(url, step1, caplog, "a sparse file"))
    assert error is None, error


def forge_legacy_metadata(url: str, edit) -> None:
    path = os.path.join(url, layout.step_dir(2), ".metadata")
    with open(path, "rb") as f:
        metadata = load_metadata(f.read())
    edit(metadata)
    replace_legacy_file(url, 2, ".metadata", pickle.dumps(metadata))


def _first_tensor(md: Any) -> Any:
    return next(iter(md.state_dict_metadata.values()))


def _first_info(md: Any) -> Any:
    return next(iter(md.storage_data.values()))


LEGACY_FORGERIES = {
    "properties-OrderedDict": (lambda md: setattr(_first_tensor(md), "properties", OrderedDict()), "properties"),
    "chunks-None": (lambda md: setattr(_first_tensor(md), "chunks", None), "chunks"),
    "relative_path-OrderedDict": (lambda md: setattr(_first_info(md), "relative_path", OrderedDict()),
                                  "relative_path"),
    "size-None": (lambda md: setattr(_first_tensor(md), "size", None), "size"),
}


@pytest.mark.parametrize("forgery", list(LEGACY_FORGERIES))
def test_format1_metadata_with_fields_of_the_wrong_type_skips_the_step(tmp_path, caplog, forgery):
    """Only allowlisted classes, so it unpickles; each field of the wrong type made every start raise
    (AttributeError, TypeError)."""
    url = str(tmp_path / "ckpt")
    step1 = make(seed=1)
    write_legacy_step(url, 1, step1)
    write_legacy_step(url, 2, make(seed=2))
    edit, reason = LEGACY_FORGERIES[forgery]
    forge_legacy_metadata(url, edit)
    resumes_step_1(url, step1, caplog, reason)


# -- 3. every tensor of the state comes from the step; claimed sizes are bounded by the bytes stored ---
def test_a_tensor_left_out_of_the_metadata_is_never_a_silent_partial_load(tmp_path, caplog):
    """``{"model": net.state_dict()}``: the resume reported success while the weight left out kept its fresh
    values, with no warning."""
    url = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, {"model": net.state_dict()}, block=True)
        saved1 = {k: v.clone() for k, v in net.state_dict().items()}
        with torch.no_grad():
            net.weight.add_(1.0)
            net.bias.add_(1.0)
        ckpt.save(2, {"model": net.state_dict()}, block=True)
    forge_metadata(url, lambda doc: doc["tensors"].pop("model/weight"))
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    fresh = torch.nn.Linear(8, 4)
    with CheckpointManager(url, interval=1) as ckpt:
        assert ckpt.resume({"model": fresh.state_dict()}) == 1
        ckpt.save(2, {"model": fresh.state_dict()}, block=True)  # the forged step was set aside
    assert torch.equal(fresh.weight, saved1["weight"]) and torch.equal(fresh.bias, saved1["bias"])
    warning = next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())
    assert "model/weight" in warning and "lists no tensor" in warning, warning


def test_a_state_that_really_gained_a_tensor_keeps_the_step(tmp_path, caplog):
    """The step never had that tensor (the state changed, not the step): kept, and no step fits."""
    url = str(tmp_path / "ckpt")
    net = torch.nn.Linear(8, 4)
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, {"model": net.state_dict()}, block=True)
    grown = {"model": {**torch.nn.Linear(8, 4).state_dict(), "scale": torch.ones(4)}}
    with CheckpointManager(url) as ckpt:
        with pytest.raises(StateMismatchError, match=r"model/scale.*HINT"):
            ckpt.resume(grown)
    assert layout.committed_steps(Storage(url)) == [1], "a step the state outgrew must be kept"


def claim_adam_state(size: int):
    """Format 1: claim that Adam's first ``exp_avg`` (a tensor a fresh optimizer lacks, so a resume allocates
    it) has ``size`` elements, still stored in its record of about 1.6 kB."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def edit(md: Any) -> None:
        key = "optim/state/0/exp_avg"
        tensor = md.state_dict_metadata[key]
        tensor.size = torch.Size([size])
        tensor.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([size]))]
        for index in list(md.storage_data):
            if index.fqn == key:
                md.storage_data[type(index)(key, [0])] = md.storage_data.pop(index)

    return edit


@pytest.mark.parametrize("size", [375_000_000, 2**40], ids=["1.5GB", "4TB"])
def test_format1_claimed_sizes_are_bounded_by_the_bytes_stored(tmp_path, caplog, size):
    url = str(tmp_path / "ckpt")
    step1 = make(seed=1)
    train_step(step1)
    write_legacy_step(url, 1, step1)
    step2 = make(seed=2)
    train_step(step2)
    write_legacy_step(url, 2, step2)
    forge_legacy_metadata(url, claim_adam_state(size))
    resumed = make(seed=9)
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(resumed) == 1
    assert_same(resumed, step1)
    warning = next(r.getMessage() for r in caplog.records if "skipping step 2" in r.getMessage())
    assert "record holds only" in warning, warning


# -- 4. the exact-cover check: O(n log n) in the chunks, bounded in memory -----------------------------
def under_hang_guard(fn) -> tuple[Any, float]:
    """``(fn(), seconds)``; fails if ``fn`` runs past :data:`HANG_GUARD`."""
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.perf_counter()
        try:
            out["result"] = fn()
        except Exception as e:  # returned, for the test to look at
            out["result"] = e
        out["seconds"] = time.perf_counter() - t0

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_GUARD)
    assert not worker.is_alive(), f"ran past the {HANG_GUARD} s hang guard"
    return out["result"], out["seconds"]


def guarded_resume(url: str) -> tuple[Any, float, int]:
    """``(resume's answer, seconds, peak bytes Python allocated)``, under the hang guard."""
    def resume() -> Any:
        with CheckpointManager(url) as ckpt:
            return ckpt.resume(make(seed=9))

    tracemalloc.start()
    try:
        answer, seconds = under_hang_guard(resume)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"answered in {seconds:.2f} s, peak {peak / 1e6:.1f} MB")
    return answer, seconds, peak


def count_work(monkeypatch) -> list[int]:
    """The boxes each pass of the cover check looked at (``_slabs`` is called once per group of chunks)."""
    seen: list[int] = []
    original = tensor_metadata._slabs

    def counted(boxes, *args):
        seen.append(len(boxes))
        return original(boxes, *args)

    monkeypatch.setattr(tensor_metadata, "_slabs", counted)
    return seen


def test_sixteen_thousand_one_byte_chunks_are_answered_with_linear_work(tmp_path, monkeypatch):
    """A step whose tensor comes in 16,000 chunks of one byte (valid CRCs: it loads): the cover check alone
    took 3.5 s before."""
    url = str(tmp_path / "ckpt")
    two_steps(url)
    n = 16_000
    data = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
    add_data_file(url, "__9_0.distcp", n, data)
    chunks = [chunk([i], [1], "__9_0.distcp", i, 1, checksum.crc32c_of(data[i:i + 1])) for i in range(n)]
    forge_metadata(url, lambda doc: add_tensor(doc, "bytes", "uint8", [n], chunks))
    work = count_work(monkeypatch)
    answer, _ = under_hang_guard(lambda: resume_answer(url))
    assert answer == 2  # a valid (if odd) step: it loads, and "bytes" is reported as a key the state lacks
    assert sum(work) <= n, "each chunk is looked at once"


def resume_answer(url: str) -> Any:
    t0 = time.perf_counter()
    with CheckpointManager(url) as ckpt:
        answer = ckpt.resume(make(seed=9))
    print(f"answered in {time.perf_counter() - t0:.2f} s")
    return answer


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_the_cover_check_of_300_thousand_chunks_is_not_quadratic(monkeypatch):
    """The old check took hours here (quadratic: 8,000 chunks 1.0 s, 16,000 3.5 s)."""
    n = 300_000
    boxes = [([i], [1]) for i in reversed(range(n))]
    error, seconds = under_hang_guard(lambda: tensor_metadata.check_cover([n], boxes, ValueError))
    print(f"checked in {seconds:.2f} s")
    assert error is None
    boxes[7] = ([6], [2])
    work = count_work(monkeypatch)
    error, _ = under_hang_guard(lambda: tensor_metadata.check_cover([n], boxes, ValueError))
    assert isinstance(error, ValueError) and "overlap" in str(error)
    assert sum(work) == n, "each chunk is looked at once"


def staircase(dims: int, depth: int) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """An exact cover of [2]*depth + [1]*(dims-depth) by depth+1 boxes (box i: zeros before dim i, a one at
    dim i, anything after); the old check enumerated all 2**depth cells of its grid."""
    shape = [2] * depth + [1] * (dims - depth)
    boxes = []
    for i in range(depth):
        offsets = [0] * dims
        offsets[i] = 1
        boxes.append((offsets, [1] * (i + 1) + [2] * (depth - i - 1) + [1] * (dims - depth)))
    boxes.append(([0] * dims, [1] * dims))
    return shape, boxes


def test_a_64_dimension_staircase_is_answered_quickly_in_bounded_memory(tmp_path, monkeypatch):
    """9 KB of metadata over 64 dimensions: 12.9 s and +55 MB before (2**23 cells)."""
    url = str(tmp_path / "ckpt")
    two_steps(url)
    shape, boxes = staircase(64, 23)
    offset, chunks = 0, []
    for offsets, sizes in boxes:
        length = int(np.prod(sizes))
        chunks.append(chunk(offsets, sizes, "__9_0.distcp", offset, length))
        offset += length
    add_data_file(url, "__9_0.distcp", offset)
    forge_metadata(url, lambda doc: add_tensor(doc, "stairs", "uint8", shape, chunks))
    assert len(json.dumps(chunks)) < 12_000
    answer, _, peak = guarded_resume(url)
    assert answer == 1, "the forged step (its CRCs do not match) is skipped for step 1"
    assert peak < 20e6, f"peak {peak / 1e6:.1f} MB"
    work = count_work(monkeypatch)
    tensor_metadata.check_cover(shape, boxes, ValueError)
    assert sum(work) <= len(boxes) * 23, "each chunk is looked at once per dimension it splits"


def test_the_cover_check_refuses_gaps_overlaps_and_layouts_dcp_never_writes():
    def check(shape, boxes):
        tensor_metadata.check_cover(shape, boxes, ValueError)

    check([4, 6], [([0, 0], [2, 3]), ([0, 3], [2, 3]), ([2, 0], [2, 6])])  # a grid, then a slab
    check([4, 0], [])  # an empty tensor needs no chunk
    check([4], [([0], [4]), ([2], [0])])  # an empty chunk (an empty shard) holds nothing
    with pytest.raises(ValueError, match="do not cover the whole tensor"):
        check([4, 6], [([0, 0], [2, 3]), ([2, 0], [2, 6])])
    with pytest.raises(ValueError, match="overlap"):
        check([4, 6], [([0, 0], [4, 6]), ([1, 1], [1, 1])])
    with pytest.raises(ValueError, match="overlap"):
        check([4], [([0], [4]), ([0], [4])])
    pinwheel = [([0, 0], [2, 1]), ([2, 0], [1, 2]), ([1, 2], [2, 1]), ([0, 1], [1, 2]), ([1, 1], [1, 1])]
    with pytest.raises(ValueError, match="grid"):
        check([3, 3], pinwheel)  # an exact cover, but not one DCP writes


@pytest.mark.parametrize("where", ["inside a tensor", "in the padding"])
def test_verify_checks_each_tensor_s_bytes_against_its_own_checksum_in_one_pass(tmp_path, monkeypatch, where):
    """Bytes of a data file changed and the file's checksum recomputed in the manifest: before, ``verify`` read only
    whole-file checksums and called a step intact whose tensor bytes every resume refuses (their CRC-32C in
    ``metadata.json``), and ``gc --keep 1`` deleted the step a resume could load (helper-42). Now verify computes
    each tensor chunk's CRC in its one pass over the file; bytes outside every tensor still load."""
    from ft_checkpoint.tools.catalog import check_step, plan_gc

    url = str(tmp_path / "ckpt")
    two_steps(url)
    s = Storage(url)
    rel = f"{layout.step_dir(2)}/__0_0.distcp"
    doc = json.loads(s.read_bytes(f"{layout.step_dir(2)}/{layout.METADATA}"))
    ranges = sorted((c["offset"], c["offset"] + c["length"]) for t in doc["tensors"].values() for c in t["chunks"]
                    if c["file"] == "__0_0.distcp")
    data = bytearray(s.read_bytes(rel))
    at = ranges[0][0] + 4 if where == "inside a tensor" else next(end for end, (start, _) in zip(
        [r[1] for r in ranges], ranges[1:] + [(len(data), 0)]) if start > end)
    data[at] ^= 0xFF
    replace_with_checksum(s, 2, "__0_0.distcp", bytes(data))
    reads: list[str] = []
    iter_chunks = Storage.iter_chunks
    monkeypatch.setattr(Storage, "iter_chunks", lambda self, rel, **kw: (reads.append(rel), iter_chunks(self, rel, **kw))[1])
    check = check_step(s, 2)
    assert reads.count(rel) == 1, f"one pass over the data file: {reads}"
    if where == "in the padding":
        assert check.ok, check.problems
        return
    assert len(check.problems) == 1 and "__0_0.distcp" in check.problems[0], check.problems
    assert "do not match their checksum in metadata.json" in check.problems[0] and "forged" in check.problems[0], check.problems
    assert not check.loads
    plan = plan_gc(s, keep_last=1)
    assert plan.protected == 1 and plan.delete == [], plan


def test_verify_lets_an_empty_chunk_lie_anywhere(tmp_path):
    """An empty chunk (a zero-element tensor) placed inside another tensor's bytes holds no bytes, and a resume loads
    the step; verify split the other tensor's range there and called it forged (helper-45)."""
    from ft_checkpoint.tools.catalog import check_step

    url = str(tmp_path / "ckpt")
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, {"w": torch.arange(1000.0), "e": torch.empty(0)}, block=True)
    s = Storage(url)
    rel = f"{layout.step_dir(1)}/{layout.METADATA}"
    doc = json.loads(s.read_bytes(rel))
    w = doc["tensors"]["w"]["chunks"][0]
    doc["tensors"]["e"]["chunks"][0].update(offset=w["offset"] + 400, file=w["file"])
    replace_with_checksum(s, 1, layout.METADATA, json.dumps(doc).encode())
    check = check_step(s, 1)
    assert check.ok, check.problems
