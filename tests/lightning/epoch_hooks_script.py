"""A Lightning job whose schedule depends on epoch-level hooks: ``ReduceLROnPlateau`` on ``val_loss``,
``StochasticWeightAveraging``, an ``EarlyStopping`` that stops in the middle of an epoch, or torchmetrics metrics
accumulated over an epoch, one of them monitored by ``ReduceLROnPlateau``, or state that the LightningModule's own
``on_train_batch_end`` changes (an EMA of the weights, a random draw, a hand-written weight decay), or a backbone that
``BackboneFinetuning`` unfreezes at epoch 1 (see ``test_epoch_hooks.py``).

    python tests/lightning/epoch_hooks_script.py DIRPATH OUT --pattern plateau [--kill-at STEP] [--no-callback]

Each training batch appends ``{"step", "epoch", "batch_idx", "lr", "x"}`` to ``OUT/batches.jsonl`` (a step trained
again after a resume appends again); the end writes ``OUT/final.pt`` (weights, buffers, optimizer, schedulers). ``--kill-at STEP``
SIGKILLs the job at the start of the batch after global step STEP, once the save in flight committed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import BackboneFinetuning, EarlyStopping, StochasticWeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft import FaultTolerantCheckpoint


class Net(pl.LightningModule):
    def __init__(self, plateau: bool, metrics: str | None = None, module_hooks: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
        self.plateau, self.metrics_file = plateau, metrics
        if metrics is not None:  # torchmetrics: one computed by hand at the epoch's end, one logged as an object
            self.train_mean, self.train_mae = torchmetrics.MeanMetric(), torchmetrics.MeanAbsoluteError()
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if module_hooks else None
        self.backbone = nn.Linear(8, 8)  # BackboneFinetuning freezes it until its unfreeze epoch
        self.register_buffer("scale", torch.ones(1))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is not None:  # Lightning calls this after every callback's on_train_batch_end
            self.ema.update_parameters(self.net)
            self.scale.copy_(1 + 0.1 * torch.rand(1))  # a draw here: the next batch's loss depends on it
            with torch.no_grad():
                for p in self.net.parameters():
                    p.mul_(0.999)  # weight decay by hand, outside the optimizer's step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        prediction = self.net(batch[0] + self.backbone(batch[0]))
        loss = nn.functional.mse_loss(prediction, batch[1]) * self.scale
        if self.metrics_file is not None:
            self.train_mean.update(loss.detach())
            self.train_mae(prediction.detach(), batch[1])
            self.log("train_mae", self.train_mae, on_step=False, on_epoch=True)
            return loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.metrics_file is None:
            return
        value = self.train_mean.compute()
        self.log("train_mean", value)
        self.train_mean.reset()
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps({"epoch": self.current_epoch, "train_mean": float(value)}) + "\n")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05)
        if not self.plateau:
            return opt
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
        monitor = "val_loss" if self.metrics_file is None else "train_mean"
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": monitor, "interval": "epoch"}}


class Record(pl.Callback):
    def __init__(self, args: argparse.Namespace, ft: FaultTolerantCheckpoint | None) -> None:
        self.args, self.ft = args, ft

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.args.kill_at and self.ft is not None and self.ft.manager is not None:
            self.ft.manager.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        row = {"step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": i,
               "lr": trainer.optimizers[0].param_groups[0]["lr"], "x": float(batch[0].sum())}
        with open(os.path.join(self.args.out, "batches.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save({"model": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                    "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                    "step": trainer.global_step}, os.path.join(self.args.out, "final.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("out")
    p.add_argument("--pattern", choices=["plateau", "swa", "early_stop", "torchmetrics", "module_hooks",
                                                "finetuning"], required=True)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--no-callback", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    x = torch.randn(96, 8)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    train = DataLoader(data, batch_size=8, shuffle=True)  # 12 batches per epoch
    val = DataLoader(data, batch_size=32)
    callbacks: list[pl.Callback] = []
    options: dict[str, Any] = {"max_epochs": 3}
    if args.pattern == "swa":  # averaging from epoch 0, SWALR annealing over 2 epochs
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=2))
        options["max_epochs"] = 4
    if args.pattern == "finetuning":
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5))
    if args.pattern == "early_stop":  # validation every 5 batches; stops inside an epoch
        callbacks.append(EarlyStopping(monitor="val_loss", patience=1, min_delta=0.01))
        options.update(max_epochs=20, val_check_interval=5)
    ft = None if args.no_callback else FaultTolerantCheckpoint(args.dirpath, interval=4, keep_last=20)
    trainer = pl.Trainer(callbacks=[Record(args, ft), *callbacks, *([ft] if ft else [])], accelerator="cpu",
                         devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, deterministic=True, enable_checkpointing=ft is not None, **options)
    metrics = os.path.join(args.out, "metrics.jsonl") if args.pattern == "torchmetrics" else None
    net = Net(plateau=args.pattern in ("plateau", "torchmetrics"), metrics=metrics,
              module_hooks=args.pattern == "module_hooks")
    trainer.fit(net, train, val)


if __name__ == "__main__":
    main()
