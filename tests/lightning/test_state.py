"""The translation of Lightning's checkpoint dict for the core (lightning_ft/_state.py)."""

from __future__ import annotations

import argparse
import io
from collections import OrderedDict

import numpy as np
import pytest
import torch

from ft_checkpoint import ConfigError
from ft_checkpoint.state import split_tree
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
