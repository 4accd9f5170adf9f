"""An Accelerate training loop under the DeepSpeed plugin with accelerate_ft's FaultTolerantCheckpoint.

    accelerate launch --use_deepspeed --zero_stage Z --num_processes 2 --max_restarts 1 \\
        accelerate_train.py OUT --dirpath D [--kill-at N --kill-rank 1]

A small MLP with dropout (the RNG matters), AdamW and a StepLR schedule (stepped by Accelerate, not given
to DeepSpeed), a shuffled DataLoader of indexed samples, 3 epochs. On CPU the process group must be gloo
(``InitProcessGroupKwargs``), or every rank believes it is rank 0 of 1. ``--kill-at N``: in the first
attempt rank ``--kill-rank`` SIGKILLs itself at the top of micro-batch N (a save may be in flight); the
launcher restarts the group, which resumes. Each rank writes ``OUT/report.rank<R>.jsonl`` (its attempts and
resumes) and, at the end, ``OUT/final_rank<R>.pt``: its engine's fingerprint (module, ZeRO partition, Adam
state), the step, the learning rate, the next random numbers and the sample indices it trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs, set_seed  # noqa: E402

from accelerate_ft import FaultTolerantCheckpoint  # noqa: E402
from tests.deepspeed.ds_train import flat_tensors, optimizer_state  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dirpath", required=True)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-rank", type=int, default=1)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    rank = acc.process_index
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    loader = torch.utils.data.DataLoader(Indexed(48), batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    torch.manual_seed(100 + rank)  # dropout differs by rank
    ft = FaultTolerantCheckpoint(acc, args.dirpath, interval=args.interval, keep_last=100)

    def report(**fields) -> None:
        with open(os.path.join(args.out, f"report.rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"rank": rank, "attempt": ATTEMPT, **fields}) + "\n")

    report(resumed_from=ft.resumed_from, engine=type(model).__name__)
    seen, micro = [], 0
    for _epoch in ft.epochs(args.epochs):
        for x, y, idx in ft.batches(loader):
            micro += 1
            if args.kill_at == ft.global_step + 1 and rank == args.kill_rank and ATTEMPT == 0:
                report(killed=ft.global_step + 1)
                os.kill(os.getpid(), signal.SIGKILL)
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            seen += idx.tolist()
    ft.close()
    engine = model
    fingerprint = flat_tensors(engine.module.state_dict(), "module", {})
    fingerprint.update(optimizer_state(engine))
    torch.save({"fingerprint": fingerprint, "global_step": ft.global_step, "lr": sched.get_last_lr(),
                "probe": torch.rand(4), "seen": seen}, os.path.join(args.out, f"final_rank{rank}.pt"))
    report(done=ft.global_step)
    engine.destroy()  # before the process group ends (ZeRO may abort at exit otherwise)
    acc.end_training()


if __name__ == "__main__":
    main()
