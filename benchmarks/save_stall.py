"""How long a save stalls training: torch.save, dcp.save, dcp.async_save and ft-checkpoint, side by side.

The state is a model plus Adam state of about ``--mb`` MB. Each method saves it ``--repeats`` times
to a fresh directory under ``--dir``; the table shows the median blocking stall, the time until the
checkpoint is durable, and the write throughput. The staging-copy floor is the state's bytes divided
by the memcpy bandwidth measured in the same run (the least any asynchronous save must block to take
a consistent copy). With ``--device cuda`` the state lives on the GPU and the floor is the pinned
device-to-host copy of the same bytes.

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


def run_ours(model, opt, d: str, repeats: int) -> list[tuple[float, float]]:
    out = []
    with CheckpointManager(d, interval=1, keep_last=2) as ckpt:
        state = {"model": model, "optim": opt}
        ckpt.save(0, state, block=True)  # warm-up: allocates the reused staging buffers
        for i in range(1, repeats + 1):
            t0 = time.perf_counter()
            ckpt.save(i, state)  # the training's whole wait, timed from outside
            stall = time.perf_counter() - t0
            ckpt.wait()
            out.append((stall, time.perf_counter() - t0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=800, help="state size in MB (model + Adam)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on local disk)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    model, opt = make_state(args.mb, args.device)
    nbytes = state_bytes(model, opt)
    mb = nbytes / 1e6
    floor = copy_floor(model, opt, repeats=5)
    base = tempfile.mkdtemp(prefix="ft_bench_", dir=args.dir)
    print(f"state: {mb:.0f} MB on {args.device}; staging-copy floor {floor:.3f} s ({mb / floor:.0f} MB/s)")

    rows = {}
    for name, fn in [("torch.save", bench_torch_save), ("dcp.save", bench_dcp_save),
                     ("dcp.async_save", bench_dcp_async)]:
        d = os.path.join(base, name)
        os.makedirs(d)
        rows[name] = [fn(model, opt, d, i) for i in range(args.repeats)]
        shutil.rmtree(d)
    rows["ft-checkpoint"] = run_ours(model, opt, os.path.join(base, "ours"), args.repeats)
    shutil.rmtree(base)

    ref = statistics.median(s for s, _ in rows["torch.save"])
    print(f"\n{'method':<16}{'stall s':>9}{'durable s':>11}{'MB/s':>8}{'stall/floor':>13}{'stall/torch.save':>18}")
    for name, samples in rows.items():
        stall = statistics.median(s for s, _ in samples)
        total = statistics.median(t for _, t in samples)
        print(f"{name:<16}{stall:>9.3f}{total:>11.2f}{mb / total:>8.0f}{stall / floor:>13.2f}{stall / ref:>18.3f}")
    ours = statistics.median(s for s, _ in rows["ft-checkpoint"])
    print(f"\ntarget: stall <= 1.5x floor and <= 0.05x torch.save -> "
          f"{ours / floor:.2f}x floor, {ours / ref:.3f}x torch.save: "
          f"{'MET' if ours <= 1.5 * floor and ours <= 0.05 * ref else 'NOT MET'}")


if __name__ == "__main__":
    main()
