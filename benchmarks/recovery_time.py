"""Recovery time: from a restarted process's start to its first training step, ours against each framework's own resume.

A Lightning job and an Accelerate job (``--layers`` x ``Linear(1024, 1024)`` + Adam: 48 layers make about
600 MB of state) save every ``--every`` steps and are killed (SIGKILL) at step ``--kill-at`` after the save
before it committed. Then the same job is restarted ``--repeats`` times, each time in a fresh process that
resumes and is killed again at the start of its first training step (so every restart resumes the same
step), interleaved across the methods. The time counted runs from after ``import torch, lightning`` (or
``accelerate``), which every method pays alike, to the start of the first training step; the table shows
the best and the median, the ratio of the best to the best of the framework's own resume, and the peak
resident memory of the restarts (the most any of them held at its first step):

- Lightning: ``ModelCheckpoint(every_n_train_steps, save_last=True)`` + ``fit(ckpt_path="last")``; ours:
  ``FaultTolerantCheckpoint`` on local disk, with a fast tier under ``/dev/shm`` (``fast_dirpath``), and
  on the GCS emulator (``ft_checkpoint.testing.servers``).
- Accelerate: ``save_state`` / ``load_state`` + ``skip_first_batches``; ours: the same three.

A second table breaks our time down, from timestamps the restarted process reports (one JSON line on its
stdout): ``import`` (our package), ``build`` (model, optimizer, trainer or ``prepare``: both pay it),
``manager`` (``CheckpointManager`` start-up: config, lease, journal, listing), ``find`` (from ``resume``
to the first step opened: listing, manifest and file checks), ``load`` (open the step's small files, then
read and verify every tensor into the state), ``restore`` (the framework's part after our load: Lightning
restoring its loops, the data position) and ``other`` (the framework's own start-up around ours).

The page cache is left warm (a process crash on a node that stays up); ``--cold`` drops the local
checkpoint files from it before each restart (``posix_fadvise``), as after a node replacement. Timings
on a shared machine move with other load: compare the rows of one run, not figures across runs.

    python benchmarks/recovery_time.py                       # 48 layers (~600 MB), best of 3
    python benchmarks/recovery_time.py --layers 12 --repeats 2 --methods lightning:ours,lightning:framework

Targets: ours from local disk at most 1.0x the framework's resume; from a fast tier at most 0.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

METHODS = ["lightning:framework", "lightning:ours", "lightning:fast", "lightning:gcs",
           "accelerate:framework", "accelerate:ours", "accelerate:fast", "accelerate:gcs"]
LABELS = {"framework": {"lightning": 'ModelCheckpoint + ckpt_path="last"',
                        "accelerate": "save_state/load_state + skip_first_batches"},
          "ours": "ours, durable (local disk)", "fast": "ours, fast tier (/dev/shm)", "gcs": "ours, GCS emulator"}
PHASES = ["import", "build", "manager", "find", "load", "restore", "other"]
WIDTH, BATCH, BATCHES = 1024, 8, 64


# -- the child: one training process ---------------------------------------------------------
class Marks:
    """Timestamps of the child, relative to the moment after ``import torch`` and the framework; with ``profile``
    (a path), a cProfile of the restart up to its first step is written there."""

    def __init__(self, profile: str | None = None) -> None:
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.profile = profile
        self._profiler = None
        if profile:
            import cProfile

            self._profiler = cProfile.Profile()
            self._profiler.enable()

    def __call__(self, name: str, *, first: bool = False) -> None:
        if not (first and name in self.marks):
            self.marks[name] = time.perf_counter() - self.t0

    def wrap(self, owner: Any, attr: str, before: str | None, after: str | None) -> None:
        """Mark the first call of ``owner.attr``'s start (``before``) and the last one's end (``after``)."""
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if before:
                self(before, first=True)
            try:
                return fn(*args, **kwargs)
            finally:
                if after:
                    self(after)

        setattr(owner, attr, timed)

    def report_and_die(self, step: int) -> None:
        """The first training step starts: print the marks (one JSON line) and die as a crash would."""
        self("first_step")
        if self._profiler is not None:
            self._profiler.disable()
            self._profiler.dump_stats(self.profile)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print("RECOVERY " + json.dumps({"step": step, "peak_mb": peak_mb, **self.marks}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def instrument(marks: Marks, method: str) -> None:
    """Mark our start-up's phases: the manager's construction, ``resume``, the first step opened, the last load."""
    from ft_checkpoint import manager
    from ft_checkpoint.load.loading import StepLoader

    marks.wrap(manager.CheckpointManager, "__init__", "manager_in", "manager_out")
    marks.wrap(manager.CheckpointManager, "resume", "resume_in", "resume_out")
    loaders: list[type] = [StepLoader]
    if method == "fast":  # imported only where a fast tier is configured
        from ft_checkpoint.tiers import fast_tier

        loaders += [c for c in vars(fast_tier).values() if isinstance(c, type) and issubclass(c, StepLoader)
                    and c is not StepLoader]
    for cls in loaders:
        for attr, before, after in (("open_step", "open_in", None), ("load", None, "load_out")):
            if attr in vars(cls):
                marks.wrap(cls, attr, before, after)


def ours_config(args: argparse.Namespace, method: str) -> dict[str, Any]:
    config: dict[str, Any] = {"interval": args.every, "keep_last": 2}
    if method == "fast":
        config.update(fast_dirpath=args.fast_dir, fast_interval=args.every)
    if method == "gcs":
        config["storage_options"] = json.loads(args.storage_options)
    return config


def lightning_child(args: argparse.Namespace, method: str) -> None:
    import lightning.pytorch as pl
    import torch

    marks = Marks(args.profile)
    from torch.utils.data import DataLoader, TensorDataset

    if method != "framework":
        from lightning_ft import FaultTolerantCheckpoint

        instrument(marks, method)
    else:  # the framework's load: torch.load of the checkpoint file
        marks.wrap(torch, "load", "resume_in", "resume_out")
    marks("imported")
    restart = args.phase == "restart"

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)])

        def training_step(self, batch: Any, i: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if restart:
                marks.report_and_die(trainer.global_step)

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == args.kill_at:
                if ft is not None:
                    assert ft.manager is not None
                    ft.manager.wait()  # the save before the kill is committed
                os.kill(os.getpid(), signal.SIGKILL)

    ft = None
    if method == "framework":
        ckpt: pl.Callback = pl.callbacks.ModelCheckpoint(args.dir, every_n_train_steps=args.every, save_last=True)
    else:
        ckpt = ft = FaultTolerantCheckpoint(args.url, **ours_config(args, method))
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(BATCH * BATCHES, WIDTH)), batch_size=BATCH)
    model = Net()
    trainer = pl.Trainer(max_epochs=100, callbacks=[Probe(), ckpt], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1)
    marks("built")
    trainer.fit(model, data, ckpt_path="last" if method == "framework" and restart else None)
    raise SystemExit("the training ended without reaching its kill")


def accelerate_child(args: argparse.Namespace, method: str) -> None:
    import accelerate
    import torch

    marks = Marks(args.profile)
    from torch.utils.data import DataLoader, TensorDataset

    if method != "framework":
        from accelerate_ft import FaultTolerantCheckpoint

        instrument(marks, method)
    marks("imported")
    restart = args.phase == "restart"
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    loader = DataLoader(TensorDataset(torch.randn(BATCH * BATCHES, WIDTH)), batch_size=BATCH)
    model, opt, loader = acc.prepare(model, opt, loader)
    marks("built")

    def train(x: torch.Tensor) -> None:
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()

    if method == "framework":
        step = 0
        saved = sorted((d for d in os.listdir(args.dir) if d.startswith("step_")), key=lambda d: int(d[5:]))
        if restart and saved:
            marks("resume_in")
            acc.load_state(os.path.join(args.dir, saved[-1]))
            step = int(saved[-1][5:])
            marks("resume_out")
        batches = accelerate.skip_first_batches(loader, step % len(loader)) if step else loader
        while True:
            for (x,) in batches:
                if restart:
                    marks.report_and_die(step)
                train(x)
                step += 1
                if step % args.every == 0:
                    acc.save_state(os.path.join(args.dir, f"step_{step}"))
                if step == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            batches = loader
    ft = FaultTolerantCheckpoint(acc, args.url, **ours_config(args, method))
    for _ in ft.epochs(100):
        for (x,) in ft.batches(loader):
            if restart:
                marks.report_and_die(ft.global_step)
            train(x)
            if ft.global_step + 1 == args.kill_at:  # the hook counts this step after the batch
                ft.manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit("the training ended without reaching its kill")


# -- the driver ------------------------------------------------------------------------------
def child(args: argparse.Namespace, where: dict[str, str], method: str, phase: str) -> dict[str, Any] | None:
    """Run one child process to its SIGKILL; its report (restart) or None (the training run)."""
    framework, kind = method.split(":")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--phase", phase, "--layers",
           str(args.layers), "--every", str(args.every), "--kill-at", str(args.kill_at), *sum(
               ([f"--{k.replace('_', '-')}", v] for k, v in where.items()), [])]
    if args.profile and phase == "restart":
        cmd += ["--profile", args.profile]
    env = {**os.environ, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "PYTHONWARNINGS": "ignore",
           "PYTHONPYCACHEPREFIX": args.pycache}  # every package from bytecode, as after an install (see main)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"{method} {phase} exited with {proc.returncode}:\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RECOVERY ")]
    return json.loads(lines[-1].removeprefix("RECOVERY ")) if lines else None


def drop_cache(root: str) -> None:
    """Evict every file under ``root`` from the page cache (where the OS allows it)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def breakdown(m: dict[str, float]) -> dict[str, float]:
    """The phases (seconds) of one restart from its marks (see the module's docstring); for the framework's own
    resume, ``load`` is its ``torch.load`` (Lightning) or ``load_state`` (Accelerate)."""
    start = m.get("resume_in", m["first_step"])
    end = m.get("resume_out", start)
    opened = m.get("open_in", start)
    loaded = m.get("load_out", end if "open_in" not in m else opened)
    phases = {"import": m["imported"], "build": m["built"] - m["imported"],
              "manager": m.get("manager_out", 0.0) - m.get("manager_in", 0.0), "find": opened - start,
              "load": loaded - opened, "restore": m["first_step"] - end}
    phases["other"] = m["first_step"] - sum(phases.values())
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48, help="Linear(1024, 1024) layers; 48 make ~600 MB with Adam")
    ap.add_argument("--repeats", type=int, default=3, help="restarts per method (fresh processes): best of these")
    ap.add_argument("--every", type=int, default=20, help="save every N steps")
    ap.add_argument("--kill-at", type=int, default=45, help="the step the training is killed at")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    ap.add_argument("--cold", action="store_true", help="drop local checkpoint files from the page cache first")
    ap.add_argument("--dir", default=None, help="local directory for the checkpoints (default: a temp dir)")
    ap.add_argument("--profile", default=None, help="with --methods M: write a cProfile of M's last restart here")
    for hidden in ("--child", "--phase", "--url", "--fast-dir", "--storage-options"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return (lightning_child if args.child.startswith("lightning") else accelerate_child)(
            args, args.child.split(":")[1])
    methods = args.methods.split(",")
    mb = args.layers * (WIDTH * WIDTH + WIDTH) * 4 * 3 / 1e6
    base = tempfile.mkdtemp(prefix="ft_recovery_", dir=args.dir)
    # Bytecode of every package is cached in one place of ours, filled by the training runs: where the environment
    # turns bytecode caching off (PYTHONDONTWRITEBYTECODE), an editable install would be compiled at every start.
    args.pycache = os.path.join(base, "pycache")
    shm = tempfile.mkdtemp(prefix="ft_recovery_fast_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    server = None
    try:
        wheres: dict[str, dict[str, str]] = {}
        for method in methods:
            folder = os.path.join(base, method.replace(":", "_"))
            where = {"dir": folder, "url": folder, "fast_dir": os.path.join(shm, method.replace(":", "_"))}
            if method.endswith(":gcs"):
                if server is None:
                    from ft_checkpoint.testing import servers

                    server = servers.start("gcs")
                bucket = f"recovery-{uuid.uuid4().hex[:8]}"
                server.make_bucket(bucket)
                where.update(url=f"gs://{bucket}/run", storage_options=json.dumps(server.storage_options))
            os.makedirs(folder)
            wheres[method] = where
            t0 = time.perf_counter()
            child(args, where, method, "train")
            print(f"trained and killed {method} at step {args.kill_at} in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        for _ in range(args.repeats):  # interleaved: load on a shared machine hits every method alike
            for method in methods:
                if args.cold:
                    drop_cache(wheres[method]["dir"])
                report = child(args, wheres[method], method, "restart")
                if report is None or report["step"] != args.every * (args.kill_at // args.every):
                    raise RuntimeError(f"{method}: the restart resumed at {report and report['step']}")
                runs[method].append(report)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    report_tables(args, methods, runs, mb)


def report_tables(args: argparse.Namespace, methods: list[str], runs: dict[str, list[dict[str, Any]]],
                  mb: float) -> None:
    cache = "cold (dropped before each restart)" if args.cold else "warm"
    print(f"\nrecovery time: restart to first training step, {mb:.0f} MB state ({args.layers} x Linear({WIDTH}, "
          f"{WIDTH}) + Adam), killed at step {args.kill_at}, resumed at {args.every * (args.kill_at // args.every)}; "
          f"best of {args.repeats} fresh processes, page cache {cache}")
    print(f"{'framework':<11}{'method':<44}{'best s':>8}{'median s':>10}{'vs framework':>14}{'peak MB':>9}")
    best = {m: min(r["first_step"] for r in runs[m]) for m in methods}
    for m in methods:
        framework, kind = m.split(":")
        label = LABELS["framework"][framework] if kind == "framework" else LABELS[kind]
        ref = best.get(f"{framework}:framework")
        ratio = f"{best[m] / ref:.2f}x" if ref else "-"
        median = statistics.median(r["first_step"] for r in runs[m])
        peak = max(r.get("peak_mb", 0) for r in runs[m])
        print(f"{framework:<11}{label:<44}{best[m]:>8.2f}{median:>10.2f}{ratio:>14}{peak:>9.0f}")
    print(f"\nthe best restart broken down (s): {', '.join(PHASES)} (see the docstring)")
    print(f"{'method':<22}" + "".join(f"{p:>9}" for p in PHASES) + f"{'total':>9}")
    for m in methods:
        marks = min(runs[m], key=lambda r: r["first_step"])
        phases = breakdown(marks)
        print(f"{m:<22}" + "".join(f"{phases[p]:>9.3f}" for p in PHASES) + f"{marks['first_step']:>9.2f}")
    print("targets: ours (local disk) <= 1.0x the framework's resume; fast tier <= 0.5x")


if __name__ == "__main__":
    main()
