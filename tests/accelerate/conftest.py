"""Running the real training script (``train_script.py``) in a process, alone or under ``accelerate launch``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

from ft_checkpoint.testing import jobs

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_script.py")
TIMEOUT = 300  # generous: the machine is shared with other test runs
EPOCHS, SAMPLES, BATCH = 3, 96, 4
STEPS = EPOCHS * SAMPLES // BATCH  # micro-batches of a single-process run: 72


class Attempt(jobs.Finished):
    """A finished process (or launcher) of ``train_script.py``, with what its ranks reported."""

    def resumed_from(self, rank: int = 0) -> int | None:
        """``resumed_from`` of the last attempt of ``rank`` (after a launcher restart: the restarted one)."""
        return self.where(event="start", rank=rank)[-1]["resumed_from"]

    def summary(self, rank: int = 0) -> dict[str, Any]:
        """What a rank reported after training to the end."""
        return self.where(event="summary", rank=rank)[0]


def _attempt(job: jobs.Finished) -> Attempt:
    return Attempt(**{f.name: getattr(job, f.name) for f in dataclasses.fields(job)})


def run_script(out: str, *args: str, env: dict[str, str] | None = None) -> Attempt:
    """``python train_script.py OUT ARGS`` in one process."""
    os.makedirs(out, exist_ok=True)
    return _attempt(jobs.run(SCRIPT, out, *args, out=out, env=env, timeout=TIMEOUT))


def launch(out: str, *args: str, tmp_path, env: dict[str, str] | None = None, restarts: int = 3,
           launcher_args: tuple[str, ...] = ()) -> Attempt:
    """The script on 2 CPU ranks under ``accelerate launch --multi_gpu --max_restarts 3`` (or ``restarts``),
    with ``launcher_args`` added to the launcher's own.

    On a CPU-only machine ``ACCELERATE_USE_CPU=1`` is what gives 2 gloo ranks (without it both
    processes are rank 0).
    """
    os.makedirs(out, exist_ok=True)
    extra = {"ACCELERATE_USE_CPU": "1", "HF_HOME": str(tmp_path / "hf_home"), **(env or {})}  # no user config
    return _attempt(jobs.run(SCRIPT, out, *args, out=out, launcher="accelerate", nproc=2, restarts=restarts,
                             launcher_args=["--multi_gpu", *launcher_args], env=extra, timeout=TIMEOUT))


def final(out: str, rank: int = 0) -> dict[str, Any]:
    return torch.load(os.path.join(out, f"final_rank{rank}.pt"), weights_only=True)


def assert_bit_identical(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same weights and buffers, optimizer state, learning rate, next random numbers, and the same batches
    (sample indices and inputs, random augmentation included) after the resume, bit for bit."""
    assert got["global_step"] == want["global_step"]
    assert want["model"] and set(got["model"]) == set(want["model"])
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), f"weight {name} differs from the uninterrupted run"
    for fqn, state in want["optim"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(got["optim"]["state"][fqn][key], tensor), f"optimizer {fqn}.{key} differs"
    assert got["lr"] == want["lr"], "learning-rate schedule differs"
    assert torch.equal(got["probe"], want["probe"]), "RNG state at the end differs"
    n = len(got["seen"])
    assert got["seen"] == want["seen"][len(want["seen"]) - n:], "the resumed run saw other samples or another order"
    for i, (x, expected) in enumerate(zip(got["inputs"], want["inputs"][len(want["inputs"]) - n:])):
        assert torch.equal(x, expected), f"batch {i} after the resume differs (its random augmentation)"


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per set of arguments, cached for the session: ``reference(*args)``."""
    cache: dict[tuple[str, ...], dict[str, Any]] = {}

    def get(*args: str) -> dict[str, Any]:
        if args not in cache:
            out = str(tmp_path_factory.mktemp("reference"))
            attempt = run_script(out, "--dirpath", os.path.join(out, "ckpt"), *args)
            assert attempt.returncode == 0, attempt.explain()
            cache[args] = final(out)
        return cache[args]

    return get
