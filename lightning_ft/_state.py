"""Lightning's checkpoint dict, translated for the core, and back.

The core writes tensors with torch.distributed.checkpoint, treating them as replicated across ranks
(one copy written, the work spread over ranks), and everything else per rank in a file that loads
with ``weights_only=True``. A Lightning checkpoint dict needs three adjustments for that:

* the model and optimizer tensors (``state_dict``, ``optimizer_states``) are replicated under DDP and
  stay tensors; everything else (callback, loop, scheduler, datamodule state) may differ per rank,
  so its small tensors are stored per rank, as bytes (larger ones stay shared tensors);
* objects that ``weights_only`` refuses become plain values: numpy scalars and arrays, argparse
  Namespaces; anything else in ``hyper_parameters`` is dropped (``fit`` does not read it), and
  anywhere else it is an error that names the entry;
* under DDP, buffers (BatchNorm statistics) are taken from rank 0, as Lightning's own checkpoints do.

Example:
    >>> import torch
    >>> ck = {"state_dict": {"w": torch.ones(2)}, "callbacks": {"ES": {"best_score": torch.tensor(0.5)}}}
    >>> tree = to_core(ck)
    >>> isinstance(tree["callbacks"]["ES"]["best_score"], torch.Tensor)   # stored per rank, as bytes
    False
    >>> from_core(tree)["callbacks"]["ES"]["best_score"]
    tensor(0.5000)
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from ft_checkpoint.errors import CheckpointCorruptError, ConfigError

log = logging.getLogger(__name__)

REPLICATED = ("state_dict", "optimizer_states")
"""Entries whose tensors are the same on every rank (plain DDP) or sharded DTensors."""
LENIENT = ("hyper_parameters",)
"""Entries where a value that cannot be stored safely is dropped instead of raising."""
PER_RANK_MAX_BYTES = 1 << 20
"""Tensors up to this size outside :data:`REPLICATED` are stored per rank."""
METRICS = "lightning_ft_metrics"
"""The entry of the saved dict that holds the torchmetrics states (each rank's own, synchronized only when computed:
stored per rank whatever their size); taken out of the dict before Lightning restores it."""
FROZEN = "lightning_ft_frozen"
"""The entry that names the model's parameters that did not require grad at the save: a callback such as
``BackboneFinetuning`` freezes and unfreezes them as training goes, and no Lightning checkpoint keeps that; taken out
of the dict before Lightning restores it."""
_TENSOR, _NDARRAY = "__lightning_ft_tensor__", "__lightning_ft_ndarray__"
_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class _Drop:
    """Marks a value left out of the checkpoint."""


_DROP = _Drop()


def to_core(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """A Lightning checkpoint dict as a tree of tensors and ``weights_only``-safe values."""
    out = {}
    for key, value in checkpoint.items():
        converted = _convert(value, (key,), per_rank=key not in REPLICATED, lenient=key in LENIENT)
        if converted is not _DROP:
            out[key] = converted
    return out


def from_core(tree: Any) -> Any:
    """The inverse of :func:`to_core` (dropped values stay dropped)."""
    if isinstance(tree, Mapping):
        if len(tree) == 1 and _TENSOR in tree:
            return _decode_tensor(tree[_TENSOR])
        if len(tree) == 1 and _NDARRAY in tree:
            return _decode_ndarray(tree[_NDARRAY])
        items = [(k, from_core(v)) for k, v in tree.items()]
        return OrderedDict(items) if isinstance(tree, OrderedDict) else dict(items)
    if isinstance(tree, list):
        return [from_core(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(from_core(v) for v in tree)
    return tree


def check_model_tensors(tree: Mapping[str, Any]) -> None:
    """Raise CheckpointCorruptError if the saved model state (``tree["lightning"]["state_dict"]``, as loaded by
    the core) holds None where a tensor belongs: the step's metadata left that tensor out, and Lightning's
    ``load_state_dict`` would raise on every restart. The resume skips the step instead.

    Example:
        >>> check_model_tensors({"lightning": {"state_dict": {"w": torch.ones(1)}}})
        >>> try:
        ...     check_model_tensors({"lightning": {"state_dict": {"w": None}}})
        ... except CheckpointCorruptError as e:
        ...     print(str(e)[:50])
        the step's metadata lists no tensor for state_dict
    """
    saved = tree.get("lightning", {}).get("state_dict") if isinstance(tree.get("lightning"), Mapping) else None
    if not isinstance(saved, Mapping):  # DeepSpeed saves the model as files of its own
        return
    missing = [str(k) for k, v in saved.items() if v is None and not str(k).endswith("_extra_state")]
    if missing:
        raise CheckpointCorruptError(
            f"the step's metadata lists no tensor for state_dict {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}, which the step's state file records: the metadata was cut")


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as a per-rank plain value (dtype, shape, bytes)."""
    t = t.detach().to("cpu", copy=True).contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {_TENSOR: (str(t.dtype).removeprefix("torch."), tuple(t.shape), data)}


def _decode_tensor(value: Any) -> torch.Tensor:
    dtype_name, shape, data = value
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"checkpoint holds a tensor of unknown dtype {dtype_name!r}")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _decode_ndarray(value: Any) -> Any:
    import numpy as np

    dtype, shape, data = value
    return np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).reshape(shape)


def _convert(value: Any, path: tuple[Any, ...], *, per_rank: bool, lenient: bool) -> Any:
    if isinstance(value, torch.Tensor):
        small = value.numel() * value.element_size() <= PER_RANK_MAX_BYTES
        if per_rank and not _is_dtensor(value) and (small or path[0] == METRICS):
            return encode_tensor(value)
        return value.detach()
    numpy_value = _from_numpy(value)  # first: numpy.float64 is also a float
    if numpy_value is not None:
        return numpy_value
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping) or isinstance(value, argparse.Namespace):
        items = vars(value).items() if isinstance(value, argparse.Namespace) else value.items()
        out = []
        for k, v in items:
            if not isinstance(k, (str, int)):
                if lenient:
                    continue
                _unsupported((*path, k), k, "key")
            converted = _convert(v, (*path, k), per_rank=per_rank, lenient=lenient)
            if converted is not _DROP:
                out.append((k, converted))
        return OrderedDict(out) if isinstance(value, OrderedDict) else dict(out)
    if isinstance(value, (list, tuple)):
        converted = [_convert(v, (*path, i), per_rank=per_rank, lenient=lenient) for i, v in enumerate(value)]
        if lenient and any(c is _DROP for c in converted):
            return _DROP
        return list(converted) if isinstance(value, list) else tuple(converted)
    if lenient:
        log.debug("not saving %s (%s): only plain values are kept there", _where(path), type(value).__name__)
        return _DROP
    return _unsupported(path, value, "value")


def _from_numpy(value: Any) -> Any:
    np = sys.modules.get("numpy")  # only a value of an imported numpy can be a numpy value
    if np is None:
        return None
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return {_NDARRAY: (value.dtype.str, tuple(value.shape), value.tobytes())}
    return None


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _where(path: tuple[Any, ...]) -> str:
    return "checkpoint" + "".join(f"[{p!r}]" for p in path)


def _unsupported(path: tuple[Any, ...], value: Any, what: str) -> Any:
    raise ConfigError(
        f"FaultTolerantCheckpoint cannot save {_where(path)}: a {what} of type {type(value).__module__}."
        f"{type(value).__qualname__}, which cannot be loaded back safely (weights_only). HINT: return only "
        "tensors, numbers, strings, lists, tuples and dicts from the state_dict()/on_save_checkpoint() "
        "that produced it")


def rank0_buffers(state_dict: Mapping[str, Any], module: torch.nn.Module) -> Mapping[str, Any]:
    """``state_dict`` with its buffers replaced by copies of rank 0's (a collective: call on every rank).

    Under DDP the parameters are identical on every rank but buffers such as BatchNorm's running
    statistics are not until the next forward pass broadcasts rank 0's. The checkpoint must hold rank
    0's, which is what the training continues with.
    """
    import torch.distributed as dist

    names = {name for name, _ in module.named_buffers()}
    out = OrderedDict(state_dict)
    for key, value in state_dict.items():
        if key in names and isinstance(value, torch.Tensor):
            copy = value.detach().clone()
            dist.broadcast(copy, src=0)
            out[key] = copy
    return out


def frozen_parameters(module: torch.nn.Module) -> list[str]:
    """The names of the parameters of ``module`` that do not require grad.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> net[0].requires_grad_(False) and frozen_parameters(net)
        ['0.weight', '0.bias']
    """
    return [name for name, p in module.named_parameters() if not p.requires_grad]


def restore_frozen(module: torch.nn.Module, frozen: list[str]) -> list[str]:
    """Make the parameters named in ``frozen`` the only ones of ``module`` that do not require grad, as at the save
    :func:`frozen_parameters` described; returns the names of those changed."""
    names, changed = set(frozen), []
    for name, p in module.named_parameters():
        if p.requires_grad == (name in names):
            p.requires_grad_(name not in names)
            changed.append(name)
    return changed
