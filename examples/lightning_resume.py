"""Kill a Lightning training with SIGKILL, start it again, and watch it resume where it left off.

    python examples/lightning_resume.py

The script starts the training as a child process (this same file with ``--train``). The training uses
``FaultTolerantCheckpoint()`` with its default local dirpath (``<default_root_dir>/ft_checkpoints``;
the child runs in a fresh working directory) and saves every 10 steps in the background. Partway
through, the training is killed with SIGKILL right after a step (``--kill-after``; no clean shutdown,
like a lost node or an OOM kill), then the parent starts it again with the very same command:
``trainer.fit`` finds the newest verified checkpoint by itself and continues from it. At the end it
prints the step it resumed from, how many steps were computed twice, the newest checkpoint (the last
step: a clean end of ``fit`` saves it), and the mean training stall per save next to what a synchronous
``torch.save`` of the same state takes.

    python examples/lightning_resume.py --train [--steps N]

runs only the training job, in the current directory (checkpoints in ``./ft_checkpoints``), started
afresh or resumed from the newest checkpoint there; it prints one JSON event per line and ends with
``{"event": "done", ...}``, which carries the step it resumed from and the SHA-256 of the final model
weights, so that an interrupted and an uninterrupted run can be compared bit for bit. This is what
``examples/slurm/train.sbatch`` runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # run from a checkout without installing


def train(steps: int, crash_after: int | None = None) -> None:
    """The training job: a small MLP regression, 5 epochs of ``steps / 5`` batches; a fresh start
    SIGKILLs itself after step ``crash_after``."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ft_checkpoint.errors import Preempted
    from lightning_ft import FaultTolerantCheckpoint

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Dropout(0.1), nn.Linear(1024, 1024),
                                     nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def on_train_start(self) -> None:
            emit(event="start", resumed_from=ft.resumed_from, step=self.trainer.global_step)

        def on_train_batch_start(self, batch, batch_idx) -> None:  # step crash_after is done (and saved if due)
            if self.trainer.global_step == crash_after and ft.resumed_from is None:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean shutdown, a save may be in flight

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # a save at this step is reported next
            emit(event="step", step=self.trainer.global_step, stalls=ft.stalls[-1:] if saved() else [])

    def saved() -> bool:
        new = len(ft.stalls) > state["reported"]
        state["reported"] = len(ft.stalls)
        return new

    def emit(**fields) -> None:
        print(json.dumps(fields), flush=True)

    state = {"reported": 0}
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 16 // 5, 64, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=16, shuffle=True,
                      generator=torch.Generator().manual_seed(1))  # reproducible shuffling, resumed exactly
    ft = FaultTolerantCheckpoint(interval=10)  # the default dirpath: ./ft_checkpoints here
    trainer = pl.Trainer(max_epochs=5, accelerator="cpu", callbacks=[ft], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = Model()
    try:
        trainer.fit(model, data)
    except Preempted as stop:  # SIGTERM/SIGUSR1: the final save is committed (a Slurm job is requeued)
        emit(event="preempted", step=stop.step, reason=stop.reason, exit_code=stop.code)
        raise  # a SystemExit: the process exits with stop.code

    seconds = []
    for _ in range(3):  # Lightning's synchronous torch.save of the same state; the median of 3
        t0 = time.perf_counter()
        trainer.save_checkpoint("sync_save.ckpt")
        seconds.append(time.perf_counter() - t0)
    emit(event="done", step=trainer.global_step, resumed_from=ft.resumed_from, weights_sha256=weights_sha256(model),
         sync_save=sorted(seconds)[1], stalls=ft.stalls[state["reported"]:],  # the final save, at the end of fit
         newest=ft.saves[-1].step if ft.saves else ft.resumed_from)


def weights_sha256(model) -> str:
    """SHA-256 of every parameter and buffer, in ``state_dict`` order: equal only if bit for bit equal."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_train(workdir: str, steps: int, kill_after: int | None) -> list[dict]:
    """Run the training once (SIGKILLed after step ``kill_after``, if given). Returns what it reported."""
    crash = ["--crash-after", str(kill_after)] if kill_after is not None else []
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--train", "--steps", str(steps), *crash],
                          cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))})
    expected = -signal.SIGKILL if kill_after is not None else 0
    if proc.returncode != expected:
        raise SystemExit(f"the training exited with {proc.returncode}; run it with --train to see its output")
    return [json.loads(line) for line in proc.stdout.splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150, help="training steps in all (5 epochs)")
    p.add_argument("--kill-after", type=int, default=67, help="SIGKILL the training after this step")
    p.add_argument("--workdir", default=None, help="where the run lives (default: a new temporary directory)")
    p.add_argument("--train", action="store_true",
                   help="only run the training job, in the current directory (what a Slurm job runs)")
    p.add_argument("--crash-after", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train:
        train(args.steps, args.crash_after)
        return

    workdir = args.workdir or tempfile.mkdtemp(prefix="ft-lightning-")
    t0 = time.perf_counter()
    first = run_train(workdir, args.steps, args.kill_after)
    second = run_train(workdir, args.steps, None)
    elapsed = time.perf_counter() - t0

    killed_at = max(e["step"] for e in first if e["event"] == "step")
    start = next(e for e in second if e["event"] == "start")
    done = next(e for e in second if e["event"] == "done")
    stalls = [s for e in first + second if e["event"] in ("step", "done") for s in e["stalls"]]
    resumed = start["resumed_from"]
    print(f"checkpoints        {os.path.join(workdir, 'ft_checkpoints')}  (the default dirpath)")
    print(f"killed (SIGKILL)   after step {killed_at} of {done['step']}")
    print(f"resumed from       step {resumed}" if resumed is not None else "resumed from       nothing (fresh start)")
    print(f"steps recomputed   {killed_at - (resumed or 0)}")
    print(f"newest checkpoint  step {done['newest']} (a clean end of fit saves its last step)")
    print(f"stall per save     {1000 * sum(stalls) / max(1, len(stalls)):.1f} ms mean over {len(stalls)} saves "
          f"(training continues while the write runs)")
    print(f"sync torch.save    {1000 * done['sync_save']:.1f} ms for the same state (trainer.save_checkpoint, median of 3)")
    print(f"total              {elapsed:.1f} s for both runs")


if __name__ == "__main__":
    main()
