"""What decides an epoch's data order (lightning_ft/_data.py): found through Lightning's wrappers, put back exactly."""

from __future__ import annotations

import doctest

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, WeightedRandomSampler

from lightning_ft import _data
from lightning_ft._data import EpochStart, generators, sampler_seeds


def wrapped_loader(seed: int = 3) -> tuple[DataLoader, torch.Generator, torch.Generator]:
    """What Lightning makes of a custom sampler with a generator under DDP (rank 0 of 2)."""
    inner_g, loader_g = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    inner = WeightedRandomSampler(torch.linspace(1, 2, 16), 16, replacement=False, generator=inner_g)
    sampler = DistributedSamplerWrapper(inner, num_replicas=2, rank=0, seed=seed)
    return DataLoader(range(16), batch_size=2, sampler=sampler, generator=loader_g), inner_g, loader_g


def test_the_doc_example_runs():
    assert doctest.testmod(_data).failed == 0


def test_generators_and_seeds_are_found_through_lightnings_sampler_wrapper():
    loader, inner_g, loader_g = wrapped_loader()
    found = generators(loader)
    assert list(found) == ["generator", "sampler.dataset._sampler.generator"]
    assert found["generator"] is loader_g and found["sampler.dataset._sampler.generator"] is inner_g
    assert sampler_seeds(loader) == {"sampler.seed": 3}


def test_restore_replays_the_epoch_and_the_sampler_seed_through_a_checkpoint_state():
    loader, _, _ = wrapped_loader()
    loader.sampler.set_epoch(1)
    start = EpochStart.from_state(EpochStart.capture([loader]).to_state())
    first = [b.tolist() for b in loader]
    again, _, _ = wrapped_loader(seed=99)  # another process, given another seed
    again.sampler.set_epoch(1)
    next(iter(again))  # something already drew from its generators
    start.restore([again])
    assert again.sampler.seed == 3 and [b.tolist() for b in again] == first


def test_a_checkpoint_without_an_epoch_start_gives_none():
    assert EpochStart.from_state({}) is None
