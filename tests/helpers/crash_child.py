"""A process that resumes, then saves a checkpoint every step until it is killed.

    python tests/helpers/crash_child.py URL [PAUSE_PHASE]

The state at step s is ``expected_state(s)`` exactly, so whoever resumes can check it bit for bit.
Each save phase is printed as ``PHASE <phase> <step>``; with PAUSE_PHASE the process sleeps 0.3 s in
that phase (to widen the window a killer aims at, e.g. ``data_written``: data on disk, no manifest yet).
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ft_checkpoint import CheckpointManager  # noqa: E402


def expected_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"weights": {"a": torch.randn(1024, 1024, generator=g), "b": torch.randn(4096, generator=g)},
            "progress": {"step": step, "history": list(range(step % 7))}}


def main() -> None:
    url = sys.argv[1]
    pause = sys.argv[2] if len(sys.argv) > 2 else None

    def hook(phase: str, step: int) -> None:
        print(f"PHASE {phase} {step}", flush=True)
        if phase == pause:
            time.sleep(0.3)

    ckpt = CheckpointManager(url, interval=1, keep_last=2)
    ckpt.engine.phase_hook = hook
    state = expected_state(0)
    step = ckpt.resume(state) or 0
    print(f"RESUMED {step}", flush=True)
    while True:
        step += 1
        fresh = expected_state(step)
        state["weights"]["a"].copy_(fresh["weights"]["a"])
        state["weights"]["b"].copy_(fresh["weights"]["b"])
        state["progress"] = fresh["progress"]
        ckpt.maybe_save(step, state)


if __name__ == "__main__":
    main()
