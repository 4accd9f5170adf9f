"""How long a resume takes: find + check + load of a ~800 MB state, against reading the same bytes raw.

One step of a model plus Adam state (``--mb`` MB) is saved; then, ``--repeats`` times, interleaved:

- ``raw read``: every file of the step read once into preallocated memory (``readinto``) on local disk;
  a plain fsspec get (``cat_file``) of every object on the GCS emulator and the S3 server; one file after
  the other, and (``parallel``) one thread per file, as ours reads the files a save wrote in parallel;
- ``ft-checkpoint``: ``CheckpointManager.resume(state)``: list the steps, check the manifest, sizes and
  tensor metadata, read every byte once into the model's and optimizer's own tensors, checking each
  range's CRC-32C as it is read.

On local disk the page cache is dropped for both first (``posix_fadvise(POSIX_FADV_DONTNEED)``, after an
fsync), where the OS allows it, so both read from the disk. The table shows medians and the ratio.

    python benchmarks/resume_time.py                   # local disk, GCS emulator, S3 server
    python benchmarks/resume_time.py --where local --mb 200

Target: ours at most 1.3x the raw read.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from ft_checkpoint import CheckpointManager
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage

try:
    from save_stall import make_state, state_bytes
except ImportError:  # run from the repository root as benchmarks/resume_time.py
    from benchmarks.save_stall import make_state, state_bytes


def drop_cache(directory: str) -> bool:
    """Evict a local directory's files from the page cache; whether the OS allowed it."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def raw_read(storage: Storage, rel: str, names: list[str], buffers: dict[str, bytearray], parallel: bool) -> float:
    """Every file read once (``readinto`` preallocated memory; a plain get remotely): one after the other, or
    with ``parallel`` one thread per file (as ours reads the files a save wrote in parallel)."""
    def read(name: str) -> None:
        if storage.is_local:
            with open(storage.path(f"{rel}/{name}"), "rb", buffering=0) as f:
                view = memoryview(buffers[name])
                while view:
                    view = view[f.readinto(view):]
        else:
            storage.fs.cat_file(storage.path(f"{rel}/{name}"))

    t0 = time.perf_counter()
    if parallel:
        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(read, names))
    else:
        list(map(read, names))
    return time.perf_counter() - t0


def ours(url: str, options: dict, model, opt) -> float:
    with CheckpointManager(url, storage_options=options, announce=False) as ckpt:
        t0 = time.perf_counter()
        step = ckpt.resume({"model": model, "optim": opt})
        seconds = time.perf_counter() - t0
    assert step == 1
    return seconds


def bench(where: str, url: str, options: dict, model, opt, repeats: int) -> tuple[float, float, float, bool]:
    with CheckpointManager(url, storage_options=options, interval=1, announce=False) as ckpt:
        ckpt.save(1, {"model": model, "optim": opt}, block=True)
    storage = Storage(url, options)
    rel = layout.step_dir(1)
    names = sorted(layout.read_manifest(storage, 1).files)
    buffers = {n: bytearray(s) for n, s in storage.sizes(rel).items()} if storage.is_local else {}
    raws, pars, ourss, dropped = [], [], [], False
    for _ in range(repeats):
        dropped = storage.is_local and drop_cache(storage.path(rel))
        raws.append(raw_read(storage, rel, names, buffers, parallel=False))
        if storage.is_local:
            drop_cache(storage.path(rel))
        pars.append(raw_read(storage, rel, names, buffers, parallel=True))
        if storage.is_local:
            drop_cache(storage.path(rel))
        ourss.append(ours(url, options, model, opt))
    return statistics.median(raws), statistics.median(pars), statistics.median(ourss), dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--where", default="local,gcs,s3", help="comma-separated: local, gcs, s3")
    ap.add_argument("--dir", default=None, help="local directory to use (default: a temp dir)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model, opt = make_state(args.mb, "cpu")
    mb = state_bytes(model, opt) / 1e6
    print(f"state: {mb:.0f} MB (model + Adam); medians of {args.repeats}")
    print(f"{'where':<8}{'raw read s':>12}{'parallel s':>12}{'ours s':>9}{'ours/raw':>10}{'ours/parallel':>15}"
          f"{'ours MB/s':>11}  page cache")
    for where in args.where.split(","):
        server = None
        if where == "local":
            base = tempfile.mkdtemp(prefix="ft_resume_bench_", dir=args.dir)
            url, options = os.path.join(base, "run"), {}
        else:
            from ft_checkpoint.testing import servers

            server = servers.start(where)
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            server.make_bucket(bucket)
            url, options = f"{server.protocol}://{bucket}/run", server.storage_options
        try:
            raw, par, mine, dropped = bench(where, url, options, model, opt, args.repeats)
        finally:
            if server is not None:
                server.stop()
            else:
                shutil.rmtree(base, ignore_errors=True)
        cache = "dropped" if dropped else ("n/a (server)" if server else "NOT dropped (no posix_fadvise)")
        print(f"{where:<8}{raw:>12.2f}{par:>12.2f}{mine:>9.2f}{mine / raw:>10.2f}{mine / par:>15.2f}{mb / mine:>11.0f}"
              f"  {cache}")
    print("target: ours <= 1.3x raw read (parallel: the same files read one thread per file, the stricter floor)")


if __name__ == "__main__":
    main()
