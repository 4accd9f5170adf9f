"""A small training job on CheckpointManager that can hang in the middle of a save, to be killed there.

    python tests/cli/train_script.py URL --steps 40 --interval 10 [--hang-at 30]

Prints ``START <resumed step>`` and ``STEP <n>`` lines. With ``--hang-at S`` (a save step), the save of
step S writes its data and then stalls before its manifest, and the training stops at step S too, like
a job stuck on storage: the parent SIGKILLs it on ``HANG S``. Step S is then a partial directory, the
last progress note of the attempt says S, and the next attempt resumes from ``S - interval`` and
recomputes exactly ``interval`` steps. Storage options come from ``FT_CHECKPOINT_STORAGE_OPTIONS``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ft_checkpoint import CheckpointManager  # noqa: E402


def build() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": opt, "progress": {"step": 0}}


def train_step(state: dict) -> float:
    x = torch.randn(16, 64)
    loss = torch.nn.functional.mse_loss(state["model"](x), x[:, :1])
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["progress"]["step"] += 1
    return loss.item()


def hang(message: str) -> None:
    print(message, flush=True)
    while True:
        time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--hang-at", type=int)
    args = ap.parse_args()
    state = build()
    with CheckpointManager(args.url, interval=args.interval, keep_last=3) as ckpt:
        def hook(phase: str, step: int) -> None:
            if phase == "data_written" and step == args.hang_at:
                hang(f"HANG {step}")

        ckpt.engine.phase_hook = hook
        start = ckpt.resume(state) or 0
        print(f"START {start}", flush=True)
        for step in range(start + 1, args.steps + 1):
            loss = train_step(state)
            ckpt.maybe_save(step, state, epoch=0, metadata={"loss": round(loss, 4)})
            print(f"STEP {step}", flush=True)
            if step == args.hang_at:
                hang(f"STUCK {step}")


if __name__ == "__main__":
    main()
