"""A training job for the fast-tier tests, run as 2 "nodes" (``jobs.run_nodes``): DDP, FSDP2 or a DeepSpeed engine
(ZeRO 1-3) on CPU.

    tiers_train.py OUT --model ddp|fsdp2|zero1|zero2|zero3 --steps N --crashes "5;7:lose=B;8:flip=own;13:die-copying" --refuse 1,2

Settings come from the environment as a user's would: ``FT_CHECKPOINT_DIRPATH``, ``FT_CHECKPOINT_FAST_DIRPATH``
(each node its own folder), ``FT_CHECKPOINT_INTERVAL``, ``FT_CHECKPOINT_FAST_INTERVAL``; ``FT_TEST_NODE`` names
the node (A, B). Each step's batch is drawn from a generator seeded by (step, rank), and dropout from each rank's
global RNG.

``--crashes`` gives, for each attempt (counted in the durable tier's journal: torchrun's restart count is not
the same on both nodes when it restarts one for a membership change), the step at which it ends and how:

- ``K``: once step K is committed on the fast tier, every rank SIGKILLs itself (the launchers restart them all);
  before that, ``lose=A+B`` makes those nodes lose their fast-tier folder, ``flip=own`` flips a byte of rank 0's
  part of step K on its node, ``flip=peer`` of the copy of it on the next node;
- ``K:die-copying``: during the transfer of step K's peer copies, the ranks of node B delete its folder and
  SIGKILL themselves (a node lost in the middle of a transfer).

In the attempts listed in ``--refuse`` every read of the durable tier's step data fails (``faulty://``'s
``refuse_reads``): their resume must come from the fast tier. Every rank reports ``resumed`` (step, source and
a digest of its state and RNG right after the resume) and ``step`` (the digest after each step's save).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ft_checkpoint.testing.faults  # noqa: E402, F401 - registers faulty:// in this process (the test's directory)
from ft_checkpoint import CheckpointManager  # noqa: E402
from ft_checkpoint.format import layout
from ft_checkpoint.testing.jobs import report  # noqa: E402
from ft_checkpoint.tiers import transfer  # noqa: E402
from tests.helpers import toy  # noqa: E402


def build(kind: str, world: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class Training:
    """The model and its optimizer as one stateful value, through DCP's state-dict helpers (as torchtitan and
    ``accelerate_ft`` do): under FSDP2 they give the optimizer's state as DTensors even before its first step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.optim = model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim}

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def step(self, step: int, rank: int) -> None:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        self.optim.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optim.step()


class DeepSpeedTraining:
    """A DeepSpeed engine (``tests/deepspeed/ds_train.py``'s model, Adam and schedule) at ZeRO stage ``zero``, in the
    state as the bare engine (the manager wraps it by itself)."""

    def __init__(self, zero: int) -> None:
        from tests.deepspeed import ds_train

        self.ds, self.engine = ds_train, ds_train.make_engine(zero)

    def step(self, step: int, rank: int) -> None:
        self.ds.train_step(self.engine, step)

    def fingerprint(self) -> dict:
        """Module, this rank's ZeRO optimizer state, step counters and LR (not the RNG: see :func:`digest`)."""
        out = self.ds.fingerprint(self.engine)
        out.pop("rng")
        return out


def digest(state: dict, training) -> str:
    """Every tensor's bytes (a DTensor's local shard), every other value of the state, and the RNG, hashed."""
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    flat = training.fingerprint() if hasattr(training, "fingerprint") else toy.flat(state["training"])
    for key in sorted(flat):
        value = flat[key]
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(key.encode() + local.detach().contiguous().numpy().tobytes())
        else:
            h.update(f"{key}={value!r}".encode())
    h.update(repr(state["progress"]).encode())
    return h.hexdigest()


def damage(ckpt: CheckpointManager, step: int, lose: list[str], flip: list[str]) -> None:
    """What ``--lose`` and ``--flip`` do to the fast tier at the crash (every rank calls it, between barriers)."""
    fast = ckpt.fast
    assert fast is not None
    dist.barrier()
    peer = fast.ring.peer(0)
    if ("own" in flip and ckpt.rank == 0) or ("peer" in flip and ckpt.rank == peer):
        path = os.path.join(fast.folder.storage(0).path(layout.step_dir(step)), "__0_0.distcp")
        with open(path, "r+b") as f:
            f.seek(40)
            byte = f.read(1)[0]
            f.seek(40)
            f.write(bytes([byte ^ 0x01]))
        print(f"rank {ckpt.rank}: flipped a byte of {path}", flush=True)
    dist.barrier()
    if os.environ["FT_TEST_NODE"] in lose and os.environ["LOCAL_RANK"] == "0":
        shutil.rmtree(fast.dirpath)
        print(f"node {os.environ['FT_TEST_NODE']}: lost its fast tier", flush=True)
    dist.barrier()


def die_while_copying(step: int) -> None:
    """On node B: after the first chunk of the peer transfer of ``step`` arrived, lose the folder and die."""
    drain = transfer.Incoming.drain
    transfer.CHUNK = 4096  # several rounds, so that the node dies in the middle of the transfer

    def dying(self: transfer.Incoming, view: memoryview) -> None:
        drain(self, view)
        if self.step == step:
            shutil.rmtree(os.environ["FT_CHECKPOINT_FAST_DIRPATH"], ignore_errors=True)
            os.kill(os.getpid(), signal.SIGKILL)

    transfer.Incoming.drain = dying  # type: ignore[method-assign]


def attempt_index() -> int:
    """How many attempts of this job started before this one (its journal's attempt folders), rank 0's count."""
    journal = os.path.join(os.environ["FT_CHECKPOINT_DIRPATH"].removeprefix("faulty://"), "journal")
    count = [len(os.listdir(journal)) if os.path.isdir(journal) else 0]
    dist.broadcast_object_list(count, src=0)
    return count[0]


def parse_crash(text: str) -> tuple[int | None, dict[str, list[str]]]:
    """``"7:lose=B:flip=own+peer"`` -> ``(7, {"lose": ["B"], "flip": ["own", "peer"]})``."""
    if not text:
        return None, {}
    step, *actions = text.split(":")
    return int(step), {k: v.split("+") if v else [] for k, _, v in (a.partition("=") for a in actions)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", choices=("ddp", "fsdp2", "zero1", "zero2", "zero3"), default="ddp")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--crashes", default="")
    p.add_argument("--refuse", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    attempt, crashes = attempt_index(), args.crashes.split(";")
    crash_at, how = parse_crash(crashes[attempt] if attempt < len(crashes) else "")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.model.startswith("zero"):
        training = DeepSpeedTraining(int(args.model[4:]))
        state = {"training": training.engine, "progress": {"step": 0}}
    else:
        training = Training(build(args.model, world))
        state = {"training": training, "progress": {"step": 0}}
    torch.manual_seed(100 + rank)
    if "die-copying" in how and os.environ["FT_TEST_NODE"] == "B":
        die_while_copying(crash_at)  # type: ignore[arg-type]
    data = ["*.distcp", "rank_*.pt", "metadata.json", "*_states.pt"]  # the last: DeepSpeed's files
    refused = {"refuse_reads": data} if str(attempt) in args.refuse.split(",") else {}
    with CheckpointManager(preemption_signals=(), storage_options=refused) as ckpt:
        start = ckpt.resume(state) or 0
        report(args.out, event="resumed", attempt=attempt, step=start, source=ckpt.resumed_source,
               digest=digest(state, training))
        for step in range(start + 1, args.steps + 1):
            training.step(step, rank)
            state["progress"]["step"] = step
            ckpt.maybe_save(step, state)
            report(args.out, event="step", attempt=attempt, step=step, digest=digest(state, training))
            if step == crash_at and "die-copying" not in how:
                ckpt.wait()
                damage(ckpt, step, how.get("lose", []), how.get("flip", []))
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
