"""Where a resume can take each step from: what every node's fast tier holds, and the plan for one step.

Every rank reports what its node's fast-tier folder holds (:func:`inventory`: each rank folder's committed
step, and the steps whose manifest and file sizes check, with the save that wrote each: cheap, no data read).
A step counts if some node marks it committed (its mark is written only after every rank wrote its part and
its peer copy) for the job's world size, and if every rank's part of that save is held by some node, not
ruled out by an earlier failure (a part of another save of the same step, one a crash left half rewritten
after a resume from an older step, is never mixed in).
Each rank then takes its part from its own node if that holds it, else from a node that holds a copy.

Example:
    >>> from ft_checkpoint.tiers.folder import Mark
    >>> from ft_checkpoint.tiers.node import Ring
    >>> ring = Ring(("a", "a", "b", "b"))
    >>> a = Holding("a", marks={0: Mark(9, 4, "s1")}, steps={9: {0: "s1", 1: "s1", 2: "s1", 3: "s1"}})  # + b's copies
    >>> b = Holding("b", marks={}, steps={})                                 # node b lost its folder
    >>> plan = plan_steps([a, a, b, b], ring)[0]
    >>> plan.step, plan.holders, plan.source
    (9, (0, 1, 0, 1), 'peer copies')
"""

from __future__ import annotations

import dataclasses
import logging

from ft_checkpoint.format import layout
from ft_checkpoint.policies.adaptive.classes import CRASH, MORE, NO_FAST_STEP, NODE
from ft_checkpoint.tiers.folder import FastFolder, Mark
from ft_checkpoint.tiers.node import Ring

log = logging.getLogger(__name__)
OWN, PEER = "own node", "peer copies"


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one node's fast tier holds: each rank folder's mark, and by step the ranks whose parts check (and the
    save that wrote each)."""

    node: str
    marks: dict[int, Mark]
    steps: dict[int, dict[int, str]]


def inventory(folder: FastFolder, node: str) -> Holding:
    """What this node's folder holds (manifests and sizes checked; no data read)."""
    marks: dict[int, Mark] = {}
    steps: dict[int, dict[int, str]] = {}
    for rank in folder.held_ranks():
        mark = folder.committed(rank)
        if mark is not None:
            marks[rank] = mark
        storage = folder.storage(rank)
        for step, has_manifest in sorted(layout.list_steps(storage).items()):
            check = layout.check_step(storage, step) if has_manifest else None
            if check is not None and check.ok and check.manifest is not None:
                steps.setdefault(step, {})[rank] = _save_of(check.manifest)
    return Holding(node, marks, steps)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step from the fast tier: for each rank, the rank whose node holds its part (itself: its own node)."""

    step: int
    holders: tuple[int, ...]
    save: str = ""
    """The save whose parts these are."""

    @property
    def source(self) -> str:
        """``own node`` when every rank reads its own node's folder, else ``peer copies``."""
        return OWN if all(h == r for r, h in enumerate(self.holders)) else PEER


def plan_steps(holdings: list[Holding], ring: Ring, *, ruled_out: frozenset[tuple[str, int]] = frozenset()
               ) -> list[StepPlan]:
    """The steps every rank can take from the fast tier, newest first (``holdings`` by rank, ``ruled_out``:
    ``(node, rank)`` parts that failed already)."""
    by_node = {h.node: h for h in holdings}
    marked = {(m.step, m.save) for h in by_node.values() for m in h.marks.values() if m.world_size == ring.world_size}
    plans = []
    for step, save in sorted(marked, reverse=True):
        holders = [_holder(by_node, ring, rank, step, save, ruled_out) for rank in range(ring.world_size)]
        if all(h is not None for h in holders):
            plans.append(StepPlan(step, tuple(h for h in holders if h is not None), save))
    return plans


def failure_class(holdings: list[Holding], ring: Ring) -> str:
    """What the nodes' fast-tier folders say about the failure before this start (see ``adaptive.classes``): every
    node's folder still holds a commit mark of each of its ranks (a process crash), one node's does not (one node
    lost), more nodes' do not or the marks are another world size's (more), or no node holds any mark.

    Example:
        >>> from ft_checkpoint.tiers.folder import Mark
        >>> ring, mark = Ring(("a", "b")), Mark(9, 2, "s1")
        >>> failure_class([Holding("a", {0: mark, 1: mark}, {}), Holding("b", {}, {})], ring)   # b's folder is empty
        'one node lost'
    """
    by_node = {h.node: h for h in holdings}
    marks = [m for h in by_node.values() for m in h.marks.values()]
    if not marks:
        return NO_FAST_STEP
    if all(m.world_size != ring.world_size for m in marks):
        return MORE
    lost = [node for node in ring.nodes if any(
        (m := by_node[node].marks.get(rank)) is None or m.world_size != ring.world_size for rank in ring.ranks_on(node))]
    return CRASH if not lost else NODE if len(lost) == 1 else MORE


def other_world_sizes(holdings: list[Holding], world_size: int) -> dict[int, int]:
    """``{step: world size}`` of the committed fast-tier steps saved by another world size than ``world_size``."""
    return {m.step: m.world_size for h in holdings for m in h.marks.values() if m.world_size != world_size}


def _save_of(manifest: layout.Manifest) -> str:
    own = manifest.metadata.get(layout.FAST_TIER)
    return own.get("save", "") if isinstance(own, dict) and isinstance(own.get("save", ""), str) else ""


def _holder(by_node: dict[str, Holding], ring: Ring, rank: int, step: int, save: str,
            ruled_out: frozenset[tuple[str, int]]) -> int | None:
    """The rank that gives ``rank`` its part of ``step`` written by ``save``: itself if its node holds it, else a
    rank on a node that does (the one with the same local index), or None."""
    own = ring.node_of[rank]
    nodes = [own] + [n for n in ring.nodes if n != own]
    for node in nodes:
        held = by_node.get(node)
        if held is None or held.steps.get(step, {}).get(rank) != save or (node, rank) in ruled_out:
            continue
        if node == own:
            return rank
        there = ring.ranks_on(node)
        return there[ring.local_index(rank) % len(there)]
    return None
