"""What the hook checkpoints from an ``Accelerator``, as objects with ``state_dict``/``load_state_dict``.

Models and their optimizers go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``): keys are canonical parameter names (no DDP ``module.``
prefix, optimizer state keyed by name rather than by id), and under FSDP each rank holds only its own
shard (DTensors), so DCP writes every shard once, from its owner, and reshards on load. Under DDP the
buffers (BatchNorm's running statistics) are rank 0's on every rank: DCP writes a replicated tensor
from whichever rank its planner picks, and each rank's differ until DDP's next forward pass
broadcasts rank 0's, which the training continues with. Schedulers,
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

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from accelerate_ft import _accelerate_internals as internals
from ft_checkpoint import ConfigError, StateMismatchError

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger(__name__)
_UNSUPPORTED = ("MEGATRON_LM", "XLA")


class ModelState:
    """A model and the optimizers over its parameters, through DCP's state-dict helpers.

    Args:
        model: The prepared model (DDP-wrapped, FSDP-wrapped or plain).
        optimizers: The raw torch optimizers whose parameters all belong to ``model``.
        buffers_from_rank0: Save rank 0's buffers on every rank (DDP; a collective at each save and resume).
    """

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), *,
                 buffers_from_rank0: bool = False) -> None:
        self.model = model
        self.optimizers = list(optimizers)
        self.buffers_from_rank0 = buffers_from_rank0

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizers:
            return {"model": self._rank0_buffers(get_model_state_dict(self.model))}
        with _no_initial_step(self.model, self.optimizers):
            model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": self._rank0_buffers(model_sd), "optimizers": optim_sd}

    def _rank0_buffers(self, model_sd: dict[str, Any]) -> dict[str, Any]:
        if not self.buffers_from_rank0:
            return model_sd
        return rank0_buffers(model_sd, getattr(self.model, "module", self.model))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.optimizers:
            set_model_state_dict(self.model, state["model"])
            return
        if "optimizers" not in state:
            raise ConfigError("the checkpoint has this model without optimizer state, but this run prepared "
                              f"{len(self.optimizers)} optimizer(s) for it. HINT: prepare the same objects as the run that saved")
        _check_param_groups(self.optimizers, state["optimizers"])
        set_model_state_dict(self.model, state["model"])
        with _no_initial_step(self.model, self.optimizers):  # not strict: LBFGS keeps its state under one parameter
            set_optimizer_state_dict(self.model, self.optimizers, state["optimizers"],
                                     options=StateDictOptions(strict=False))


def _check_param_groups(optimizers: Sequence[torch.optim.Optimizer], saved: Mapping[str, Any]) -> None:
    """Raise StateMismatchError if the checkpoint's optimizers have another number of param groups than ``optimizers``:
    DCP maps optimizer state by parameter name and drops, without a word, what the live optimizers lack (a group
    added during training with ``add_param_group``, which the resumed run has not added yet)."""
    groups, saved_groups = sum(len(opt.param_groups) for opt in optimizers), len(saved.get("param_groups", []))
    if saved_groups != groups:
        raise StateMismatchError(
            f"the checkpoint's optimizers have {saved_groups} param groups, this run's {groups}: "
            "loading it would drop the optimizer state (and the training) of the parameters of the groups this run "
            "lacks. HINT: add the same param groups (optimizer.add_param_group) before FaultTolerantCheckpoint(...) "
            "resumes, as they were at the saved step")


@contextlib.contextmanager
def _no_initial_step(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Keep DCP's state-dict helpers from stepping an optimizer that has no state yet.

    ``get_state_dict`` and ``set_state_dict`` create a fresh optimizer's state by a step over zero gradients
    (learning rate 0): a full optimizer step and a zero tensor per parameter on every resume (for Adam over
    600 MB of parameters, seconds before the load starts), and a step counted (Adam's ``step`` becomes 1) in a
    state that had none. A resume needs none of it: the checkpoint's optimizer tensors that the state lacks are
    read into new tensors, which ``load_state_dict`` takes as they are. An empty placeholder per parameter
    (which optimizers treat as not yet initialized) tells DCP the state exists; ``load_state_dict`` replaces
    them, and any left afterwards are removed. A save before the first optimizer step (or of an optimizer that
    keeps no state, such as SGD without momentum) leaves the live optimizer as it is and saves each parameter's
    state empty. FSDP's optimizer state (DTensors, or FSDP1's flat parameters) keeps DCP's own path.
    """
    fresh = [opt for opt in optimizers  # empty: no state, no gradients (DCP's own test for stepping it)
             if not opt.state and all(p.grad is None for group in opt.param_groups for p in group["params"])]
    placeholders = []
    if fresh and not _sharded(model) and not _fsdp1(model):  # a save after the first step looks no further
        for opt in fresh:
            placeholders += [(opt, p, opt.state[p]) for group in opt.param_groups for p in group["params"]
                             if p.requires_grad]  # each a new {}
    try:
        yield
    finally:
        for opt, param, placeholder in placeholders:
            if opt.state.get(param) is placeholder and not placeholder:
                del opt.state[param]


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


def rank0_buffers(state_dict: Mapping[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """``state_dict`` with its buffers replaced by copies of rank 0's (a collective: call on every rank).

    Under DDP the parameters are identical on every rank, buffers are not until the next forward pass
    broadcasts rank 0's. The checkpoint must hold rank 0's, which the training continues with.
    """
    names = {name for name, _ in module.named_buffers()}
    out = dict(state_dict)
    for key, value in state_dict.items():
        if key in names and isinstance(value, torch.Tensor):
            copy = value.detach().clone()
            dist.broadcast(copy, src=0)
            out[key] = copy
    return out


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
    ``scaler``, ``custom`` (``register_for_checkpointing``). Under DeepSpeed see :func:`deepspeed_state`.

    Raises:
        ConfigError: for a Megatron-LM or XLA accelerator, or when nothing was prepared yet.
    """
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise ConfigError(f"FaultTolerantCheckpoint does not support {kind} (it checkpoints through its own engine). "
                          "HINT: use DDP, FSDP, DeepSpeed or a single process, or that engine's own checkpointing")
    models, optimizers = internals.models(accelerator), internals.optimizers(accelerator)
    registered = internals.registered(accelerator)
    if not models and not optimizers and not registered:
        raise ConfigError("the accelerator has prepared nothing to checkpoint. HINT: create FaultTolerantCheckpoint "
                          "after `model, optimizer, ... = accelerator.prepare(...)`")
    if kind == "DEEPSPEED":
        return deepspeed_state(accelerator)
    paired, unpaired = pair_optimizers(models, optimizers)
    if unpaired:
        log.warning("%d optimizer(s) cover parameters of several (or no) prepared models; they are saved with their "
                    "own state_dict, which works for DDP but cannot be resharded (FSDP)", len(unpaired))
    ddp = _replicated_by_ddp(accelerator)
    state: dict[str, Any] = {
        ("model" if i == 0 else f"model_{i}"): ModelState(m, opts, buffers_from_rank0=ddp and not _sharded(m))
        for i, (m, opts) in enumerate(zip(models, paired))}
    state["unpaired_optimizers"] = StatefulList("unpaired optimizer", unpaired)
    state["schedulers"] = StatefulList("scheduler", internals.schedulers(accelerator))
    state["scaler"] = _Scaler(accelerator.scaler)
    state["custom"] = StatefulList("object registered for checkpointing", registered)
    return state


def deepspeed_state(accelerator: Accelerator) -> dict[str, Any]:
    """The state of an accelerator with the DeepSpeed plugin, as ``Accelerator.save_state`` saves it.

    Each prepared engine saves itself through DeepSpeed's ``save_checkpoint`` (its model, ZeRO optimizer
    partitions and the scheduler DeepSpeed was given): ``model``, ``model_1``, ... (the files of
    ``model_<i>`` are prefixed ``model_<i>.``). Accelerate's optimizer and DeepSpeed scheduler wrappers are
    not saved again; other schedulers (not given to DeepSpeed) and ``register_for_checkpointing`` objects
    use their own ``state_dict``.
    """
    from accelerate.utils import DeepSpeedSchedulerWrapper

    from ft_checkpoint.integrations.deepspeed import DeepSpeedState

    state: dict[str, Any] = {}
    for i, engine in enumerate(internals.models(accelerator)):
        key = "model" if i == 0 else f"model_{i}"
        state[key] = DeepSpeedState(engine, prefix="" if i == 0 else f"{key}.")
    own = [s for s in internals.schedulers(accelerator) if not isinstance(s, DeepSpeedSchedulerWrapper)]
    state["schedulers"] = StatefulList("scheduler", own)
    state["custom"] = StatefulList("object registered for checkpointing", internals.registered(accelerator))
    return state


def _replicated_by_ddp(accelerator: Accelerator) -> bool:
    """Whether ``prepare`` wrapped models in DDP (several processes, not FSDP); warns if it leaves buffers per rank."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    ddp = accelerator.num_processes > 1 and kind.startswith("MULTI_")
    handler = getattr(accelerator, "ddp_handler", None)
    if ddp and handler is not None and not handler.broadcast_buffers:
        log.warning("DistributedDataParallelKwargs(broadcast_buffers=False): each rank keeps its own buffers (e.g. "
                    "BatchNorm statistics), but a checkpoint holds one copy, rank 0's; after a resume every rank "
                    "starts from rank 0's")
    return ddp


def _fsdp1(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds FSDP1 modules (flat parameters, whose optimizer state DCP converts itself)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())
