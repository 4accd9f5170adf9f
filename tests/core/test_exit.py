"""A manager left open at interpreter exit (a loop without ``with`` or ``close()``) is closed then: a clean
end, unless an uncaught exception ends the program. Before, a clean exit was journaled as a failure (fed
to the adaptive interval's failure rate) and the lease stayed behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ft_checkpoint.run.journal import read_journal
from ft_checkpoint.run.lease import LEASE
from ft_checkpoint.store.storage import Storage

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOP = """
import sys, torch
sys.path.insert(0, {root!r})
from ft_checkpoint import CheckpointManager
ckpt = CheckpointManager({url!r}, interval=2)
state = {{"w": torch.zeros(3)}}
start = ckpt.resume(state) or 0
for step in range(start + 1, 6):
    state["w"] += 1
    ckpt.maybe_save(step, state)
{ending}
"""


@pytest.mark.parametrize("ending,clean", [("", True), ("raise RuntimeError('the training failed')", False)])
def test_a_manager_left_open_is_closed_at_exit(tmp_path, ending, clean):
    url = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", LOOP.format(root=ROOT, url=url, ending=ending)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == (0 if clean else 1), proc.stderr
    events = [e["event"] for e in read_journal(Storage(url))]
    assert ("clean_end" in events) == clean, events
    assert not Storage(url).exists(LEASE), "the lease was left behind"
    assert events.count("commit") == 2  # steps 2 and 4, the last one drained at exit
