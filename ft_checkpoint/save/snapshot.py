"""The lazy snapshot: copy parameters and optimizer state while the next forward and backward run.

Parameters and optimizer state change only in an optimizer step, so a save need not block for their copy:
it copies everything else at once (buffers such as BatchNorm's running statistics, tensors of no optimizer,
small tensors, the non-tensor state, RNG states, the data position) and returns; the rest is copied on a
thread of its own, and the next optimizer step (a global ``torch.optim`` step pre-hook, so plain loops,
Lightning and Accelerate get it without a call of their own) first waits until that copy is done. A step
given a closure (Lightning runs the forward and backward in one) waits when the closure returns.

A tensor edited in place between the save and that step (a hand-written update, ``p.mul_(...)`` under
``no_grad``) may have been copied before or after the edit. Every deferred tensor's version counter is read
at the save and again when the copy is settled (at the next optimizer step, save, ``wait`` or ``close``);
a changed one makes the snapshot torn: the save is abandoned with a warning (the previous committed step
stays the resume point), never committed. Edits through ``.data`` or a NumPy view bypass version counters
(diffusers' ``EMAModel.copy_to`` and ``restore`` swap the EMA weights in that way for a validation): for a CPU
tensor its first and last 8 bytes (of a non-contiguous one, a channels_last convolution's weight, its first and last
elements) are also read at the save and compared with its copy, so that a copy made while such an edit was in place
makes the snapshot torn too; a collective (``all_reduce``, ``broadcast``) into a parameter moves no version
counter either. A CUDA tensor has only its version counter (reading device memory at the save would wait for the
GPU): make such edits under ``torch.no_grad()``, or turn ``lazy_snapshot`` off.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 4)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> install()
    >>> model(torch.ones(1, 4)).sum().backward(); opt.step()   # the hook learns this optimizer
    >>> tensors = {"w": model.weight.detach(), "b": model.bias.detach()}
    >>> sorted(deferrable(tensors, min_bytes=0))
    ['b', 'w']
    >>> targets = {k: torch.empty_like(t) for k, t in tensors.items()}
    >>> copy = LazyCopy(tensors, targets)
    >>> copy.run(); copy.settle(); copy.verdict()   # nothing changed in place: not torn
    []
    >>> bool(torch.equal(targets["w"], model.weight))
    True
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ft_checkpoint.save.staging import _is_dtensor

log = logging.getLogger(__name__)

MIN_BYTES = 1024
"""Tensors smaller than this are always copied at the save (deferring them saves next to nothing)."""

_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_pending: weakref.WeakSet[LazyCopy] = weakref.WeakSet()
_lock = threading.Lock()
_u64 = ctypes.c_uint64.from_address
_handle: Any = None


def install() -> None:
    """Register the global optimizer step pre-hook (once per process): it learns which optimizers step, and
    before each step settles every lazy copy still pending. At interpreter exit the pending copies are settled
    before the background threads are joined (a writer waiting for a settlement would be waited for forever)."""
    global _handle
    with _lock:
        if _handle is None:
            _handle = (register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step))
            at_threading_exit = getattr(threading, "_register_atexit", None)  # runs before threads are joined
            if at_threading_exit is not None:
                at_threading_exit(settle_all)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """Settle the pending copies now; with a closure (Lightning's automatic optimization runs the forward and
    backward in it), right after the closure returns, before the step changes any parameter."""
    _optimizers.add(optimizer)
    if not _pending:
        return None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer itself
    if not callable(closure):
        settle_all()
        return None

    def settled_after() -> Any:
        result = closure()
        settle_all()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": settled_after}
    return (args[0], settled_after, *args[2:]), kwargs


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step that never called its closure: settle now (a parameter it changed makes the snapshot torn)."""
    if _pending:
        settle_all()


def settle_all() -> None:
    """Settle every pending lazy copy (see :meth:`LazyCopy.settle`); cheap when none is pending."""
    for copy in list(_pending):
        copy.settle()


def optimizer_storages() -> set[int]:
    """The storage addresses of every parameter and state tensor (DTensors left out) of the optimizers that have
    stepped."""
    out: set[int] = set()
    for opt in list(_optimizers):
        tensors = [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        # a DTensor (FSDP2) has no storage of its own to look at, and is never deferred
        out.update(ptr for t in tensors if not _is_dtensor(t) and (ptr := _storage(t)) is not None)
    return out


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor subclass that has none of its own (torchao's low-bit
    optimizer states wrap theirs): never deferred, it is copied at the save."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def deferrable(tensors: Mapping[str, torch.Tensor], *, min_bytes: int = MIN_BYTES) -> set[str]:
    """The keys of ``tensors`` whose copy may wait for the next optimizer step: plain (not DTensor, not
    inference) tensors of at least ``min_bytes`` that share storage with an optimizer's parameter or state."""
    owned = optimizer_storages()
    return {k for k, t in tensors.items()
            if type(t) is torch.Tensor and not t.is_inference() and t.numel() * t.element_size() >= min_bytes
            and t.untyped_storage().data_ptr() in owned}


class LazyCopy:
    """One save's deferred copies: ``run`` them on a background thread, ``settle`` on the training thread.

    Args:
        sources: The live tensors, by key (their version counters are read now).
        targets: Where each is copied (staging slots of the same shape and dtype).
        on_wait: Told how many seconds :meth:`settle` waited for the copy.
    """

    def __init__(self, sources: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], *,
                 on_wait: Callable[[float], None] | None = None) -> None:
        self._sources: dict[str, torch.Tensor] | None = dict(sources)
        self._targets = {k: targets[k] for k in sources}
        self._versions = {k: t._version for k, t in sources.items()}
        self._samples = {k: _ends(t) for k, t in sources.items()}
        self._copied, self._settled = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._changed: list[str] = []
        self._ready = _record_streams(self._sources.values())
        self._on_wait = on_wait
        self._pid = os.getpid()
        _pending.add(self)

    def run(self) -> None:
        """Copy every source into its target (on the copy thread); a CUDA copy runs on a stream of its own,
        after the work queued before the save, and is synchronized before the copy counts as done."""
        try:
            assert self._sources is not None
            cuda = next((t.device for t in self._sources.values() if t.is_cuda), None)
            with _side_stream(cuda, self._ready) as stream:
                for key, src in self._sources.items():
                    self._targets[key].copy_(src.detach(), non_blocking=src.is_cuda)
                if stream is not None:
                    stream.synchronize()
            self._changed = [k for k, ends in self._samples.items() if _differ(ends, self._targets[k])]
        except BaseException as e:  # kept for the writer: the save fails, never the training
            self._error = e
        finally:
            self._copied.set()

    def settle(self) -> None:
        """Wait until the copy is done, then compare the version counters (on the training thread, before the
        next optimizer step, save, wait or close: every in-place change made so far is counted). In a forked
        child (a DataLoader worker) it returns at once: the copy and its thread are the parent's, and waiting for
        it there (a worker's exit runs the threading exit hooks) would hang the worker forever."""
        if self._settled.is_set() or os.getpid() != self._pid:
            return
        start = time.perf_counter()
        self._copied.wait()
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - start)
        sources, self._sources = self._sources, None
        if sources is not None:  # ``_changed`` holds the copies whose ends differ from the save's (see ``run``)
            self._changed = sorted({*self._changed, *(k for k, t in sources.items() if t._version != self._versions[k])})
        self._settled.set()
        _pending.discard(self)

    def wait_copied(self) -> None:
        """Wait until every copy is done (the staged bytes may be read); raise the copy's error, if any."""
        self._copied.wait()
        if self._error is not None:
            raise self._error

    def verdict(self) -> list[str]:
        """The keys changed in place before their copy was settled (empty: a consistent snapshot). Waits for
        :meth:`settle`; once the main thread has ended, settles here. Raises the copy's error, if any."""
        while not self._settled.wait(0.2):
            if not threading.main_thread().is_alive():
                self.settle()
        if self._error is not None:
            raise self._error
        return self._changed


def _ends(t: torch.Tensor) -> tuple[Any, Any] | None:
    """A sample of a CPU tensor's data read in place (0.5-1 us; a copy of the tensor would cost a pass over it): the
    first and last 8 bytes of a contiguous one; of any other strided one (channels_last, a transposed view) its first
    and last elements in index order, which a contiguous copy of it has at its own ends. None for other tensors."""
    if not t.is_cpu or t.layout != torch.strided or t.numel() == 0:
        return None
    p, n = t.data_ptr(), t.nbytes
    if t.is_contiguous():
        return (_u64(p).value, _u64(p + n - 8).value) if n >= 16 else None
    return _elements(t)


def _elements(t: torch.Tensor) -> tuple[bytes, bytes]:
    """The bytes of ``t``'s first and last elements in index order, wherever its strides put them."""
    size, p = t.element_size(), t.data_ptr()
    last = p + size * sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return ctypes.string_at(p, size), ctypes.string_at(last, size)


def _differ(ends: tuple[Any, Any] | None, copy: torch.Tensor) -> bool:
    """Whether ``copy``'s sample differs from ``ends``, the source's at the save (taken the same way: a contiguous
    copy of a non-contiguous source by its elements); never when either is unread."""
    if ends is None or not copy.is_cpu or copy.numel() == 0:
        return False
    if isinstance(ends[0], bytes):
        return _elements(copy) != ends
    return copy.is_contiguous() and _ends(copy) != ends


def _record_streams(tensors: Any) -> dict[torch.device, Any]:
    """A CUDA event on each device's current stream (the work the copies must come after), recorded at the save."""
    events = {}
    for t in tensors:
        if t.is_cuda and t.device not in events:
            events[t.device] = torch.cuda.Event()
            events[t.device].record(torch.cuda.current_stream(t.device))
    return events


class _side_stream:
    """A CUDA stream for the copies on ``device`` (after ``ready``'s events), or nothing for CPU tensors."""

    def __init__(self, device: torch.device | None, ready: Mapping[torch.device, Any]) -> None:
        self.stream = torch.cuda.Stream(device) if device is not None else None
        self._ready = ready
        self._ctx: Any = None

    def __enter__(self) -> Any:
        if self.stream is None:
            return None
        for event in self._ready.values():
            self.stream.wait_event(event)
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
