"""Accelerate's ``LocalSGD`` on 2 ranks (``accelerate launch``, CPU): between its averaging steps each rank's weights
differ, and it never averages an optimizer's state. A checkpoint holds one replicated copy, so a save where the ranks
disagree is refused, naming LocalSGD; saves on its averaging steps with a stateless optimizer resume exactly."""

from __future__ import annotations

import pytest

from tests.accelerate.conftest import launch
from tests.accelerate.test_launch import run_pair

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_local_sgd_with_adamw_is_refused_at_its_first_save_naming_local_sgd(tmp_path):
    """AdamW's moments differ by rank even on an averaging step: the save is refused (before, the HINT named only
    ``per_rank=``, which the Accelerate hook has no use for)."""
    run = launch(str(tmp_path / "out"), "--dirpath", str(tmp_path / "ckpt"), "--local-sgd", "4", "--interval", "4",
                 tmp_path=tmp_path, restarts=0)
    assert run.returncode != 0, run.explain()
    assert "differ across ranks" in run.stderr and "LocalSGD" in run.stderr, run.explain()
    assert "optimizers" in run.stderr, run.explain()


def test_local_sgd_saving_on_its_averaging_steps_resumes_exactly(tmp_path):
    """Plain SGD, ``LocalSGD(local_sgd_steps=4)`` made per epoch of 12 batches, a save every 4 steps: each save falls
    on an averaging step, and a resume restarts LocalSGD's count where the uninterrupted run's is a multiple of 4."""
    run_pair(tmp_path, "--local-sgd", "4", "--sgd", "--interval", "4")
