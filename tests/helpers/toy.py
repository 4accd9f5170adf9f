"""A small, deterministic model + optimizer + scheduler, and exact comparisons, for tests."""

from __future__ import annotations

from typing import Any

import torch


def make(seed: int = 0, width: int = 32) -> dict[str, Any]:
    """A fresh training state (model, Adam, StepLR, counters); different seeds give different weights."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                torch.nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched, "progress": {"step": 0, "seen": []}}


def train_step(state: dict[str, Any]) -> None:
    """One step on random data drawn from the global RNG (so RNG state matters for exactness)."""
    model, opt = state["model"], state["optim"]
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    state["sched"].step()
    state["progress"]["step"] += 1
    state["progress"]["seen"].append(round(float(x[0, 0]), 6))


def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a (state_dict) tree by path, for exact comparison."""
    if hasattr(obj, "state_dict") and not isinstance(obj, dict):
        obj = obj.state_dict()
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}/{i}"))
        return out
    return {prefix: obj}


def assert_same(a: Any, b: Any) -> None:
    """Bit-exact equality of two states (tensors with torch.equal, dtype included)."""
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys(), sorted(set(fa) ^ set(fb))
    for k in fa:
        va, vb = fa[k], fb[k]
        if isinstance(va, torch.Tensor):
            assert isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and torch.equal(va, vb), k
        else:
            assert va == vb, (k, va, vb)
