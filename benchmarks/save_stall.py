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
- ``durable/raw``: against the better of ``raw write`` and ``raw write O_DIRECT``: the same bytes written
  from memory with ``os.write`` into one file and fsynced, through the page cache or from one
  page-aligned buffer with ``O_DIRECT``, measured in the same run (the floor of time to durable here).

    python benchmarks/save_stall.py                 # ~800 MB, CPU
    python benchmarks/save_stall.py --device cuda   # on a GPU machine

``--sizes 1,10,100,800`` prints instead, per state size, the time a training loop is blocked by a save: the
``save`` call plus any wait at the next optimizer step (``lazy_snapshot``: parameters and optimizer state are
copied while the next forward/backward runs), against the staging-copy floor and a synchronous ``torch.save``
(fsynced), with a forward/backward long enough to cover the copy (``covered``) and none at all (``short``: the
optimizer step right after the save; a forward/backward of one row still covers the copy here, as its backward
writes every gradient),
and with ``lazy_snapshot=False`` (``eager``). ``capture s`` is what any save that resumes exactly does before it
returns, whatever it copies and whenever: walk the state (the model's and the optimizer's ``state_dict``) and
take the random number generators' states (torch, Python, NumPy); where 0.5x the staging floor lies below it
(small states, whose copy takes less than that), the target is out of reach, and ``/capture`` says how far above
that floor the save is. Both floors are the best of a tight loop, the state hot in the cache; a line below each size
gives them again as measured where a save runs, right after a forward/backward and optimizer step (medians),
and the covered save against that copy. ``--profile`` adds where a small save's call spends its time.

    python benchmarks/save_stall.py --sizes 1,10,100,800
    python benchmarks/save_stall.py --sizes 1,10,100 --device cuda
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
from ft_checkpoint.state import rng_state

try:
    from floor_saver import write_durably
except ImportError:  # imported as benchmarks.save_stall (from the repository root)
    from benchmarks.floor_saver import write_durably


def make_state(mb: float, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``mb / 3`` MB of fp32 weights plus Adam's two moments: ``mb`` MB in all (layers 2048 wide, or
    one narrower layer below 50 MB)."""
    width = min(2048, max(16, int((mb * 1e6 / 3 / 4) ** 0.5)))
    layers = max(1, round(mb * 1e6 / 3 / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(model, opt))


def copy_floor(model: torch.nn.Module, opt: torch.optim.Optimizer, repeats: int) -> float:
    """Seconds to copy every state tensor into preallocated (pinned, for CUDA) host buffers.

    The best of ``repeats`` rounds of two ways to copy: tensor ``copy_`` and raw storage ``copy_``.
    """
    tensors = tensors_of(model, opt)
    dst = staging_buffers(tensors)
    ways = [lambda d, t: d.copy_(t, non_blocking=t.is_cuda),
            lambda d, t: d.untyped_storage().copy_(t.untyped_storage(), non_blocking=t.is_cuda)]
    return min(timed_copy(dst, tensors, copy) for copy in ways * repeats)


def capture_floor(model: torch.nn.Module, opt: torch.optim.Optimizer, repeats: int) -> float:
    """Seconds, the best of ``repeats``, to walk the state and take the RNG states: what a save that resumes
    exactly must do before it returns, however little it copies then (see the module's docstring)."""
    return min(timed_capture(model, opt) for _ in range(repeats))


def floors_in_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor,
                   rounds: int) -> tuple[float, float]:
    """``(staging copy, capture)``, each the median of ``rounds`` taken where a save runs: right after a forward,
    backward and optimizer step, the caches holding the training's data rather than the state's. (The floors above
    are the best of a tight loop, the state hot in the cache: at 10 MB several times faster.)"""
    tensors = tensors_of(model, opt)
    dst = staging_buffers(tensors)
    copies, captures = [], []
    for _ in range(rounds):
        train_step(model, opt, batch)
        copies.append(timed_copy(dst, tensors, lambda d, t: d.copy_(t, non_blocking=t.is_cuda)))
        train_step(model, opt, batch)
        captures.append(timed_capture(model, opt))
    return statistics.median(copies), statistics.median(captures)


def staging_buffers(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host buffers for ``tensors`` (pinned for CUDA ones), as a save's staging has."""
    return [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]


def timed_copy(dst: list[torch.Tensor], tensors: list[torch.Tensor], copy) -> float:
    """Seconds for ``copy(d, t)`` of every tensor into its buffer, synchronized for CUDA."""
    t0 = time.perf_counter()
    for d, t in zip(dst, tensors):
        copy(d, t)
    if tensors[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def timed_capture(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """Seconds to take the model's and the optimizer's state dicts and the RNG states."""
    t0 = time.perf_counter()
    model.state_dict()
    opt.state_dict()
    rng_state()
    return time.perf_counter() - t0


def tensors_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state: the model's, then the optimizer's."""
    tensors = list(model.state_dict().values())
    return tensors + [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def bench_raw_write(model, opt, d: str, i: int, direct: bool = False) -> tuple[float, float]:
    """The floor of time to durable: every tensor's bytes, already in host memory, written into one file and
    fsynced; with ``direct``, from one page-aligned buffer with ``O_DIRECT`` (no page cache)."""
    from ft_checkpoint.format.shards import byte_view
    from ft_checkpoint.save.staging import Stager

    tensors = tensors_of(model, opt)
    if direct:  # not timed: staging is measured separately
        stager = bench_raw_write.__dict__.setdefault("stager", Stager())
        stager.stage({str(k): t for k, t in enumerate(tensors)})
        views = [memoryview(stager.arena._mmap)]
    else:
        views = [byte_view(t.detach().cpu().contiguous()) for t in tensors]
    t0 = time.perf_counter()
    write_durably(os.path.join(d, f"raw_{i}.bin"), views, direct=direct)
    t = time.perf_counter() - t0
    return t, t


def bench_raw_direct(model, opt, d: str, i: int) -> tuple[float, float]:
    return bench_raw_write(model, opt, d, i, direct=True)


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


class Ours:
    """A CheckpointManager saving the state into its own directory, one save per call."""

    def __init__(self, model, opt, d: str, **config) -> None:
        self.ckpt = CheckpointManager(d, interval=1, keep_last=2, announce=False, **config)
        self.state, self.step = {"model": model, "optim": opt}, 0

    def __call__(self, *_: object) -> tuple[float, float]:
        self.step += 1
        t0 = time.perf_counter()
        stats = self.ckpt.save(self.step, self.state)  # the training's whole wait, timed from outside
        stall = time.perf_counter() - t0
        self.ckpt.wait()
        return stall, stats.duration - stats.stall + stall  # durable: from the call until the commit

    def settle(self) -> None:
        """Not timed: as in training, the deletions a commit started are over long before the next save."""
        self.ckpt.wait(retention=True)

    def close(self) -> None:
        self.ckpt.close()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor | None) -> None:
    """One forward, backward and optimizer step (no forward/backward with ``batch=None``: the step at once)."""
    if batch is not None:
        model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def batch_covering(model: torch.nn.Module, seconds: float, device: str) -> torch.Tensor:
    """A batch whose forward/backward takes about ``seconds`` (at least one row)."""
    width = model[0].in_features
    probe = torch.randn(64, width, device=device)
    for _ in range(2):  # the second is the one timed
        t0 = time.perf_counter()
        model(probe).square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - t0
    return torch.randn(max(1, round(64 * seconds / took)), width, device=device)


def blocked(model, opt, d: str, batch: torch.Tensor | None, rounds: int, lazy: bool) -> list[tuple[float, float]]:
    """``(save call, wait at the next optimizer step)`` of ``rounds`` saves of a training loop (after 2 unmeasured)."""
    ckpt = CheckpointManager(d, interval=1, keep_last=2, announce=False, lazy_snapshot=lazy)
    state, out = {"model": model, "optim": opt}, []
    for step in range(1, rounds + 3):
        train_step(model, opt, batch if batch is not None else torch.randn(1, model[0].in_features))
        t0 = time.perf_counter()
        stats = ckpt.save(step, state)
        call = time.perf_counter() - t0
        train_step(model, opt, batch)  # the forward/backward the copy overlaps; its step waits for the copy
        ckpt.wait(retention=True)
        if step > 2:
            out.append((call, stats.step_wait))
    ckpt.close()
    return out


def profile_small_save(model, opt, d: str) -> None:
    """Where the save call of a small state spends its time (cProfile, cumulative, the top entries)."""
    import cProfile
    import pstats

    ckpt = CheckpointManager(d, interval=1, keep_last=2, announce=False)
    state = {"model": model, "optim": opt}
    for step in range(1, 4):
        ckpt.save(step, state)
        ckpt.wait(retention=True)
    prof = cProfile.Profile()
    for step in range(4, 24):
        prof.enable()
        ckpt.save(step, state)
        prof.disable()
        ckpt.wait(retention=True)
    ckpt.close()
    print("\nprofile of 20 save calls (cumulative seconds):")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)


def sizes_table(sizes: list[float], device: str, repeats: int, base: str, profile: bool) -> None:
    """The blocked-time table (see the module's docstring), one row per state size and mode."""
    print(f"{'state':>8}{'mode':>9}{'fwd/bwd s':>11}{'call s':>9}{'step wait s':>13}{'blocked s':>11}{'floor s':>9}"
          f"{'capture s':>11}{'torch.save s':>14}{'/floor':>8}{'/capture':>10}{'/torch.save':>13}")
    for mb in sizes:
        model, opt = make_state(mb, device)
        floor = copy_floor(model, opt, repeats=5)
        capture = capture_floor(model, opt, repeats=50)
        d = os.path.join(base, f"ts_{mb}")
        os.makedirs(d)
        plain = statistics.median(bench_torch_save(model, opt, d, i)[0] for i in range(repeats + 1))
        shutil.rmtree(d)
        covering = batch_covering(model, 3 * floor + 0.01, device)
        floor_here, capture_here = floors_in_loop(model, opt, covering, rounds=max(20, repeats))
        totals = {}
        for mode, lazy, batch in [("eager", False, covering), ("covered", True, covering), ("short", True, None)]:
            t0 = time.perf_counter()
            train_step(model, opt, batch)
            fwd = time.perf_counter() - t0
            rows = blocked(model, opt, os.path.join(base, f"{mode}_{mb}"), batch, repeats, lazy)
            call, wait = (statistics.median(r[k] for r in rows) for k in range(2))
            total = statistics.median(r[0] + r[1] for r in rows)
            print(f"{state_bytes(model, opt) / 1e6:>6.0f}MB{mode:>9}{fwd:>11.3f}{call:>9.4f}{wait:>13.4f}{total:>11.4f}"
                  f"{floor:>9.4f}{capture:>11.5f}{plain:>14.4f}{total / floor:>8.2f}{total / capture:>10.2f}"
                  f"{total / plain:>13.2f}")
            totals[mode] = total
        print(f"{'':>8}where a save runs (after a forward/backward and step; medians): staging copy {floor_here:.5f} s, "
              f"capture {capture_here:.5f} s; covered blocked {totals['covered'] / floor_here:.2f}x that copy")
        if capture_here > floor_here / 2:
            print(f"{'':>8}where a save runs, covered <= 0.5x the copy ({floor_here / 2:.5f} s) is out of reach: capture "
                  f"alone takes {capture_here:.5f} s")
        if capture > floor / 2:
            print(f"{'':>8}covered <= 0.5x floor ({floor / 2:.5f} s) is out of reach: capture alone takes {capture:.5f} s")
        if profile and mb == min(sizes):
            profile_small_save(model, opt, os.path.join(base, "profile"))
        del model, opt
    print("(medians; blocked = save call + wait at the next optimizer step. Targets: covered <= 0.5x floor; "
          ">= 10 MB: <= 0.3x torch.save)")


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its live children (a writer process)."""
    total = time.process_time()
    children = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):  # each thread's children (a writer thread starts them)
        try:
            children += open(f"/proc/{os.getpid()}/task/{task}/children").read().split()
        except OSError:
            continue
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
    ap.add_argument("--sizes", default=None, help="state sizes in MB, e.g. 1,10,100,800: the blocked-time table")
    ap.add_argument("--profile", action="store_true", help="with --sizes: profile the smallest size's save call")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.sizes:
        base = tempfile.mkdtemp(prefix="ft_bench_", dir=args.dir)
        try:
            sizes_table([float(x) for x in args.sizes.split(",")], args.device, args.repeats, base, args.profile)
        finally:
            shutil.rmtree(base)
        return

    model, opt = make_state(args.mb, args.device)
    nbytes = state_bytes(model, opt)
    mb, gb = nbytes / 1e6, nbytes / 1e9
    floor = copy_floor(model, opt, repeats=5)
    base = tempfile.mkdtemp(prefix="ft_bench_", dir=args.dir)
    print(f"state: {mb:.0f} MB on {args.device}; staging-copy floor {floor:.3f} s ({mb / floor:.0f} MB/s)")

    rows = {}
    for name, fn in [("torch.save", bench_torch_save), ("dcp.save", bench_dcp_save), ("dcp.async_save", bench_dcp_async)]:
        d = os.path.join(base, name)
        os.makedirs(d)
        samples = [timed(fn, model, opt, d, i) for i in range(args.warmup + args.repeats)]
        rows[name] = samples[args.warmup:]
        shutil.rmtree(d)
    # the floor and ours interleaved, round by round: the disk and the page cache treat each alike
    contenders = {"raw write": bench_raw_write, "raw write O_DIRECT": bench_raw_direct,
                  **{f"ft-checkpoint {w}": Ours(model, opt, os.path.join(base, w), writer=w) for w in ("thread", "process")}}
    for name in contenders:
        os.makedirs(os.path.join(base, name), exist_ok=True)
        rows[name] = []
    for i in range(args.warmup + args.repeats):
        for name, fn in contenders.items():
            sample = timed(fn, model, opt, os.path.join(base, name), i)
            if isinstance(fn, Ours):
                fn.settle()
            if name.startswith("raw write") and i >= 2:
                os.remove(os.path.join(base, name, f"raw_{i - 2}.bin"))  # two kept, as ours keeps two steps
            if i >= args.warmup:
                rows[name].append(sample)
    for fn in contenders.values():
        if isinstance(fn, Ours):
            fn.close()
    shutil.rmtree(base)

    med = {name: [statistics.median(x[k] for x in samples) for k in range(3)] for name, samples in rows.items()}
    cpu_min = {name: min(x[2] for x in samples) for name, samples in rows.items()}
    raw = min(med["raw write"][1], med["raw write O_DIRECT"][1])  # the better of the two floors
    print(f"\n{'method':<22}{'stall s':>9}{'durable s':>11}{'MB/s':>8}{'CPU s/GB':>10}{'(min)':>7}{'stall/floor':>13}"
          f"{'durable/raw':>13}")
    for name, (stall, durable, cpu) in med.items():
        print(f"{name:<22}{stall:>9.3f}{durable:>11.2f}{mb / durable:>8.0f}{cpu / gb:>10.2f}{cpu_min[name] / gb:>7.2f}"
              f"{stall / floor:>13.2f}{durable / raw:>13.2f}")
    print("(medians; CPU also its minimum: on these VMs a write into page-cache memory the guest has not touched "
          "lately costs ~2 s/GB more CPU, for any writer)")
    for writer in ("thread", "process"):
        stall, durable, cpu = med[f"ft-checkpoint {writer}"]
        print(f"ft-checkpoint {writer}: stall {stall / floor:.2f}x floor (target <= 1.5), CPU {cpu / gb:.2f} s/GB, "
              f"min {cpu_min[f'ft-checkpoint {writer}'] / gb:.2f} (target <= 0.5), durable {durable / raw:.2f}x raw "
              "write (target <= 1.2)")


if __name__ == "__main__":
    main()
