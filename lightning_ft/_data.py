"""What decides a training epoch's data: the RNG states its iterator draws from, captured before it exists.

A ``DataLoader`` iterator draws, when it is created and at its first batch, from

* the torch RNG (``shuffle=True`` without a generator: ``RandomSampler``'s seed; the workers' base seed),
* ``DataLoader(generator=g)`` instead, when given (the shuffle of ``shuffle=True`` and the workers' seed),
* a sampler's own ``generator`` (``RandomSampler(data, generator=g)``, also inside Lightning's
  ``DistributedSamplerWrapper``),
* a ``DistributedSampler``'s ``seed`` plus its epoch (Lightning's default sampler under DDP, seeded from
  ``seed_everything``).

:class:`EpochStart` holds all of these as they were right before the epoch's iterator was created;
:meth:`EpochStart.restore` puts them back before the resumed epoch's iterator is created again, so
the resumed epoch draws the same order and worker seeds, and a generator is not drawn from twice.
Generator states are stored per rank, as bytes.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader(range(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    >>> start = EpochStart.capture([loader])
    >>> first = [b.tolist() for b in loader]
    >>> EpochStart.from_state(start.to_state()).restore([loader])
    >>> [b.tolist() for b in loader] == first
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import RandomSampler

from lightning_ft import _lightning_internals as internals
from lightning_ft._state import encode_tensor, from_core


def generators(dataloader: Any) -> dict[str, torch.Generator]:
    """The generators ``dataloader`` draws from, by attribute path; an object that fills several roles
    (``shuffle=True, generator=g`` makes ``g`` the sampler's too) is listed once, at its first path."""
    candidates = [("generator", getattr(dataloader, "generator", None))]
    candidates += [(f"{path}.generator", getattr(s, "generator", None)) for path, s in internals.samplers(dataloader)]
    found: dict[str, torch.Generator] = {}
    for path, g in candidates:
        if isinstance(g, torch.Generator) and all(g is not other for other in found.values()):
            found[path] = g
    return found


def draws_from_torch_rng(dataloader: Any) -> bool:
    """Whether a new iterator of ``dataloader`` draws from the global torch RNG: the shuffle of a ``RandomSampler``
    without a generator, or the workers' base seed of a loader without one.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> draws_from_torch_rng(DataLoader(range(4), shuffle=True)), draws_from_torch_rng(DataLoader(range(4)))
        (True, False)
    """
    if getattr(dataloader, "num_workers", 0) > 0 and getattr(dataloader, "generator", None) is None:
        return True
    return any(isinstance(s, RandomSampler) and s.generator is None for _, s in internals.samplers(dataloader))


def sampler_seeds(dataloader: Any) -> dict[str, int]:
    """The ``seed`` of each sampler that shuffles by seed and epoch (``DistributedSampler``), by path."""
    return {f"{path}.seed": s.seed for path, s in internals.samplers(dataloader)
            if isinstance(getattr(s, "seed", None), int) and callable(getattr(s, "set_epoch", None))}


@dataclasses.dataclass
class EpochStart:
    """The RNG states a training epoch's iterators draw from, as they were before the first was created."""

    torch_rng: torch.Tensor
    """The global torch RNG state."""
    loaders: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Per train loader: ``{"generators": {path: state}, "seeds": {path: seed}}``."""

    @classmethod
    def capture(cls, loaders: Sequence[Any]) -> EpochStart:
        """The states now (call right before the epoch's iterator is created)."""
        return cls(torch.get_rng_state(), [{"generators": {p: g.get_state() for p, g in generators(dl).items()},
                                            "seeds": sampler_seeds(dl)} for dl in loaders])

    def restore(self, loaders: Sequence[Any]) -> None:
        """Put the states back (before the epoch's iterator is created). A loader, generator or sampler
        that is not there any more (another world size, other loaders) is left as it is."""
        torch.set_rng_state(self.torch_rng)
        for saved, dl in zip(self.loaders, loaders):
            live = generators(dl)
            for path, state in saved["generators"].items():
                if path in live:
                    live[path].set_state(state)
            samplers = dict(internals.samplers(dl))
            for path, seed in saved["seeds"].items():
                sampler = samplers.get(path.removesuffix(".seed"))
                if sampler is not None and isinstance(getattr(sampler, "seed", None), int) and sampler.seed != seed:
                    rank_zero_info(f"FaultTolerantCheckpoint: the data order continues with the checkpoint's "
                                   f"{type(sampler).__name__} seed {seed} ({path}; this run was given {sampler.seed})")
                    sampler.seed = seed

    def to_state(self) -> dict[str, Any]:
        """Plain per-rank data for the checkpoint (``iter_rng`` is the key older checkpoints used)."""
        return {"iter_rng": encode_tensor(self.torch_rng),
                "loaders": [{"generators": {p: encode_tensor(s) for p, s in dl["generators"].items()},
                             "seeds": dict(dl["seeds"])} for dl in self.loaders]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpochStart | None:
        """The inverse of :meth:`to_state`; None for a checkpoint without one."""
        state = from_core(state)
        if state.get("iter_rng") is None:
            return None
        loaders = [{"generators": dict(dl.get("generators", {})), "seeds": dict(dl.get("seeds", {}))}
                   for dl in state.get("loaders", [])]
        return cls(state["iter_rng"], loaders)
