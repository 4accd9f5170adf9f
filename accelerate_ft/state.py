"""What the hook checkpoints from an ``Accelerator``, as objects with ``state_dict``/``load_state_dict``.

Models and their optimizers go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``): keys are canonical parameter names (no DDP ``module.``
prefix, optimizer state keyed by name rather than by id), and under FSDP each rank holds only its own
shard (DTensors), so DCP writes every shard once, from its owner, and reshards on load. Schedulers,
the grad scaler and objects passed to ``accelerator.register_for_checkpointing`` use their own
``state_dict``.

Example:
    >>> import torch
    >>> from accelerate import Accelerator
    >>> acc = Accelerator(cpu=True)
    >>> model = torch.nn.Linear(2, 2)
    >>> model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> sorted(accelerator_state(acc))
    ['custom', 'model', 'scaler', 'schedulers', 'unpaired_optimizers']
    >>> sorted(accelerator_state(acc)["model"].state_dict()["model"])
    ['bias', 'weight']
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ft_checkpoint import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger(__name__)
_UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM", "XLA")


class ModelState:
    """A model and the optimizers over its parameters, through DCP's state-dict helpers.

    Args:
        model: The prepared model (DDP-wrapped, FSDP-wrapped or plain).
        optimizers: The raw torch optimizers whose parameters all belong to ``model``.
    """

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        self.model = model
        self.optimizers = list(optimizers)

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizers:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optimizers": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.optimizers:
            set_model_state_dict(self.model, state["model"])
            return
        if "optimizers" not in state:
            raise ConfigError("the checkpoint has this model without optimizer state, but this run prepared "
                              f"{len(self.optimizers)} optimizer(s) for it. HINT: prepare the same objects as the run that saved")
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizers"])


class StatefulList:
    """Several objects with ``state_dict``/``load_state_dict`` (schedulers, custom objects), by index.

    Args:
        what: What the objects are, for error messages (``"scheduler"``).
        objects: The objects.
    """

    def __init__(self, what: str, objects: Sequence[Any]) -> None:
        self.what = what
        self.objects = list(objects)

    def state_dict(self) -> dict[str, Any]:
        return {str(i): obj.state_dict() for i, obj in enumerate(self.objects)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state) != len(self.objects):
            raise ConfigError(
                f"the checkpoint has {len(state)} {self.what}(s), this run has {len(self.objects)}. "
                "HINT: prepare / register_for_checkpointing the same objects, in the same order, as the run that saved")
        for i, obj in enumerate(self.objects):
            obj.load_state_dict(state[str(i)])


class _Scaler:
    """The accelerator's grad scaler, or nothing (it exists only for fp16 on an accelerator device)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def pair_optimizers(models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]
                    ) -> tuple[list[list[torch.optim.Optimizer]], list[torch.optim.Optimizer]]:
    """Each model's optimizers (those whose parameters all belong to it), and the optimizers that span models.

    Example:
        >>> a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        >>> oa, ob = torch.optim.SGD(a.parameters(), lr=1), torch.optim.SGD(b.parameters(), lr=1)
        >>> paired, unpaired = pair_optimizers([a, b], [ob, oa])
        >>> paired == [[oa], [ob]], unpaired
        (True, [])
    """
    owner: dict[int, int] = {}
    for i, model in enumerate(models):
        for p in model.parameters():
            owner.setdefault(id(p), i)
    paired: list[list[torch.optim.Optimizer]] = [[] for _ in models]
    unpaired = []
    for opt in optimizers:
        owners = {owner.get(id(p)) for group in opt.param_groups for p in group["params"]}
        if len(owners) == 1 and None not in owners:
            paired[owners.pop()].append(opt)  # type: ignore[index]
        else:
            unpaired.append(opt)
    return paired, unpaired


def accelerator_state(accelerator: Accelerator) -> dict[str, Any]:
    """Everything ``accelerator`` prepared or registered, as a state dict for :class:`ft_checkpoint.CheckpointManager`.

    Keys: ``model``, ``model_1``, ... (each with its optimizers), ``unpaired_optimizers`` (optimizers
    over several models; saved with their own ``state_dict``, so not resharded), ``schedulers``,
    ``scaler``, ``custom`` (``register_for_checkpointing``).

    Raises:
        ConfigError: for a DeepSpeed, Megatron-LM or XLA accelerator, or when nothing was prepared yet.
    """
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise ConfigError(f"FaultTolerantCheckpoint does not support {kind} (it checkpoints through its own engine). "
                          "HINT: use DDP, FSDP or a single process, or that engine's own checkpointing")
    models = list(accelerator._models)
    optimizers = [getattr(o, "optimizer", o) for o in accelerator._optimizers]
    if not models and not optimizers and not accelerator._custom_objects:
        raise ConfigError("the accelerator has prepared nothing to checkpoint. HINT: create FaultTolerantCheckpoint "
                          "after `model, optimizer, ... = accelerator.prepare(...)`")
    paired, unpaired = pair_optimizers(models, optimizers)
    if unpaired:
        log.warning("%d optimizer(s) cover parameters of several (or no) prepared models; they are saved with their "
                    "own state_dict, which works for DDP but cannot be resharded (FSDP)", len(unpaired))
    state: dict[str, Any] = {("model" if i == 0 else f"model_{i}"): ModelState(m, opts)
                             for i, (m, opts) in enumerate(zip(models, paired))}
    state["unpaired_optimizers"] = StatefulList("unpaired optimizer", unpaired)
    state["schedulers"] = StatefulList("scheduler", accelerator._schedulers)
    state["scaler"] = _Scaler(accelerator.scaler)
    state["custom"] = StatefulList("object registered for checkpointing", accelerator._custom_objects)
    return state
