"""What checkpointing costs a Lightning training: none, ModelCheckpoint, + AsyncCheckpointIO, ours, and the floor.

The same training (a model whose fp32 weights plus Adam's two moments make about ``--mb`` MB; ``--steps``
steps, a save every ``--every`` steps) runs once per method, each in a fresh process, and the table
shows the training time (``trainer.fit`` until every save is durable) and the overhead against no
checkpointing, side by side; also the process CPU time (all threads: what the background writes cost in
compute, writer processes included) and how long the training waited per save (measured by the callback for ours; for Lightning
the time spent in ModelCheckpoint's hook when it saved). On a shared machine wall-clock times swing
with other load; the stall and CPU columns do much less. ``floor`` is the least any background save can cost
here: the state copied into reused buffers, then written and fsynced by a thread, nothing else
(``floor_saver.RawSaver``); where it alone costs more than the target allows, the target is out of this
machine's reach, and ours is compared with it too.

    python benchmarks/lightning_overhead.py                       # ~800 MB, 100 steps, save every 20
    python benchmarks/lightning_overhead.py --mb 100 --steps 40   # quick
    python benchmarks/lightning_overhead.py --repeats 4 --methods "FaultTolerantCheckpoint,FaultTolerantCheckpoint writer=process"

Target: our overhead at most 0.1x ModelCheckpoint's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

METHODS = ["none", "ModelCheckpoint", "ModelCheckpoint+AsyncCheckpointIO", "floor", "FaultTolerantCheckpoint",
           "FaultTolerantCheckpoint writer=process", "FaultTolerantCheckpoint writer_priority=19"]


def run_method(method: str, mb: int, steps: int, every: int, directory: str) -> dict:
    """One training with one method, in this process; returns its measurements."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import FaultTolerantCheckpoint

    try:
        from floor_saver import RawSaver
        from save_stall import tensors_of
    except ImportError:  # run from the repository root as benchmarks/lightning_overhead.py
        from benchmarks.floor_saver import RawSaver
        from benchmarks.save_stall import tensors_of

    width, batch = 2048, 8
    layers = max(1, round(mb * 1e6 / 3 / 4 / (width * width)))

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, b, i):
            return self.net(b[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    class Timed(ModelCheckpoint):
        """ModelCheckpoint that records how long each of its saves blocked the training."""

        stalls: list[float] = []

        def on_train_batch_end(self, trainer, *args, **kwargs):
            t0, saved = time.perf_counter(), self._last_global_step_saved
            super().on_train_batch_end(trainer, *args, **kwargs)
            if self._last_global_step_saved != saved:
                self.stalls.append(time.perf_counter() - t0)

    class Floor(pl.Callback):
        """The floor of an async save (``floor_saver``), every ``every`` steps."""

        def __init__(self) -> None:
            self.saver = RawSaver(directory)
            self.stalls = self.saver.stalls

        def on_train_batch_end(self, trainer, module, *args):
            if trainer.global_step % every == 0:
                self.saver.save(trainer.global_step, tensors_of(module, trainer.optimizers[0]))

        def on_train_end(self, trainer, module):
            self.saver.wait()

    pl.seed_everything(0, verbose=False)
    data = DataLoader(TensorDataset(torch.randn((steps + 1) * batch, width)), batch_size=batch)  # no epoch end
    callbacks: list = []
    plugins: list = []
    ft = mc = floor = None
    if method == "floor":
        os.makedirs(directory, exist_ok=True)
        floor = Floor()
        callbacks.append(floor)
    elif method.startswith("ModelCheckpoint"):
        mc = Timed(dirpath=directory, every_n_train_steps=every, save_top_k=-1)
        callbacks.append(mc)
        plugins = [AsyncCheckpointIO()] if "Async" in method else []
    elif method.startswith("FaultTolerantCheckpoint"):
        options = dict(o.split("=") for o in method.split()[1:])
        if "writer_priority" in options:
            options["writer_priority"] = int(options["writer_priority"])
        ft = FaultTolerantCheckpoint(directory, interval=every, keep_last=2, **options)
        callbacks.append(ft)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=ft is not None or mc is not None, callbacks=callbacks,
                         plugins=plugins, num_sanity_val_steps=0)
    model = Model()
    state_mb = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    t0, c0 = time.perf_counter(), cpu_seconds()
    trainer.fit(model, data)  # returns once teardown drained every save (and ended any writer process)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    stalls = next((c.stalls for c in (ft, mc, floor) if c is not None), [])
    return {"method": method, "seconds": seconds, "cpu": cpu, "state_mb": state_mb, "saves": len(stalls),
            "stall": sum(stalls) / len(stalls) if stalls else 0.0, "threads": torch.get_num_threads()}


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its children that ended (writer processes)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def run_child(method: str, args: argparse.Namespace, directory: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--method", method, "--mb", str(args.mb),
           "--steps", str(args.steps), "--every", str(args.every), "--dir", directory]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    shutil.rmtree(directory, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"{method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=800, help="model + Adam state, MB")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=20, help="save every N steps")
    ap.add_argument("--repeats", type=int, default=1, help="runs per method, interleaved; the table shows minimums")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir on local disk)")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=METHODS, metavar="A,B",
                    help="which methods to run, comma-separated (none, ModelCheckpoint and floor always run)")
    ap.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)  # one run, in a child process
    args = ap.parse_args()
    if unknown := set(args.methods) - set(METHODS):
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    methods = [m for m in METHODS if m in {"none", "ModelCheckpoint", "floor", *args.methods}]
    if args.method:
        print(json.dumps(run_method(args.method, args.mb, args.steps, args.every, args.dir)))
        return

    base = tempfile.mkdtemp(prefix="ft_lightning_bench_", dir=args.dir)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    try:
        for _ in range(args.repeats):
            for method in methods:  # interleaved, so a slow spell of a shared machine hits every method
                runs[method].append(run_child(method, args, os.path.join(base, method)))
                print(f"  {method}: {runs[method][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = {m: {**r[0], **{k: min(x[k] for x in r) for k in ("seconds", "cpu", "stall")}} for m, r in runs.items()}

    none, none_cpu = rows["none"]["seconds"], rows["none"]["cpu"]
    first = rows["none"]
    print(f"\nstate {first['state_mb']:.0f} MB (model + Adam), {args.steps} steps, a save every {args.every}, "
          f"{first['threads']} torch threads, {os.cpu_count()} CPUs, minimum of {args.repeats} run(s) per method")
    print(f"{'method':<44}{'train s':>9}{'overhead s':>12}{'CPU s':>8}{'CPU overhead s':>16}{'saves':>7}"
          f"{'stall/save s':>14}{'stall total s':>15}")
    for method, r in rows.items():
        print(f"{method:<44}{r['seconds']:>9.1f}{r['seconds'] - none:>12.1f}{r['cpu']:>8.1f}{r['cpu'] - none_cpu:>16.1f}"
              f"{r['saves']:>7}{r['stall']:>14.3f}{r['stall'] * r['saves']:>15.2f}")
    theirs = rows["ModelCheckpoint"]
    ours_methods = [m for m in methods if m.startswith("FaultTolerantCheckpoint")]
    for variant in ["floor", *ours_methods]:
        compare(variant, rows[variant], theirs, none, none_cpu)
    floor = rows["floor"]
    print("\nagainst the floor (the bytes alone: copy, write, fsync):")
    for variant in ours_methods:
        ours = rows[variant]
        print(f"  {variant:<44} overhead {ours['seconds'] - none:+.1f} s vs {floor['seconds'] - none:+.1f} s, "
              f"CPU {ours['cpu'] - none_cpu:+.1f} s vs {floor['cpu'] - none_cpu:+.1f} s")
    print("Wall-clock figures need a quiet machine; on a shared one, compare the stall and CPU columns.")


def compare(name: str, ours: dict, theirs: dict, none: float, none_cpu: float) -> None:
    print(f"\n{name} / ModelCheckpoint (target <= 0.1x):")
    for label, a, b in [("training-time overhead", ours["seconds"] - none, theirs["seconds"] - none),
                        ("time training waited (stall total)", ours["stall"] * ours["saves"], theirs["stall"] * theirs["saves"]),
                        ("CPU-time overhead (all threads)", ours["cpu"] - none_cpu, theirs["cpu"] - none_cpu)]:
        ratio = a / b if b > 0 else float("nan")
        verdict = "MET" if 0 <= ratio <= 0.1 else ("n/a: no overhead measured for ModelCheckpoint" if b <= 0 else "NOT MET")
        print(f"  {label:<36}{ratio:>7.2f}x  {verdict}")


if __name__ == "__main__":
    main()
