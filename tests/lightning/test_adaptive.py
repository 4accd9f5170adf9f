"""The callback's default interval is the adaptive one, and it explains its decisions (log and logger)."""

from __future__ import annotations

import csv
import logging
import os
import re
import time

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval
from lightning_ft import FaultTolerantCheckpoint
from lightning_ft.testing import fit


class SlowSteps(pl.Callback):
    """50 ms per training step, so that a 1 s MTBF spans a few dozen steps."""

    def on_train_batch_end(self, *_: object) -> None:
        time.sleep(0.05)


def test_defaults_to_the_adaptive_interval_and_logs_its_decisions(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ft_checkpoint")
    logger = CSVLogger(tmp_path / "logs", name="run")
    cb = FaultTolerantCheckpoint(str(tmp_path / "ckpt"), mtbf="1s")  # no interval: adaptive
    fit([cb, SlowSteps()], logger=logger, log_every_n_steps=1)
    assert isinstance(cb.manager.adaptive, AdaptiveInterval)
    # The first save, planned with the guessed cost, measured it; the interval then changed, with reasons.
    assert re.search(r"checkpoint interval [\d.]+ s -> [\d.]+ s: save cost d=\d+\.\d+ s, MTBF M=", caplog.text)
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    decisions = [r for r in rows if r.get("ft_checkpoint/mtbf_s")]
    assert len(decisions) >= 2 and all(float(r["ft_checkpoint/interval_s"]) > 0 for r in decisions)
    assert float(decisions[-1]["ft_checkpoint/cost_s"]) < 60  # measured, no longer the guess
    assert len({r["ft_checkpoint/saved_step"] for r in rows if r.get("ft_checkpoint/saved_step")}) >= 2
