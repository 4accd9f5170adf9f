"""DeepSpeed tests: skipped without the ``deepspeed`` extra; real processes under torchrun on CPU (gloo)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

from ft_checkpoint.testing import jobs

if importlib.util.find_spec("deepspeed") is None:  # not imported here: this process runs every other test too
    pytest.skip("the deepspeed extra is not installed (DS_BUILD_OPS=0 pip install -e '.[deepspeed]')",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 600  # generous: the first DeepSpeed process of a machine compiles a small op (about 50 s)
SEED = int(os.environ.get("FT_TEST_SEED", "7"))
STEPS, INTERVAL = 12, 2
"""Steps of ``ds_train.py`` runs, and the save interval."""


ENV = {"DS_ACCELERATOR": "cpu"}
"""What every DeepSpeed job gets on top of ``jobs.job_env``."""

Run = jobs.Finished


def torchrun(script: str, nproc: int, *args: Any, out: Any, restarts: int = 0,
             extra_env: dict[str, str] | None = None) -> Run:
    """``torchrun --nproc-per-node N --max-restarts R script ARGS``; the script reports into ``out``."""
    return jobs.run(os.path.join(HERE, script), *args, out=out, launcher="torchrun", nproc=nproc, restarts=restarts,
                    env={**ENV, **(extra_env or {})}, timeout=TIMEOUT)


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
