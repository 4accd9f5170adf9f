"""Running the real training script (``train_script.py``) in a process, alone or under ``accelerate launch``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from ft_checkpoint.testing.servers import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_script.py")
TIMEOUT = 300  # generous: the machine is shared with other test runs
EPOCHS, SAMPLES, BATCH = 3, 96, 4
STEPS = EPOCHS * SAMPLES // BATCH  # micro-batches of a single-process run: 72


@dataclasses.dataclass
class Attempt:
    """One finished process (or launcher): exit code, output, and the FTTEST lines it printed."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def report(self) -> list[str]:
        return [line for line in self.stdout.splitlines() if line.startswith("FTTEST")]

    def resumed_from(self, rank: int = 0) -> int | None:
        """``resumed_from`` of the last attempt of ``rank`` (after a launcher restart: the restarted one)."""
        lines = [line for line in self.report if f"rank={rank} resumed_from=" in line]
        value = lines[-1].split("resumed_from=")[1].split()[0]
        return None if value == "None" else int(value)

    def summary(self, rank: int = 0) -> dict[str, Any]:
        """The JSON summary a rank prints after training to the end."""
        rows = [json.loads(line[len("FTTEST "):]) for line in self.report if line.startswith("FTTEST {")]
        return next(r for r in rows if r["rank"] == rank)

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_CHECKPOINT_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def run_script(out: str, *args: str, env: dict[str, str] | None = None) -> Attempt:
    """``python train_script.py OUT ARGS`` in one process."""
    os.makedirs(out, exist_ok=True)
    proc = subprocess.run([sys.executable, SCRIPT, out, *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env(env))
    return Attempt(proc.returncode, proc.stdout, proc.stderr)


def launch(out: str, *args: str, tmp_path, env: dict[str, str] | None = None) -> Attempt:
    """The script on 2 CPU ranks under ``accelerate launch --multi_gpu --max_restarts 3``.

    On a CPU-only machine ``ACCELERATE_USE_CPU=1`` is what gives 2 gloo ranks (without it both
    processes are rank 0). Restarts are reliable with the c10d rendezvous and an unshared TCP store.
    """
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--max_restarts", "3", "--rdzv_backend", "c10d", "--main_process_port", str(free_port()),
           SCRIPT, out, *args]
    extra = {"ACCELERATE_USE_CPU": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
             "HF_HOME": str(tmp_path / "hf_home"), **(env or {})}  # no user accelerate config
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env(extra))
    return Attempt(proc.returncode, proc.stdout, proc.stderr)


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
