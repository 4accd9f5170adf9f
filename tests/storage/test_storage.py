"""One storage suite, run against every backend: local disk, memory://, GCS emulator, S3 server."""

from __future__ import annotations

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ft_checkpoint.errors import (
    CheckpointCorruptError,
    ConfigError,
    StorageError,
    StorageExistsError,
    StorageNotFoundError,
)
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage, is_transient


@pytest.fixture
def storage(backend) -> Storage:
    s = Storage(backend.url, backend.storage_options, retries=2, backoff=0.01)
    s.ensure_root()
    return s


def test_write_read_overwrite(storage):
    storage.write_bytes("a/b.bin", b"x" * 1000)
    assert storage.read_bytes("a/b.bin") == b"x" * 1000
    storage.write_bytes("a/b.bin", b"second")
    assert storage.read_bytes("a/b.bin") == b"second"


def test_a_file_larger_than_its_listed_size_is_refused_and_never_read_whole(storage, monkeypatch):
    """A file read at the size its manifest lists (a rank file, ``metadata.json``) that grew or was replaced since
    (10 MB here): on object stores it was read whole; now one ranged read of one byte more, then refused."""
    storage.write_bytes("a.bin", b"x" * 10_000_000)
    assert storage.read_bytes("a.bin", size=10_000_000) == b"x" * 10_000_000
    storage.write_bytes("empty.bin", b"")
    assert storage.read_bytes("empty.bin", size=0) == b""
    if not storage.is_local:
        received = []
        cat_file = storage.fs.cat_file
        monkeypatch.setattr(storage.fs, "cat_file", lambda *a, **k: received.append(len(data := cat_file(*a, **k))) or data)
    for size in (100, 20_000_000):
        with pytest.raises(CheckpointCorruptError, match=f"the manifest says {size} .changed since it was listed"):
            storage.read_bytes("a.bin", size=size)
    if not storage.is_local:
        assert received == [101, 10_000_000]


def test_an_exclusive_write_never_replaces_a_file_on_local_disk_s3_and_gcs_and_writes_as_usual_elsewhere(storage,
                                                                                                           monkeypatch):
    """A step's files are created with ``exclusive=True`` (see ``store.fence``). On local disk (``O_EXCL``), S3
    (``If-None-Match: *``) and GCS (``ifGenerationMatch=0``; on GCS before, a plain write) such a write over a file
    that exists is refused with StorageExistsError and leaves the file as it was, whether the file goes in one
    request, in parts (the completion is what is conditional) or streamed; a new name is written. Elsewhere
    (``memory://``) it writes as any write does, and so does an atomic write on local disk (the manifest: renamed
    into the directory its save made, never seen under a second name)."""
    from ft_checkpoint.store import storage as storage_module

    monkeypatch.setattr(storage_module, "SINGLE_PUT_MAX", 1 << 20)
    monkeypatch.setattr(storage_module, "PART_SIZE", 5 << 20)  # S3's smallest part: 6 MiB go in two
    writes = {
        "bytes.bin": lambda data: storage.write_bytes("bytes.bin", data, atomic=False, exclusive=True),
        "manifest.json": lambda data: storage.write_bytes("manifest.json", data, exclusive=True),
        "parts.bin": lambda data: storage.write_views("parts.bin", [memoryview(data * (6 << 20))], exclusive=True),
        "stream.bin": lambda data: storage.write_stream("stream.bin", lambda f: f.write(data * (6 << 20)),
                                                        exclusive=True),
        "lease.json": lambda data: storage.create_new("lease.json", data),
    }
    for name, write in writes.items():
        write(b"1")
        refused = storage.exclusive_creates and not (storage.is_local and name == "manifest.json")
        if refused:
            with pytest.raises(StorageExistsError, match=f"{name}: already exists"):
                write(b"2")
        else:
            write(b"2")
        assert storage.read_bytes(name)[:1] == (b"1" if refused else b"2"), name
    assert storage.exclusive_creates == (not storage.url.startswith("memory://"))


def test_an_exclusive_streamed_upload_to_gcs_is_refused_at_its_end_if_the_object_appeared_meanwhile(request, tmp_path):
    """GCS checks ``ifGenerationMatch=0`` of a resumable upload when its last byte arrives: a file another writer
    created after the upload started (the new owner's, while a job that lost the directory still uploads) is kept,
    and the late upload is refused with StorageExistsError."""
    from tests.conftest import _make_backend

    backend = _make_backend("gcs", request, tmp_path)
    late, new_owner = (Storage(backend.url, backend.storage_options, retries=2, backoff=0.01) for _ in range(2))

    def produce(f) -> None:
        f.write(b"late" * (4 << 20))  # 16 MiB: a resumable upload, its first chunks already sent
        new_owner.write_bytes("step/a.bin", b"new owner's", atomic=False, exclusive=True)
        f.write(b"late" * (4 << 20))

    with pytest.raises(StorageExistsError, match="a.bin: already exists"):
        late.write_stream("step/a.bin", produce, exclusive=True)
    assert new_owner.read_bytes("step/a.bin") == b"new owner's"


def test_listdir_and_sizes(storage):
    storage.write_bytes("step_000000000002/x.pt", b"12345")
    storage.write_bytes("step_000000000002/y.pt", b"1")
    storage.write_bytes("step_000000000010/x.pt", b"")
    assert storage.listdir("") == ["step_000000000002", "step_000000000010"]
    assert storage.sizes("step_000000000002") == {"x.pt": 5, "y.pt": 1}
    assert storage.listdir("missing") == [] and storage.sizes("missing") == {}


def test_exists_and_delete(storage):
    storage.write_bytes("d/one", b"1")
    storage.write_bytes("d/two", b"2")
    assert storage.exists("d/one")
    storage.delete_file("d/one")
    assert not storage.exists("d/one") and storage.exists("d/two")
    storage.delete_file("d/two")
    storage.delete_empty_dir("d")
    assert storage.listdir("d") == [] and "d" not in storage.listdir("")
    storage.delete_file("never-existed")  # not an error


def test_read_control_reads_a_small_file_whole_and_refuses_a_larger_one(storage):
    storage.write_bytes("c/manifest.json", b"x" * 100)
    assert storage.read_control("c/manifest.json", max_bytes=100) == b"x" * 100
    with pytest.raises(CheckpointCorruptError, match=r"c/manifest.json: larger than the 99 bytes .*refusing"):
        storage.read_control("c/manifest.json", max_bytes=99)
    with pytest.raises(StorageNotFoundError):
        storage.read_control("c/missing.json", max_bytes=10)


def test_delete_directory_deletes_its_files_and_leaves_a_subdirectory(storage):
    for name in ("s/manifest.json", "s/a.bin", "s/b.bin", "t/a.bin"):
        storage.write_bytes(name, b"1")
    assert storage.delete_directory("s", first="manifest.json")
    assert storage.listdir("") == ["t"]
    storage.write_bytes("t/sub/kept", b"2")
    assert not storage.delete_directory("t")
    assert storage.listdir("t") == ["sub"] and storage.read_bytes("t/sub/kept") == b"2"
    assert storage.delete_directory("never-existed")


def test_delete_is_literal_never_a_pattern(storage):
    """fsspec's ``rm`` expands ``*?[]`` on object stores and memory://: deleting ``sweep[1]/a`` also deleted
    ``sweep1/a``. Our deletes name one object, literally."""
    for name in ("sweep[1]/a", "sweep1/a", "star*/a", "starX/a", "q?/a", "qq/a"):
        storage.write_bytes(name, b"x")
    for name in ("sweep[1]/a", "star*/a", "q?/a"):
        storage.delete_file(name)
    for name in ("sweep1/a", "starX/a", "qq/a"):
        assert storage.exists(name), f"deleting a pattern-like name also deleted {name}"
    assert not any(storage.exists(n) for n in ("sweep[1]/a", "star*/a", "q?/a"))


@pytest.mark.parametrize("url", ["/tmp/runs/sweep[1]", "memory://runs/sweep*", "s3://b/run?", "gs://b/r[a-z]"])
def test_a_dirpath_with_glob_characters_is_refused(url):
    with pytest.raises(ConfigError, match=r"dirpath=.*expands as a pattern.*HINT"):
        Storage(url)


def test_streamed_checksum_matches_whole(storage):
    data = bytes(range(256)) * 40_000  # 10 MB: several chunks
    storage.write_bytes("big.bin", data)
    assert layout.checksum(storage.iter_chunks("big.bin", chunk_size=1 << 20)) == layout.checksum([data])


def test_missing_object_names_the_url(storage):
    with pytest.raises(StorageNotFoundError, match="nothing-here") as e:
        storage.read_bytes("nothing-here")
    assert isinstance(e.value, FileNotFoundError)
    assert storage.url in str(e.value)


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_missing_bucket_fails_at_once(kind, request):
    server = request.getfixturevalue(f"{kind}_server")
    s = Storage(f"{server.protocol}://no-such-bucket-xyz/run", server.storage_options, retries=1)
    with pytest.raises(StorageNotFoundError, match="no-such-bucket-xyz"):
        s.ensure_root()


def test_unknown_protocol_is_a_config_error():
    with pytest.raises(ConfigError, match="foo://x"):
        Storage("foo://x/run")


class FlakyMemoryFileSystem(MemoryFileSystem):
    """A memory filesystem whose first ``failures`` writes raise ConnectionResetError."""

    protocol = "flakymem"
    failures = 0

    def pipe_file(self, path, value, **kwargs):
        if FlakyMemoryFileSystem.failures > 0:
            FlakyMemoryFileSystem.failures -= 1
            raise ConnectionResetError("injected reset")
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("flakymem", FlakyMemoryFileSystem, clobber=True)


def test_transient_errors_are_retried():
    s = Storage("flakymem://retry", retries=4, backoff=0.001)
    FlakyMemoryFileSystem.failures = 3
    s.write_bytes("x", b"ok")
    assert s.read_bytes("x") == b"ok"


def test_retries_are_bounded():
    s = Storage("flakymem://bounded", retries=2, backoff=0.001)
    FlakyMemoryFileSystem.failures = 5
    with pytest.raises(StorageError, match="after 2 attempts"):
        s.write_bytes("x", b"never")
    FlakyMemoryFileSystem.failures = 0


@pytest.mark.parametrize("exc,expected", [
    (TimeoutError(), True), (ConnectionResetError(), True), (OSError(11, "again"), True),
    (FileNotFoundError(), False), (PermissionError(), False), (ValueError(), False),
])
def test_is_transient(exc, expected):
    assert is_transient(exc) is expected


def test_is_transient_looks_at_http_status_and_causes():
    class HttpError(Exception):
        def __init__(self, code):
            self.code = code

    assert is_transient(HttpError(503)) and is_transient(HttpError(429))
    assert not is_transient(HttpError(403))
    try:
        try:
            raise TimeoutError()
        except TimeoutError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert is_transient(outer)


def test_gcs_stored_crc32c_is_compared_with_ours(request, tmp_path):
    """GCS keeps a CRC-32C of every object: a write compares it with the CRC of the bytes it sent, so bytes
    changed on the way are caught (and the write retried) before the commit, without reading them back."""
    from ft_checkpoint.store.checksum import crc32c_of
    from ft_checkpoint.store.storage import StoredChecksumMismatch
    from tests.conftest import _make_backend

    backend = _make_backend("gcs", request, tmp_path)
    s = Storage(backend.url, backend.storage_options, retries=1)
    s.ensure_root()
    s.write_views("a.bin", [memoryview(b"hello "), memoryview(b"world")])  # compared, and equal
    s.fs.pipe_file(s.path("b.bin"), b"what the store got")
    s._check_stored("b.bin", 18, crc32c_of(b"what the store got"))
    with pytest.raises(StoredChecksumMismatch, match="corrupted on the way"):
        s._check_stored("b.bin", 13, crc32c_of(b"what was sent"))


def test_gcs_a_write_compares_the_crc_of_its_own_upload_not_of_a_later_writers_object(request, tmp_path, monkeypatch):
    """The CRC-32C compared is the one GCS returned for our own upload: another writer's object landing right
    after it (a lease taken over) is neither called corrupt nor overwritten by a retry. Comparing with the
    object's metadata read afterwards did both."""
    from tests.conftest import _make_backend

    backend = _make_backend("gcs", request, tmp_path)
    s = Storage(backend.url, backend.storage_options, retries=1)
    s.ensure_root()
    upload = s.fs.pipe_file

    def then_another_writer(path, data, **kwargs):
        response = upload(path, data, **kwargs)
        upload(path, b"the other writer's object")  # lands between our upload and our comparison
        return response

    monkeypatch.setattr(s.fs, "pipe_file", then_another_writer)
    s.write_bytes("shared.json", b"ours")  # compared with our upload's CRC: equal, no retry
    monkeypatch.undo()
    assert s.read_bytes("shared.json") == b"the other writer's object"


def test_gcs_a_response_with_only_a_generation_compares_that_generation_not_a_later_writers(request, tmp_path,
                                                                                             monkeypatch):
    """Where the upload's response names the object's generation but carries no CRC-32C, the object's metadata is
    compared only while it is still that generation: the lease, written through this same check (it skipped the
    check before), is neither called corrupt nor written over again when a takeover replaces it at once; and
    bytes of our own generation that differ from those sent are still caught."""
    from ft_checkpoint.store.checksum import crc32c_of
    from ft_checkpoint.store.storage import StoredChecksumMismatch
    from tests.conftest import _make_backend

    backend = _make_backend("gcs", request, tmp_path)
    s = Storage(backend.url, backend.storage_options, retries=1)
    s.ensure_root()
    upload = s.fs.pipe_file

    def generation_only_then_another_writer(path, data, **kwargs):
        response = upload(path, data, **kwargs)
        upload(path, b"the other writer's lease")  # a takeover, between our upload and our comparison
        return {"generation": response["generation"]}

    monkeypatch.setattr(s.fs, "pipe_file", generation_only_then_another_writer)
    s.write_bytes("lease.json", b"ours")  # not compared with their object, so not retried over it
    monkeypatch.undo()
    assert s.read_bytes("lease.json") == b"the other writer's lease"
    ours = s.fs.pipe_file(s.path("b.bin"), b"what the store got")
    with pytest.raises(StoredChecksumMismatch, match="corrupted on the way"):
        s._check_stored("b.bin", 13, crc32c_of(b"what was sent"), {"generation": ours["generation"]})


def test_gcs_a_small_file_is_joined_in_a_buffer_that_the_next_save_reuses(request, tmp_path):
    """On GCS a file up to SINGLE_PUT_MAX is joined into a pooled buffer instead of fresh memory on every save:
    the next file of the same size reuses it, and each object keeps its own bytes (the buffer is not reused
    while an upload reads it), through gcsfs's one-request upload and its resumable one (over 50 MiB)."""
    from ft_checkpoint.store.checksum import crc32c_of
    from tests.conftest import _make_backend

    backend = _make_backend("gcs", request, tmp_path)
    s = Storage(backend.url, backend.storage_options, retries=1)
    s.ensure_root()
    for size in (3 << 20, 51 << 20):
        first, second = [b"\1" * size, b"first"], [b"\2" * size, b"other"]
        assert s.write_views(f"a{size}", [memoryview(p) for p in first]) == [crc32c_of(p) for p in first]
        reused = s._buffers.reused
        assert s.write_views(f"b{size}", [memoryview(p) for p in second]) == [crc32c_of(p) for p in second]
        assert s._buffers.reused == reused + 1
        assert s.read_bytes(f"a{size}") == b"".join(first) and s.read_bytes(f"b{size}") == b"".join(second)


def test_s3_a_small_file_is_one_put_and_a_large_one_is_streamed_in_parts(request, tmp_path, monkeypatch):
    """On S3 a file up to SINGLE_PUT_MAX goes as one object in one request (a multipart upload made the S3
    server reassemble it: 1.9x a plain put); a larger one goes in parts of PART_SIZE, one part in memory at a
    time. S3 tells them apart: a multipart object's ETag ends in ``-<parts>``. Both keep their bytes and
    return the CRC of each buffer."""
    from ft_checkpoint.store import storage as storage_module
    from ft_checkpoint.store.checksum import crc32c_of
    from tests.conftest import _make_backend

    backend = _make_backend("s3", request, tmp_path)
    s = Storage(backend.url, backend.storage_options, retries=1)
    s.ensure_root()
    pieces = [bytes([i]) * (3 << 20) + b"tail" for i in range(4)]  # 12 MB in 4 buffers
    views = [memoryview(p) for p in pieces]

    assert s.write_views("one.bin", views) == [crc32c_of(p) for p in pieces]
    monkeypatch.setattr(storage_module, "SINGLE_PUT_MAX", 1 << 20)
    monkeypatch.setattr(storage_module, "PART_SIZE", 5 << 20)  # S3's smallest part
    assert s.write_views("parts.bin", views) == [crc32c_of(p) for p in pieces]

    etag = {name: s.fs.info(s.path(name))["ETag"].strip('"') for name in ("one.bin", "parts.bin")}
    assert "-" not in etag["one.bin"], etag
    assert etag["parts.bin"].rsplit("-", 1)[1].isdigit(), etag
    assert s.read_bytes("one.bin") == s.read_bytes("parts.bin") == b"".join(pieces)


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_memory_store_lists_a_directory_while_other_threads_write_and_delete_in_it():
    """fsspec's memory filesystem is one dict shared by every thread; our engine lists a step directory while
    retention deletes and writer threads create files (seen in CI: 'dictionary changed size during iteration')."""
    import sys
    import threading
    import uuid

    s = Storage(f"memory://listing-race-{uuid.uuid4().hex}")
    s.write_bytes("step_8/keep", b"x")
    stop = threading.Event()
    errors: list[Exception] = []

    def churn():
        i = 0
        while not stop.is_set():
            s.write_bytes(f"step_8/f{i % 50}", b"y" * 64, atomic=False)
            s.delete_file(f"step_8/f{(i + 25) % 50}")
            i += 1

    def stream():  # a file growing write by write while it is listed (its size read as it grows)
        while not stop.is_set():
            try:
                s.write_stream("step_8/streamed", lambda f: [f.write(b"z" * 10) for _ in range(2000)])
            except StorageError as e:  # BufferError: a BytesIO cannot grow while a listing reads its size
                errors.append(e)
                stop.set()

    workers = [threading.Thread(target=churn) for _ in range(3)] + [threading.Thread(target=stream)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: a race that needs an unlucky switch shows at once
    for w in workers:
        w.start()
    try:
        for _ in range(3000):
            assert s.entries("step_8")["keep"].kind == "file"
    finally:
        stop.set()
        for w in workers:
            w.join()
        sys.setswitchinterval(interval)
    assert not errors, errors[0]


def test_memory_store_two_threads_verifying_the_same_good_step_both_find_it_intact():
    """Every open of a ``memory://`` file returned the one shared file object: two readers moved each other's
    position, and a good step was reported corrupt (2 to 3 checks in 8), so a resume could set it aside."""
    import sys
    import threading
    import uuid

    import torch

    from ft_checkpoint import CheckpointManager

    url = f"memory://two-readers-{uuid.uuid4().hex}"
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, {"w": torch.arange(3_000_000, dtype=torch.float32), "b": torch.ones(1000)}, block=True)
    storage = Storage(url)
    results: list[list[str]] = []

    def verify():
        for _ in range(8):
            results.append(layout.check_step(storage, 1, checksums=True).problems)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: a shared position shows at once
    try:
        workers = [threading.Thread(target=verify) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(results) == 16 and all(problems == [] for problems in results), [p for p in results if p]


def test_memory_store_each_open_has_its_own_position():
    s = Storage(f"memory://positions-{__import__('uuid').uuid4().hex}")
    s.write_bytes("f.bin", b"0123456789")
    with s.open_read("f.bin") as a, s.open_read("f.bin") as b:
        assert a.read(4) == b"0123"
        assert b.read(4) == b"0123", "a second reader started where the first one stopped"
        assert a.read() == b"456789"
