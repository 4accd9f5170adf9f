"""Nodes and the ring of peers: which node each rank runs on, and which rank holds a copy of whose files.

A node is what shares one fast-tier folder: its ranks write their own files there, and it also holds the
files of the ranks of the node before it in a ring over the nodes (ordered by name), each kept by the rank
with the same local index. Nodes are named by what stays with the machine, the host name and the fast
tier's path (or ``node_id``), never by torchrun's node rank: its c10d rendezvous numbers nodes in joining
order, which can change at every restart.

Example:
    >>> ring = Ring(("b", "b", "a", "a"))     # ranks 0 and 1 on node b, ranks 2 and 3 on node a
    >>> ring.nodes, ring.peer(2), ring.peer(0), ring.sources(0)
    (['a', 'b'], 0, 2, [2])
    >>> Ring(("a", "a")).peer(1) is None      # one node: no peer
    True
"""

from __future__ import annotations

import dataclasses
import os
import socket


def default_node_id(fast_dirpath: str) -> str:
    """This node's default name: ``<host name>:<fast tier's real path>`` (two "nodes" on one machine, each with
    a folder of its own, are two nodes)."""
    return f"{socket.gethostname()}:{os.path.realpath(fast_dirpath)}"


@dataclasses.dataclass(frozen=True)
class Ring:
    """The node of every rank (``node_of[rank]``), and the ring over the nodes that places peer copies."""

    node_of: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> list[str]:
        """The node names, in ring order."""
        return sorted(set(self.node_of))

    def ranks_on(self, node: str) -> list[int]:
        """The ranks running on ``node``, in rank order."""
        return [r for r, n in enumerate(self.node_of) if n == node]

    def local_index(self, rank: int) -> int:
        """``rank``'s position among the ranks of its node."""
        return self.ranks_on(self.node_of[rank]).index(rank)

    def peer(self, rank: int) -> int | None:
        """The rank on the next node that holds a copy of ``rank``'s files (None on a single node)."""
        nodes = self.nodes
        if len(nodes) < 2:
            return None
        following = self.ranks_on(nodes[(nodes.index(self.node_of[rank]) + 1) % len(nodes)])
        return following[self.local_index(rank) % len(following)]

    def sources(self, rank: int) -> list[int]:
        """The ranks whose files ``rank`` holds copies of."""
        return [r for r in range(self.world_size) if self.peer(r) == rank]
