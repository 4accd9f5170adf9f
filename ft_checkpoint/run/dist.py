"""The few collectives checkpointing needs, on its own gloo groups, and no-ops in a single process.

Checkpoint traffic runs on dedicated gloo process groups so it never interleaves with the training's
collectives (NCCL on GPUs): one group for the background writer (DCP's plan exchange, the checksum
gather) and one for decisions made on the training thread (which step, resume agreement). Two groups,
because a collective issued by the training thread while the writer thread uses the same group could
pair up differently on different ranks.

Example:
    >>> g = Groups.create()          # single process: world_size 1, every collective is local
    >>> g.world_size, g.broadcast("same everywhere"), g.all_gather(3)
    (1, 'same everywhere', [3])
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


@dataclasses.dataclass
class Groups:
    """Rank, world size and the two checkpoint process groups (None when not distributed)."""

    rank: int = 0
    world_size: int = 1
    writer: Any = None
    control: Any = None

    @classmethod
    def create(cls) -> Groups:
        """Make the groups; a collective call when distributed, so every rank must call it."""
        if not is_distributed():
            return cls()
        writer = dist.new_group(backend="gloo")
        control = dist.new_group(backend="gloo")
        return cls(dist.get_rank(), dist.get_world_size(), writer, control)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def destroy(self) -> None:
        """Destroy the checkpoint groups (local to this process, no collective): each gloo group keeps two threads
        and its sockets alive until it is destroyed. No collective may run on them after this. Each group once;
        one destroyed already is skipped (``destroy_process_group()`` of the default group destroys every group)."""
        for group in {id(g): g for g in (self.writer, self.control) if g is not None}.values():
            try:
                dist.destroy_process_group(group)
            except ValueError:  # "Invalid process group specified": destroyed already
                pass

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` of rank ``src`` on every rank (training thread only)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    def all_gather(self, obj: T, *, writer: bool = False) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.writer if writer else self.control)
        return out

    def barrier(self, *, writer: bool = False) -> None:
        """Wait for every rank."""
        if self.distributed:
            dist.barrier(group=self.writer if writer else self.control)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank (a collective when distributed)."""
        return any(self.all_gather(flag))

    def on_rank0(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only; every rank gets its result, or raises its exception."""
        result: Any = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:
                error = e
        if self.distributed:
            if error is not None and not _picklable(error):
                error = RuntimeError(f"{type(error).__name__}: {error}")
            result, error = self.broadcast((result, error))
        if error is not None:
            raise error
        return result


PEER_GONE = ("connection reset by peer", "connection closed by peer")
"""What a collective's error says when a process of the job died (gloo, the TCP store; lower case)."""


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) says that a peer process of the job is gone.

    Socket errors (``OSError``: a storage server that reset a connection) are not collectives' and do not count.

    Example:
        >>> peer_lost(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:53893: Connection reset by peer."))
        True
        >>> peer_lost(ValueError("loss is nan")), peer_lost(ConnectionResetError("Connection reset by peer"))
        (False, False)
    """
    seen: set[int] = set()
    node: BaseException | None = error
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if not isinstance(node, OSError) and any(words in str(node).lower() for words in PEER_GONE):
            return True
        node = node.__cause__ or node.__context__
    return False


def short_error(error: BaseException, limit: int = 160) -> str:
    """``Type: message`` on one line, without gloo's ``[file.cc:123]`` prefix and its advice, at most ``limit`` characters.

    Example:
        >>> short_error(RuntimeError("[pair.cc:537] Read error: Connection reset by peer. This is typically caused by"))
        'RuntimeError: Read error: Connection reset by peer'
    """
    text = (str(error).strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.split(". This is typically")[0].rstrip(".")
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _picklable(obj: Any) -> bool:
    try:
        pickle.loads(pickle.dumps(obj))
    except Exception:
        return False
    return True
