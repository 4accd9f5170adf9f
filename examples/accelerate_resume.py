"""An Accelerate training loop with FaultTolerantCheckpoint: crash it, start it again, it resumes exactly.

Settings come from ``examples/accelerate_ft.yaml`` (named by ``FT_CHECKPOINT_CONFIG``) and can be
overridden by ``FT_CHECKPOINT_*`` env vars, e.g. ``FT_CHECKPOINT_DIRPATH=s3://bucket/run``.

One process (the first command is SIGKILLed at optimizer step 40; the second resumes and finishes)::

    python examples/accelerate_resume.py --crash-at-step 40
    python examples/accelerate_resume.py

Two ranks; the launcher restarts the group after the crash and it resumes by itself (on a CPU-only
machine ``ACCELERATE_USE_CPU=1`` is what makes two gloo ranks; on GPUs leave it out)::

    ACCELERATE_USE_CPU=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 accelerate launch --multi_gpu \\
        --num_processes 2 --max_restarts 3 --rdzv_backend c10d examples/accelerate_resume.py --crash-at-step 40

The last line prints a fingerprint of the final weights: an uninterrupted run into an empty directory
(``FT_CHECKPOINT_DIRPATH=/tmp/fresh python examples/accelerate_resume.py``) prints the same one.
Delete ``checkpoints/accelerate_resume`` to start over.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from accelerate_ft import FaultTolerantCheckpoint

# A job would set FT_CHECKPOINT_CONFIG in its environment; the example points at its own file.
os.environ.setdefault("FT_CHECKPOINT_CONFIG", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                           "accelerate_ft.yaml"))


def build(accelerator: Accelerator):
    """Model, optimizer, schedule and a shuffled loader of a small regression task."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(4096, 1, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def fingerprint(accelerator: Accelerator, model: torch.nn.Module) -> str:
    weights = accelerator.get_state_dict(model)
    return hashlib.sha256(b"".join(w.cpu().numpy().tobytes() for w in weights.values())).hexdigest()[:16]


def crash_now(args: argparse.Namespace, accelerator: Accelerator, ft: FaultTolerantCheckpoint) -> bool:
    """``--crash-at-step``: the last rank of a run that started fresh dies once that step is done."""
    return (args.crash_at_step is not None and ft.resumed_from is None and ft.global_step == args.crash_at_step
            and accelerator.process_index == accelerator.num_processes - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--crash-at-step", type=int, help="SIGKILL the last rank at this optimizer step (fresh runs only)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    set_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, train_loader, scheduler = build(accelerator)

    with FaultTolerantCheckpoint(accelerator) as ft:  # dirpath, interval, ... from the YAML file or env
        accelerator.print(f"start: global step {ft.global_step}, epoch {ft.epoch}, resumed from {ft.resumed_from}")
        for epoch in ft.epochs(args.epochs):
            for x, y in ft.batches(train_loader):
                if crash_now(args, accelerator, ft):
                    print(f"rank {accelerator.process_index}: SIGKILL after optimizer step {ft.global_step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean shutdown, a save may be in flight
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            accelerator.print(f"epoch {epoch} done: global step {ft.global_step}, loss {loss.item():.4f}")
    accelerator.print(f"done at global step {ft.global_step}; final weights {fingerprint(accelerator, model)}")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
