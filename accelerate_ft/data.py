"""The data side of an exact resume: shuffle order, position, and the random state each batch is loaded with.

What a batch holds depends on more than its indices when ``Dataset.__getitem__`` draws random numbers
(random crops, masking). ``save_state``/``load_state`` + ``skip_first_batches`` get it wrong in three ways,
each handled here:

- **The shuffle order** comes from the global torch RNG (one process), a generator shared by all ranks
  (``synchronized_generator``), ``DataLoader(generator=...)`` or ``data_seed + epoch``. Their states at
  the start of each epoch are saved (:func:`capture_epoch_start`) and put back before the resumed epoch's
  iterator is created, so it draws the same order; a resume on an epoch end runs the finished epoch's
  index sampler through (nothing is loaded) so the generators end where that epoch left them.
- **No workers:** ``__getitem__`` draws from the main process's RNGs, and a prepared loader has already
  fetched the next batch when the loop body of the current one runs. So the RNG state right before each
  batch is fetched is noted (by the batch sampler, :class:`_IndexBatches`); a save keeps that state for
  the batches fetched but not yet trained on, and the resume sets each one right before the same batch
  is fetched again, then the saved state before the next. The skipped batches are never loaded.
- **Workers** are seeded from a base seed drawn when the epoch's iterator is created, and each one's
  RNG advances with every batch it loads. So the resumed epoch's iterator is created from the same
  state and the consumed batches are loaded again in the workers and dropped (``replay_in_workers``):
  the cost is their loading time (no forward or backward pass).

Example:
    >>> import torch
    >>> loader = torch.utils.data.DataLoader(range(8), batch_size=2, shuffle=True)
    >>> start = capture_epoch_start(loader)
    >>> first = [b.tolist() for _, b in EpochReader(loader)]
    >>> restore_epoch_start(loader, start)
    >>> [b.tolist() for _, b in EpochReader(loader, skip=3)] == first[3:]
    True
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler

from accelerate_ft import _accelerate_internals as internals
from ft_checkpoint.state import set_rng_state

log = logging.getLogger(__name__)


# -- RNG states as plain data (tensors would be written once for all ranks, as if replicated) ---------
def encode_rng(state: torch.Tensor) -> str:
    """An RNG state as a hex string: plain data, so each rank keeps its own (tensors are deduplicated as replicated)."""
    return bytes(state.tolist()).hex()


def decode_rng(text: str) -> torch.Tensor:
    """The inverse of :func:`encode_rng`."""
    return torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA if initialized, Python, NumPy if imported), cheaply, as they are."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def encode_rng_state(state: dict[str, Any]) -> dict[str, Any]:
    """What :func:`capture_rng` returned, as plain data (``torch.load(weights_only=True)`` reads it back)."""
    out: dict[str, Any] = {"torch": encode_rng(state["torch"]), "python": state["python"]}
    if "cuda" in state:
        out["cuda"] = [encode_rng(s) for s in state["cuda"]]
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        out["numpy"] = (name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    return out


def decode_rng_state(plain: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode_rng_state`, in the form ``ft_checkpoint.state.set_rng_state`` takes."""
    state = dict(plain, torch=decode_rng(plain["torch"]))
    if "cuda" in plain:
        state["cuda"] = [decode_rng(s) for s in plain["cuda"]]
    return state


# -- the shuffle order ---------------------------------------------------------------------------------
def sampler_of(loader: Any) -> Any:
    """The innermost index sampler of a (prepared) DataLoader, or None."""
    # not ``batch_sampler or sampler``: a sampler's truth is its len(), which an IterableDataset's sampler lacks
    node = getattr(loader, "batch_sampler", None)
    node = getattr(loader, "sampler", None) if node is None else node
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
    sampler: Any = getattr(loader, "sampler", None)
    if callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(epoch)


def batches_per_epoch(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader without a length (an iterable dataset)."""
    try:
        return len(loader)
    except TypeError:  # an iterable dataset
        return None


# -- one epoch -------------------------------------------------------------------------------------------
class _IndexBatches(BatchSampler):
    """A loader's batch sampler that skips the first ``skip`` batches by index and, before handing out
    each batch's indices (the loader fetches that batch right after, in the main process), notes the
    RNG states, or first sets those ``plan`` holds for that batch. Attributes are the wrapped sampler's.
    """

    KEEP = 4
    """How many of the newest batches' states are kept (a prepared loader fetches one batch ahead)."""

    def __init__(self, batch_sampler: Any, skip: int = 0,
                 plan: dict[int, dict[str, Any]] | None = None) -> None:  # no super().__init__: attributes delegate
        self._batch_sampler = batch_sampler
        self._skip = skip
        self._plan = plan if plan is not None else {}
        self.fetched: dict[int, dict[str, Any]] = {}
        """Batch index -> the RNG states right before that batch was fetched (the newest ``KEEP``)."""

    def __iter__(self) -> Iterator[list[int]]:
        for index, indices in enumerate(self._batch_sampler):
            if index < self._skip:
                continue
            if index in self._plan:
                set_rng_state(self._plan.pop(index))
            self.fetched[index] = capture_rng()
            self.fetched.pop(index - self.KEEP, None)
            yield indices

    def __len__(self) -> int:
        return max(0, len(self._batch_sampler) - self._skip)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._batch_sampler, name)


class EpochReader:
    """One epoch of ``loader`` from batch ``skip`` on, each batch as the uninterrupted run loaded it.

    Iterating gives ``(index in the epoch, batch)``. Create it after :func:`set_epoch` and, on a resume,
    after :func:`restore_epoch_start`.

    Args:
        loader: A loader prepared by ``accelerator.prepare``, a plain ``DataLoader``, or another loader
            (then only the position is restored: batches are skipped with Accelerate's ``skip_first_batches``).
        skip: The batches of this epoch already trained on.
        resume_rng: On a resume, the RNG states the checkpoint restored (``ft_checkpoint.state.rng_state()``
            right after the resume): the state the training continues with.
        prefetched: On a resume, :meth:`prefetched` of the run that saved.
        replay_in_workers: With ``num_workers > 0``, load the ``skip`` consumed batches again in the
            workers and drop them, so that each worker's RNG continues exactly; False skips them by index
            (no loading; exact only if ``__getitem__`` draws no random numbers).
        epoch: The epoch, for messages.
    """

    def __init__(self, loader: Iterable[Any], skip: int = 0, *, resume_rng: dict[str, Any] | None = None,
                 prefetched: Sequence[dict[str, Any]] = (), replay_in_workers: bool = True, epoch: int = 0) -> None:
        self.loader, self.skip, self.epoch = loader, skip, epoch
        self.replay_in_workers = replay_in_workers
        self._resume_rng = resume_rng
        self._plan: dict[int, dict[str, Any]] = {}
        if resume_rng is not None:
            self._plan = {skip + i: decode_rng_state(s) for i, s in enumerate(prefetched)}
            self._plan[skip + len(prefetched)] = resume_rng
        self._batches: _IndexBatches | None = None
        if resume_rng is not None and internals.from_torchdata(loader):
            log.warning("resumed epoch %d of a loader from torchdata with its own samplers (a StatefulDataLoader given "
                        "to prepare), an iterable dataset or dispatch_batches: its position is restored, but its order "
                        "and random state may differ from an uninterrupted run's (not exact). HINT: a torch DataLoader "
                        "given to prepare (use_stateful_dataloader=True or not) is resumed exactly", epoch)

    def prefetched(self, batches_done: int) -> list[dict[str, Any]]:
        """The RNG states right before each batch fetched from index ``batches_done`` on (as plain data).

        A save after ``batches_done`` batches keeps them, so that a resume loads those batches again
        with the same random numbers. Empty unless the main process loads the batches.
        """
        if self._batches is None:
            return []
        fetched = self._batches.fetched
        return [encode_rng_state(fetched[i]) for i in sorted(fetched) if i >= batches_done]

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        start, source = self._open()
        for index, batch in enumerate(source, start=start):
            if index < self.skip:
                continue  # replayed in the workers, dropped
            self._settle()
            yield index, batch
        self._settle()

    def _settle(self) -> None:
        """Put back the checkpoint's RNG states before the first resumed batch is trained on, unless the
        batch sampler already did so before fetching the batch after the prefetched ones."""
        if self._resume_rng is not None and any(state is self._resume_rng for state in self._plan.values()):
            set_rng_state(self._resume_rng)
        self._plan.clear()
        self._resume_rng = None

    def _open(self) -> tuple[int, Iterable[Any]]:
        """``(index of its first batch, the iterable)`` for this epoch."""
        internals.drop_iterator_made_for_state_dict(self.loader)  # its workers' seed drawn as the epoch starts
        length, workers = batches_per_epoch(self.loader), getattr(self.loader, "num_workers", 0)
        if length is not None and 0 < length <= self.skip:
            self._run_sampler_through()
            return self.skip, ()
        if workers == 0:
            batches = _IndexBatches(getattr(internals.base_loader(self.loader), "batch_sampler", None),
                                    self.skip, self._plan)
            rebuilt = internals.rebuild(self.loader, batches) if batches._batch_sampler is not None else None
            if rebuilt is not None:
                self._batches = batches
                return self.skip, rebuilt
        elif self.skip and self.replay_in_workers:
            return 0, self._replay(workers)
        return self.skip, self._skip_by_index()

    def _replay(self, workers: int) -> Iterator[Any]:
        """The loader from its first batch: the workers load the consumed ones again (dropped by the caller)."""
        if getattr(self.loader, "persistent_workers", False) and self.epoch > 0:
            log.warning("the loader keeps its workers across epochs (persistent_workers=True): their random state "
                        "at epoch %d cannot be restored, so random augmentation in __getitem__ differs after this "
                        "resume. HINT: persistent_workers=False makes it exact", self.epoch)
        t0 = time.perf_counter()
        for index, batch in enumerate(self.loader):
            if index == self.skip:
                log.info("resumed epoch %d: its %d consumed batches were loaded again in the loader's %d workers and "
                         "dropped in %.2f s, so that the workers' random state continues exactly", self.epoch,
                         self.skip, workers, time.perf_counter() - t0)
            yield batch

    def _skip_by_index(self) -> Iterable[Any]:
        if self.skip <= 0:
            return self.loader
        from accelerate import skip_first_batches

        return skip_first_batches(self.loader, internals.batches_to_skip(self.loader, self.skip))

    def _run_sampler_through(self) -> None:
        """A resume on the end of an epoch: create the finished epoch's iterator and run its index sampler to
        the end without loading anything, so the shuffle generators advance past that epoch as they did."""
        base = internals.base_loader(self.loader)
        rebuilt = None
        if base is not None:
            rebuilt = internals.rebuild(base, _IndexBatches(base.batch_sampler, skip=self.skip), in_main_process=True)
        if rebuilt is None:
            log.warning("resumed on the end of epoch %d of a %s: its shuffle generator is not advanced past that "
                        "epoch, so the next epoch may repeat its order", self.epoch, type(self.loader).__name__)
            return
        internals.synchronize_shuffle(self.loader)
        for _ in rebuilt:
            pass
