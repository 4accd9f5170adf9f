"""Chaos trials: kill real training processes with SIGKILL at random instants, restart until done.

    python benchmarks/chaos.py --trials 100 --framework core
    python benchmarks/chaos.py --trials 30 --framework lightning     # or accelerate, or all
    python benchmarks/chaos.py --trials 30 --transient-rate 0.1     # and 10% of storage calls fail

Each trial runs one training job (CPU, one process, a save every 4 steps, the newest 2 kept) to
completion through as many SIGKILLs as it takes. The job is one of:

- ``core``: ``CheckpointManager`` on a plain loop: an MLP with dropout, AdamW, random data, 60 steps;
- ``lightning``: a real ``Trainer`` with ``lightning_ft.FaultTolerantCheckpoint`` on the test suite's
  model (BatchNorm, dropout, draws from every RNG, a shuffled loader, validation twice an epoch), 36 steps;
- ``accelerate``: a real Accelerate loop with ``accelerate_ft.FaultTolerantCheckpoint``: an MLP with
  dropout, AdamW, StepLR, a shuffled loader, 36 steps.

Each run of the job is armed to SIGKILL itself at a random instant of one kind: during a training
step, during staging, during the background write, between data and manifest, during retention
deletes, or during resume itself. The core's phase hooks (``engine.phase_hook``) say when such a
moment starts; after a few of them (a random number) a timer thread sends the SIGKILL a random
fraction of the moment's usual length later, so the kill falls inside it wherever the moment runs.

The driver restarts the job until it finishes and checks every restart: it resumed from the newest
step that had committed (else a checkpoint was *lost*), and the weights it loaded equal those of an
uninterrupted run of the same job at that step (else the load was *corrupt*); at the end, the final
weights must equal the uninterrupted run's bit for bit. Prints one table row per framework and exits
1 on any failure (showing the failed trial's log).

With ``--transient-rate R`` the checkpoint directory is ``faulty://`` (``ft_checkpoint.testing.faults``): each
storage call fails with a transient error at rate R, on top of the kills, and every save must still
commit (``on_save_error="raise"``: a save that gives up crashes the run, which fails the trial).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ft_checkpoint.testing.faults  # noqa: E402, F401 - registers faulty:// (--transient-rate) in this process

FRAMEWORKS = ("core", "lightning", "accelerate")
INTERVAL, KEEP = 4, 2
AIMS = {"step": 0.01, "staging": 0.005, "writing": 0.025, "data_written": 0.003, "retention": 0.005,
        "resuming": 0.05}
"""The kinds of instant, each with about how long it lasts here (s): the kill comes uniformly within."""
SKIPS = {"step": 20, "resuming": 0}
"""At most how many occurrences of a kind to let pass before the kill (else 3: the saves of a run)."""
Weights = dict[str, torch.Tensor]


# -- in the training process -------------------------------------------------------------------
class Probe:
    """A training process's side of a trial: the aimed SIGKILL, and what the driver checks.

    Prints ``COMMITTED <step>``, ``RESUMED <step>`` (0: a fresh start) and ``DONE``; writes the weights
    it resumed and its final weights to ``out`` (with ``record``, every step's weights too).
    """

    def __init__(self, out: str, aim: str | None, skip: int, delay: float, record: bool) -> None:
        self.out, self.aim, self.skip, self.delay = out, aim, skip, delay
        self.steps: dict[int, Weights] | None = {} if record else None

    def phase(self, phase: str, step: int) -> None:
        """The engine's phase hook; the workers call it too, at each step (and Accelerate's resume)."""
        if phase == "committed":
            say(f"COMMITTED {step}")
        if phase != self.aim:
            return
        if self.skip:
            self.skip -= 1
            return
        self.aim = None
        timer = threading.Timer(self.delay, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()

    def resumed(self, step: int, weights: Weights) -> None:
        torch.save(weights, os.path.join(self.out, "resumed.pt"))
        say(f"RESUMED {step}")

    def stepped(self, step: int, weights: Weights) -> None:
        if self.steps is not None:
            self.steps[step] = {k: v.clone() for k, v in weights.items()}

    def done(self, weights: Weights) -> None:
        if self.steps is not None:
            torch.save(self.steps, os.path.join(self.out, "steps.pt"))
        torch.save(weights, os.path.join(self.out, "final.pt"))
        say("DONE")


def say(line: str) -> None:
    """One line to the driver, in one write (the writer thread prints too)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def core(ckpt: str, probe: Probe) -> None:
    from ft_checkpoint import CheckpointManager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt}
    with CheckpointManager(ckpt, interval=INTERVAL, keep_last=KEEP) as manager:
        manager.engine.phase_hook = probe.phase
        start = manager.resume(state) or 0
        probe.resumed(start, model.state_dict())
        for step in range(start + 1, 61):
            probe.phase("step", step)
            x = torch.randn(16, 32)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
            probe.stepped(step, model.state_dict())
            manager.maybe_save(step, state)
    probe.done(model.state_dict())


def lightning(ckpt: str, probe: Probe) -> None:
    import lightning.pytorch as pl

    from lightning_ft import FaultTolerantCheckpoint
    from lightning_ft.testing import Data, Net, trainer

    class ProbedNet(Net):
        def setup(self, stage: str) -> None:  # after every callback's setup (ft made its manager), before resume
            ft.manager.engine.phase_hook = probe.phase

        def on_train_start(self) -> None:
            probe.resumed(ft.resumed_from or 0, self.state_dict())

        def on_train_batch_start(self, *_: Any) -> None:
            probe.phase("step", self.trainer.global_step + 1)

        def on_train_batch_end(self, *_: Any) -> None:
            probe.stepped(self.trainer.global_step, self.state_dict())

    pl.seed_everything(0, verbose=False)
    model, ft = ProbedNet(), FaultTolerantCheckpoint(ckpt, interval=INTERVAL, keep_last=KEEP)
    trainer([ft], max_epochs=3).fit(model, datamodule=Data())
    probe.done(model.state_dict())


def accelerate(ckpt: str, probe: Probe) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from accelerate_ft import FaultTolerantCheckpoint
    from accelerate_ft.testing import toy_model

    set_seed(0)
    acc = Accelerator(cpu=True)
    model = toy_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    probe.phase("resuming", -1)  # the hook resumes as it is created
    with FaultTolerantCheckpoint(acc, ckpt, interval=INTERVAL, keep_last=KEEP) as ft:
        ft.manager.engine.phase_hook = probe.phase
        probe.resumed(ft.resumed_from or 0, model.state_dict())
        for _ in ft.epochs(3):
            for x, y in ft.batches(loader):
                probe.phase("step", ft.global_step + 1)
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
                probe.stepped(ft.global_step + 1, model.state_dict())
    probe.done(model.state_dict())


WORKERS = {"core": core, "lightning": lightning, "accelerate": accelerate}


# -- the driver --------------------------------------------------------------------------------
TRANSIENT_RATE = 0.0
"""``--transient-rate``: the rate of injected transient storage errors in the workers."""


def run(framework: str, tmp: str, *args: str) -> dict[str, Any]:
    """One training process on ``tmp/ckpt``, to its end or its SIGKILL; what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_CHECKPOINT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", FT_CHECKPOINT_ON_SAVE_ERROR="raise")
    ckpt = os.path.join(tmp, "ckpt")
    if TRANSIENT_RATE:
        ckpt = f"faulty://{ckpt}"
        env["FT_CHECKPOINT_STORAGE_OPTIONS"] = json.dumps({"transient_rate": TRANSIENT_RATE})
    cmd = [sys.executable, __file__, "--worker", framework, ckpt, tmp, *args]
    with open(os.path.join(tmp, "worker.log"), "a") as log:
        log.write(f"$ {' '.join(cmd[2:])}\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, timeout=300)
        except subprocess.TimeoutExpired:  # a hang: a failure, like a crash
            log.write("HUNG: killed after 300 s\n")
            proc = subprocess.CompletedProcess(cmd, 1, "")
    out = {"killed": proc.returncode == -signal.SIGKILL, "resumed": None, "committed": 0, "done": False}
    for key, _, value in (line.partition(" ") for line in proc.stdout.splitlines()):
        if key == "RESUMED" and value.isdigit():
            out["resumed"] = int(value)
        elif key == "COMMITTED" and value.isdigit():
            out["committed"] = max(out["committed"], int(value))
        elif key == "DONE":
            out["done"] = True
    return out


def same(a: Weights, b: Weights | None) -> bool:
    return b is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def load(tmp: str, name: str) -> Any:
    return torch.load(os.path.join(tmp, name), weights_only=True)


def reference(framework: str) -> dict[str, Any]:
    """An uninterrupted run of the job: its weights at every step and at the end."""
    tmp = tempfile.mkdtemp(prefix=f"chaos_ref_{framework}_")
    try:
        if not run(framework, tmp, "--record")["done"]:
            raise SystemExit(f"the uninterrupted {framework} run failed:\n{tail(tmp)}")
        return {"steps": load(tmp, "steps.pt"), "final": load(tmp, "final.pt")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tail(tmp: str, lines: int = 40) -> str:
    with open(os.path.join(tmp, "worker.log")) as f:
        return "".join(f.readlines()[-lines:])


def trial(framework: str, ref: dict[str, Any], rng: random.Random, max_kills: int) -> dict[str, int]:
    """Run the job to its end, each run armed to be killed at a random instant; count what went wrong."""
    tmp = tempfile.mkdtemp(prefix=f"chaos_{framework}_")
    stats = {"kills": 0, "resumes": 0, "lost": 0, "corrupt": 0, "exact": 0}
    committed = 0
    try:
        while True:
            args = []
            if stats["kills"] < max_kills:
                aim = rng.choice(list(AIMS))
                args = ["--aim", aim, "--skip", str(rng.randint(0, SKIPS.get(aim, 3))),
                        "--delay", f"{rng.uniform(0, AIMS[aim]):.4f}"]
            result = run(framework, tmp, *args)
            if result["resumed"] is not None:
                step = result["resumed"]
                stats["resumes"] += step > 0
                stats["lost"] += step < committed
                stats["corrupt"] += step > 0 and not same(load(tmp, "resumed.pt"), ref["steps"].get(step))
            committed = max(committed, result["committed"])
            stats["kills"] += result["killed"]
            if result["done"]:
                stats["exact"] = int(same(load(tmp, "final.pt"), ref["final"]))
            if result["done"] or not result["killed"]:
                break  # finished, or crashed (a failure, shown below)
        if not stats["exact"] or stats["lost"] or stats["corrupt"]:
            print(f"FAILED {framework} trial {stats}:\n{tail(tmp)}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100, help="trials per framework")
    ap.add_argument("--framework", choices=[*FRAMEWORKS, "all"], default="core")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-kills", type=int, default=30, help="SIGKILLs per trial at most; then a run to the end")
    ap.add_argument("--transient-rate", type=float, default=0.0,
                    help="also fail this fraction of storage calls with a transient error (faulty://)")
    ap.add_argument("--worker", nargs=3, metavar=("FRAMEWORK", "CKPT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--aim", help=argparse.SUPPRESS)
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        framework, ckpt, out = args.worker
        return WORKERS[framework](ckpt, Probe(out, args.aim, args.skip, args.delay, args.record))

    global TRANSIENT_RATE
    TRANSIENT_RATE = args.transient_rate
    rng = random.Random(args.seed)
    rows, ok = [], True
    for framework in FRAMEWORKS if args.framework == "all" else [args.framework]:
        start = time.monotonic()
        ref = reference(framework)
        stats = [trial(framework, ref, rng, args.max_kills) for _ in range(args.trials)]
        total = {k: sum(s[k] for s in stats) for k in ("kills", "resumes", "exact", "lost", "corrupt")}
        ok = ok and total["exact"] == args.trials and total["lost"] == 0 and total["corrupt"] == 0
        rows.append((framework, total, time.monotonic() - start))
    print(f"\n{'framework':<11}{'trials':>7}{'kills':>7}{'resumes':>9}{'bit-exact':>11}{'lost':>6}{'corrupt':>9}")
    for framework, t, _ in rows:
        print(f"{framework:<11}{args.trials:>7}{t['kills']:>7}{t['resumes']:>9}{t['exact']:>11}{t['lost']:>6}"
              f"{t['corrupt']:>9}")
    if TRANSIENT_RATE:
        print(f"with {TRANSIENT_RATE:.0%} of storage calls failing with a transient error")
    print("wall time: " + ", ".join(f"{framework} {seconds:.0f} s" for framework, _, seconds in rows))
    print("all runs bit-exact, no checkpoint lost, no corrupt load" if ok else "FAILURES above")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
