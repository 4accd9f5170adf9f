"""A LightningCLI job whose every setting, FaultTolerantCheckpoint's included, comes from a YAML file.

    python tests/lightning/cli_script.py fit --config CONFIG.yaml

Used by ``test_cli.py``. The config may name two callbacks of this module (importable as ``cli_script``: the
script's folder is on ``sys.path``): ``Record(out)`` appends ``{"resumed_from", "global_step"}`` to
``OUT/runs.jsonl`` when training starts and writes ``OUT/final.pt`` (``lightning_ft.testing.final_state``)
at the end; ``KillAt(step)`` SIGKILLs the job's process group after that step, after every callback, once the
save in flight committed (run it with ``start_new_session=True``).
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from lightning_ft import FaultTolerantCheckpoint  # noqa: E402
from lightning_ft.testing import Data, Net, final_state  # noqa: E402


def _ours(trainer: pl.Trainer) -> FaultTolerantCheckpoint:
    return next(cb for cb in trainer.callbacks if isinstance(cb, FaultTolerantCheckpoint))


class Record(pl.Callback):
    """What the job resumed from, and its final state."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "runs.jsonl"), "a") as f:
            f.write(json.dumps({"resumed_from": _ours(trainer).resumed_from, "global_step": trainer.global_step}) + "\n")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(final_state(pl_module, trainer), os.path.join(self.out, "final.pt"))


class KillAt(pl.Callback):
    """SIGKILL the job after step ``step`` (from the module's batch-end hook, which runs after every callback)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        def kill(tr: pl.Trainer) -> None:
            if tr.global_step == self.step:
                _ours(tr).manager.wait()
                os.killpg(os.getpgid(0), signal.SIGKILL)
        pl_module.kill = kill  # type: ignore[assignment]


if __name__ == "__main__":
    LightningCLI(Net, Data)
