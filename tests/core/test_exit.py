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


LAZY_LOOP = """
import sys, torch
sys.path.insert(0, {root!r})
from ft_checkpoint import CheckpointManager
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
opt = torch.optim.AdamW(model.parameters())
ckpt = CheckpointManager({url!r}, interval=3, writers=2)
state = {{"model": model, "optim": opt}}
for step in range(1, 6):
    if step == 4:
        raise ValueError("a bug in the training step after the save")
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.maybe_save(step, state)
"""


def test_an_uncaught_exception_right_after_a_save_still_commits_it(tmp_path):
    """The save of step 3 is in flight (its lazy copy settles at exit, two writer threads) when the loop raises:
    its write ran after Python's exit handler for ``concurrent.futures``, whose executors then refuse new work, and
    failed ("cannot schedule new futures after interpreter shutdown"): a restart started fresh."""
    url = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", LAZY_LOOP.format(root=ROOT, url=url)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ValueError" in proc.stderr, proc.stderr
    assert "failed too" not in proc.stderr, proc.stderr
    assert [e.get("step") for e in read_journal(Storage(url)) if e["event"] == "commit"] == [3], proc.stderr
