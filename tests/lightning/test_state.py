"""The translation of Lightning's checkpoint dict for the core (lightning_ft/_state.py)."""

from __future__ import annotations

import argparse
import io
from collections import OrderedDict
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from ft_checkpoint import ConfigError
from ft_checkpoint.format.layout import committed_steps
from ft_checkpoint.state import split_tree
from ft_checkpoint.store.storage import Storage
from lightning_ft._state import PER_RANK_MAX_BYTES, from_core, to_core
from lightning_ft.testing import assert_same


def checkpoint() -> dict:
    return {
        "epoch": 1, "global_step": 7, "pytorch-lightning_version": "2.6.6",
        "state_dict": OrderedDict(w=torch.arange(6.0).reshape(3, 2), b=torch.zeros(2, dtype=torch.bfloat16)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "callbacks": {"EarlyStopping{'monitor': 'val_loss'}": {"best_score": torch.tensor(0.25), "wait_count": 1},
                      "Big": {"ema": torch.ones(PER_RANK_MAX_BYTES // 4 + 1)}},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": np.int64(2)}}}},
        "MyData": {"mean": np.arange(3, dtype=np.float32), "scale": np.float64(0.5)},
        "hyper_parameters": {"lr": 0.1, "ns": argparse.Namespace(depth=3), "fn": print, "tags": ["a", print]},
    }


def test_round_trip_through_a_weights_only_file():
    tree = to_core(checkpoint())
    tensors, skeleton = split_tree(tree)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    skeleton = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # what the core does per rank
    from ft_checkpoint.state import merge_tree

    back = from_core(merge_tree(skeleton, tensors))
    expected = checkpoint()
    assert_same(expected["state_dict"], back["state_dict"])
    assert_same(expected["optimizer_states"], back["optimizer_states"])
    assert_same(expected["callbacks"], back["callbacks"])
    assert back["loops"]["fit_loop"]["epoch_progress"]["total"]["ready"] == 2
    assert np.array_equal(back["MyData"]["mean"], expected["MyData"]["mean"]) and back["MyData"]["scale"] == 0.5
    assert back["hyper_parameters"] == {"lr": 0.1, "ns": {"depth": 3}}


def test_replicated_and_large_tensors_go_to_dcp_small_per_rank_ones_do_not():
    tensors, _ = split_tree(to_core(checkpoint()))
    assert set(tensors) == {"state_dict/w", "state_dict/b", "optimizer_states/0/state/0/step", "callbacks/Big/ema"}


def test_an_object_that_cannot_be_loaded_safely_is_named():
    ck = checkpoint()
    ck["callbacks"]["Mine"] = {"thing": object()}
    with pytest.raises(ConfigError, match=r"checkpoint\['callbacks'\]\['Mine'\]\['thing'\].*HINT"):
        to_core(ck)


class _Gan(pl.LightningModule):
    """Manual optimization: the discriminator steps every batch, the generator accumulates over 2 batches."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.d, self.g = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_d, opt_g = self.optimizers()
        opt_d.zero_grad()
        self.manual_backward(self.d(batch[0]).sum() + self.g(batch[0]).sum() / 2)
        opt_d.step()
        if batch_idx % 2 == 1:
            opt_g.step()
            opt_g.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.d.parameters(), lr=0.1), torch.optim.SGD(self.g.parameters(), lr=0.1)


def test_a_save_waits_for_a_batch_where_no_optimizer_holds_gradients_for_a_later_step(tmp_path):
    """The generator's gradients of an odd batch are in no checkpoint: a save there resumed without them and ended
    with other weights. Saves wait for the batches where it stepped (global steps 3, 6, 9, ...: 2 per such batch)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import FaultTolerantCheckpoint
    from lightning_ft.testing import trainer

    ft = FaultTolerantCheckpoint(str(tmp_path / "ckpt"), interval=1, keep_last=100, async_save=False)
    t = trainer([ft], max_epochs=1, val_check_interval=None)
    t.fit(_Gan(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
    assert t.global_step == 12 and committed_steps(Storage(str(tmp_path / "ckpt"))) == [3, 6, 9, 12]


class _Counting(pl.LightningModule):
    """Counts its training batches in a torchmetrics metric; raises at the start of batch ``crash_at``."""

    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        import torchmetrics

        self.net, self.batches, self.crash_at = torch.nn.Linear(4, 1), torchmetrics.SumMetric(), crash_at

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.crash_at:
            raise RuntimeError("the training failed")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batches.update(torch.tensor(1.0))
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_save_after_an_exception_leaves_out_metrics_that_counted_batches_after_its_safe_point(tmp_path, caplog):
    """``save_on_exception`` saves the last safe point (the end of batch 5, an optimizer step with
    ``accumulate_grad_batches=2``) while the metrics were taken as they were at the exception (the start of batch 7),
    with batch 6's ``update`` in them: the resume, at batch 6, counted it twice. They are left out of such a save, and
    the resume says that they start empty."""
    import logging

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import FaultTolerantCheckpoint
    from lightning_ft.testing import trainer

    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
    url = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="the training failed"):
        trainer([FaultTolerantCheckpoint(url, interval=1000, save_on_exception=True)], max_epochs=1,
                val_check_interval=None, accumulate_grad_batches=2).fit(_Counting(crash_at=7), loader)
    assert committed_steps(Storage(url)) == [3]
    caplog.set_level(logging.WARNING, logger="lightning_ft")
    model = _Counting()
    trainer([FaultTolerantCheckpoint(url, interval=1000)], max_epochs=1, val_check_interval=None,
            accumulate_grad_batches=2).fit(model, loader)
    assert "the torchmetrics metrics batches start empty in resumed epoch 0" in caplog.text, caplog.text
    assert float(model.batches.compute()) == 10, "the batches since the resume, none counted twice"
