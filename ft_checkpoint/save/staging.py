"""Staging: copy a state's tensors out of the training's way, into host buffers allocated once and reused.

The copy is all a save blocks for. Every tensor gets a slot in one arena of host memory, laid out at
the first save and reused by every later save while the tensors keep their shapes and dtypes (a new
layout allocates a new arena). Slots start on page boundaries and are padded with zeros to whole pages,
so a writer can hand them to the disk with ``O_DIRECT`` (no copy into the page cache). For CUDA
tensors the arena is pinned and the copies are non-blocking, with one synchronization at the end. With
``shared=True`` the arena is an anonymous shared-memory file (``memfd``), so a writer process can map
it and write the bytes without another copy (see ``writer_process``). A DTensor's local shard is
staged and wrapped back into a DTensor with the same mesh and placements, so DCP plans its chunks as usual.

Example:
    >>> import torch
    >>> s = Stager()
    >>> staged = s.stage({"w": torch.arange(3.0), "n": torch.tensor(7)})
    >>> staged["w"], staged["n"]
    (tensor([0., 1., 2.]), tensor(7))
    >>> again = s.stage({"w": torch.ones(3), "n": torch.tensor(8)})   # the same buffers, reused
    >>> again["w"].data_ptr() == staged["w"].data_ptr()
    True
    >>> s.close()
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Collection, Mapping

import torch

from ft_checkpoint.format._dcp_internals import dtensor_like
from ft_checkpoint.store.storage import DIRECT_ALIGN, padded

ALIGN = DIRECT_ALIGN
"""Every slot starts on, and is padded to, a page boundary: what ``O_DIRECT`` needs."""


class Arena:
    """One block of host memory holding every staged tensor, at fixed offsets."""

    def __init__(self, nbytes: int, *, shared: bool, pin: bool) -> None:
        self.nbytes = max(nbytes, ALIGN)
        self.fd: int | None = None
        if shared:  # a memfd a writer process can map; mapped here too, page-aligned and zeroed
            self.fd = os.memfd_create("ft-checkpoint-staging", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.nbytes)
            self._mmap = mmap.mmap(self.fd, self.nbytes)
        else:  # private anonymous memory: page-aligned and zeroed too
            self._mmap = mmap.mmap(-1, self.nbytes)
        self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if pin:
            _register_pinned(self.bytes)

    @property
    def base(self) -> int:
        """The address of the arena's first byte (to find a staged tensor's offset)."""
        return self.bytes.data_ptr()

    def contains(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a contiguous tensor whose bytes start on a slot boundary of this arena (then its
        slot, padded to whole pages, can be written with ``O_DIRECT``)."""
        offset = t.data_ptr() - self.base
        return (t.device.type == "cpu" and t.is_contiguous() and offset % ALIGN == 0
                and 0 <= offset and offset + padded(t.numel() * t.element_size()) <= self.nbytes)

    def view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = shape.numel() * torch.empty((), dtype=dtype).element_size()
        return self.bytes[offset:offset + n].view(dtype).view(shape)

    def close(self) -> None:
        """Drop this arena's references; the memory is unmapped when the last staged tensor viewing it goes.

        Never ``mmap.close()``: ``torch.frombuffer`` keeps the mmap object alive but holds no buffer export,
        so closing it would unmap memory that a staged tensor still in use (a write, a traceback's frame)
        points into, and touching that tensor would crash the process (a segmentation fault).
        """
        del self.bytes, self._mmap
        if self.fd is not None:  # the mapping outlives its file descriptor
            os.close(self.fd)
            self.fd = None


def _register_pinned(t: torch.Tensor) -> None:
    """Page-lock memory torch did not allocate (a shared arena), so device-to-host copies can be asynchronous."""
    torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]  # a DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


class Stager:
    """Stages flat dicts of tensors into a reused :class:`Arena`.

    Args:
        shared: Put the arena in shared memory (for a writer process).
        pin: Page-lock the arena (default: whether CUDA is available); needed for asynchronous copies.
    """

    def __init__(self, *, shared: bool = False, pin: bool | None = None) -> None:
        self.shared = shared
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.arena: Arena | None = None
        self._layout: list[tuple[str, torch.Size, torch.dtype]] = []
        self._views: dict[str, torch.Tensor] = {}
        """Each key's slot, as a tensor of its shape and dtype (made once per layout: a save reuses them)."""

    def stage(self, tensors: Mapping[str, torch.Tensor], *, defer: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` (a flat dict) in the arena; blocks until every copy is done. The keys in
        ``defer`` get their slots but are not copied: the caller copies them later (see ``snapshot``)."""
        if not tensors:
            return {}
        layout = [(k, _local(t).shape, t.dtype) for k, t in tensors.items()]
        if layout != self._layout:
            self._allocate(layout)
        assert self.arena is not None
        out, devices = {}, set()
        for key, t in tensors.items():
            local = _local(t).detach()
            buf = self._views[key]
            if key in defer:
                out[key] = buf
                continue
            buf.copy_(local, non_blocking=local.is_cuda and self.pin)
            if local.is_cuda:
                devices.add(local.device)
            out[key] = dtensor_like(t, buf) if _is_dtensor(t) else buf
        for device in devices:
            torch.cuda.synchronize(device)
        return out

    def _allocate(self, layout: list[tuple[str, torch.Size, torch.dtype]]) -> None:
        self.close()
        offset, offsets = 0, {}
        for key, shape, dtype in layout:
            offsets[key] = offset
            offset += padded(shape.numel() * torch.empty((), dtype=dtype).element_size())
        self.arena = Arena(offset, shared=self.shared, pin=self.pin)
        self._layout = layout
        self._views = {key: self.arena.view(offsets[key], shape, dtype) for key, shape, dtype in layout}

    def close(self) -> None:
        """Release the arena."""
        if self.arena is not None:
            self.arena.close()
        self.arena, self._layout, self._views = None, [], {}
