"""Every use of Accelerate's private API in accelerate_ft, in one place.

Accelerate offers no public way to do two things the hook needs:

1. list what an ``Accelerator`` prepared or registered (``_models``, ``_optimizers``, ``_schedulers``,
   ``_custom_objects``);
2. build a loader that behaves like a prepared one (device placement, one batch fetched ahead to know
   the last one, the shared shuffle generator, gradient-accumulation sync at the end) but takes its
   batches of indices from another batch sampler: what ``skip_first_batches`` does inside, through
   ``DataLoaderShard``'s constructor and its ``device``, ``rng_types``, ``synchronized_generator``,
   ``iteration``, ``_drop_last``, ``_non_blocking`` and ``use_stateful_dataloader`` attributes.

Under ``use_stateful_dataloader=True`` a third: torchdata's private ``_initial_iter_for_state_dict``
says whether Accelerate's ``state_dict()`` call at ``prepare`` left an iterator made in advance.

Each use is a small function here. ``tests/accelerate/test_accelerate_internals.py`` exercises every
one against the installed Accelerate and fails, naming this module, when a release changes one.

Example:
    >>> import torch
    >>> loader = torch.utils.data.DataLoader(range(6), batch_size=2)
    >>> [b.tolist() for b in rebuild(loader, [[5, 4], [1]])]
    [[5, 4], [1]]
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

if TYPE_CHECKING:
    from accelerate import Accelerator

# DataLoader arguments that are not about which indices go into a batch: copied from the loader (each is
# stored under its own name). The batch sampler replaces batch_size, shuffle, sampler and drop_last.
_INDEX_ARGS = {"self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}
_LOADER_ARGS = [name for name in inspect.signature(DataLoader.__init__).parameters if name not in _INDEX_ARGS]


# -- what the accelerator prepared -----------------------------------------------------------------
def models(accelerator: Accelerator) -> list[torch.nn.Module]:
    """The models ``accelerator.prepare`` returned (wrapped: DDP, FSDP), in order."""
    return list(accelerator._models)


def optimizers(accelerator: Accelerator) -> list[torch.optim.Optimizer]:
    """The raw torch optimizers inside the prepared ``AcceleratedOptimizer``\\ s, in order."""
    return [getattr(o, "optimizer", o) for o in accelerator._optimizers]


def schedulers(accelerator: Accelerator) -> list[Any]:
    """The prepared learning-rate schedulers (Accelerate's wrappers, which have ``state_dict``)."""
    return list(accelerator._schedulers)


def registered(accelerator: Accelerator) -> list[Any]:
    """The objects passed to ``accelerator.register_for_checkpointing``."""
    return list(accelerator._custom_objects)


# -- loaders ---------------------------------------------------------------------------------------
def _shard_class() -> type | None:
    try:
        from accelerate.data_loader import DataLoaderShard
    except ImportError:
        return None
    return DataLoaderShard


def _stateful_class() -> type | None:
    """torchdata's ``StatefulDataLoader``, if torchdata is imported (there is none of them otherwise)."""
    return getattr(sys.modules.get("torchdata.stateful_dataloader"), "StatefulDataLoader", None)


def base_loader(loader: Any) -> DataLoader | None:
    """The torch ``DataLoader`` that reads ``loader``'s map-style dataset by batches of indices, or None.

    That is ``loader`` itself, or the one inside a loader prepared by ``accelerator.prepare`` on a
    single node (``DataLoaderShard``): a plain one, or torchdata's ``StatefulDataLoader`` (under
    ``use_stateful_dataloader=True``), a subclass whose iterators draw from the RNG and read batches
    as a plain one's do. None for anything else: an iterable dataset, a dispatching loader
    (``dispatch_batches``), a ``BatchSampler`` passed as ``sampler``.
    """
    shard = _shard_class()
    if shard is not None and type(loader) is shard:
        loader = loader.base_dataloader
    if type(loader) not in (DataLoader, _stateful_class()) or isinstance(loader.dataset, IterableDataset):
        return None
    if loader.batch_sampler is None or isinstance(loader.sampler, BatchSampler):
        return None
    return loader


def from_torchdata(loader: Any) -> bool:
    """Whether ``loader`` holds torchdata's samplers (a ``StatefulDataLoader`` given to ``prepare``), or is or holds
    its ``StatefulDataLoader`` and :func:`base_loader` finds none (an iterable dataset, ``dispatch_batches``): not
    resumed exactly. torchdata's ``RandomSampler`` draws a permutation whenever an iterator of it is created, which
    a loader with workers does twice an epoch and a resume's run through a finished epoch once. A ``DataLoader``
    prepared with ``use_stateful_dataloader=True`` is not from torchdata here: torch's samplers, a ``base_loader``."""
    loaders = [loader, getattr(loader, "base_dataloader", None)]
    samplers = [getattr(p, name, None) for p in loaders for name in ("sampler", "batch_sampler")]
    samplers += [getattr(p, "sampler", None) for p in samplers]
    parts = samplers if base_loader(loader) is not None else loaders + samplers
    return any(type(p).__module__.startswith("torchdata") for p in parts if p is not None)


def drop_iterator_made_for_state_dict(loader: Any) -> None:
    """Make torchdata's ``StatefulDataLoader`` (inside ``loader``, or ``loader``) create its next iterator when
    iterated, as a ``DataLoader`` does, rather than reuse one a ``state_dict()`` call made in advance.

    Accelerate's ``DataLoaderAdapter.__init__`` calls it at ``prepare``: the first epoch's iterator (and its
    workers) are made there, their seed drawn from the torch RNG at ``prepare``, not when the epoch starts.
    ``load_state_dict({})`` drops that iterator (a state loaded before is kept).
    """
    inner = getattr(loader, "base_dataloader", loader)
    if getattr(inner, "_initial_iter_for_state_dict", False):
        inner.load_state_dict({})


def batches_to_skip(loader: Any, steps: int) -> int:
    """What to pass ``skip_first_batches(loader, n)`` to skip ``loader``'s first ``steps`` batches.

    ``steps`` itself, except for a dispatching loader (``dispatch_batches``) of a map-style dataset without
    ``split_batches``: each of its steps takes ``num_processes`` batches of its batch sampler (the main process
    loads one for each process), and ``skip_first_batches`` skips batches of that sampler.
    """
    try:
        from accelerate.data_loader import DataLoaderDispatcher
    except ImportError:
        return steps
    if isinstance(loader, DataLoaderDispatcher) and not loader.split_batches \
            and not isinstance(loader.dataset, IterableDataset):
        return steps * loader.state.num_processes
    return steps


def rebuild(loader: Any, batch_sampler: Any, *, in_main_process: bool = False) -> Any:
    """A loader like ``loader`` that takes its batches of indices from ``batch_sampler``; None if unsupported.

    A prepared loader gives a prepared one (same device placement, RNG synchronization and shuffle
    generator; it fetches one batch ahead like the original); a plain ``DataLoader`` (or a
    ``StatefulDataLoader``) a plain one. Under ``use_stateful_dataloader=True`` the prepared one it gives
    holds a plain ``DataLoader``: its iterators draw from the RNG as the ``StatefulDataLoader``'s.
    ``in_main_process`` builds it with ``num_workers=0``. The samplers are shared, not copied.
    """
    base = base_loader(loader)
    if base is None:
        return None
    kwargs = {name: getattr(base, name) for name in _LOADER_ARGS if hasattr(base, name)}
    if in_main_process:
        kwargs.update(num_workers=0, prefetch_factor=None, persistent_workers=False, timeout=0,
                      multiprocessing_context=None)
    if base is loader:
        return DataLoader(base.dataset, batch_sampler=batch_sampler, **kwargs)
    shard = _shard_class()
    rebuilt = shard(base.dataset, device=loader.device, rng_types=loader.rng_types,
                    synchronized_generator=loader.synchronized_generator, _drop_last=loader._drop_last,
                    _non_blocking=loader._non_blocking, batch_sampler=batch_sampler, **kwargs)
    rebuilt.iteration = loader.iteration
    return rebuilt


def synchronize_shuffle(loader: Any) -> None:
    """What a prepared loader does first at each epoch: give every rank rank 0's shuffle (and other) RNG states."""
    rng_types = getattr(loader, "rng_types", None)
    if rng_types is not None:
        from accelerate.utils import synchronize_rng_states

        synchronize_rng_states(rng_types, getattr(loader, "synchronized_generator", None))
