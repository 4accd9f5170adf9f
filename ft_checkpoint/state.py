"""Training state as a tree: split it into tensors (for DCP) and everything else (per rank), and back.

``state`` follows DCP's convention: a dict whose values are tensors, nested dicts/lists, plain
values, or objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers,
samplers, ...). Tensors go to torch.distributed.checkpoint, which shards them and writes a replicated
tensor once. Everything else forms a small "skeleton" that each rank saves in its own file, loaded back
with ``torch.load(weights_only=True)`` so that loading never runs pickled code. DCP itself would store
those values with ``torch.save`` and load them with ``weights_only=False``; that is why they take this
separate path.

Example:
    >>> import torch
    >>> tensors, skeleton = split_tree({"model": {"w": torch.ones(2)}, "step": 7, "betas": (0.9, 0.99)})
    >>> sorted(tensors), skeleton["step"], skeleton["betas"]
    (['model/w'], 7, (0.9, 0.99))
    >>> merge_tree(skeleton, tensors)["model"]["w"]
    tensor([1., 1.])
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import random
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ft_checkpoint.errors import CheckpointCorruptError, ConfigError, StateMismatchError
from ft_checkpoint.format import torch_file
from ft_checkpoint.run.dist import Groups

Path = tuple[Any, ...]


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has callable ``state_dict`` and ``load_state_dict`` (DCP's Stateful)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class FilesParticipant(Protocol):
    """A part of the state that saves itself as files of its own (a DeepSpeed engine writes its own files),
    written, checksummed and committed by ft-checkpoint like the rest of a step."""

    def stage_files(self) -> dict[str, Callable[[Any], None]]:
        """At a save, on the training thread, once the previous save has committed: copy what the files need
        out of the training's way, and return ``{file name: writer}``; each writer later writes its file
        into the file object it is given, in the background. Names are plain and unique across ranks."""

    # Optional, for the fast tier: ``stands_alone`` (a bool) and ``stage_part()``, which returns ``(the files of
    # stage_files, the files this rank's fast-tier part holds besides: those another rank writes for it)``, so
    # that a rank's part alone loads it. A participant without them is saved to the durable tier only.

    def load_files(self, files: StepFiles) -> None:
        """At a resume: load the state from the step's files; ``files(name)`` returns a file's bytes, checked
        against the manifest (see :class:`StepFiles`). Raise CheckpointCorruptError or StateMismatchError
        to have the step skipped. Called on every rank (collectives are allowed)."""


@dataclasses.dataclass(frozen=True)
class StepFiles:
    """What a participant's ``load_files`` gets: ``files(name)`` reads a file of the step, checked against
    its size and CRC-32C in the manifest (CheckpointCorruptError), plus what the manifest says of the step.

    Example:
        >>> files = StepFiles(read=lambda name: b"abc", names=frozenset({"a.pt"}), metadata={"kind": "toy"},
        ...                   step=7, world_size=1)
        >>> files("a.pt"), files.metadata["kind"]
        (b'abc', 'toy')
    """

    read: Callable[[str], bytes]
    names: frozenset[str]
    """Every file the manifest lists (every rank's, every part's)."""
    metadata: Any
    """What this part's ``describe()`` returned at the save (rank 0's), or None."""
    step: int
    world_size: int
    """The number of ranks that saved the step."""

    def __call__(self, name: str) -> bytes:
        return self.read(name)


def is_files_participant(obj: Any) -> bool:
    """Whether ``obj`` saves itself as files of its own (see :class:`FilesParticipant`)."""
    return callable(getattr(obj, "stage_files", None)) and callable(getattr(obj, "load_files", None))


INTEGRATIONS = "ft_checkpoint.integrations"
"""Where the integration of a framework whose objects save themselves as files lives, as a module named after the
framework's top-level package (``ft_checkpoint.integrations.deepspeed``): the core names no framework."""


def integration_for(obj: Any) -> Any | None:
    """The integration that wraps ``obj`` in a files participant: the module of :data:`INTEGRATIONS` named after
    the package of one of its classes, if there is one and its ``is_participant(obj)`` says so. It offers
    ``participant(obj, key=..., several=...)``.

    Example:
        >>> integration_for(torch.nn.Linear(1, 1)) is None
        True
    """
    for cls in type(obj).__mro__:
        integration = _integration(cls.__module__.partition(".")[0])
        if integration is not None and integration.is_participant(obj):
            return integration
    return None


@functools.cache
def _integration(package: str) -> Any | None:
    name = f"{INTEGRATIONS}.{package}"
    try:
        return importlib.import_module(name) if importlib.util.find_spec(name) is not None else None
    except (ImportError, ValueError):  # not a module name
        return None


def split_participants(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the rest of state, its files participants)``, by key."""
    parts = {k: v for k, v in state.items() if is_files_participant(v)}
    return {k: v for k, v in state.items() if k not in parts}, parts


class Participants:
    """Splits a state into its plain part and its files participants, wrapping each object of a framework that
    saves itself as files (a DeepSpeed engine) by its integration (see :func:`integration_for`), the same
    wrapper at every save (it keeps its staging buffers); with several in one state, each is told so.

    Example:
        >>> plain, parts = Participants().split({"model": torch.nn.Linear(1, 1), "step": 3})
        >>> sorted(plain), parts
        (['model', 'step'], {})
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def split(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(the rest of state, its files participants)``, by key."""
        plain, participants = split_participants(state)
        found = {key: integration for key, value in plain.items() if (integration := integration_for(value)) is not None}
        for key, integration in found.items():
            obj = plain.pop(key)
            kept = self._wrapped.get(key)
            if kept is None or kept[0] is not obj:
                kept = self._wrapped[key] = (obj, integration.participant(obj, key=key, several=len(found) > 1))
            participants[key] = kept[1]
        return plain, participants


def describe_participants(parts: Mapping[str, Any]) -> dict[str, Any]:
    """What each participant says of itself for the manifest's metadata (``describe()``, if it has one), by key."""
    return {key: part.describe() for key, part in parts.items() if callable(getattr(part, "describe", None))}


FileWriters = dict[str, Callable[[Any], None]]


def stage_participants(parts: Mapping[str, Any], *, standalone: bool = False) -> tuple[FileWriters, FileWriters]:
    """Every participant's staged files: ``(this rank's files of the step, the files only its fast-tier part holds)``
    (with ``standalone``: see :class:`FilesParticipant`; else the second is empty). A name used twice is a
    ConfigError.

    Example:
        >>> stage_participants({})
        ({}, {})
    """
    files: FileWriters = {}
    extra: FileWriters = {}
    for key, part in parts.items():
        own, more = part.stage_part() if standalone else (part.stage_files(), {})
        clash = sorted((set(files) | set(extra)) & (set(own) | set(more)))
        if clash:
            raise ConfigError(f"state[{key!r}] stages a file named {clash[0]!r}, which another part of the state "
                              "stages too")
        files.update(own)
        extra.update(more)
    return files, extra


def stands_alone(parts: Mapping[str, Any]) -> bool:
    """Whether every participant can give a rank's files on their own, for a fast-tier part (see
    :class:`FilesParticipant`).

    Example:
        >>> stands_alone({})
        True
    """
    return all(callable(getattr(p, "stage_part", None)) and getattr(p, "stands_alone", False) for p in parts.values())


def require_state_dict(state: Any) -> None:
    """ConfigError, naming what was passed, unless ``state`` is a dict (a model passed as it is, say).

    Example:
        >>> try:
        ...     require_state_dict(object())
        ... except ConfigError as e:
        ...     print(str(e).split(". HINT")[0])
        state must be a dict of tensors, dicts and objects with state_dict(); got object
    """
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a dict of tensors, dicts and objects with state_dict(); got "
                          f"{type(state).__name__}. HINT: pass a dict, e.g. {{'model': model, 'optimizer': optimizer}}")


def to_tree(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every stateful value replaced by its ``state_dict()``."""
    require_state_dict(state)
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}


def tensor_key(path: Path) -> str:
    """The flat DCP key of the tensor at ``path``."""
    return "/".join(map(str, path))


def split_tree(tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors by flat key, skeleton)``: the skeleton is the tree with every tensor replaced by None."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: Path) -> Any:
        if isinstance(node, torch.Tensor):
            if (key := tensor_key(path)) in tensors:  # {"a/b": t, "a": {"b": u}}: one would load into the other
                raise ConfigError(f"state has two tensors at the key {key!r} (a path's keys joined with '/'): one at "
                                  f"{list(path)} and another whose keys join the same way. HINT: rename the key that "
                                  "has a '/' in it")
            tensors[key] = node
            return None
        if isinstance(node, Mapping):
            keys = [str(k) for k in node]
            if len(set(keys)) != len(keys):
                raise ConfigError(f"state at {tensor_key(path) or '<root>'!r} has keys that collide as strings: {list(node)}")
            items = [(k, walk(v, (*path, k))) for k, v in node.items()]
            return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
        if isinstance(node, (list, tuple)) and type(node) in (list, tuple):
            return type(node)(walk(v, (*path, i)) for i, v in enumerate(node))
        return node

    return tensors, walk(tree, ())


def leaf_types(tree: Any, path: Path = ()) -> dict[str, str]:
    """The type of every leaf of ``tree``, by flat key (as :func:`split_tree` names tensors).

    Example:
        >>> leaf_types({"model": {"w": torch.ones(2)}, "best": 0.5, "betas": (0.9, None)})
        {'model/w': 'Tensor', 'best': 'float', 'betas/0': 'float', 'betas/1': 'NoneType'}
    """
    if isinstance(tree, Mapping):
        return {k: t for key, value in tree.items() for k, t in leaf_types(value, (*path, key)).items()}
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return {k: t for i, value in enumerate(tree) for k, t in leaf_types(value, (*path, i)).items()}
    return {tensor_key(path): "Tensor" if isinstance(tree, torch.Tensor) else type(tree).__name__}


def check_tensors_match(tree: Mapping[str, Any], groups: Groups) -> None:
    """Raise StateMismatchError on every rank if a key of the shared ``tree`` holds a tensor on some ranks and
    another type (or nothing) on others, naming the key and both types.

    A tensor is written once for all ranks, any other value by each rank, so such a state can be neither
    saved nor resumed (nanoGPT's ``best_val_loss``: a 0-dim tensor on the rank that evaluates, a float on the
    others). A collective, on the training thread: call it on every rank; one small all-gather when they agree.

    Example:
        >>> from ft_checkpoint.run.dist import Groups
        >>> check_tensors_match({"best_val_loss": torch.tensor(0.5)}, Groups())   # one rank: nothing to compare
    """
    if not groups.distributed:
        return
    digest = zlib.crc32("\n".join(sorted(split_tree(tree)[0])).encode())
    if len(set(groups.all_gather(digest))) == 1:
        return
    kinds = groups.all_gather(leaf_types(tree))
    for key in sorted({k for ranks in kinds for k, t in ranks.items() if t == "Tensor"}):
        found = [ranks.get(key, "nothing") for ranks in kinds]
        other = next((r for r, t in enumerate(found) if t != "Tensor"), None)
        if other is not None:
            tensor = found.index("Tensor")
            raise StateMismatchError(
                f"state key {key!r} is a Tensor on rank {tensor} but {_a(found[other])} on rank {other}: a tensor of "
                "the shared state is written once for every rank, any other value by each rank, so this state can "
                f"be neither saved nor resumed. HINT: give {key!r} one type on every rank (float(x) everywhere, or "
                "torch.tensor(x) everywhere), or pass it in per_rank=")


def _a(type_name: str) -> str:
    return type_name if type_name == "nothing" else f"a {type_name}"


def merge_tree(skeleton: Any, tensors: Mapping[str, torch.Tensor], path: Path = ()) -> Any:
    """The inverse of :func:`split_tree`: put ``tensors`` back at their paths."""
    key = tensor_key(path)
    if path and key in tensors and skeleton is None:
        return tensors[key]
    if isinstance(skeleton, Mapping):
        items = [(k, merge_tree(v, tensors, (*path, k))) for k, v in skeleton.items()]
        return OrderedDict(items) if isinstance(skeleton, OrderedDict) else dict(items)
    if isinstance(skeleton, (list, tuple)) and type(skeleton) in (list, tuple):
        return type(skeleton)(merge_tree(v, tensors, (*path, i)) for i, v in enumerate(skeleton))
    return skeleton


MAX_DEPTH = 200
"""The deepest nesting of dicts, lists and tuples a saved state may have (the functions here recurse)."""

MAX_REPEATED = 1_000_000
"""How many more objects than it holds a saved state may present to a walk through its shared parts. A state
file that ft-checkpoint writes is a tree (:func:`split_tree` rebuilds every container), so it presents each object
once; a forged one of a few KB can nest one list twice in the next, 60 times over: 2**60 objects to a walk."""


def _children(node: Any) -> Any:
    """The values of a dict, list or tuple (of any subclass); None for anything else."""
    kind = type(node)
    if kind is list or kind is tuple:
        return node
    if kind is dict or isinstance(node, Mapping):
        return node.values()
    return node if isinstance(node, (list, tuple)) else None


def check_depth(tree: Any, limit: int = MAX_DEPTH, repeated: int = MAX_REPEATED) -> None:
    """Raise CheckpointCorruptError if ``tree`` nests dicts, lists and tuples deeper than ``limit``, or shares
    its parts so that a walk of it (:func:`merge_tree`, :func:`none_keys`) would meet more than ``repeated``
    objects beyond those it holds (a forged state file; walking it would exhaust the stack or the CPU).
    Iterative, and each container is measured once, so any depth and any sharing is checked in the time of
    one pass over what the file holds.

    Example:
        >>> check_depth({"model": {"w": [1, 2]}})
        >>> deep = []
        >>> for _ in range(MAX_DEPTH + 1):
        ...     deep = [deep]
        >>> try:
        ...     check_depth(deep)
        ... except CheckpointCorruptError as e:
        ...     print(e)
        the state saved nests deeper than 200 levels
        >>> wide = []
        >>> for _ in range(60):
        ...     wide = [wide, wide]
        >>> try:
        ...     check_depth(wide)
        ... except CheckpointCorruptError as e:
        ...     print(str(e)[:60])
        the state saved repeats its parts: a walk of it would meet 2
    """
    measured: dict[int, tuple[int, int]] = {}  # id of a container -> (levels below it, objects a walk meets in it)
    held = 1  # the objects a walk would meet if the file held a tree: the root and one per edge
    stack: list[tuple[Any, int, bool]] = [(tree, 0, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > limit:  # also ends a cycle, which never gets measured
            raise CheckpointCorruptError(f"the state saved nests deeper than {limit} levels")
        children = _children(node)
        if children is None or (not done and id(node) in measured):
            continue
        if not done:
            stack.append((node, depth, True))
            stack.extend((child, depth + 1, False) for child in children)
            continue
        below = [measured.get(id(child), (-1, 1)) for child in children]  # its containers were measured first
        measured[id(node)] = (1 + max((levels for levels, _ in below), default=-1), 1 + sum(n for _, n in below))
        held += len(children)
    levels, met = measured.get(id(tree), (0, 1))
    if levels > limit:
        raise CheckpointCorruptError(f"the state saved nests deeper than {limit} levels")
    if met - held > repeated:
        raise CheckpointCorruptError(f"the state saved repeats its parts: a walk of it would meet {met} objects, "
                                     f"{met - held} more than it holds")


def none_keys(skeleton: Any, path: Path = ()) -> set[str]:
    """The flat keys of a skeleton's None leaves: where :func:`split_tree` took a tensor out (or a None was).

    Example:
        >>> sorted(none_keys(split_tree({"model": {"w": torch.ones(1)}, "step": 3, "best": None})[1]))
        ['best', 'model/w']
    """
    if skeleton is None:
        return {tensor_key(path)} if path else set()
    if isinstance(skeleton, Mapping):
        return set().union(*(none_keys(v, (*path, k)) for k, v in skeleton.items()))
    if isinstance(skeleton, (list, tuple)) and type(skeleton) in (list, tuple):
        return set().union(*(none_keys(v, (*path, i)) for i, v in enumerate(skeleton)))
    return set()


def load_tree_into(state: dict[str, Any], tree: Mapping[str, Any]) -> list[str]:
    """Restore ``state`` in place from a loaded tree: ``load_state_dict`` on stateful values, else replace.

    Returns the keys of ``tree`` that ``state`` does not have (not loaded anywhere).

    Raises:
        StateMismatchError: a key of ``state`` is not in ``tree`` (nothing is changed then).
    """
    if not isinstance(tree, Mapping):
        raise StateMismatchError(f"the checkpoint holds a {type(tree).__name__}, not a state dict")
    missing = [k for k in state if k not in tree]
    if missing:
        raise StateMismatchError(
            f"state keys {missing} are not in the checkpoint (it has {sorted(map(str, tree))[:20]}). "
            "HINT: pass the same state keys to resume() as to save()")
    for k, v in state.items():
        if is_stateful(v):
            try:
                v.load_state_dict(tree[k])
            except Exception as e:  # a module's size mismatch, an optimizer's other param groups, ...
                raise StateMismatchError(f"state[{k!r}].load_state_dict failed: {type(e).__name__}: {e}") from e
        else:
            state[k] = tree[k]
    return sorted(str(k) for k in tree if k not in state)


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch, CUDA (if initialized), Python and NumPy (if installed)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return out
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))  # type: ignore[attr-defined]
    return out


def check_rng_state(state: Any) -> None:
    """Raise CheckpointCorruptError unless :func:`set_rng_state` can restore ``state`` whole. Each saved state
    is first set on a throwaway generator of its kind, which checks its size and type exactly as the real
    one would: a bad one is found before any RNG of this process is touched.

    Example:
        >>> check_rng_state(rng_state())
        >>> try:
        ...     check_rng_state({**rng_state(), "python": [1]})
        ... except CheckpointCorruptError as e:
        ...     print(str(e)[:45])
        the Python RNG state saved cannot be restored
    """
    if not isinstance(state, Mapping) or "torch" not in state or "python" not in state:
        raise CheckpointCorruptError("the RNG states saved are not a dict with 'torch' and 'python' states")
    checks: list[tuple[str, Callable[[], Any]]] = [
        ("torch RNG state", lambda: torch.Generator().set_state(state["torch"])),
        ("Python RNG state", lambda: random.Random().setstate(state["python"]))]
    if "cuda" in state and torch.cuda.is_available():
        checks.append(("CUDA RNG states", lambda: [torch.Generator(f"cuda:{i}").set_state(s)
                                                   for i, s in _cuda_states(state["cuda"])]))
    if "numpy" in state:
        checks.append(("NumPy RNG state", lambda: _numpy().random.RandomState().set_state(_numpy_state(state["numpy"]))))
    for what, check in checks:
        try:
            check()
        except Exception as e:  # whatever the generator refuses it with: a size, a type, a length
            raise CheckpointCorruptError(f"the {what} saved cannot be restored ({type(e).__name__}: {str(e)[:200]})") from e


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned. A state that cannot be restored raises CheckpointCorruptError
    before any RNG is set (see :func:`check_rng_state`)."""
    check_rng_state(state)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        for i, cuda in _cuda_states(state["cuda"]):
            torch.cuda.set_rng_state(cuda, i)
    if "numpy" in state:
        _numpy().random.set_state(_numpy_state(state["numpy"]))


def _cuda_states(states: Any) -> list[tuple[int, Any]]:
    """``(device, state)`` for each saved CUDA state whose device exists here."""
    if not isinstance(states, (list, tuple)):
        raise TypeError(f"expected a list of states, got {type(states).__name__}")
    return list(enumerate(states))[:torch.cuda.device_count()]


def _numpy() -> Any:
    import numpy

    return numpy


def _numpy_state(saved: Any) -> tuple[Any, ...]:
    """What ``numpy.random.set_state`` takes, from the plain values :func:`rng_state` saved."""
    name, keys, pos, has_gauss, cached = saved
    return name, _numpy().asarray(keys, dtype=_numpy().uint32), pos, has_gauss, cached


def parse_rank_file(data: bytes, name: str, where: str) -> dict[str, Any]:
    """A step's rank file ``name`` (read from ``where``, its URL), loaded through the allowlist and checked as a
    resume checks it (its shape, depth and RNG states): ``{"skeleton": ..., "per_rank": ...}``. ``verify`` checks
    each rank file the same way, so that it never calls intact a step a resume refuses.

    Raises:
        CheckpointCorruptError: naming the file.

    Example:
        >>> import io
        >>> buf = io.BytesIO(); torch.save({"skeleton": {"w": None}, "per_rank": {}}, buf)
        >>> parse_rank_file(buf.getvalue(), "rank_00000.pt", "memory://doc/rank_00000.pt")["skeleton"]
        {'w': None}
    """
    rank_state = torch_file.load(data, where)
    if not isinstance(rank_state, dict) or set(rank_state) != {"skeleton", "per_rank"} \
            or not isinstance(rank_state["per_rank"], dict):
        raise CheckpointCorruptError(f"{name}: not an ft-checkpoint rank file")
    try:
        check_depth(rank_state)
        if rank_state["per_rank"].get("rng") is not None:
            check_rng_state(rank_state["per_rank"]["rng"])
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{name}: {e}") from e
    return rank_state
