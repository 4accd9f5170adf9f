"""A plain DeepSpeed training loop with CheckpointManager, for the end-to-end tests (run under torchrun).

    torchrun --nproc-per-node N [--max-restarts R] ds_train.py --zero Z --dir CKPT --out OUT [options]

Trains a tiny MLP with dropout (so each rank's RNG matters) with DeepSpeed's ZeRO stage ``Z`` (Adam and
a WarmupLR schedule from the DeepSpeed config), on batches drawn from a generator seeded by step and rank,
saving every ``--interval`` steps with ``state={"engine": engine}``.

``--kill "ATTEMPT:RANK:STEP:HOW,..."``: in restart ``ATTEMPT`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``)
rank ``RANK`` SIGKILLs itself: ``batch_end`` after ``maybe_save`` of step ``STEP`` (a save of that step
is in flight), ``writing`` when the background writer of the save of step ``STEP`` has written the
data but not the manifest. ``--checks`` (an uninterrupted run) then checks, each time in a copy of the
checkpoint directory resumed by a fresh engine: a save whose write was held back until training had gone
two steps further restores its own step (``--delay-step``); a flipped byte in the newest step's optimizer
partition makes the resume fall back one step; a newest step whose optimizer file was replaced by a
pickle payload (its manifest checksum recomputed) falls back too, and the payload never runs.

Each rank writes ``OUT/report.rank<R>.jsonl`` (its attempts and resumes; the checks) and
``OUT/final_rank<R>.pt``: its fingerprint (module, optimizer state, step counters) and the full weights.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import sys
import threading
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ft_checkpoint import CheckpointManager  # noqa: E402
from ft_checkpoint.format import layout

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


REPORT: list[str] = []


def report(**fields) -> None:
    """A line of ``OUT/report.rank<R>.jsonl`` (one file per rank: lines of two ranks never interleave)."""
    line = json.dumps({"rank": RANK, "attempt": ATTEMPT, **fields})
    print("FTTEST " + line, flush=True)
    with open(REPORT[0], "a") as f:
        f.write(line + "\n")


def make_engine(zero: int, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.01}},
              "zero_optimization": {"stage": zero}, "gradient_clipping": 1.0}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(1000 + RANK)  # dropout differs by rank; each rank's RNG state is checkpointed
    return engine


def train_step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(step * 100 + RANK)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def flat_tensors(tree, prefix: str, out: dict) -> dict:
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree.detach().clone()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            flat_tensors(v, f"{prefix}/{k}", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            flat_tensors(v, f"{prefix}/{i}", out)
    return out


def optimizer_state(engine) -> dict:
    """Each parameter's full fp32 master copy and Adam moments (DeepSpeed's public gatherers: a collective under
    ZeRO-3), and the optimizer's step counts. Not the raw ZeRO-3 partitions: their padding is uninitialized
    memory, different in every process."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).clone()
    steps = flat_tensors(engine.optimizer.state_dict(), "optim", {})
    out.update({k: v for k, v in steps.items() if k.endswith("/step")})
    return out


def fingerprint(engine, *, gathered: bool = False) -> dict:
    """This rank's view: module tensors, optimizer state, LR and counters, next random numbers.

    The optimizer state is this rank's ZeRO ``state_dict`` as it is, or with ``gathered`` each parameter's
    full fp32 copy and Adam moments (:func:`optimizer_state`: comparable across processes, but DeepSpeed can
    gather them only once a step ran after a load).
    """
    out = flat_tensors(engine.module.state_dict(), "module", {})
    out.update(optimizer_state(engine) if gathered else flat_tensors(engine.optimizer.state_dict(), "optim", {}))
    out["global_steps"] = torch.tensor(engine.global_steps)
    out["lr"] = torch.tensor(engine.get_lr())
    out["rng"] = torch.get_rng_state()
    return out


def full_weights(engine) -> dict:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def kill_plan(spec: str) -> dict:
    plan = {}
    for item in filter(None, spec.split(",")):
        attempt, rank, step, how = item.split(":")
        if int(attempt) == ATTEMPT and int(rank) == RANK:
            plan[how] = int(step)
    return plan


def die(why: str) -> None:
    report(killed=why)
    os.kill(os.getpid(), signal.SIGKILL)


def train(args, ckpt: CheckpointManager, engine, expected: dict) -> None:
    plan = kill_plan(args.kill)
    held = threading.Event()
    waited = {}

    def phase(name: str, step: int) -> None:
        if name == "data_written" and plan.get("writing") == step:
            die(f"writing step {step}")
        if args.checks and name == "writing" and step == args.delay_step:
            waited["ok"] = held.wait(120)  # the training goes on two steps before this write starts

    ckpt.engine.phase_hook = phase
    state = {"engine": engine}
    start = ckpt.resume(state) or 0
    report(resumed_from=ckpt.resumed_from)
    for step in range(start + 1, args.steps + 1):
        train_step(engine, step)
        if step == args.delay_step + 2:
            held.set()
        if ckpt.maybe_save(step, state) and args.checks:
            expected[step] = fingerprint(engine)
        if plan.get("batch_end") == step:
            die(f"after step {step}")
    ckpt.wait()
    if args.checks:
        report(delayed_write_waited=waited.get("ok"))


def copy_steps(src: str, dst: str, newest: int) -> None:
    """Rank 0: ``dst`` holds the committed steps of ``src`` up to ``newest``."""
    if RANK == 0:
        os.makedirs(dst)
        for d in glob.glob(os.path.join(src, "step_*")):
            if layout.parse_step(os.path.basename(d)) <= newest:
                shutil.copytree(d, os.path.join(dst, os.path.basename(d)))
    dist.barrier()


def resume_fresh(zero: int, url: str) -> tuple:
    engine = make_engine(zero, seed=99)  # other initial weights: what matches was loaded
    with CheckpointManager(url, interval=1000, announce=False) as ckpt:
        step = ckpt.resume({"engine": engine})
    return step, fingerprint(engine)


def same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def flip_a_byte(path: str) -> None:
    """Flip a byte in the middle of the largest tensor record of a torch.save zip file (torch does not notice)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        offset = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def forge(step_dir: str, name: str, marker: str) -> None:
    """Replace ``name`` by a pickle payload and recompute its size and checksum in the manifest."""
    path = os.path.join(step_dir, name)
    torch.save({"optimizer_state_dict": Payload(marker)}, path)
    with open(path, "rb") as f:
        data = f.read()
    manifest_path = os.path.join(step_dir, layout.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"][name] = {**manifest["files"][name], "size": len(data), "checksum": layout.checksum([data])}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def checks(args, expected: dict) -> None:
    base, world, newest = args.out, dist.get_world_size(), max(expected)
    previous = max(s for s in expected if s < newest)
    copy_steps(args.dir, os.path.join(base, "snapshot"), args.delay_step)
    step, got = resume_fresh(args.zero, os.path.join(base, "snapshot"))
    report(check="snapshot", step=step, ok=step == args.delay_step and same(got, expected[args.delay_step]))

    copy_steps(args.dir, os.path.join(base, "flipped"), newest)
    if RANK == 0:
        flip_a_byte(os.path.join(base, "flipped", layout.step_dir(newest),
                                 f"zero_pp_rank_{world - 1}_mp_rank_00_optim_states.pt"))
    dist.barrier()
    step, got = resume_fresh(args.zero, os.path.join(base, "flipped"))
    report(check="flipped", step=step, ok=step == previous and same(got, expected[previous]))

    marker = os.path.join(base, "payload-ran")
    copy_steps(args.dir, os.path.join(base, "forged"), newest)
    if RANK == 0:
        forge(os.path.join(base, "forged", layout.step_dir(newest)), "zero_pp_rank_0_mp_rank_00_optim_states.pt",
              marker)
    dist.barrier()
    step, got = resume_fresh(args.zero, os.path.join(base, "forged"))
    report(check="forged", step=step, ok=step == previous and same(got, expected[previous]),
           payload_ran=os.path.exists(marker))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--kill", default="")
    p.add_argument("--checks", action="store_true")
    p.add_argument("--delay-step", type=int, default=4)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    REPORT.append(os.path.join(args.out, f"report.rank{RANK}.jsonl"))
    engine = make_engine(args.zero)
    expected: dict = {}
    with CheckpointManager(args.dir, interval=args.interval, keep_last=100, announce=False) as ckpt:
        train(args, ckpt, engine, expected)
    torch.save({"fingerprint": fingerprint(engine, gathered=True), "full": full_weights(engine)},
               os.path.join(args.out, f"final_rank{RANK}.pt"))
    if args.checks:
        checks(args, expected)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
