"""A DDP training worker for distributed tests, run under torchrun (gloo, CPU).

    torchrun --nproc-per-node 2 tests/helpers/dist_worker.py save  URL OUT_DIR
    torchrun --nproc-per-node N tests/helpers/dist_worker.py load  URL OUT_DIR

``save`` trains 3 DDP steps, saves step 3 through CheckpointManager, and writes what every rank expects
to load (its state and the next random numbers) to OUT_DIR. ``load`` resumes on any number of ranks
and exits non-zero unless everything matches bit for bit.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ft_checkpoint import CheckpointManager  # noqa: E402
from tests.helpers.toy import assert_same, flat, make, train_step  # noqa: E402


def build(rank: int) -> dict:
    state = make(seed=0, width=256)
    state["model"] = DDP(state["model"])
    state["progress"]["rank"] = rank  # per-rank, non-tensor
    torch.manual_seed(100 + rank)  # each rank draws its own data
    return state


def main() -> None:
    mode, url, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = build(rank if mode == "save" else 99)
    with CheckpointManager(url, interval=1) as ckpt:
        if mode == "save":
            for _ in range(3):
                train_step(state)
            ckpt.save(3, state, block=True)
            expected = {"state": flat(state), "rand": torch.rand(4)}
            torch.save(expected, os.path.join(out, f"expected_rank{rank}.pt"))
        else:
            assert ckpt.resume(state) == 3
            expected = torch.load(os.path.join(out, f"expected_rank{rank}.pt"), weights_only=True)
            assert_same(flat(state), expected["state"])
            assert torch.equal(torch.rand(4), expected["rand"]), "RNG state differs"
            print(f"rank {rank}/{world}: bit-exact", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
