"""The data side of an exact resume: the sampler's epoch and the shuffle order of the resumed epoch.

A prepared DataLoader draws its shuffle order, depending on how it was prepared, from the global
torch RNG (one process), from a generator shared by all ranks (``synchronized_generator``, several
processes), from ``DataLoader(generator=...)``, or from ``data_seed + epoch`` (seedable sampler).
``save_state`` keeps none of these, so ``load_state`` + ``skip_first_batches`` replays a different
order. Here the states of all of them are captured when an epoch starts, saved with the checkpoint,
and put back before the resumed epoch's iterator is created; then the skipped batches are dropped at
the index level (``skip_first_batches``), never loaded nor run through the model.

Example:
    >>> import torch
    >>> loader = torch.utils.data.DataLoader(range(8), batch_size=2, shuffle=True)
    >>> start = capture_epoch_start(loader)
    >>> first = [b.tolist() for b in loader]
    >>> restore_epoch_start(loader, start)
    >>> [b.tolist() for b in loader] == first
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def encode_rng(state: torch.Tensor) -> str:
    """An RNG state as a hex string: plain data, so each rank keeps its own (tensors are deduplicated as replicated)."""
    return bytes(state.tolist()).hex()


def decode_rng(text: str) -> torch.Tensor:
    """The inverse of :func:`encode_rng`."""
    return torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)


def sampler_of(loader: Any) -> Any:
    """The innermost index sampler of a (prepared) DataLoader, or None."""
    node = getattr(loader, "batch_sampler", None) or getattr(loader, "sampler", None)
    for _ in range(4):  # BatchSamplerShard -> BatchSampler -> sampler
        if node is None:
            return None
        inner = getattr(node, "sampler", None)
        if inner is not None and not hasattr(inner, "batch_size"):
            return inner
        node = inner if inner is not None else getattr(node, "batch_sampler", None)
    return None


def generators(loader: Any) -> dict[str, torch.Generator]:
    """The generators the loader's order depends on, by role (one object may fill several roles)."""
    found = {
        "synchronized": getattr(loader, "synchronized_generator", None),
        "loader": getattr(loader, "generator", None),
        "sampler": getattr(sampler_of(loader), "generator", None),
    }
    return {role: g for role, g in found.items() if isinstance(g, torch.Generator)}


def capture_epoch_start(loader: Any) -> dict[str, str]:
    """The RNG states that decide the order of the epoch about to start: global torch RNG and generators."""
    states = {f"generator/{role}": encode_rng(g.get_state()) for role, g in generators(loader).items()}
    states["torch"] = encode_rng(torch.get_rng_state())
    return states


def restore_epoch_start(loader: Any, states: dict[str, str]) -> None:
    """Put back what :func:`capture_epoch_start` returned, before the epoch's iterator is created."""
    torch.set_rng_state(decode_rng(states["torch"]))
    for role, g in generators(loader).items():
        saved = states.get(f"generator/{role}")
        if saved is not None:
            g.set_state(decode_rng(saved))


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader (or its sampler, e.g. a ``DistributedSampler``) which epoch starts."""
    if callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(epoch)
        return
    sampler = getattr(loader, "sampler", None)
    if callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(epoch)


def remaining(accelerator: Any, loader: Iterable[Any], skip: int) -> Iterable[Any]:
    """``loader`` without its first ``skip`` batches (dropped by index, so never loaded)."""
    if skip <= 0:
        return loader
    try:
        if skip >= len(loader):  # type: ignore[arg-type]
            return ()  # resumed at the end of the epoch (an empty skip loader yields None on Accelerate 1.0)
    except TypeError:  # an iterable dataset: no length
        pass
    return accelerator.skip_first_batches(loader, skip)
