"""A DCGAN-style Accelerate loop with two optimizers at different rates (``test_exact.py``): the discriminator steps
every batch, the generator accumulates its gradients over 2 batches (stepped by the index from ``ft.enumerate``).

    python gan_script.py DIRPATH OUT [--kill-at N]

``--kill-at N`` SIGKILLs the process at the top of micro-batch N (counted over all epochs), with saves every 3 steps,
committed before the kill (synchronous saves). The end writes ``OUT/final.pt``: both models, both optimizers' states.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.nn import functional

from accelerate_ft import FaultTolerantCheckpoint


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("out")
    p.add_argument("--kill-at", type=int, default=-1)
    args = p.parse_args()
    acc = Accelerator(cpu=True)
    set_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(120, 8, generator=torch.Generator().manual_seed(1)))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)  # 15 batches: windows cross epochs
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(disc.parameters(), lr=1e-3)
    gen, disc, opt_g, opt_d, loader = acc.prepare(gen, disc, opt_g, opt_d, loader)
    with FaultTolerantCheckpoint(acc, args.dirpath, interval=3, async_save=False) as ft:
        for epoch in ft.epochs(3):
            for i, (real,) in ft.enumerate(loader):
                if epoch * len(loader) + i == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                fake = gen(torch.randn(real.size(0), 4))
                opt_d.zero_grad()
                loss_d = functional.softplus(-disc(real)).mean() + functional.softplus(disc(fake.detach())).mean()
                acc.backward(loss_d)
                opt_d.step()
                acc.backward(functional.softplus(-disc(fake)).mean() / 2)
                if i % 2 == 1:
                    opt_g.step()
                    opt_g.zero_grad()
    os.makedirs(args.out, exist_ok=True)
    torch.save({"gen": gen.state_dict(), "disc": disc.state_dict(), "opt_g": opt_g.state_dict(),
                "opt_d": opt_d.state_dict()}, os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    main()
