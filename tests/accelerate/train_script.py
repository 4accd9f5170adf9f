"""A real Accelerate training loop with FaultTolerantCheckpoint, for the end-to-end tests.

    python train_script.py OUT [--dirpath D] [--epochs 3] [--ga 1] [--interval 3] [--kill-at N] ...
    accelerate launch --multi_gpu --num_processes 2 ... train_script.py OUT --kill-at N --kill-rank 1 --kill-first-attempt

Trains a small MLP with dropout (so the RNG matters), AdamW, a StepLR schedule and a shuffled
DataLoader whose samples carry their index. Options add the patterns of real scripts: random
augmentation inside ``Dataset.__getitem__`` (``--augment``, with ``--workers N``), BatchNorm
(``--batchnorm``), manual gradient accumulation without ``accelerator.accumulate`` (``--manual-accum N``,
as in Accelerate's ``complete_nlp_example.py``), an iterable dataset (``--iterable``), Accelerate's
``dispatch_batches`` (``--dispatch-batches``), and the README quickstart without ``with`` or
``close()`` (``--no-close``). ``--kill-at N`` SIGKILLs the process at the top of the
loop body of micro-batch N (counted over all epochs), so a save may be in flight; ``--signal-at N``
sends ``--signal`` (a preemption notice) there instead. Without ``--dirpath``
the checkpoint settings come only from ``FT_CHECKPOINT_*`` env vars. At the end each rank writes
``OUT/final_rank<R>.pt``: final weights, optimizer state, learning rate, the next random numbers, and
the sample indices and inputs this attempt trained on (an attempt restarted after the end keeps the one that
trained: ``keep_final``). What happened is reported into
``OUT/report.rank<R>.jsonl`` (``ft_checkpoint.testing.jobs``): a ``start``, a ``killed`` and a ``summary`` event.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.local_sgd import LocalSGD
from accelerate.utils import set_seed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ft_checkpoint.testing.faults  # noqa: E402, F401 - registers faulty:// (tests use it as the dirpath)
from accelerate_ft import FaultTolerantCheckpoint  # noqa: E402
from accelerate_ft.testing import IndexedData, toy_model  # noqa: E402
from ft_checkpoint.testing.jobs import report  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dirpath")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--interval", type=int)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--signal-at", type=int, help="send --signal to this process at the top of micro-batch N")
    p.add_argument("--signal", default="SIGUSR1")
    p.add_argument("--user-sigterm-marker", help="install a SIGTERM handler of the user's that writes this file")
    p.add_argument("--kill-first-attempt", action="store_true", help="kill only when TORCHELASTIC_RESTART_COUNT=0")
    p.add_argument("--fsdp2", action="store_true", help="shard the model with fully_shard (FSDP2) on CPU")
    p.add_argument("--seedable", action="store_true", help="Accelerate's seedable sampler (seed + epoch)")
    p.add_argument("--loader-generator", action="store_true", help="DataLoader(generator=...) owns the shuffle")
    p.add_argument("--augment", action="store_true", help="random augmentation inside Dataset.__getitem__")
    p.add_argument("--workers", type=int, default=0, help="DataLoader(num_workers=...)")
    p.add_argument("--iterable", action="store_true", help="the samples as an IterableDataset (no shuffle, no len)")
    p.add_argument("--dispatch-batches", action="store_true", help="DataLoaderConfiguration(dispatch_batches=True)")
    p.add_argument("--local-sgd", type=int, help="Accelerate's LocalSGD, averaging every N steps (made per epoch)")
    p.add_argument("--sgd", action="store_true", help="plain SGD (no state) instead of AdamW")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d layer (buffers that differ per rank)")
    p.add_argument("--manual-accum", type=int, help="step every N batches by hand, without accelerator.accumulate")
    p.add_argument("--no-close", action="store_true", help="the README quickstart: no `with`, no close()")
    p.add_argument("--fail-at-end", action="store_true", help="raise an exception after training (no close)")
    p.add_argument("--abort-at-exit", type=int, default=None, metavar="RANK",
                   help="in the first attempt, abort this rank after its end of training, as gloo's teardown may")
    return p.parse_args()


class Stream(torch.utils.data.IterableDataset):
    """The samples of ``data`` as a stream, in their order: an iterable dataset has no sampler and no len."""

    def __init__(self, data: IndexedData) -> None:
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def build_model(acc: Accelerator, fsdp2: bool, batchnorm: bool = False) -> torch.nn.Module:
    model = toy_model(batchnorm)
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (acc.num_processes,))
        for layer in [m for m in model if isinstance(m, torch.nn.Linear)]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def should_kill(args: argparse.Namespace, acc: Accelerator, position: int) -> bool:
    if args.kill_at is None or position != args.kill_at or acc.process_index != args.kill_rank:
        return False
    return not args.kill_first_attempt or first_attempt()


def first_attempt() -> bool:
    """Whether this is the launcher's first start of the job (not a restart)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, [opt.optimizer], options=StateDictOptions(full_state_dict=True))


def train(args: argparse.Namespace, acc: Accelerator, ft: FaultTolerantCheckpoint, model, opt, sched, loader,
          record: dict) -> None:
    """The training loop, each epoch under Accelerate's ``LocalSGD`` with ``--local-sgd``."""
    report(args.out, event="start", resumed_from=ft.resumed_from, epoch=ft.epoch, batches_done=ft.batches_done,
           source=ft.manager.resumed_source)
    per_epoch = -(-args.samples // 4) if args.iterable else len(loader)  # a stream has no len
    for _ in ft.epochs(args.epochs):
        with LocalSGD(acc, model, args.local_sgd) if args.local_sgd else contextlib.nullcontext() as local_sgd:
            train_epoch(args, acc, ft, model, opt, sched, loader, record, per_epoch, local_sgd)


def train_epoch(args: argparse.Namespace, acc: Accelerator, ft: FaultTolerantCheckpoint, model, opt, sched, loader,
                record: dict, per_epoch: int, local_sgd: LocalSGD | None) -> None:
    """One epoch: ``accelerator.accumulate`` (``--ga``), or manual accumulation (``--manual-accum``)."""
    for step, (x, y, index) in ft.enumerate(loader):
        if should_kill(args, acc, ft.epoch * per_epoch + ft.batches_done):
            report(args.out, event="killed", global_step=ft.global_step)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.signal_at == ft.epoch * per_epoch + ft.batches_done:
            os.kill(os.getpid(), signal.Signals[args.signal])  # a preemption notice
        record["seen"].append(index.tolist())
        record["inputs"].append(x.clone())
        record["ran"] += 1
        if args.manual_accum:  # complete_nlp_example.py: no accelerator.accumulate
            loss = torch.nn.functional.mse_loss(model(x), y) / args.manual_accum
            acc.backward(loss)
            if step % args.manual_accum == 0:
                opt.step()
                sched.step()
                opt.zero_grad()
            continue
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        if local_sgd is not None:
            local_sgd.step()


def keep_final(out: str, rank: int, result: dict, restarted_at_the_end: bool) -> None:
    """Write ``OUT/final_rank<R>.pt``, unless an earlier attempt of this job trained to the end and wrote it: a rank
    that aborts at exit makes the launcher restart every rank, which resume at the end and train nothing. The record
    of the attempt that trained stands, and this one must end in the same state.

    Gloo aborts so at times ("terminate called without an active exception", about 1 run in 90 with ``--fsdp2``):
    a worker thread of the default group still frees the last barrier, which holds the full state's all-gather and
    its tensors, when the interpreter finalizes; the tensors' release waits for the GIL and the thread is ended
    (seen in a core dump; pytorch/pytorch#179291)."""
    path = os.path.join(out, f"final_rank{rank}.pt")
    if not (restarted_at_the_end and os.path.exists(path)):
        torch.save(result, path)
        return
    from tests.accelerate.conftest import assert_bit_identical

    assert_bit_identical(result, torch.load(path, weights_only=True))


def main() -> None:
    args = parse()
    if args.user_sigterm_marker:
        signal.signal(signal.SIGTERM, lambda *_: open(args.user_sigterm_marker, "a").write("ran\n"))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    set_seed(0)
    data_config = DataLoaderConfiguration(use_seedable_sampler=args.seedable, dispatch_batches=args.dispatch_batches
                                          or None)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=args.ga, dataloader_config=data_config)
    data = IndexedData(args.samples, augment=args.augment)
    model = build_model(acc, args.fsdp2, args.batchnorm)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2) if args.sgd else torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    generator = torch.Generator().manual_seed(5) if args.loader_generator else None
    if args.iterable:
        loader = torch.utils.data.DataLoader(Stream(data), batch_size=4, num_workers=args.workers)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=generator,
                                             num_workers=args.workers)
    if args.fsdp2:  # Accelerate has no FSDP on CPU and would wrap the sharded model in DDP: register it as is
        opt, sched, loader = acc.prepare(opt, sched, loader)
        acc._models.append(model)
    else:
        model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    config = {"interval": args.interval} if args.interval else {}

    record = {"seen": [], "inputs": [], "ran": 0}
    ft = FaultTolerantCheckpoint(acc, args.dirpath, **config)
    if args.no_close:  # the README's quickstart: no `with`, no close()
        train(args, acc, ft, model, opt, sched, loader, record)
    else:
        with ft:
            train(args, acc, ft, model, opt, sched, loader, record)
    model_sd, optim_sd = full_state(model, opt)
    result = {"model": model_sd, "optim": optim_sd, "lr": sched.get_last_lr(), "probe": torch.rand(4),
              "seen": record["seen"], "inputs": record["inputs"], "global_step": ft.global_step}
    keep_final(args.out, acc.process_index, result, restarted_at_the_end=ft.resumed_from is not None
               and record["ran"] == 0)
    report(args.out, event="summary", ran=record["ran"], loaded=data.loaded, global_step=ft.global_step)
    acc.wait_for_everyone()
    if args.fail_at_end:
        raise RuntimeError("the script failed after training")
    acc.end_training()
    if args.abort_at_exit == acc.process_index and first_attempt():
        os.abort()


if __name__ == "__main__":
    main()
