"""Gradients an optimizer holds for a step it has not taken yet: a save then would lose them.

A loop with several optimizers may step them at different rates: a GAN whose generator accumulates its gradients
over two batches while the discriminator steps every batch. A checkpoint holds parameters and optimizer state, not
gradients, so a resume from a batch where one optimizer holds accumulated gradients trains on without them and ends
with other weights. The integrations save only after batches where no optimizer holds such gradients.

An optimizer holds gradients it has not stepped on when a parameter of it has a gradient other than the one its last
step used: another tensor (``zero_grad()`` sets them to None, the next backward makes new ones), or the same one
changed since (its version counter: a backward adds into it in place) and not all zeros (``zero_grad(set_to_none=
False)`` zeroes it in place). Two parameters per optimizer are looked at, the first and the last with a gradient: a
backward through the optimizer's model writes them alike. With a single optimizer nothing is watched (its step is
the step boundary the integrations already wait for).

Example:
    >>> import torch
    >>> d, g = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    >>> opt_d, opt_g = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
    >>> watch = PendingGradients([opt_d, opt_g])
    >>> (d(torch.ones(2)) + g(torch.ones(2))).sum().backward(); opt_d.step(); opt_d.zero_grad()
    >>> watch.held()        # opt_g accumulates for a later step: no save here
    [1]
    >>> g(torch.ones(2)).sum().backward(); opt_g.step(); opt_g.zero_grad()
    >>> watch.held()
    []
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

MAX_WITHHELD = 64
"""Step boundaries in a row a save may be held back for; then it goes ahead (with a warning): an optimizer whose
parameters keep a gradient it never steps on (a second optimizer unused for a while) must not stop every save."""


class PendingGradients:
    """Watches ``optimizers`` (see the module's docstring); :meth:`withhold` at each step boundary says whether a save
    there would lose gradients held for a later step. :meth:`close` removes its step hooks. ``quiet``: no warning
    (ranks other than 0)."""

    def __init__(self, optimizers: Sequence[Any], *, quiet: bool = False) -> None:
        self.optimizers = [o for o in optimizers if hasattr(o, "register_step_post_hook")]
        self._used: dict[int, list[tuple[torch.Tensor, weakref.ref[torch.Tensor], int]]] = {}
        self._stepped: set[int] = set()
        self._in_a_row, self._warned, self._quiet = 0, False, quiet
        several = len(self.optimizers) > 1
        self._handles = [o.register_step_post_hook(self._after_step) for o in self.optimizers] if several else []

    def _after_step(self, optimizer: Any, *_: Any) -> None:
        self._stepped.add(id(optimizer))
        self._used[id(optimizer)] = [(p, weakref.ref(p.grad), p.grad._version) for p in _probes(optimizer)
                                     if p.grad is not None]

    def held(self) -> list[int]:
        """The indices of the optimizers that did not step since the last call (or :meth:`forget_steps`) and hold
        gradients they have not stepped on; then forgets which stepped."""
        if not self._handles:  # a single optimizer: nothing is watched, and nothing looked at on this hot path
            return []
        held = [i for i, o in enumerate(self.optimizers) if id(o) not in self._stepped and self._holds(o)]
        self._stepped.clear()
        return held

    def forget_steps(self) -> None:
        """The steps so far belong to no step boundary (a batch the loop left by ``break``): the next boundary looks
        at every optimizer that steps in its own batch only."""
        self._stepped.clear()

    def _holds(self, optimizer: Any) -> bool:
        used = self._used.get(id(optimizer))
        if not used:  # no step yet, or a step without gradients: any gradient is gathered for a later one
            return any(p.grad is not None for p in _probes(optimizer))
        for param, ref, version in used:
            grad = param.grad
            if grad is None or (ref() is grad and grad._version == version):
                continue  # set to None since its step, or the very gradient it used
            if ref() is not grad or bool(grad.any()):  # the same tensor zeroed in place holds nothing
                return True
        return False

    def withhold(self) -> bool:
        """Whether a save after this batch would lose gradients an optimizer holds for a later step (see
        :meth:`held`); after :data:`MAX_WITHHELD` such batches in a row it goes ahead, with a warning."""
        held = self.held()
        if not held:
            self._in_a_row = 0
            return False
        self._in_a_row += 1
        if self._in_a_row <= MAX_WITHHELD:
            return True
        if not self._warned and not self._quiet:
            self._warned = True
            log.warning("optimizer %d (%s) has held gradients it did not step on for %d step boundaries in a row: "
                        "saving anyway (gradients are in no checkpoint: a resume from such a step trains on without "
                        "them)", held[0], type(self.optimizers[held[0]]).__name__, self._in_a_row)
        return False

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._used.clear()


def _probes(optimizer: Any) -> list[torch.Tensor]:
    """The first and the last parameter of ``optimizer`` with a gradient (a backward through part of its parameters,
    a partly frozen model, reaches one of them at least as often), or fewer."""
    groups = optimizer.param_groups  # scanned from each end, never whole unless no parameter has a gradient
    first = next((p for group in groups for p in group["params"] if p.grad is not None), None)
    last = next((p for group in reversed(groups) for p in reversed(group["params"]) if p.grad is not None), None)
    return [p for p in (first, last) if p is not None][: 1 if first is last else 2]
