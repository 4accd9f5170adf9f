"""Lightning with ``DeepSpeedStrategy(stage=...)`` on CPU ranks and FaultTolerantCheckpoint; optionally killed.

    python lightning_train.py DIRPATH OUT --stage Z [--devices 2] [--kill-at STEP]

``tests/lightning/models.Net`` (dropout, every RNG drawn in ``training_step``; no BatchNorm: under ZeRO 1/2
DeepSpeed saves rank 0's buffers only) on ``models.Data``, 3 epochs, a save every ``--interval`` steps.
Lightning's launcher starts rank 1 by running this script again. ``--kill-at STEP``: after the batch of
that step, rank 0 SIGKILLs the whole process group (run it with ``start_new_session=True``). Rank 0 writes
``OUT/final.pt`` at the end; every rank appends ``{"rank", "resumed_from", "global_step"}`` to
``OUT/runs.jsonl`` when training starts and one line per batch to ``OUT/batches.rank<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_ft import FaultTolerantCheckpoint  # noqa: E402
from lightning_ft.testing import Data, Net, trainer  # noqa: E402
from tests.deepspeed.ds_train import flat_tensors, optimizer_state  # noqa: E402
from tests.deepspeed.lightning_cpu import cpu_deepspeed_strategy  # noqa: E402


class Record(pl.Callback):
    def __init__(self, out: str, ft: FaultTolerantCheckpoint, kill_at: int | None) -> None:
        self.out, self.ft, self.kill_at = out, ft, kill_at

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        source = self.ft.manager.resumed_source if self.ft.manager is not None else None
        line = {"rank": trainer.global_rank, "global_step": trainer.global_step, "resumed_from": self.ft.resumed_from,
                "source": source}
        with open(os.path.join(self.out, "runs.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        line = {"step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                "idx": batch[2].tolist()}
        with open(os.path.join(self.out, f"batches.rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.kill_at and trainer.is_global_zero:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.deepspeed_engine
        state = flat_tensors(engine.module.state_dict(), "module", {})
        state.update(optimizer_state(engine))
        state["scheduler"] = torch.tensor(trainer.lr_scheduler_configs[0].scheduler.get_last_lr())
        state["step"] = torch.tensor(trainer.global_step)
        state["probe"] = torch.rand(4)
        torch.save(state, os.path.join(self.out, f"final.rank{trainer.global_rank}.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("out")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--kill-at", type=int)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    model, data = Net(batch_norm=False), Data()
    ft = FaultTolerantCheckpoint(args.dirpath, interval=args.interval, keep_last=3)
    t = trainer([Record(args.out, ft, args.kill_at), ft], max_epochs=3, devices=args.devices,
                strategy=cpu_deepspeed_strategy(args.stage, args.devices),
                deterministic=False)  # 4 times slower with DeepSpeed on CPU; the runs are compared bit for bit anyway
    t.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
