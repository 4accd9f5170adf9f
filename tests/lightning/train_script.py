"""Train ``models.Net`` with FaultTolerantCheckpoint in a real process; optionally SIGKILL the job on the way.

    python tests/lightning/train_script.py DIRPATH OUT [--devices 2] [--kill-at STEP --kill-how HOW] ...

``--kill-how``: ``batch_end`` (after the batch of step STEP, after every callback, so a save the policy
started at STEP is in flight), or ``writing`` (when the writer of the save of step STEP has written the
data but not the manifest). The kill is a SIGKILL of the whole process group: every rank dies at once,
as on a lost node. Run it with ``start_new_session=True``. ``--sigterm-at STEP`` sends SIGTERM instead
(a preemption notice: FaultTolerantCheckpoint saves the next batch and the job exits); ``--signal-in-step STEP``
sends ``--signal`` to rank 0 inside a training step (FaultTolerantCheckpoint makes the final save), and
``--signal-in-validation STEP`` inside the first validation step after step STEP; ``--signal-rank R`` sends it
from rank R to itself instead, ``--signal-group`` to every process of the job (as Slurm or a scheduler does),
``--signal-times N`` N times, 0.2 s apart. With
``--devices 2`` Lightning's DDP launcher starts rank 1 by running this script again (hence the ``__main__`` guard).

``--kill-after-commit`` makes a ``batch_end`` kill wait for the save in flight to commit first (the
resume step is then known). ``--loader``, ``--workers`` and ``--augment`` choose the train loader (see
``models.Data``); ``--seed`` is the ``seed_everything`` seed.

Rank 0 writes ``OUT/final.pt`` (``models.final_state``) at the end and every rank appends a line to
``OUT/runs.jsonl`` when training starts: ``{"rank", "resumed_from", "global_step"}``, and one line per
training batch to ``OUT/batches.rank<R>.jsonl``: ``{"step", "epoch", "batch_idx", "idx", "x"}`` (``idx``:
the samples' indices; ``x``: a hash of the input tensor, augmentation included).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import ft_checkpoint.testing.faults  # noqa: E402, F401 - registers faulty:// (tests use it as the dirpath)
from lightning_ft import FaultTolerantCheckpoint  # noqa: E402
from lightning_ft.testing import LOADERS, Data, Net, final_state, trainer  # noqa: E402


def kill_job() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)


class Record(pl.Callback):
    """Writes what each rank resumed from, and rank 0's final state."""

    def __init__(self, out: str, ft: FaultTolerantCheckpoint | None) -> None:
        self.out, self.ft = out, ft

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        line = {"rank": trainer.global_rank, "global_step": trainer.global_step,
                "resumed_from": self.ft.resumed_from if self.ft else None,
                "source": self.ft.manager.resumed_source if self.ft and self.ft.manager else None}
        with open(os.path.join(self.out, "runs.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object,
                             batch_idx: int) -> None:
        x, _, idx = batch
        line = {"step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                "idx": idx.tolist(), "x": hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]}
        with open(os.path.join(self.out, f"batches.rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            torch.save(final_state(pl_module, trainer), os.path.join(self.out, "final.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--interval", type=lambda v: int(v) if v.isdigit() else v, default=4,
                   help="steps, '30m', 'adaptive'")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-how", choices=["batch_end", "writing"], default="batch_end")
    p.add_argument("--kill-after-commit", action="store_true",
                   help="before a batch_end kill, wait for the save in flight to commit")
    p.add_argument("--loader", choices=LOADERS, default="shuffle")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--augment", action="store_true", help="randomness in Dataset.__getitem__")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sigterm-at", type=int, default=None, help="SIGTERM the job after this step")
    p.add_argument("--signal-in-step", type=int, default=None,
                   help="rank 0 sends itself --signal inside the training step that starts at this global step")
    p.add_argument("--signal-in-validation", type=int, default=None,
                   help="rank 0 sends itself --signal inside the first validation step after this global step")
    p.add_argument("--signal", default="SIGUSR1")
    p.add_argument("--signal-rank", type=int, default=0, help="the rank that sends --signal-in-step's signal")
    p.add_argument("--signal-group", action="store_true", help="send it to every process of the job")
    p.add_argument("--signal-times", type=int, default=1, help="send it this many times, 0.2 s apart")
    p.add_argument("--user-sigterm-marker", default=None, help="install a SIGTERM handler of the user's that writes this")
    p.add_argument("--save-on-exception", action="store_true")
    p.add_argument("--storage-options", default="{}", help="JSON")
    p.add_argument("--no-callback", action="store_true", help="train without FaultTolerantCheckpoint")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.user_sigterm_marker:
        signal.signal(signal.SIGTERM, lambda *_: open(args.user_sigterm_marker, "a").write("ran\n"))
    pl.seed_everything(args.seed, verbose=False)
    model, data = Net(), Data(num_workers=args.workers, loader=args.loader, augment=args.augment)
    ft = None if args.no_callback else FaultTolerantCheckpoint(
        args.dirpath, interval=args.interval, keep_last=3, storage_options=json.loads(args.storage_options),
        save_on_exception=args.save_on_exception)
    callbacks: list[pl.Callback] = [Record(args.out, ft)] + ([ft] if ft else [])
    extra = {"strategy": "ddp", "devices": args.devices} if args.devices > 1 else {}
    t = trainer(callbacks, max_epochs=args.epochs, enable_checkpointing=ft is not None, **extra)

    if args.kill_at is not None and args.kill_how == "batch_end":
        def kill(tr: pl.Trainer) -> None:
            if tr.global_step == args.kill_at and tr.is_global_zero:
                if args.kill_after_commit and ft is not None:
                    ft.manager.wait()
                kill_job()
        model.kill = kill
    if args.sigterm_at is not None:
        def term(tr: pl.Trainer) -> None:
            if tr.global_step == args.sigterm_at and tr.is_global_zero:
                os.killpg(os.getpgid(0), signal.SIGTERM)
        model.kill = term
    if args.signal_in_step is not None:
        def notice(tr: pl.Trainer) -> None:
            if tr.global_step == args.signal_in_step and tr.global_rank == args.signal_rank:
                for i in range(args.signal_times):
                    time.sleep(0.2 if i else 0)
                    if args.signal_group:
                        os.killpg(os.getpgid(0), signal.Signals[args.signal])
                    else:
                        os.kill(os.getpid(), signal.Signals[args.signal])
        model.in_step = notice
    if args.signal_in_validation is not None:
        def notice_in_validation(tr: pl.Trainer) -> None:
            if tr.global_step == args.signal_in_validation and tr.is_global_zero and not sent:
                sent.append(True)
                os.kill(os.getpid(), signal.Signals[args.signal])
        sent: list[bool] = []
        model.in_validation_step = notice_in_validation
    if args.kill_at is not None and args.kill_how == "writing":
        class ArmWriterKill(pl.Callback):
            def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                def hook(phase: str, step: int) -> None:
                    if phase == "data_written" and step == args.kill_at:
                        kill_job()
                if trainer.is_global_zero:
                    ft.manager.engine.phase_hook = hook
        t.callbacks.insert(0, ArmWriterKill())
    t.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
