"""A DDP training worker for distributed tests, run under torchrun (gloo, CPU).

    torchrun --nproc-per-node 2 tests/helpers/dist_worker.py save  URL OUT_DIR
    torchrun --nproc-per-node N tests/helpers/dist_worker.py load  URL OUT_DIR
    torchrun --nproc-per-node 2 tests/helpers/dist_worker.py per_rank URL OUT_DIR
    torchrun --nproc-per-node 2 tests/helpers/dist_worker.py diverge URL OUT_DIR

``save`` trains 3 DDP steps, saves step 3 through CheckpointManager, and writes what every rank expects
to load (its state and the next random numbers) to OUT_DIR. ``load`` resumes on any number of ranks
and exits non-zero unless everything matches bit for bit. ``per_rank`` keeps a prefetched batch that
differs by rank, as nanoGPT-style loops do, in ``per_rank=`` and checks each rank gets its own back;
``diverge`` puts such a batch in the shared state and checks that the save fails naming it; ``mixed_types``
keeps nanoGPT's ``best_val_loss``, a 0-dim tensor on rank 0 (which evaluates) and a float on rank 1, and
checks that ``save`` refuses it on the calling thread, on both ranks, and that nothing was written; ``groups``
checks that closing the manager destroys its own gloo groups and leaves the default one; ``same_node_id`` checks
that two ranks with fast-tier folders of their own but one ``node_id`` are refused at the start.
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
    if mode in ("per_rank", "diverge", "mixed_types", "groups", "same_node_id"):
        globals()[mode](url, rank)
        dist.destroy_process_group()
        return
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


def per_rank(url: str, rank: int) -> None:
    """A batch prefetched per rank (nanoGPT's ``x, y = get_batch()`` before the loop) survives a resume."""
    state = make(seed=0)
    batch = {"x": torch.full((4, 8), float(rank)), "y": torch.arange(4) + 100 * rank}
    with CheckpointManager(url, interval=1) as ckpt:
        ckpt.save(1, state, per_rank={"batch": batch}, block=True)
    mine = {"batch": {"x": torch.zeros(4, 8), "y": torch.zeros(4, dtype=torch.int64)}}
    with CheckpointManager(url) as ckpt:
        assert ckpt.resume(make(seed=1), per_rank=mine) == 1
    assert torch.equal(mine["batch"]["x"], batch["x"]) and torch.equal(mine["batch"]["y"], batch["y"]), mine
    print(f"rank {rank}: own batch back", flush=True)


def diverge(url: str, rank: int) -> None:
    """The same batch in the shared state: it would come back as one rank's value everywhere."""
    from ft_checkpoint.errors import SaveError, StateMismatchError

    state = {**make(seed=0), "batch": torch.full((4, 8), float(rank))}
    with CheckpointManager(url, interval=1, on_save_error="warn") as ckpt:
        ckpt.save(1, state)
        try:
            ckpt.wait()
        except SaveError as e:
            assert isinstance(e.__cause__, StateMismatchError), repr(e.__cause__)
            print(f"rank {rank}: refused: {e}", flush=True)
        else:
            raise AssertionError("a tensor that differs across ranks was saved as replicated")
        assert ckpt.latest() is None


def mixed_types(url: str, rank: int) -> None:
    """nanoGPT evaluates on rank 0 only: ``best_val_loss`` is a tensor there and a float (1e9) elsewhere."""
    from ft_checkpoint.errors import StateMismatchError

    state = {**make(seed=0), "best_val_loss": torch.tensor(0.5) if rank == 0 else 1e9}
    with CheckpointManager(url, interval=1) as ckpt:
        try:
            ckpt.save(1, state)
        except StateMismatchError as e:
            print(f"rank {rank}: refused at the save: {e}", flush=True)
        else:
            raise AssertionError("save() accepted a key that is a tensor on one rank and a float on another")
        assert not ckpt.engine.in_flight and ckpt.latest() is None
        state["best_val_loss"] = float(state["best_val_loss"])  # what the HINT says: one type everywhere
        ckpt.save(2, state, block=True)
        assert ckpt.latest() == 2
    print(f"rank {rank}: saved once fixed", flush=True)



def groups(url: str, rank: int) -> None:
    """The manager's own gloo groups (and its fast tier's) are destroyed when it closes; the default group is the
    training's and stays."""
    fast = os.path.join(os.path.dirname(url), "fast")
    ckpt = CheckpointManager(url, interval=1, fast_dirpath=fast, fast_interval=1)
    ckpt.save(1, make(), block=True)
    ours = [ckpt.groups.writer, ckpt.groups.control, ckpt.fast.tier.writer]
    assert all(len(dist.get_process_group_ranks(g)) == 2 for g in ours)
    ckpt.close()
    for g in ours:
        try:
            dist.get_process_group_ranks(g)
        except (KeyError, ValueError, RuntimeError):
            continue
        raise AssertionError(f"rank {rank}: a checkpoint group outlived the manager's close")
    dist.barrier()  # the default group still works
    print(f"rank {rank}: our groups destroyed", flush=True)


def same_node_id(url: str, rank: int) -> None:
    """Two "machines" (a fast-tier folder each) given one ``node_id``: refused at the start on both ranks, naming it."""
    from ft_checkpoint import ConfigError

    fast = os.path.join(os.path.dirname(url), f"fast-{rank}")
    try:
        CheckpointManager(url, interval=1, fast_dirpath=fast, fast_interval=1, node_id="node-1")
    except ConfigError as e:
        print(f"rank {rank}: refused: {e}", flush=True)
        return
    raise AssertionError(f"rank {rank}: two folders under one node_id were taken for one node")


if __name__ == "__main__":
    main()
