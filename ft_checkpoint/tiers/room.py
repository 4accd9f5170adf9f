"""The room a node's fast tier needs, checked at the first fast-tier save (not mid-run, when memory runs out).

A node holds, for each of its ranks and for each rank whose peer copy it keeps, two steps at most: the newest
committed one and the one being written. Each rank's part is its staged bytes (every tensor of its local state,
as staged) plus its rank file (the non-tensor state), whose size is known only once it is serialized, on the
writer: the first save counts an allowance for it, and each write checks again with its real size, before any
rank writes (a step that would not fit is not written). The fast tier has room if the free space of its
filesystem, plus what this run holds there already (it will be replaced), covers that.

Example:
    >>> from ft_checkpoint.tiers.node import Ring
    >>> ring = Ring(("a", "a", "b", "b"))
    >>> room_needed(ring, [100, 100, 100, 100], node="a", replicas=1)    # 2 steps x (2 own + 2 copies) x 100
    800
    >>> room_problem("/dev/shm/ft", need=800, free=500, node="a").split(" (")[0]
    'node a: the fast tier /dev/shm/ft has 500 B free, and needs 800 B'
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from ft_checkpoint.store.storage import padded
from ft_checkpoint.tiers.node import Ring
from ft_checkpoint.units import human_bytes

STEPS_KEPT = 2
"""Steps a rank folder holds at most: the newest committed one and the one being written."""
RANK_FILE_ALLOWANCE = 1 << 20
"""Bytes counted for a part's metadata and its rank file until the rank file's size is known, and for each file of
the state's own (its non-tensor content)."""


def part_bytes(tensors: Iterable[int], files: Iterable[int] = (), *, rank_file: int = 0) -> int:
    """Bytes of one rank's part: its tensors' (``tensors``: each one's bytes) and its own files' (``files``: the
    bytes of each one's tensors), page-rounded, with :data:`RANK_FILE_ALLOWANCE` for the metadata and each own file,
    and ``rank_file``, its rank file's size once serialized (0 before: the allowance stands for it).

    Example:
        >>> part_bytes([10], rank_file=5000) == 4096 + RANK_FILE_ALLOWANCE + 8192
        True
    """
    return (sum(padded(n) for n in tensors) + RANK_FILE_ALLOWANCE + padded(rank_file)
            + sum(padded(n) + RANK_FILE_ALLOWANCE for n in files))


def room_needed(ring: Ring, part_bytes: list[int], *, node: str, replicas: int) -> int:
    """Bytes ``node``'s fast tier needs: :data:`STEPS_KEPT` steps of its ranks' parts and of the parts it copies."""
    held = [r for r in ring.ranks_on(node)]
    if replicas:
        held += [s for r in ring.ranks_on(node) for s in ring.sources(r)]
    return STEPS_KEPT * sum(part_bytes[r] for r in held)


def free_bytes(fast_dirpath: str, run_folder: str) -> int:
    """What the fast tier's filesystem has free, plus what this run's folder holds already."""
    os.makedirs(fast_dirpath, exist_ok=True)
    held = 0
    for here, _, names in os.walk(run_folder):
        for name in names:
            try:
                held += os.lstat(os.path.join(here, name)).st_size
            except FileNotFoundError:
                pass
    return shutil.disk_usage(fast_dirpath).free + held


def room_problem(fast_dirpath: str, *, need: int, free: int, node: str) -> str | None:
    """None if ``free`` covers ``need``; else what is wrong and what to do."""
    if need <= free:
        return None
    return (f"node {node}: the fast tier {fast_dirpath} has {human_bytes(free)} free, and needs {human_bytes(need)} "
            f"({STEPS_KEPT} steps of the parts of the state this node keeps: its ranks' and its peer copies). HINT: give "
            "it more room (a container's /dev/shm: docker --shm-size, Kubernetes an emptyDir with medium: Memory), "
            "point fast_dirpath at a node-local disk, set fast_replicas=0, or fast_dirpath=None for no fast tier")
