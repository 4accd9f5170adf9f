"""The floor of an asynchronous save, for the overhead benchmarks: what any background checkpointer must do.

At each save, the state's tensors are copied into one page-aligned buffer allocated once (the training waits
for this copy: the stall), then one background thread writes it into one file with large ``os.write`` calls
(which release the GIL), with ``O_DIRECT`` where the filesystem allows it (no copy into the page cache),
and fsyncs it. No checksum, no metadata, no commit, no retention, no resume: nothing a checkpoint needs
beyond its bytes. Run in the same benchmark as the frameworks' saves and ours, it shows how much of a
training's time this machine takes for the bytes alone.

    >>> import tempfile, torch
    >>> saver = RawSaver(tempfile.mkdtemp())
    >>> saver.save(1, [torch.ones(4)]); saver.wait(); saver.saves
    1
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import torch

IO_SLICE = 16 << 20
"""Bytes per write call, as ft-checkpoint's own."""
ALIGN = 4096


class RawSaver:
    """Copy into reused buffers, then write + fsync in a background thread; ``stalls`` per save, in seconds."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.buffer: torch.Tensor | None = None
        self._memory: object = None  # what the buffer's memory belongs to
        self.thread: threading.Thread | None = None
        self.stalls: list[float] = []
        self.saves = 0

    def save(self, step: int, tensors: list[torch.Tensor]) -> None:
        """Stage ``tensors`` (waiting for the previous save's write first, as every async checkpointer does)
        and start writing them."""
        t0 = time.perf_counter()
        self.wait()
        flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
        size = sum(t.numel() for t in flat)
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer, self._memory = _aligned(size, pinned=any(t.is_cuda for t in tensors))
        offset = 0
        for t in flat:
            self.buffer[offset:offset + t.numel()].copy_(t, non_blocking=True)
            offset += t.numel()
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        self.stalls.append(time.perf_counter() - t0)
        path = os.path.join(self.directory, f"raw_{step % 2}.bin")  # two files, as keep_last=2
        self.thread = threading.Thread(target=self._write, args=(path, self.buffer), daemon=True)
        self.thread.start()
        self.saves += 1

    def wait(self) -> None:
        """Until the last save is durable."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    @staticmethod
    def _write(path: str, buffer: torch.Tensor) -> None:
        direct = buffer.data_ptr() % ALIGN == 0 and buffer.numel() % ALIGN == 0
        write_durably(path, [memoryview(buffer.numpy())], direct=direct)


def write_durably(path: str, views: list[memoryview], *, direct: bool) -> None:
    """Write ``views`` into the file ``path`` in ``IO_SLICE`` calls and fsync it; with ``direct``, with
    ``O_DIRECT`` where the filesystem allows it (the views then page-aligned, a whole number of pages)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
    except OSError:  # no O_DIRECT here (tmpfs)
        fd = os.open(path, flags, 0o644)
    try:
        for view in views:
            for start in range(0, len(view), IO_SLICE):
                piece = view[start:start + IO_SLICE]
                while piece:
                    piece = piece[os.write(fd, piece):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _aligned(size: int, pinned: bool) -> tuple[torch.Tensor, object]:
    """A uint8 buffer of at least ``size`` bytes, page-aligned and a whole number of pages (for ``O_DIRECT``):
    pinned host memory for CUDA tensors (cudaHostAlloc returns pages), an anonymous mapping otherwise."""
    padded = -(-size // ALIGN) * ALIGN
    if pinned:
        buffer = torch.empty(padded, dtype=torch.uint8, pin_memory=True)
        return buffer, buffer
    memory = mmap.mmap(-1, padded)
    return torch.frombuffer(memory, dtype=torch.uint8), memory

