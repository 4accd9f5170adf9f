"""Preemption in an Accelerate loop: a real signal mid-epoch, the final save, exit 0, exact resume."""

from __future__ import annotations

import pytest

from ft_checkpoint import read_journal
from ft_checkpoint.store.storage import Storage
from tests.accelerate.conftest import assert_bit_identical, final, run_script

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_signal_saves_that_step_exits_0_and_resumes_exactly(tmp_path, reference, sig):
    out, ckpt, marker = str(tmp_path / "out"), str(tmp_path / "ckpt"), tmp_path / "user-handler-ran"
    first = run_script(out, "--dirpath", ckpt, "--interval", "5", "--signal-at", "8", "--signal", sig,
                       "--user-sigterm-marker", str(marker))
    assert first.returncode == 0, first.explain()
    assert marker.exists() == (sig == "SIGTERM")  # the user's own SIGTERM handler still ran
    events = [e for e in read_journal(Storage(ckpt)) if e["event"] == "preempted"]
    assert [(e["step"], e["reason"]) for e in events] == [(9, sig)]  # micro-batch 8 is global step 9
    assert not first.where(event="summary")  # it exited, it did not train on
    second = run_script(out, "--dirpath", ckpt, "--interval", "5")
    assert second.returncode == 0 and second.resumed_from() == 9, second.explain()
    assert_bit_identical(final(out), reference("--interval", "5"))
