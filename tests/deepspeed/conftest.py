"""DeepSpeed tests: skipped without the ``deepspeed`` extra; real processes under torchrun on CPU (gloo)."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from ft_checkpoint.testing.servers import free_port

if importlib.util.find_spec("deepspeed") is None:  # not imported here: this process runs every other test too
    pytest.skip("the deepspeed extra is not installed (DS_BUILD_OPS=0 pip install -e '.[deepspeed]')",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 600  # generous: the first DeepSpeed process of a machine compiles a small op (about 50 s)
SEED = int(os.environ.get("FT_TEST_SEED", "7"))
STEPS, INTERVAL = 12, 2
"""Steps of ``ds_train.py`` runs, and the save interval."""


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("FT_CHECKPOINT_")}
    out.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", **(extra or {})})
    return out


@dataclasses.dataclass
class Run:
    """A finished launcher: exit code, output, and what its ranks reported (``OUT/report.rank<R>.jsonl``)."""

    returncode: int
    stdout: str
    stderr: str
    out: str | None = None

    @property
    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for path in sorted(glob.glob(os.path.join(self.out or "", "report.rank*.jsonl"))):
            with open(path) as f:
                rows += [json.loads(line) for line in f]
        return rows

    def where(self, **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.rows if all(k in r and r[k] == v for k, v in match.items())]

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-8000:]}"


def torchrun(script: str, nproc: int, *args: Any, out: Any, restarts: int = 0,
             extra_env: dict[str, str] | None = None) -> Run:
    """``torchrun --nproc-per-node N --max-restarts R script ARGS`` (c10d rendezvous on a free port); the script
    reports into ``out``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts",
           str(restarts), "--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", os.path.join(HERE, script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                          env=env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(extra_env or {})}))
    return Run(proc.returncode, proc.stdout, proc.stderr, str(out))


def final(out: str, rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(out, f"final_rank{rank}.pt"), weights_only=True)


def assert_bit_exact(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Every tensor of ``want`` (a dict of flat dicts of tensors) equal in ``got``, bit for bit."""
    for part, tensors in want.items():
        assert set(got[part]) == set(tensors), f"{what}: {part} has other entries"
        for key, tensor in tensors.items():
            assert torch.equal(got[part][key], tensor), f"{what}: {part}[{key}] differs from the uninterrupted run"


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run (with its checks) of each configuration, once per session: ``(out, run)``."""
    cache: dict = {}

    def get(zero: int, ranks: int):
        if (zero, ranks) not in cache:
            base = tmp_path_factory.mktemp(f"ds-zero{zero}-{ranks}")
            run = torchrun("ds_train.py", ranks, "--zero", zero, "--dir", base / "ckpt", "--out", base / "out",
                           "--steps", STEPS, "--interval", INTERVAL, "--checks", out=base / "out")
            assert run.returncode == 0, run.explain()
            cache[zero, ranks] = (str(base), run)
        return cache[zero, ranks]

    return get
