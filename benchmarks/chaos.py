"""Chaos trials: kill real training processes with SIGKILL at random instants, restart until done.

    python benchmarks/chaos.py --trials 100 --framework core

Each trial runs one training job (a real model, AdamW, dropout, random data, a save every few steps)
to completion through as many SIGKILLs as it takes. Each kill is aimed at a random moment of one kind:
during a training step, during staging, during the background write, between data and manifest,
during retention deletes, or during resume itself. After every restart the worker checks the state
it resumed against an uninterrupted reference run at that step (a corrupt load otherwise); at the
end the final weights must equal the reference's bit for bit. A checkpoint is lost when a restart
resumes from an older step than one that had committed. Prints one table.

Only ``--framework core`` is implemented here so far; the integrations follow the same protocol.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS, INTERVAL = 60, 4
AIMS = ("step", "staging", "writing", "data_written", "retention", "resuming")


def build() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": opt, "progress": {"step": 0}}


def train_step(state: dict) -> None:
    x = torch.randn(16, 32)
    loss = torch.nn.functional.mse_loss(state["model"](x), x[:, :1])
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["progress"]["step"] += 1


def weights(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def reference(ref_dir: str) -> None:
    """The uninterrupted run: weights at every checkpoint step and at the end."""
    state = build()
    for step in range(1, STEPS + 1):
        train_step(state)
        if step % INTERVAL == 0 or step == STEPS:
            torch.save(weights(state), os.path.join(ref_dir, f"{step}.pt"))


def worker(dirpath: str, ref_dir: str, pause: str | None) -> None:
    """One training process: resume, check what was loaded, train to the end, write final weights."""
    from ft_checkpoint import CheckpointManager

    def hook(phase: str, step: int) -> None:
        print(f"PHASE {phase} {step}", flush=True)
        if phase == pause:
            time.sleep(0.2)

    state = build()
    with CheckpointManager(dirpath, interval=INTERVAL, keep_last=2) as ckpt:
        ckpt.engine.phase_hook = hook
        start = ckpt.resume(state) or 0
        if start:
            expected = torch.load(os.path.join(ref_dir, f"{start}.pt"), weights_only=True)
            ok = all(torch.equal(expected[k], v) for k, v in state["model"].state_dict().items())
            print(f"RESUMED {start} {'OK' if ok else 'CORRUPT'}", flush=True)
        else:
            print("RESUMED 0 OK", flush=True)
        for step in range(start + 1, STEPS + 1):
            train_step(state)
            print(f"STEP {step}", flush=True)
            ckpt.maybe_save(step, state)
    torch.save(weights(state), os.path.join(dirpath, "final.pt"))
    print("DONE", flush=True)


def run_once(dirpath: str, ref_dir: str, aim: str, rng: random.Random) -> dict:
    """Start a worker and SIGKILL it at the aimed moment (or let it finish)."""
    pause = aim if aim in ("data_written", "retention", "resuming") else None
    cmd = [sys.executable, __file__, "--worker", dirpath, ref_dir] + ([pause] if pause else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = {"killed": False, "resumed": None, "corrupt": False, "committed": 0, "done": False}
    skip = rng.randint(0, 3)
    kill_at = None
    for line in proc.stdout:
        words = line.split()
        if not words:
            continue
        if words[0] == "RESUMED":
            out["resumed"], out["corrupt"] = int(words[1]), words[2] == "CORRUPT"
        elif words[0] == "DONE":
            out["done"] = True
        elif words[:2] == ["PHASE", "committed"]:
            out["committed"] = max(out["committed"], int(words[2]))
        if aim == "step" and words[0] == "STEP" and kill_at is None:
            kill_at = time.monotonic() + rng.uniform(0, 0.3)
        hit = (words[:2] == ["PHASE", aim]) if aim != "step" else (kill_at is not None and time.monotonic() >= kill_at)
        if hit:
            if skip:
                skip -= 1
                continue
            time.sleep(rng.uniform(0, 0.05))
            proc.send_signal(signal.SIGKILL)
            out["killed"] = True
            break
    proc.wait()
    return out


def trial(ref_dir: str, rng: random.Random, max_runs: int = 30) -> dict:
    dirpath = tempfile.mkdtemp(prefix="chaos_")
    stats = {"kills": 0, "resumes": 0, "lost": 0, "corrupt": 0, "exact": False}
    committed = 0
    try:
        for _ in range(max_runs):
            result = run_once(dirpath, ref_dir, rng.choice(AIMS), rng)
            if result["resumed"] is not None:
                stats["resumes"] += result["resumed"] > 0
                stats["lost"] += result["resumed"] < committed
                stats["corrupt"] += result["corrupt"]
            committed = max(committed, result["committed"])
            stats["kills"] += result["killed"]
            if result["done"]:
                final = torch.load(os.path.join(dirpath, "final.pt"), weights_only=True)
                expected = torch.load(os.path.join(ref_dir, f"{STEPS}.pt"), weights_only=True)
                stats["exact"] = all(torch.equal(expected[k], v) for k, v in final.items())
                break
    finally:
        shutil.rmtree(dirpath, ignore_errors=True)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--framework", choices=["core"], default="core")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.worker[2] if len(args.worker) > 2 else None)

    ref_dir = tempfile.mkdtemp(prefix="chaos_ref_")
    reference(ref_dir)
    rng = random.Random(args.seed)
    rows = [trial(ref_dir, rng) for _ in range(args.trials)]
    shutil.rmtree(ref_dir, ignore_errors=True)
    total = {k: sum(r[k] for r in rows) for k in ("kills", "resumes", "lost", "corrupt", "exact")}
    print(f"\n{'framework':<11}{'trials':>7}{'kills':>7}{'resumes':>9}{'bit-exact':>11}{'lost':>6}{'corrupt':>9}")
    print(f"{args.framework:<11}{len(rows):>7}{total['kills']:>7}{total['resumes']:>9}{total['exact']:>11}"
          f"{total['lost']:>6}{total['corrupt']:>9}")
    ok = total["exact"] == len(rows) and total["lost"] == 0 and total["corrupt"] == 0
    print("all runs bit-exact, no checkpoint lost, no corrupt load" if ok else "FAILURES above")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
