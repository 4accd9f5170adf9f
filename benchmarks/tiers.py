"""The fast tier against the durable tier and against the floors, for one ~800 MB state (model + Adam), in one run.

1. **Resume** (one process): ``CheckpointManager.resume`` from the fast tier (``--fast-dir``, default
   ``/dev/shm``), against a raw read of the same files from the fast tier (``readinto`` preallocated memory),
   and against a resume from the durable tier on local disk (page cache dropped, where the OS allows it) and on
   the GCS emulator.
2. **Save** (one process): the stall and the CPU (every thread, from the call until committed, per GB) of a
   fast-tier save, against today's save (the durable tier only, on local disk).
3. **Peer copy** (2 processes, each a "node" with a fast-tier folder of its own, on one gloo group): the time
   from the end of a fast-tier save's stall (the state staged) until its step and the peer copies are committed
   on both nodes, against a raw write of the same bytes (from memory) to the fast tier plus their transfer over
   the same process group (both ways at once).

Medians of ``--repeats`` after ``--warmup`` unmeasured rounds.

    python benchmarks/tiers.py                       # ~800 MB, fast tier in /dev/shm
    python benchmarks/tiers.py --mb 200 --skip gcs

Targets (issue 24): fast-tier resume <= 1.3x the raw read and <= 0.3x a durable resume from the GCS emulator;
fast-tier save stall <= 1.2x today's; time to peer-committed <= 1.5x raw write + transfer.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from resume_time import drop_cache  # noqa: E402
from save_stall import make_state, state_bytes  # noqa: E402

from ft_checkpoint import CheckpointManager  # noqa: E402
from ft_checkpoint.format import layout
from ft_checkpoint.testing import servers  # noqa: E402
from ft_checkpoint.tiers.folder import runs_in  # noqa: E402

NEVER = 10**11
"""A durable interval no run reaches: saves go to the fast tier only."""


def resume_seconds(url: str, state: dict, *, options: dict | None = None, fast: str | None = None) -> tuple[float, str]:
    with CheckpointManager(url, storage_options=options or {}, fast_dirpath=fast, announce=False) as ckpt:
        t0 = time.perf_counter()
        assert ckpt.resume(state) == 1
        seconds = time.perf_counter() - t0
        ckpt.close(clean=False)  # keeps the fast tier for the next round
        return seconds, ckpt.resumed_source or ""


def raw_read(folder: str) -> float:
    """Every file of a fast-tier part read once into preallocated memory."""
    names = sorted(os.listdir(folder))
    buffers = {n: bytearray(os.path.getsize(os.path.join(folder, n))) for n in names}
    t0 = time.perf_counter()
    for name in names:
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            view = memoryview(buffers[name])
            while view:
                view = view[f.readinto(view):]
    return time.perf_counter() - t0


def bench_resume(model, opt, fast_root: str, repeats: int, skip: set[str]) -> dict[str, float]:
    state = {"model": model, "optim": opt}
    base = tempfile.mkdtemp(prefix="ft_tiers_bench_")
    local, fast = os.path.join(base, "run"), os.path.join(fast_root, f"ft-bench-{uuid.uuid4().hex[:6]}")
    out: dict[str, list[float]] = {"raw": [], "fast": [], "local": [], "gcs": []}
    server = None
    try:
        with CheckpointManager(local, interval=1, fast_dirpath=fast, fast_interval=1, announce=False) as ckpt:
            ckpt.save(1, state, block=True)
            ckpt.close(clean=False)
        part = runs_in(fast)[0].storage(0).path(layout.step_dir(1))
        gcs = None
        if "gcs" not in skip:
            server = servers.start("gcs")
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            server.make_bucket(bucket)
            gcs = (f"gs://{bucket}/run", server.storage_options)
            with CheckpointManager(gcs[0], storage_options=gcs[1], interval=1, announce=False) as ckpt:
                ckpt.save(1, state, block=True)
        dropped = False
        for _ in range(repeats):
            out["raw"].append(raw_read(part))
            seconds, source = resume_seconds(local, state, fast=fast)
            assert source.startswith("fast tier"), source
            out["fast"].append(seconds)
            dropped = drop_cache(os.path.join(local, layout.step_dir(1)))
            out["local"].append(resume_seconds(local, state)[0])
            if gcs is not None:
                out["gcs"].append(resume_seconds(gcs[0], state, options=gcs[1])[0])
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(fast, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in out.items() if v}
    medians["dropped"] = float(dropped)
    return medians


def bench_save(model, opt, fast_root: str, warmup: int, repeats: int) -> dict[str, tuple[float, float]]:
    """``{"today": (stall, CPU s), "fast tier": (stall, CPU s)}``, medians; the two saves alternate step by step, so
    that both see the same load of a shared machine."""
    state = {"model": model, "optim": opt}
    base = tempfile.mkdtemp(prefix="ft_tiers_save_")
    fast = os.path.join(fast_root, f"ft-bench-{uuid.uuid4().hex[:6]}")
    configs = {"today": {"interval": 1}, "fast tier": {"interval": NEVER, "fast_dirpath": fast, "fast_interval": 1}}
    managers = {name: CheckpointManager(os.path.join(base, str(i)), announce=False, **config)
                for i, (name, config) in enumerate(configs.items())}
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in managers}
    try:
        for step in range(1, warmup + repeats + 1):
            for name, ckpt in managers.items():
                cpu0, t0 = time.process_time(), time.perf_counter()
                assert ckpt.maybe_save(step, state)
                stall = time.perf_counter() - t0
                ckpt.wait()
                if step > warmup:
                    measured[name].append((stall, time.process_time() - cpu0))
    finally:
        for ckpt in managers.values():
            ckpt.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(fast, ignore_errors=True)
    return {name: (statistics.median(s for s, _ in m), statistics.median(c for _, c in m)) for name, m in measured.items()}


def _peer_worker(rank: int, port: int, mb: int, fast_root: str, warmup: int, repeats: int, queue) -> None:
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, opt = make_state(mb, "cpu")
    state = {"model": model, "optim": opt}
    base = tempfile.mkdtemp(prefix="ft_tiers_peer_") if rank == 0 else None
    base = [base]
    dist.broadcast_object_list(base)
    fast = os.path.join(fast_root, f"node{rank}")
    committed, floors = [], []
    with CheckpointManager(os.path.join(base[0], "run"), interval=NEVER, fast_dirpath=fast, fast_interval=1,
                           node_id=f"node{rank}", announce=False) as ckpt:
        for step in range(1, warmup + repeats + 1):
            dist.barrier()
            assert ckpt.maybe_save(step, state)
            ckpt.wait()
            if step > warmup:
                committed.append(ckpt.fast.last.duration - ckpt.fast.last.stall)  # from staged, as the floor
                floors.append(_floor(ckpt, fast))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base[0], ignore_errors=True)
        queue.put((statistics.median(committed), statistics.median(w for w, _ in floors),
                   statistics.median(t for _, t in floors)))
    dist.destroy_process_group()


def _floor(ckpt: CheckpointManager, fast: str) -> tuple[float, float]:
    """A raw write of this rank's staged bytes into the fast tier (no fsync, as the fast tier), then their transfer
    to the peer over the fast tier's own group while the peer's come in (both ways at once)."""
    from ft_checkpoint.format.shards import byte_view

    arena = ckpt.engine._stager.arena
    data = arena.bytes
    dist.barrier()
    t0 = time.perf_counter()
    with open(os.path.join(fast, "raw.bin"), "wb", buffering=0) as f:
        view = byte_view(data)
        while view:
            view = view[f.write(view):]
    written = time.perf_counter() - t0
    os.remove(os.path.join(fast, "raw.bin"))
    incoming = torch.empty_like(data)
    group, peer = ckpt.fast.tier.writer, 1 - dist.get_rank()
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.isend(data, peer, group=group), dist.irecv(incoming, peer, group=group)]
    for w in works:
        w.wait()
    return written, time.perf_counter() - t0


def bench_peer(mb: int, fast_root: str, warmup: int, repeats: int) -> tuple[float, float, float]:
    root = os.path.join(fast_root, f"ft-bench-{uuid.uuid4().hex[:6]}")
    queue = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_peer_worker, args=(servers.free_port(), mb, root, warmup, repeats, queue), nprocs=2)
        return queue.get()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fast-dir", default="/dev/shm", help="where the fast tier lives (default /dev/shm)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: gcs, peer")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    skip = set(args.skip.split(",")) - {""}
    model, opt = make_state(args.mb, "cpu")
    gb = state_bytes(model, opt) / 1e9
    print(f"state: {gb * 1e3:.0f} MB (model + Adam); fast tier in {args.fast_dir}; medians of {args.repeats}")

    r = bench_resume(model, opt, args.fast_dir, args.repeats, skip)
    cache = "page cache dropped" if r["dropped"] else "page cache NOT dropped (no posix_fadvise)"
    print("\nresume                          seconds   fast tier / this")
    print(f"  fast tier (own node)            {r['fast']:7.2f}")
    print(f"  raw read of its files           {r['raw']:7.2f}   {r['fast'] / r['raw']:5.2f}x   target <= 1.3x")
    print(f"  durable, local disk             {r['local']:7.2f}   {r['fast'] / r['local']:5.2f}x   ({cache})")
    if "gcs" in r:
        print(f"  durable, GCS emulator           {r['gcs']:7.2f}   {r['fast'] / r['gcs']:5.2f}x   target <= 0.3x")

    s = bench_save(model, opt, args.fast_dir, args.warmup, args.repeats)
    (stall0, cpu0), (stall1, cpu1) = s["today"], s["fast tier"]
    print("\nsave                            stall s   CPU s/GB (call to committed)")
    print(f"  today (durable, local disk)     {stall0:7.3f}   {cpu0 / gb:6.2f}")
    print(f"  fast tier only                  {stall1:7.3f}   {cpu1 / gb:6.2f}   stall {stall1 / stall0:.2f}x today's, "
          "target <= 1.2x")
    del model, opt
    if "peer" not in skip:
        committed, written, sent = bench_peer(args.mb, args.fast_dir, args.warmup, args.repeats)
        print("\npeer copy (2 nodes of 1 rank)   seconds")
        print(f"  staged to peer-committed        {committed:7.2f}   (after the save's stall, as the floor)")
        print(f"  raw write + transfer            {written + sent:7.2f}   ({written:.2f} + {sent:.2f});  "
              f"{committed / (written + sent):.2f}x, target <= 1.5x")


if __name__ == "__main__":
    main()
