"""What a DeepSpeed save costs the training: DeepSpeed's own synchronous save_checkpoint against ft-checkpoint.

The same ZeRO engine (a stack of ``--width`` x ``--width`` linear layers, Adam, about ``--mb`` MB of
checkpoint files in all: fp32 weights plus the fp32 master copy and two Adam moments, partitioned over
the ranks) is saved ``--warmup`` times unmeasured, then ``--repeats`` times measured, each way, into a
fresh directory under ``--dir``:

- ``deepspeed``: ``engine.save_checkpoint(dir, tag)`` with DeepSpeed's default (``torch.save``) engine; it
  returns once the files are written, not fsynced: ``durable`` adds an fsync of every file it wrote;
- ``ft-checkpoint``: ``CheckpointManager.save(step, {"engine": engine})``; it returns once the state is
  staged in host memory; ``durable`` is when the step is committed (files fsynced, manifest written).

Per way, medians over the repeats of the slowest rank (a synchronous job waits for it): ``stall s``
(what the training was blocked), ``durable s`` (from the call until durable), and the ratios.

    python benchmarks/deepspeed_save.py               # starts itself under torchrun on 2 CPU ranks
    python benchmarks/deepspeed_save.py --ranks 1 --mb 100 --zero 3
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=250, help="checkpoint size in MB, all ranks' files together")
    p.add_argument("--zero", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory on local disk)")
    return p.parse_args()


def relaunch(args: argparse.Namespace) -> int:
    """Start this script under torchrun on ``--ranks`` CPU ranks (gloo)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           *sys.argv]
    return subprocess.call(cmd, env=env)


def make_engine(args: argparse.Namespace, world: int):
    import deepspeed
    import torch

    # files: weights W (model states) + 3 W (master copy and two moments, partitioned): 4 W bytes in all
    layers = max(1, round(args.mb * 1e6 / 4 / 4 / (args.width * args.width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)])
    config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": args.zero}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, args.width)).pow(2).mean()
    engine.backward(loss)
    engine.step()  # Adam state exists
    return engine


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def slowest(value: float) -> float:
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return max(values)


def deepspeed_save(engine, root: str, i: int) -> tuple[float, float]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(root, tag=f"t{i}", save_latest=False)
    stall = time.perf_counter() - t0
    fsync_tree(os.path.join(root, f"t{i}"))
    dist.barrier()
    return slowest(stall), slowest(time.perf_counter() - t0)


def ft_save(ckpt, engine, i: int) -> tuple[float, float]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    ckpt.save(i + 1, {"engine": engine})
    stall = time.perf_counter() - t0
    ckpt.wait()
    return slowest(stall), slowest(time.perf_counter() - t0)


def measure(save, args: argparse.Namespace) -> tuple[float, float]:
    rows = [save(i) for i in range(args.warmup + args.repeats)][args.warmup:]
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def run(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from ft_checkpoint import CheckpointManager

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    engine = make_engine(args, int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    base = args.dir or tempfile.gettempdir()
    root = os.path.join(base, f"ft-bench-deepspeed-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    ds = measure(lambda i: deepspeed_save(engine, os.path.join(root, "deepspeed"), i), args)
    with CheckpointManager(os.path.join(root, "ft"), interval=10**9, keep_last=2, announce=False) as ckpt:
        ft = measure(lambda i: ft_save(ckpt, engine, i), args)
        size = ckpt.last_save.bytes if ckpt.last_save is not None else 0
    if rank == 0:
        report(args, size, ds, ft)
        shutil.rmtree(root, ignore_errors=True)
    engine.destroy()
    dist.destroy_process_group()


def report(args: argparse.Namespace, size: int, ds: tuple[float, float], ft: tuple[float, float]) -> None:
    print(f"ZeRO-{args.zero} on {args.ranks} CPU ranks, {size / 1e6:.0f} MB of checkpoint files; medians of "
          f"{args.repeats} saves after {args.warmup} warm-up, slowest rank")
    print(f"{'':<16}{'stall s':>10}{'durable s':>12}")
    print(f"{'deepspeed':<16}{ds[0]:>10.3f}{ds[1]:>12.3f}")
    print(f"{'ft-checkpoint':<16}{ft[0]:>10.3f}{ft[1]:>12.3f}")
    print(f"{'ft / deepspeed':<16}{ft[0] / ds[0]:>10.3f}{ft[1] / ds[1]:>12.3f}")


def main() -> int:
    args = parse()
    if "LOCAL_RANK" not in os.environ:
        return relaunch(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
