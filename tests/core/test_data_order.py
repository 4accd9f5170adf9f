"""A plain loop over a shuffled ``DataLoader`` (pytorch/examples' dcgan and mnist) on the core API: the core restores
the RNG as it was at the save, not at the epoch's start, so the resumed epoch's order must come from somewhere else.
The README's recipe (a ``torch.Generator`` for the shuffle, seeded per epoch; the resumed epoch's consumed batches
skipped) resumes bit-exactly after a SIGKILL; the loop without it does not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOP = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
from torch.utils.data import DataLoader, TensorDataset
from ft_checkpoint import CheckpointManager
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters())
recipe = {recipe}
g = torch.Generator()
loader = DataLoader(data, batch_size=8, shuffle=True, generator=g if recipe else None)
with CheckpointManager({url!r}, interval=3, async_save=False) as ckpt:
    state = {{"model": model, "optim": opt}}
    start = ckpt.resume(state) or 0
    for epoch in range(start // len(loader), 3):
        if recipe:
            g.manual_seed(1000 + epoch)  # the epoch's order, the same after a resume
        for i, (x, y) in enumerate(loader):
            step = epoch * len(loader) + i + 1
            if step <= start:
                continue  # consumed before the resume (loaded again: nothing random in this dataset)
            if step == {kill_at}:
                os.kill(os.getpid(), signal.SIGKILL)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            ckpt.maybe_save(step, state)
torch.save(model.state_dict(), {out!r})
"""


def run(tmp_path, name: str, recipe: bool, kill_at: int = -1) -> int:
    code = LOOP.format(root=ROOT, url=str(tmp_path / f"ckpt-{name}"), recipe=recipe, kill_at=kill_at,
                       out=str(tmp_path / f"{name}.pt"))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode


@pytest.mark.parametrize("recipe", [True, False])
def test_a_shuffled_loader_resumes_exactly_with_the_readmes_recipe_only(tmp_path, recipe):
    assert run(tmp_path, "ref", recipe) == 0
    assert run(tmp_path, "run", recipe, kill_at=14) == -9  # epoch 1, batch 6; resumes from step 12
    assert run(tmp_path, "run", recipe) == 0
    ref, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    same = all(torch.equal(ref[k], got[k]) for k in ref)
    assert same == recipe, "exact with the recipe, and only with it"
