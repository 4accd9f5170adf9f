"""What a save costs: torch.save, dcp.save, dcp.async_save and ft-checkpoint, side by side with the floors.

The state is a model plus Adam state of about ``--mb`` MB. Each method saves it ``--warmup`` times
unmeasured (buffers allocated, the page cache recycling freed pages: the steady state), then
``--repeats`` times measured, into a fresh directory under ``--dir``. Per method, medians of:

- ``stall s``: what the caller was blocked;
- ``durable s``: from the call until the checkpoint is durable (fsynced, committed);
- ``CPU s/GB``: CPU seconds of the whole process (every thread) from the call until durable, per GB;
- ``stall/floor``: against the staging-copy floor, the state's bytes copied into preallocated buffers
  (the least any asynchronous save must block to take a consistent copy; with ``--device cuda`` the
  pinned device-to-host copy of the same bytes);
- ``durable/raw``: against ``raw write``, the same bytes written from memory with ``os.write`` into
  one file and fsynced, measured in the same run (the floor of time to durable on this disk).

    python benchmarks/save_stall.py                 # ~800 MB, CPU
    python benchmarks/save_stall.py --device cuda   # on a GPU machine
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from ft_checkpoint import CheckpointManager


def make_state(mb: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``mb / 3`` MB of fp32 weights plus Adam's two moments: ``mb`` MB in all."""
    width = 2048
    layers = max(1, round(mb * 1e6 / 3 / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values())
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_floor(model: torch.nn.Module, opt: torch.optim.Optimizer, repeats: int) -> float:
    """Seconds to copy every state tensor into preallocated (pinned, for CUDA) host buffers.

    The best of ``repeats`` rounds of two ways to copy: tensor ``copy_`` and raw storage ``copy_``.
    """
    tensors = list(model.state_dict().values())
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    cuda = tensors[0].is_cuda
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    ways = [lambda d, t: d.copy_(t, non_blocking=cuda),
            lambda d, t: d.untyped_storage().copy_(t.untyped_storage(), non_blocking=cuda)]
    best = float("inf")
    for copy in ways * repeats:
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            copy(d, t)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def tensors_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    return tensors + [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def bench_raw_write(model, opt, d: str, i: int) -> tuple[float, float]:
    """The floor of time to durable: every tensor's bytes, already in host memory, written and fsynced."""
    from ft_checkpoint.shards import byte_view

    host = [t.detach().cpu().contiguous() for t in tensors_of(model, opt)]  # not timed: staging is separate
    t0 = time.perf_counter()
    fd = os.open(os.path.join(d, f"raw_{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in host:
            view = byte_view(t)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    t = time.perf_counter() - t0
    return t, t


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def bench_torch_save(model, opt, d: str, i: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    path = os.path.join(d, f"ckpt_{i}.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    fsync_tree(d)
    t = time.perf_counter() - t0
    return t, t


def bench_dcp_save(model, opt, d: str, i: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(d, f"s{i}"))
    t = time.perf_counter() - t0
    return t, t


def bench_dcp_async(model, opt, d: str, i: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    fut = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                         checkpoint_id=os.path.join(d, f"s{i}"))
    stall = time.perf_counter() - t0
    fut.result()
    return stall, time.perf_counter() - t0


def run_ours(model, opt, d: str, warmup: int, repeats: int, **config) -> list[tuple[float, float, float]]:
    out = []
    with CheckpointManager(d, interval=1, keep_last=2, announce=False, **config) as ckpt:
        state = {"model": model, "optim": opt}
        for i in range(warmup + repeats):
            c0, t0 = cpu_seconds(), time.perf_counter()
            ckpt.save(i, state)  # the training's whole wait, timed from outside
            stall = time.perf_counter() - t0
            ckpt.wait()
            if i >= warmup:
                out.append((stall, time.perf_counter() - t0, cpu_seconds() - c0))
    return out


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its live children (a writer process)."""
    total = time.process_time()
    try:
        children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    except OSError:
        return total
    tick = os.sysconf("SC_CLK_TCK")
    for pid in children:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def timed(fn, model, opt, d: str, i: int) -> tuple[float, float, float]:
    c0 = cpu_seconds()
    stall, durable = fn(model, opt, d, i)
    return stall, durable, cpu_seconds() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=800, help="state size in MB (model + Adam)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured saves per method first (steady state)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on local disk)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    model, opt = make_state(args.mb, args.device)
    nbytes = state_bytes(model, opt)
    mb, gb = nbytes / 1e6, nbytes / 1e9
    floor = copy_floor(model, opt, repeats=5)
    base = tempfile.mkdtemp(prefix="ft_bench_", dir=args.dir)
    print(f"state: {mb:.0f} MB on {args.device}; staging-copy floor {floor:.3f} s ({mb / floor:.0f} MB/s)")

    rows = {}
    for name, fn in [("torch.save", bench_torch_save), ("dcp.save", bench_dcp_save),
                     ("dcp.async_save", bench_dcp_async), ("raw write", bench_raw_write)]:
        d = os.path.join(base, name)
        os.makedirs(d)
        samples = [timed(fn, model, opt, d, i) for i in range(args.warmup + args.repeats)]
        rows[name] = samples[args.warmup:]
        shutil.rmtree(d)
    for writer in ("thread", "process"):
        rows[f"ft-checkpoint {writer}"] = run_ours(model, opt, os.path.join(base, writer), args.warmup, args.repeats,
                                                   writer=writer)
    shutil.rmtree(base)

    med = {name: [statistics.median(x[k] for x in samples) for k in range(3)] for name, samples in rows.items()}
    raw = med["raw write"][1]
    print(f"\n{'method':<22}{'stall s':>9}{'durable s':>11}{'MB/s':>8}{'CPU s/GB':>10}{'stall/floor':>13}"
          f"{'durable/raw':>13}")
    for name, (stall, durable, cpu) in med.items():
        print(f"{name:<22}{stall:>9.3f}{durable:>11.2f}{mb / durable:>8.0f}{cpu / gb:>10.2f}{stall / floor:>13.2f}"
              f"{durable / raw:>13.2f}")
    for writer in ("thread", "process"):
        stall, durable, cpu = med[f"ft-checkpoint {writer}"]
        print(f"ft-checkpoint {writer}: stall {stall / floor:.2f}x floor (target <= 1.5), CPU {cpu / gb:.2f} s/GB "
              f"(target <= 0.5), durable {durable / raw:.2f}x raw write (target <= 1.2)")


if __name__ == "__main__":
    main()
