"""A small training job (single process, or DDP under torchrun) for preemption and restart tests.

    python tests/helpers/preempt_train.py DIRPATH OUT --steps 40 [--interval 10] [--step-time 0.05]
    torchrun --nproc-per-node 2 --max-restarts 3 tests/helpers/preempt_train.py DIRPATH OUT ...

Rank 0 prints ``RESUMED <step|none>`` at the start and ``STEP <n>`` after every step, and writes
``OUT/final.pt`` (the model's weights) at the end. The batch of step n depends only on (n, rank), so
a resumed run must end bit-identical to an uninterrupted one. ``--user-sigterm-marker PATH`` installs
a SIGTERM handler of the user's (it writes PATH) before the checkpoint manager exists.
``--kill-rank R --kill-at N``: rank R SIGKILLs itself after step N, in the first attempt only;
``--signal-rank R --signal-at N --signal SIGUSR1``: rank R sends itself the signal after step N.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ft_checkpoint import CheckpointManager  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps (room to signal)")
    p.add_argument("--user-sigterm-marker", default=None)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--signal-rank", type=int, default=0)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal", default="SIGUSR1")
    args = p.parse_args()
    if args.user_sigterm_marker:
        signal.signal(signal.SIGTERM, lambda *_: open(args.user_sigterm_marker, "a").write("ran\n"))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = torch.nn.parallel.DistributedDataParallel(net) if dist.is_initialized() else net
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = {"model": net, "optim": opt}
    with CheckpointManager(args.dirpath, interval=args.interval, keep_last=2) as ckpt:
        step = ckpt.resume(state) or 0
        if rank == 0:
            print(f"RESUMED {ckpt.resumed_from if ckpt.resumed_from is not None else 'none'}", flush=True)
        while step < args.steps:
            step += 1
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(8, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :1].sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_time)
            if rank == 0:
                print(f"STEP {step}", flush=True)
            if first_attempt and rank == args.kill_rank and step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == args.signal_rank and step == args.signal_at:
                os.kill(os.getpid(), signal.Signals[args.signal])
            ckpt.maybe_save(step, state)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(net.state_dict(), os.path.join(args.out, "final.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
