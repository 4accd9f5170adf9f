"""What checkpointing costs an Accelerate training loop: no saving vs ``accelerator.save_state()`` vs ours.

One process trains a model of about ``--mb`` MB of weights plus Adam state for ``--steps`` steps,
several times in one run: without saving; with ``accelerator.save_state()`` every ``--every`` steps
(as Accelerate users do; it writes to the page cache and returns before the data is durable); the
same followed by an fsync of the files (durable, like ours); with ``FaultTolerantCheckpoint(interval=--every)``,
which stages a copy and writes, checksums and commits in the background; and with the floor of any
background save (``floor_saver.RawSaver``: the state copied into reused buffers, then written and fsynced
by a thread, nothing else), which shows what this machine takes for the bytes alone. The table shows the
training loop's time, the overhead over no saving, the median time one save blocked the loop, and the
ratio of our overhead to save_state's (target <= 0.1x).
Wall-clock overheads need a quiet machine: use ``--repeats`` (round robin, minimums) on a shared one.
Our last save is drained at ``close()``; that wait is shown on its own, outside the loop time.

    python benchmarks/accelerate_overhead.py                   # ~800 MB, 100 steps, save every 20
    python benchmarks/accelerate_overhead.py --mb 100 --steps 40 --every 10   # quick
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
from accelerate import Accelerator
from floor_saver import RawSaver
from save_stall import fsync_tree, make_state, state_bytes, tensors_of  # this folder: the same state as the core benchmark

from accelerate_ft import FaultTolerantCheckpoint

KEEP = 2
"""Checkpoints kept by every method (ours: ``keep_last``)."""


class Run:
    """One training run: loop time, and how long each save blocked the loop."""

    def __init__(self, name: str) -> None:
        self.name, self.loop, self.stalls, self.drain = name, 0.0, [], 0.0

    def train(self, acc: Accelerator, model, opt, steps: Iterator, on_step: Callable[[int], None]) -> None:
        """One pass over ``steps`` (an iterator of batches), calling ``on_step(step)`` after each."""
        t0 = time.perf_counter()
        train(acc, model, opt, steps, on_step)
        self.loop = time.perf_counter() - t0


def train(acc: Accelerator, model, opt, steps: Iterator, on_step: Callable[[int], None]) -> None:
    for step, (x,) in enumerate(steps, start=1):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        on_step(step)


def run_none(acc, model, opt, loader, args, base) -> Run:
    run = Run("no saving")
    run.train(acc, model, opt, iter(loader), lambda step: None)
    return run


def run_save_state(acc, model, opt, loader, args, base, *, fsync: bool) -> Run:
    run = Run("save_state + fsync" if fsync else "save_state")
    root = tempfile.mkdtemp(dir=base)
    saved: list[str] = []

    def on_step(step: int) -> None:
        if step % args.every:
            return
        t0 = time.perf_counter()
        path = os.path.join(root, f"step_{step}")
        acc.save_state(path)
        if fsync:
            fsync_tree(path)
        run.stalls.append(time.perf_counter() - t0)
        saved.append(path)
        if len(saved) > KEEP:
            shutil.rmtree(saved.pop(0))

    run.train(acc, model, opt, iter(loader), on_step)
    shutil.rmtree(root)
    return run


def run_floor(acc, model, opt, loader, args, base) -> Run:
    run = Run("floor")
    saver = RawSaver(tempfile.mkdtemp(dir=base))

    def on_step(step: int) -> None:
        if step % args.every == 0:
            saver.save(step, tensors_of(acc.unwrap_model(model), opt.optimizer))

    run.train(acc, model, opt, iter(loader), on_step)
    t0 = time.perf_counter()
    saver.wait()
    run.drain, run.stalls = time.perf_counter() - t0, saver.stalls
    shutil.rmtree(saver.directory)
    return run


def run_ours(acc, model, opt, loader, args, base, *, writer: str = "thread") -> Run:
    run = Run("ft-checkpoint" if writer == "thread" else f"ft-checkpoint {writer}")
    root = tempfile.mkdtemp(dir=base)  # empty: nothing to resume
    ft = FaultTolerantCheckpoint(acc, root, interval=args.every, keep_last=KEEP, writer=writer)
    epochs = ft.epochs(1)
    next(epochs)

    def on_step(step: int) -> None:  # runs before the hook's own step end: reports the save of an earlier step
        last = ft.manager.last_save
        if last is not None and (not run.stalls or run.stalls[-1][0] != last.step):
            run.stalls.append((last.step, last.stall))

    run.train(acc, model, opt, ft.batches(loader), on_step)
    t0 = time.perf_counter()
    ft.close()
    run.drain = time.perf_counter() - t0
    on_step(0)
    run.stalls = [stall for _, stall in run.stalls]
    shutil.rmtree(root)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=800, help="model + Adam state in MB (default 800)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=20, help="save every N steps (default 20)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all methods; the minimum loop time is shown")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on local disk)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    acc = Accelerator()
    model, opt = make_state(args.mb, str(acc.device))
    width = model[0].in_features
    data = torch.utils.data.TensorDataset(torch.randn(args.steps * args.batch, width))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    model, opt, loader = acc.prepare(model, opt, loader)
    train(acc, model, opt, (b for _, b in zip(range(3), loader)), lambda step: None)  # warm-up
    mb = state_bytes(model, opt.optimizer) / 1e6
    base = tempfile.mkdtemp(prefix="ft_accelerate_bench_", dir=args.dir)
    print(f"state: {mb:.0f} MB (model + Adam) on {acc.device}; {args.steps} steps, save every {args.every}; "
          f"torch threads {torch.get_num_threads()}")

    methods = [run_none, lambda *a: run_save_state(*a, fsync=False), lambda *a: run_save_state(*a, fsync=True),
               run_floor, run_ours, lambda *a: run_ours(*a, writer="process")]
    runs: dict[str, list[Run]] = {}
    try:
        for _ in range(args.repeats):  # round robin, so a noisy minute on a shared machine hits every method
            for fn in methods:
                os.sync()  # no writeback of the previous run's files during this one
                run = fn(acc, model, opt, loader, args, base)
                runs.setdefault(run.name, []).append(run)
                print(f"  {run.name:<24} loop {run.loop:7.2f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    loop = {name: min(r.loop for r in rs) for name, rs in runs.items()}
    stalls = {name: [s for r in rs for s in r.stalls] for name, rs in runs.items()}
    drain = {name: statistics.median(r.drain for r in rs) for name, rs in runs.items()}
    none = loop.pop("no saving")
    print(f"\n{'method':<24}{'loop s':>8}{'overhead s':>12}{'overhead':>10}{'saves':>7}{'blocked/save s':>16}"
          f"{'drain s':>9}")
    print(f"{'no saving':<24}{none:>8.2f}{0:>12.2f}{0:>10.1%}{0:>7}{'-':>16}{'-':>9}")
    for name, seconds in loop.items():
        print(f"{name:<24}{seconds:>8.2f}{seconds - none:>12.2f}{(seconds - none) / none:>10.1%}"
              f"{len(stalls[name]) // args.repeats:>7}{statistics.median(stalls[name]):>16.3f}{drain[name]:>9.2f}")
    print()
    for mine in ("floor", "ft-checkpoint", "ft-checkpoint process"):
        ours = loop[mine] - none
        for name in ("save_state", "save_state + fsync"):
            theirs = loop[name] - none
            ratio = ours / theirs if theirs > 0 else float("inf")
            verdict = "n/a: within noise of no saving" if min(ours, theirs) <= 0 else "MET" if ratio <= 0.1 else "NOT MET"
            print(f"overhead {mine} / {name}: {ratio:.3f}x  (target <= 0.1x: {verdict})")
    floor = loop["floor"] - none
    for mine in ("ft-checkpoint", "ft-checkpoint process"):
        print(f"overhead {mine}: {loop[mine] - none:+.2f} s against the floor's {floor:+.2f} s")
    blocked = statistics.median(stalls["ft-checkpoint"]) / statistics.median(stalls["save_state"])
    print(f"blocked per save ours / save_state: {blocked:.3f}x")
    with contextlib.suppress(Exception):
        acc.end_training()


if __name__ == "__main__":
    main()
