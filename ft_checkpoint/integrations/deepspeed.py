"""DeepSpeed engines in a checkpoint: DeepSpeed's own files, staged at the save, written, checked and committed
by ft-checkpoint like the rest of a step.

A :class:`DeepSpeedState` wraps a ``DeepSpeedEngine``. At a save it calls the engine's own
``save_checkpoint`` with a checkpoint engine of ours installed in the engine: each ``save(state_dict,
path)`` DeepSpeed makes (model states, ZeRO optimizer partitions, client state) is captured, and its
tensors are copied into host buffers kept from save to save (that copy is all the training waits
for); the files are then ``torch.save``\\ d from the copies by the background writer, with their sizes
and CRC-32C in the step's manifest. Each rank stages the files DeepSpeed has it write, under
DeepSpeed's names (unique across ranks), so a step directory is also a DeepSpeed tag directory that
DeepSpeed's tools (``zero_to_fp32.py``, ``ds_to_universal``) read. DeepSpeed's ``latest`` file is not
written, and the recovery scripts it copies are left out of the step.

At a resume, ``load_checkpoint`` runs with a ``load`` of ours: every file this rank will read is first
read through the manifest's checks and decoded with ``torch.load(weights_only=True)`` (the few DeepSpeed
classes its optimizer files pickle are allowlisted by exact name), and all ranks agree before DeepSpeed
starts loading; a corrupt or forged file makes the step skipped on every rank, and nothing in it runs.

:class:`~ft_checkpoint.CheckpointManager` wraps a DeepSpeed engine found in ``state`` by itself; use
``DeepSpeedState`` directly for its options.

Example:
    >>> import deepspeed                                                       # doctest: +SKIP
    >>> engine, *_ = deepspeed.initialize(model=model, config=ds_config)      # doctest: +SKIP
    >>> with CheckpointManager("gs://bucket/run", interval=500) as ckpt:      # doctest: +SKIP
    ...     state = {"engine": engine}                 # or {"engine": DeepSpeedState(engine, ...)}
    ...     start = ckpt.resume(state) or 0
    ...     for step in range(start + 1, steps + 1):
    ...         engine.backward(engine(next(data)).loss); engine.step()
    ...         ckpt.maybe_save(step, state)
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ft_checkpoint.errors import CheckpointCorruptError, ConfigError, StateMismatchError
from ft_checkpoint.format import layout, torch_file
from ft_checkpoint.integrations import _deepspeed_internals as internals
from ft_checkpoint.state import StepFiles

log = logging.getLogger(__name__)

STAGING_TAG = "ft-checkpoint"
"""The tag DeepSpeed is given at a save. DeepSpeed stores no tag in its files; on load the step directory
is the tag directory."""
UNIVERSAL_HINT = (
    "HINT: restart on the number of data-parallel ranks the step was saved with, or convert the step to "
    "DeepSpeed's universal format (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
    "<step directory> --output_folder <dir>) and load that with DeepSpeed's load_universal")


class DeepSpeedState:
    """A DeepSpeed engine as part of a checkpoint state (a files participant, see ``ft_checkpoint.state``).

    Args:
        engine: A ``deepspeed.DeepSpeedEngine`` (ZeRO stage 0 to 3).
        client_state: A dict saved as DeepSpeed's ``client_state`` and, at a resume, updated in place with the
            loaded one. Keep other values in the state passed to the manager instead where you can.
        prefix: Put before each file name, for several engines in one state (``"model_1."``).
        load_module_strict: ``load_checkpoint``'s argument of that name.
        load_lr_scheduler_states: ``load_checkpoint``'s argument of that name.
        exclude_frozen_parameters: ``save_checkpoint``'s argument of that name.

    Raises:
        ConfigError: for what it cannot save: optimizer or parameter offload to NVMe (the swap files are
            outside DeepSpeed's checkpoint files), or a checkpoint writer other than ``torch.save``
            configured in the DeepSpeed config (``checkpoint.writer``, DataStates).

    Example:
        >>> state = {"engine": DeepSpeedState(engine, client_state={"tokens": 0})}   # doctest: +SKIP
    """

    def __init__(self, engine: Any, *, client_state: dict[str, Any] | None = None, prefix: str = "",
                 load_module_strict: bool = True, load_lr_scheduler_states: bool = True,
                 exclude_frozen_parameters: bool = False) -> None:
        internals.check_version()
        _check_supported(engine)
        if prefix and not layout.is_plain_name(prefix + "x"):
            raise ConfigError(f"prefix={prefix!r}: use letters, digits, '_', '-' and '.' only")
        self.engine = engine
        self.client_state = client_state
        self.prefix = prefix
        self.load_module_strict = load_module_strict
        self.load_lr_scheduler_states = load_lr_scheduler_states
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self._checkpoint_engine = _install(engine)
        self._stager = TreeStager()
        self._save_dir = tempfile.mkdtemp(prefix="ft-checkpoint-deepspeed-")  # DeepSpeed copies scripts here
        weakref.finalize(self, shutil.rmtree, self._save_dir, True)

    def describe(self) -> dict[str, Any]:
        """What the manifest records: ZeRO stage, parallel sizes, DeepSpeed's version, the file prefix."""
        import deepspeed

        sizes = internals.parallel_sizes(self.engine)
        return {"kind": "deepspeed", "zero_stage": internals.zero_stage(self.engine), "dp_world_size": sizes["dp"],
                "mp_world_size": sizes["mp"], "pp_world_size": sizes["pp"], "deepspeed": deepspeed.__version__,
                "prefix": self.prefix}

    # -- saving --------------------------------------------------------------------------------
    def stage_files(self) -> dict[str, Callable[[Any], None]]:
        """Run the engine's ``save_checkpoint`` into host copies; ``{file name: writer}`` (every rank)."""
        return self._stage(standalone=False)[0]

    @property
    def stands_alone(self) -> bool:
        """Whether :meth:`stage_part` can give this rank's files alone (a fast-tier part): not for pipeline or
        expert parallelism, nor ZeRO's elastic checkpoints (a rank reads every rank's partition there)."""
        return not (internals.is_pipeline(self.engine) or internals.has_moe(self.engine)
                    or (self.engine.zero_optimization() and self.engine.zero_elastic_checkpoint()))

    def stage_part(self) -> tuple[dict[str, Callable[[Any], None]], dict[str, Callable[[Any], None]]]:
        """:meth:`stage_files` for a save that also writes this rank's fast-tier part: ``(this rank's files of the
        step, the files its part holds besides)``. Besides: the model states file, which one data-parallel rank
        writes for all under ZeRO 0-2 and every rank stages here from its own replica of the module, so that its
        part alone loads it (every rank).

        Example:
            >>> own, extra = DeepSpeedState(engine).stage_part()   # doctest: +SKIP
            >>> sorted(extra)                                       # doctest: +SKIP
            ['mp_rank_00_model_states.pt']
        """
        return self._stage(standalone=True)

    def _stage(self, *, standalone: bool) -> tuple[dict[str, Callable[[Any], None]], dict[str, Callable[[Any], None]]]:
        root = os.path.join(self._save_dir, STAGING_TAG)
        capture = _Capture(root, self.prefix)
        writes_model = internals.writes_model_states(self.engine)
        everyone = internals.model_states_on_every_rank(self.engine) if standalone else contextlib.nullcontext()
        with self._checkpoint_engine.capturing(capture), everyone:
            self.engine.save_checkpoint(self._save_dir, tag=STAGING_TAG, client_state=self._client_state(),
                                        save_latest=False, exclude_frozen_parameters=self.exclude_frozen_parameters)
        staged = {name: _TorchSave(obj) for name, obj in self._stager.stage(capture.files).items()}
        extra = set() if writes_model else {name for name in staged if _is_model_states(name[len(self.prefix):])}
        return ({n: w for n, w in staged.items() if n not in extra}, {n: w for n, w in staged.items() if n in extra})

    def _client_state(self) -> dict[str, Any]:
        """The user's client state, plus what DeepSpeed's ``ds_to_universal`` converter requires of a checkpoint
        (unless the model declares its own, as AutoTP models do)."""
        out = dict(self.client_state or {})
        if internals.universal_info_needed(self.engine):
            out.setdefault(internals.UNIVERSAL_CHECKPOINT_INFO, {"universal_checkpoint_version": 0.2})
        return out

    # -- loading -------------------------------------------------------------------------------
    def load_files(self, files: StepFiles) -> None:
        """Load the engine from a step: check that it fits, read and decode this rank's files (every rank agrees
        they are sound), then ``load_checkpoint`` from them. Collective."""
        _check_fits(files.metadata, self.engine, files.step)
        tag = layout.step_dir(files.step)
        with tempfile.TemporaryDirectory(prefix="ft-checkpoint-deepspeed-load-") as load_dir:
            tag_dir = self._stand_ins(files, os.path.join(load_dir, tag))
            needed = internals.files_to_read(self.engine, load_dir, tag, files.metadata["dp_world_size"])
            decoded = _agree(lambda: _read_all(files, [self.prefix + name for name in needed]))
            with self._checkpoint_engine.loading(_Source(tag_dir, self.prefix, files, decoded)):
                client_state = self._load_checkpoint(load_dir, tag, files.step)
        if self.client_state is not None:
            client_state.pop(internals.UNIVERSAL_CHECKPOINT_INFO, None)
            self.client_state.clear()
            self.client_state.update(client_state)

    def _stand_ins(self, files: StepFiles, tag_dir: str) -> str:
        """``tag_dir`` with an empty file for each DeepSpeed file of this engine in the step: DeepSpeed lists its
        model files with glob; their bytes come from the step, checked."""
        os.makedirs(tag_dir)
        for name in files.names:
            rest = name[len(self.prefix):]
            if name.startswith(self.prefix) and internals.DS_FILE_RE.fullmatch(rest):
                open(os.path.join(tag_dir, rest), "wb").close()
        return tag_dir

    def _load_checkpoint(self, load_dir: str, tag: str, step: int) -> dict[str, Any]:
        try:
            path, client_state = self.engine.load_checkpoint(
                load_dir, tag, load_module_strict=self.load_module_strict, load_optimizer_states=True,
                load_lr_scheduler_states=self.load_lr_scheduler_states)
        except (CheckpointCorruptError, StateMismatchError):
            raise
        except Exception as e:  # a model that changed shape, keys that are missing: the state, not the step
            raise StateMismatchError(f"DeepSpeed could not load step {step}: {type(e).__name__}: {e}") from e
        if path is None:
            raise CheckpointCorruptError(f"DeepSpeed found no checkpoint in step {step}")
        return dict(client_state or {})


# -- the checkpoint engine of ours ---------------------------------------------------------------------
def is_participant(obj: Any) -> bool:
    """Whether ``obj`` is a DeepSpeed engine, which the manager wraps by itself (see ``state.integration_for``;
    checked by class name: DeepSpeed is not imported here).

    Example:
        >>> is_participant(torch.nn.Linear(1, 1))
        False
    """
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed.") for c in type(obj).__mro__)


def participant(engine: Any, *, key: str, several: bool) -> DeepSpeedState:
    """The wrapper of a bare engine found in a state under ``key``: with ``several`` engines in one state, the files
    of each are prefixed by its key."""
    return DeepSpeedState(engine, prefix=f"{key}." if several else "")


class _Capture:
    """What one ``save_checkpoint`` hands to the checkpoint engine: ``{file name: state dict}`` (live tensors)."""

    def __init__(self, root: str, prefix: str) -> None:
        self.root, self.prefix = root, prefix
        self.files: dict[str, Any] = {}

    def add(self, path: str, state_dict: Any) -> None:
        rel = os.path.relpath(path, self.root)
        if not internals.DS_FILE_RE.fullmatch(rel):
            raise ConfigError(f"DeepSpeed saves {path!r}, which is not a file of its tag directory: this kind of "
                              "engine (pipeline or expert parallelism?) is not supported by ft-checkpoint yet")
        self.files[self.prefix + rel] = state_dict


class _Source:
    """Where ``load`` takes a file from during a load of ours: decoded already, or read (checked) on demand."""

    def __init__(self, tag_dir: str, prefix: str, files: StepFiles, decoded: dict[str, Any]) -> None:
        self.tag_dir, self.prefix, self.files, self.decoded = tag_dir, prefix, files, decoded

    def covers(self, path: str) -> bool:
        return os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.tag_dir)

    def load(self, path: str) -> Any:
        name = self.prefix + os.path.basename(path)
        if name in self.decoded:
            return self.decoded.pop(name)  # DeepSpeed may change what it gets: a second load decodes again
        log.debug("DeepSpeed reads %s, which was not read ahead", name)
        return _decode(name, _read(self.files, name))


_ENGINE_CLASS: type | None = None


def _engine_class() -> type:
    """Our checkpoint engine class (defined on first use: it subclasses DeepSpeed's, an optional import)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        _ENGINE_CLASS = _define_engine_class(internals.checkpoint_engine_base())
    return _ENGINE_CLASS


def _define_engine_class(base: type) -> type:
    class FTCheckpointEngine(base):
        """DeepSpeed's checkpoint engine interface for ft-checkpoint: inside a save of ours ``save`` captures
        (nothing is written), inside a load of ours ``load`` serves checked files; otherwise the engine it
        replaced does the work (``engine.save_checkpoint(dir)`` by the user still writes DeepSpeed files)."""

        def __init__(self, fallback: Any) -> None:
            super().__init__(None)
            self.name = "FTCheckpointEngine"
            self.fallback = fallback
            self.capture: _Capture | None = None
            self.source: _Source | None = None

        @contextlib.contextmanager
        def capturing(self, capture: _Capture) -> Iterator[None]:
            self.capture = capture
            try:
                yield
            finally:
                self.capture = None

        @contextlib.contextmanager
        def loading(self, source: _Source) -> Iterator[None]:
            self.source = source
            try:
                yield
            finally:
                self.source = None

        def create(self, info: Any) -> Any:
            return None if self.capture is not None else self.fallback.create(info)

        def makedirs(self, path: str, exist_ok: bool = False) -> Any:
            return None if self.capture is not None else self.fallback.makedirs(path, exist_ok=exist_ok)

        def save(self, state_dict: Any, path: str) -> Any:
            if self.capture is not None:
                return self.capture.add(path, state_dict)
            return self.fallback.save(state_dict, path)

        def load(self, path: str, map_location: Any = None) -> Any:
            if self.source is not None and self.source.covers(path):
                return self.source.load(path)
            return self.fallback.load(path, map_location=map_location)

        def commit(self, info: Any) -> Any:
            return True if self.capture is not None else self.fallback.commit(info)

        def preserves_storage_sharing(self) -> bool:  # DeepSpeed would clone before save(): we copy anyway
            return False if self.capture is not None else self.fallback.preserves_storage_sharing()

        def is_data_parallel_writer(self, dp_rank: int) -> bool:
            return self.fallback.is_data_parallel_writer(dp_rank)

    return FTCheckpointEngine


def _install(engine: Any) -> Any:
    """Our checkpoint engine in ``engine`` (installed once; a second DeepSpeedState of it shares it)."""
    current = internals.get_checkpoint_engine(engine)
    cls = _engine_class()
    if isinstance(current, cls):
        return current
    ours = cls(current)
    internals.set_checkpoint_engine(engine, ours)
    return ours


def _check_supported(engine: Any) -> None:
    """Refuse what ft-checkpoint cannot save (ConfigError naming the DeepSpeed setting)."""
    offloaded = internals.nvme_offload(engine)
    if offloaded:
        raise ConfigError(
            f"this DeepSpeed engine offloads its {' and '.join(offloaded)} state to NVMe (zero_optimization."
            f"offload_{offloaded[0]}.device='nvme'): DeepSpeed keeps it in swap files beside its checkpoint files, "
            "which ft-checkpoint cannot stage, check or commit. HINT: offload to 'cpu' or not at all")
    current = internals.get_checkpoint_engine(engine)
    if not isinstance(current, _engine_class()) and not internals.is_torch_checkpoint_engine(current):
        raise ConfigError(
            f"this DeepSpeed engine writes checkpoints with {type(current).__name__} (the DeepSpeed config's "
            "'checkpoint': {'writer': ...} or 'datastates_ckpt'): ft-checkpoint writes DeepSpeed's files itself and "
            "cannot honour another writer. HINT: remove that setting from the DeepSpeed config")
    if internals.is_pipeline(engine) or internals.has_moe(engine):
        log.warning("DeepSpeed pipeline parallelism and mixture-of-experts layers are not tested with ft-checkpoint")


def _check_fits(saved: Any, engine: Any, step: int) -> None:
    """StateMismatchError unless the step holds a DeepSpeed engine saved with this engine's ZeRO stage and sizes."""
    if not isinstance(saved, Mapping) or saved.get("kind") != "deepspeed":
        raise StateMismatchError(f"step {step} holds no DeepSpeed engine under this state key")
    now, sizes = internals.zero_stage(engine), internals.parallel_sizes(engine)
    if saved.get("zero_stage") != now:
        raise StateMismatchError(f"step {step} was saved with ZeRO stage {saved.get('zero_stage')}, this engine runs "
                                 f"stage {now}. HINT: use the DeepSpeed config the step was saved with")
    for key, what in (("dp", "data-parallel"), ("mp", "model-parallel"), ("pp", "pipeline-parallel")):
        was = saved.get(f"{key}_world_size")
        if was != sizes[key]:
            raise StateMismatchError(
                f"step {step} was saved on {was} {what} ranks, this engine runs on {sizes[key]}: DeepSpeed cannot "
                f"load ZeRO partitions saved on another {what} size. {UNIVERSAL_HINT}")


def _read(files: StepFiles, name: str) -> bytes:
    if name not in files.names:
        raise CheckpointCorruptError(f"the step has no {name}, which DeepSpeed needs")
    return files(name)


def _decode(name: str, data: bytes) -> Any:
    """A DeepSpeed file's contents: ``torch.load(weights_only=True)`` with DeepSpeed's classes allowlisted, once
    the file checked as what ``torch.save`` writes (see ``torch_file``)."""
    return torch_file.load(data, name, safe_globals=internals.safe_globals(), map_location="cpu")


def _read_all(files: StepFiles, names: list[str]) -> dict[str, Any]:
    return {name: _decode(name, _read(files, name)) for name in names}


def _agree(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, once every rank's succeeded; else CheckpointCorruptError on every rank (DeepSpeed's load is
    collective: a rank that stopped inside it would leave the others waiting)."""
    result, error = None, None
    try:
        result = fn()
    except CheckpointCorruptError as e:
        error = str(e)
    errors = [error]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    if error is not None:
        raise CheckpointCorruptError(error)
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointCorruptError(f"not loaded: rank {', '.join(map(str, failed))} found DeepSpeed files unsound")
    assert result is not None
    return result


class _TorchSave:
    """Writes a staged file with ``torch.save``; ``nbytes``: its tensors' bytes (what a fast tier must hold, counted
    only when asked: the first fast-tier save's room check)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.obj))

    def __call__(self, f: Any) -> None:
        torch.save(self.obj, f)


def _tensors(node: Any) -> Iterator[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, Mapping):
        for value in node.values():
            yield from _tensors(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _tensors(value)


def _is_model_states(name: str) -> bool:
    m = internals.DS_FILE_RE.fullmatch(name)
    return m is not None and m.group(1) == "model"


# -- staging ---------------------------------------------------------------------------------------------
class TreeStager:
    """Copies nested state dicts out of the training's way: each tensor into a host buffer of its own, kept
    and reused by the next save while its shape and dtype stay (pinned, with asynchronous copies, for CUDA
    tensors); containers rebuilt; other values deep-copied. A tensor found twice is copied once.

    Each buffer has a storage of its own, so that ``torch.save`` of a copy writes only its bytes.

    Example:
        >>> stager = TreeStager()
        >>> live = {"w": torch.ones(2), "n": [3, "x"]}
        >>> first = stager.stage({"f": live})
        >>> live["w"] += 1; first["f"]["w"]
        tensor([1., 1.])
        >>> stager.stage({"f": live})["f"]["w"].data_ptr() == first["f"]["w"].data_ptr()   # reused
        True
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, trees: Mapping[str, Any]) -> dict[str, Any]:
        used: dict[tuple[Any, ...], torch.Tensor] = {}
        copied: dict[int, torch.Tensor] = {}
        devices: set[torch.device] = set()

        def walk(node: Any, path: tuple[Any, ...]) -> Any:
            if isinstance(node, torch.Tensor):
                if id(node) not in copied:
                    copied[id(node)] = used[path] = self._copy(node, path, devices)
                return copied[id(node)]
            if type(node) in (dict, OrderedDict):
                return type(node)((k, walk(v, (*path, k))) for k, v in node.items())
            if type(node) in (list, tuple):
                return type(node)(walk(v, (*path, i)) for i, v in enumerate(node))
            return copy.deepcopy(node)

        out = {name: walk(tree, (name,)) for name, tree in trees.items()}
        for device in devices:
            torch.cuda.synchronize(device)
        self._buffers = used  # buffers of tensors no longer saved are released
        return out

    def _copy(self, t: torch.Tensor, path: tuple[Any, ...], devices: set[torch.device]) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        buf.copy_(t, non_blocking=t.is_cuda)
        if t.is_cuda:
            devices.add(t.device)
        return buf
