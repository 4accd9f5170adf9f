"""A plain PyTorch loop with ft-checkpoint: killed with SIGKILL partway, restarted, resumed exactly.

    python examples/core_resume.py [--dirpath checkpoints/core_example] [--steps 200] [--kill-at 130]

The parent starts the training as a child process, SIGKILLs it at step ``--kill-at``, starts it again
(it resumes by itself from the newest committed checkpoint), lets it finish, and then checks the final
weights against an uninterrupted run of the same training.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

from ft_checkpoint import CheckpointManager

INTERVAL = 20


def build() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    return {"model": model, "optim": opt, "sched": sched, "progress": {"step": 0}}


def train_step(state: dict) -> float:
    x = torch.randn(32, 64)
    y = x[:, :1] * 2 + 0.1 * torch.randn(32, 1)
    loss = torch.nn.functional.mse_loss(state["model"](x), y)
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()
    state["progress"]["step"] += 1
    return loss.item()


def worker(dirpath: str, steps: int, summary: str) -> None:
    """The training process: resume if possible, train, save every INTERVAL steps."""
    state = build()
    stalls = []
    with CheckpointManager(dirpath, interval=INTERVAL, keep_last=2) as ckpt:
        start = ckpt.resume(state) or 0
        print(f"START {start}", flush=True)
        for step in range(start + 1, steps + 1):
            loss = train_step(state)
            if ckpt.maybe_save(step, state):
                stalls.append(ckpt.last_save.stall)
            print(f"STEP {step} loss={loss:.4f}", flush=True)
    torch.save(state["model"].state_dict(), summary + ".weights.pt")
    with open(summary, "w") as f:
        json.dump({"start": start, "stalls": stalls}, f)


def run_child(args: argparse.Namespace, summary: str, kill_at: int | None) -> int:
    """Run one training process; SIGKILL it once it reports step ``kill_at``. Returns its last step."""
    cmd = [sys.executable, __file__, "--worker", "--dirpath", args.dirpath, "--steps", str(args.steps),
           "--summary", summary]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    last = 0
    for line in proc.stdout:
        if line.startswith("START"):
            print(f"  training process {proc.pid} started at step {line.split()[1]}")
        if line.startswith("STEP"):
            last = int(line.split()[1])
            if kill_at is not None and last >= kill_at:
                proc.send_signal(signal.SIGKILL)
                print(f"  SIGKILL at step {last} (a crash: no clean shutdown, no final save)")
                break
    proc.wait()
    return last


def torch_save_seconds(state: dict, path: str) -> float:
    t0 = time.perf_counter()
    torch.save({"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirpath", default=os.path.join("checkpoints", "core_example"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kill-at", type=int, default=130)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--summary", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")
    if args.worker:
        return worker(args.dirpath, args.steps, args.summary)

    shutil.rmtree(args.dirpath, ignore_errors=True)
    summary = os.path.join(os.path.dirname(os.path.abspath(args.dirpath)), ".core_example_summary.json")
    print(f"run 1: train {args.steps} steps, saving every {INTERVAL} to {args.dirpath}")
    killed_at = run_child(args, summary, args.kill_at)
    print("run 2: start again with the same command")
    run_child(args, summary, None)
    with open(summary) as f:
        result = json.load(f)

    reference = build()
    for _ in range(args.steps):
        train_step(reference)
    resumed = torch.load(summary + ".weights.pt", weights_only=True)
    exact = all(torch.equal(resumed[k], v) for k, v in reference["model"].state_dict().items())
    sync = torch_save_seconds(reference, summary + ".torch_save.pt")
    stall = sum(result["stalls"]) / max(1, len(result["stalls"]))
    for path in (summary, summary + ".weights.pt", summary + ".torch_save.pt"):
        os.remove(path)
    print("\nsummary")
    print(f"  killed at step {killed_at}, resumed from step {result['start']}: "
          f"{killed_at - result['start']} steps recomputed")
    print(f"  mean stall per save {stall * 1000:.1f} ms vs synchronous torch.save {sync * 1000:.1f} ms")
    print(f"  final weights identical to an uninterrupted run: {'yes' if exact else 'NO'}")
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
