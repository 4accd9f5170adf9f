"""Test support: a small Lightning model and data that make exact resume hard (dropout, BatchNorm, every RNG,
shuffling), for the tests, the chaos benchmark and your own checks of a resume.

``training_step`` draws from the torch, Python and NumPy RNGs, so a resume that restores any of them
wrongly changes the weights; it records which samples each batch held, so tests can compare data order.
:class:`Data` builds its train loader the ways user code does (see :data:`LOADERS`), optionally with
workers and with randomness in ``__getitem__`` (an augmentation).
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, WeightedRandomSampler

from lightning_ft import _lightning_internals as internals

LOADERS = ("shuffle", "generator", "sampler_generator", "weighted_generator")
"""How :class:`Data` shuffles: ``DataLoader(shuffle=True)`` (the global torch RNG), ``DataLoader(shuffle=True,
generator=torch.Generator().manual_seed(s))``, ``DataLoader(sampler=RandomSampler(ds, generator=...))``
(under DDP Lightning replaces a RandomSampler with a DistributedSampler), or a custom sampler with a
generator, ``WeightedRandomSampler(..., generator=...)`` (under DDP Lightning wraps it in a
``DistributedSamplerWrapper``)."""
LOADER_SEED = 1234


class IndexedData(Dataset):
    """``n`` fixed random samples; each item also carries its index. ``augment`` adds noise drawn from the
    torch and NumPy RNGs in ``__getitem__`` (in a worker: the worker's RNGs, seeded from the loader)."""

    def __init__(self, n: int = 96, seed: int = 0, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[i]
        if self.augment:
            x = x + 0.01 * torch.randn(8) + 0.01 * float(np.random.rand())
        return x, self.y[i], i


class Net(pl.LightningModule):
    """MLP with BatchNorm and dropout; AdamW and a step-interval StepLR."""

    def __init__(self, lr: float = 0.05, batch_norm: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32) if batch_norm else nn.Identity(), nn.ReLU(),
                                 nn.Dropout(0.3), nn.Linear(32, 1))
        self.seen: list[tuple[int, int, list[int]]] = []
        self.kill: Any = None
        """Called as ``kill(trainer)`` after every training batch, after all callbacks and the batch's save (tests
        use it to crash)."""
        self._batch_ended = False
        self.in_step: Any = None
        """Called as ``in_step(trainer)`` inside every ``training_step`` (tests send signals from there)."""
        self.in_validation_step: Any = None
        """Called as ``in_validation_step(trainer)`` inside every ``validation_step``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        if self.in_step is not None:
            self.in_step(self.trainer)
        self.seen.append((self.current_epoch, batch_idx, idx.tolist()))
        noise = (torch.rand(1).item() + random.random() + float(np.random.rand())) * 1e-3
        loss = nn.functional.mse_loss(self.net(x), y) + noise
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        if self.in_validation_step is not None:
            self.in_validation_step(self.trainer)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def on_train_epoch_end(self) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)  # set by fit (not in Trainer's type hints)
        if datamodule is not None:
            datamodule.train_epochs += 1

    def on_fit_start(self) -> None:
        # after the batch's save: FaultTolerantCheckpoint saves after this module's on_train_batch_end
        internals.after_module_batch_end(self.trainer, self._after_batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batch_ended = True

    def _after_batch(self) -> None:
        if self._batch_ended and self.kill is not None:
            self._batch_ended = False
            self.kill(self.trainer)

    def teardown(self, stage: str) -> None:
        internals.release_resume(self.trainer)  # undoes on_fit_start's hook too

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Data(pl.LightningDataModule):
    """Shuffled train loader (``loader``: one of :data:`LOADERS`), fixed val loader; counts its own epochs
    as datamodule state."""

    def __init__(self, batch_size: int = 8, num_workers: int = 0, loader: str = "shuffle",
                 augment: bool = False) -> None:
        super().__init__()
        assert loader in LOADERS, loader
        self.batch_size, self.num_workers, self.loader, self.augment = batch_size, num_workers, loader, augment
        self.train_epochs = 0

    def train_dataloader(self) -> DataLoader:
        data = IndexedData(96, augment=self.augment)
        kw: dict[str, Any] = dict(batch_size=self.batch_size, num_workers=self.num_workers)
        if self.loader == "generator":
            return DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(LOADER_SEED), **kw)
        if self.loader == "sampler_generator":
            return DataLoader(data, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(LOADER_SEED)),
                              **kw)
        if self.loader == "weighted_generator":  # every sample once per epoch, heavier ones earlier
            weights = torch.linspace(1.0, 2.0, len(data)).tolist()
            sampler = WeightedRandomSampler(weights, len(data), replacement=False,
                                            generator=torch.Generator().manual_seed(LOADER_SEED))
            return DataLoader(data, sampler=sampler, **kw)
        return DataLoader(data, shuffle=True, **kw)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedData(32, seed=1), batch_size=16)

    def state_dict(self) -> dict[str, Any]:
        return {"train_epochs": self.train_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_epochs = state["train_epochs"]


def trainer(callbacks: list[Any], **kw: Any) -> pl.Trainer:
    """A quiet CPU trainer; ``kw`` overrides the defaults."""
    args: dict[str, Any] = dict(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
                                val_check_interval=0.5)
    args.update(kw)
    return pl.Trainer(callbacks=callbacks, **args)


def final_state(model: pl.LightningModule, trainer: pl.Trainer) -> dict[str, Any]:
    """Everything a resume must get exactly right, in a form torch.save and torch.equal handle."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step, "epoch": trainer.current_epoch}


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


class Crash(Exception):
    """Raised inside training by a test, to interrupt a fit in-process."""


def fit(callbacks: list[Any], *, crash_at: int | None = None, ckpt_path: str | None = None,
        data: type[Data] = Data, **trainer_kw: Any) -> tuple[Net, Data, pl.Trainer, bool]:
    """Seed, build a fresh model and datamodule (``data``: :class:`Data` or a subclass), fit in this process;
    ``crash_at`` raises Crash after that step.

    Returns ``(model, data, trainer, crashed)``.
    """
    pl.seed_everything(0, verbose=False)
    model, datamodule = Net(), data()
    if crash_at is not None:
        def kill(t: pl.Trainer) -> None:
            if t.global_step == crash_at:
                raise Crash(f"crash after step {crash_at}")
        model.kill = kill
    t = trainer(callbacks, **trainer_kw)
    try:
        t.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except Crash:
        return model, datamodule, t, True
    return model, datamodule, t, False
