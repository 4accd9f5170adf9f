"""Saving to object storage: time to durable of ours against a plain fsspec put of the same bytes.

On the GCS emulator and the S3 server (both on this machine), ``--repeats`` times, interleaved:

- ``plain put``: every file of a committed step (its shards, metadata, rank file and manifest), put with
  ``fs.pipe_file`` as one object each, from bytes already in memory;
- ``ft-checkpoint``: ``save`` of the same state, from the call until the commit (staging, the shards
  streamed from the staging buffers with their CRC-32C, the rank file, the tensor metadata, the manifest).

    python benchmarks/object_store.py             # ~200 MB
    python benchmarks/object_store.py --mb 800

Target: ours at most 1.2x the plain put.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import uuid

from ft_checkpoint import CheckpointManager
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.testing import servers

try:
    from save_stall import make_state, state_bytes
except ImportError:  # run from the repository root as benchmarks/object_store.py
    from benchmarks.save_stall import make_state, state_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--where", default="gcs,s3")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model, opt = make_state(args.mb, "cpu")
    mb = state_bytes(model, opt) / 1e6
    print(f"state: {mb:.0f} MB (model + Adam); medians of {args.repeats}")
    print(f"{'where':<8}{'plain put s':>13}{'ours s':>9}{'ours/put':>10}{'ours MB/s':>11}")
    for where in args.where.split(","):
        server = servers.start(where)
        try:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            server.make_bucket(bucket)
            url, options = f"{server.protocol}://{bucket}/run", server.storage_options
            storage = Storage(url, options)
            puts, ours = [], []
            with CheckpointManager(url, storage_options=options, interval=1, keep_last=2, announce=False) as ckpt:
                state = {"model": model, "optim": opt}
                ckpt.save(0, state, block=True)  # warm-up; its files are what the plain put writes
                files = {n: storage.read_bytes(f"{layout.step_dir(0)}/{n}") for n in layout.read_manifest(storage, 0).files}
                for i in range(1, args.repeats + 1):
                    t0 = time.perf_counter()
                    for name, data in files.items():
                        storage.fs.pipe_file(storage.path(f"put_{i}/{name}"), data)
                    puts.append(time.perf_counter() - t0)
                    stats = ckpt.save(i, state)
                    ckpt.wait(retention=True)
                    ours.append(stats.duration)  # from the call until the commit
        finally:
            server.stop()
        put, mine = statistics.median(puts), statistics.median(ours)
        print(f"{where:<8}{put:>13.2f}{mine:>9.2f}{mine / put:>10.2f}{mb / mine:>11.0f}")
    print("target: ours <= 1.2x plain put")


if __name__ == "__main__":
    main()
