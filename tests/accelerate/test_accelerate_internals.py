"""Accelerate's private API that accelerate_ft relies on, exercised against the installed Accelerate.

If one of these fails after an Accelerate upgrade, accelerate_ft/_accelerate_internals.py needs
updating (the message says so); the rest of accelerate_ft only calls that module.
"""

from __future__ import annotations

import accelerate
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from accelerate_ft import _accelerate_internals as internals
from accelerate_ft.data import _IndexBatches

HINT = (f"accelerate {accelerate.__version__} changed a private API that accelerate_ft/_accelerate_internals.py "
        "relies on; update that module")


@pytest.fixture
def acc():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_what_the_accelerator_prepared_is_listed(acc):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    assert internals.models(acc) == [model], HINT
    assert internals.optimizers(acc) == [opt.optimizer] and type(opt.optimizer) is torch.optim.SGD, HINT
    assert [s.scheduler for s in internals.schedulers(acc)] == [sched.scheduler], HINT
    assert internals.registered(acc) == [counter], HINT


def test_a_rebuilt_prepared_loader_behaves_like_the_prepared_one(acc):
    loader = acc.prepare(torch.utils.data.DataLoader(torch.arange(10.0), batch_size=2, shuffle=True))
    assert internals.base_loader(loader) is loader.base_dataloader, HINT
    loader.set_epoch(3)
    rng = torch.get_rng_state()
    expected = [b.tolist() for b in loader]
    loader.set_epoch(3)
    torch.set_rng_state(rng)
    batches = _IndexBatches(internals.base_loader(loader).batch_sampler, skip=1)
    rebuilt = internals.rebuild(loader, batches)

    assert type(rebuilt) is type(loader) and rebuilt.iteration == 3, HINT
    assert rebuilt.device == loader.device and rebuilt.total_batch_size == loader.total_batch_size == 2, HINT
    assert len(rebuilt) == 4, HINT
    seen, ahead, ends = [], [], []
    for index, batch in enumerate(rebuilt, start=1):
        seen.append(batch)
        ahead.append(max(batches.fetched) - index)  # batches fetched beyond the one just handed out
        ends.append(acc.gradient_state.end_of_dataloader)
    assert ahead == [1, 1, 1, 0], f"the prepared loader no longer fetches exactly one batch ahead. {HINT}"
    assert ends == [False, False, False, True], f"end_of_dataloader (accumulation sync) changed. {HINT}"
    assert [b.tolist() for b in seen] == expected[1:], HINT


def test_a_rebuilt_plain_loader_and_a_main_process_one(acc):
    plain = torch.utils.data.DataLoader(range(6), batch_size=2, num_workers=2, prefetch_factor=3)
    assert internals.base_loader(plain) is plain
    rebuilt = internals.rebuild(plain, [[1, 0]], in_main_process=True)
    assert type(rebuilt) is torch.utils.data.DataLoader and rebuilt.num_workers == 0
    assert [b.tolist() for b in rebuilt] == [[1, 0]]
    prepared = acc.prepare(torch.utils.data.DataLoader(range(6), batch_size=2))
    assert [b.tolist() for b in internals.rebuild(internals.base_loader(prepared), [[5]], in_main_process=True)] == [[5]]


def test_a_stateful_loaders_iterator_made_at_prepare_is_dropped(acc):
    """``use_stateful_dataloader=True``: ``prepare`` made the first iterator (``state_dict()``), its workers' seed drawn
    then; dropped, the loader draws from the RNG at its first batch as the plain one ``rebuild`` gives does."""
    pytest.importorskip("torchdata")
    from accelerate.utils import DataLoaderConfiguration

    AcceleratorState._reset_state(True)
    stateful = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = stateful.prepare(torch.utils.data.DataLoader(range(8), batch_size=2, shuffle=True))
    base = internals.base_loader(loader)
    assert base is loader.base_dataloader and base._initial_iter_for_state_dict, HINT
    internals.drop_iterator_made_for_state_dict(loader)
    assert not base._initial_iter_for_state_dict, HINT
    rng = torch.get_rng_state()
    batches = [b.tolist() for b in loader]
    torch.set_rng_state(rng)
    rebuilt = internals.rebuild(loader, base.batch_sampler)
    assert type(rebuilt.base_dataloader) is torch.utils.data.DataLoader, HINT
    assert [b.tolist() for b in rebuilt] == batches, HINT


def test_loaders_it_cannot_rebuild_are_named_none(acc):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    assert internals.base_loader(acc.prepare(torch.utils.data.DataLoader(Stream(), batch_size=2))) is None
    assert internals.base_loader(range(3)) is None
    batch_sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(4)), 2, False)
    assert internals.base_loader(torch.utils.data.DataLoader(range(4), sampler=batch_sampler, batch_size=None)) is None


def test_shuffle_generators_are_synchronized(acc):
    generator = torch.Generator().manual_seed(3)
    loader = acc.prepare(torch.utils.data.DataLoader(range(8), batch_size=2, shuffle=True, generator=generator))
    internals.synchronize_shuffle(loader)  # one process: nothing to exchange, but the call must exist
    assert getattr(loader, "rng_types", None) is not None, HINT
