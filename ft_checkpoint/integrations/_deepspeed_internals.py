"""Every use of DeepSpeed's private API (and of its internal classes) in ft_checkpoint, in one place.

DeepSpeed offers no public way to do five things :mod:`ft_checkpoint.integrations.deepspeed` needs:

1. replace an engine's checkpoint engine (``engine.checkpoint_engine``, an attribute set in
   ``_configure_checkpointing``; its base class lives in ``deepspeed.runtime.checkpoint_engine``);
2. know which files of a checkpoint this rank will read in ``load_checkpoint`` before it reads them
   (``_get_ckpt_name``, ``_get_zero_ckpt_name``, ``_get_rank_zero_ckpt_name``), so that every file is
   checked and decoded, and every rank agrees, before DeepSpeed starts loading and its collectives;
3. the parallel sizes and configuration an engine runs with (``dp_world_size``, ``mp_world_size``,
   ``num_stages`` of a ``PipelineEngine``, ``zero_offload_*``, ``zero_nvme_offload_optimizer``);
4. load DeepSpeed's optimizer files with ``weights_only=True``: they pickle a few DeepSpeed classes,
   allowlisted here by exact module and name (:data:`SAFE_GLOBALS`);
5. have every rank stage the model states file that one data-parallel rank writes for all under ZeRO 0-2
   (``engine.save_non_zero_checkpoint``, set in ``_configure_checkpointing``), for a fast-tier part that
   loads its rank on its own.

``tests/deepspeed/test_deepspeed_internals.py`` exercises every one of them against the installed
DeepSpeed and fails, naming this module, when a release changes one. :data:`TESTED` is the range of
DeepSpeed versions that test passed on; pyproject pins the same range.

Example:
    >>> check_version("0.19.8")
    True
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

TESTED = ((0, 17, 1), (0, 20, 0))
"""DeepSpeed versions ``[low, high)``: 0.17.1 brought ``commit(info)``; the suite passed with 0.19.8."""

SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),          # ZeRO 1/2 optimizer files
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),   # the same with fp16 (untested on CPU)
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),            # ZeRO 1-3 optimizer files
    ("deepspeed.utils.tensor_fragment", "fragment_address"),       # ZeRO 1/2 param_slice_mappings
)
"""The classes DeepSpeed's checkpoint files pickle, by exact module and name; nothing else is unpickled."""

DS_FILE_RE = re.compile(r"[A-Za-z0-9_\-]*(model|optim)_states\.pt", re.ASCII)
"""A file DeepSpeed writes into a tag directory: ``mp_rank_00_model_states.pt``,
``zero_pp_rank_1_mp_rank_00_optim_states.pt``, ``layer_01-model_states.pt``."""


def check_version(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed DeepSpeed) is in :data:`TESTED`; warns if not."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    ok = bool(m) and TESTED[0] <= tuple(int(x) for x in m.groups()) < TESTED[1]  # type: ignore[union-attr]
    if not ok:
        low, high = (".".join(map(str, v)) for v in TESTED)
        warnings.warn(f"deepspeed {version} is outside the range ft_checkpoint was tested with (>={low},<{high}); "
                      f"saves or resumes may fail. HINT: pip install 'deepspeed>={low},<{high}'", stacklevel=2)
    return ok


def safe_globals() -> list[Any]:
    """The classes of :data:`SAFE_GLOBALS`, each checked to be defined where it is named (no re-export)."""
    out = []
    for module, name in SAFE_GLOBALS:
        cls = getattr(importlib.import_module(module), name)
        if not isinstance(cls, type) or cls.__module__ != module or cls.__qualname__ != name:
            raise TypeError(f"{module}.{name} is not the class ft_checkpoint allowlists (see {__name__})")
        out.append(cls)
    return out


# -- the checkpoint engine ------------------------------------------------------------------------
def checkpoint_engine_base() -> type:
    """DeepSpeed's abstract checkpoint engine (``create``, ``save``, ``load``, ``commit(info)``, ``makedirs``)."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    return CheckpointEngine


def is_torch_checkpoint_engine(checkpoint_engine: Any) -> bool:
    """Whether ``checkpoint_engine`` is DeepSpeed's default (``torch.save``), i.e. no other writer is configured."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type(checkpoint_engine) is TorchCheckpointEngine


def get_checkpoint_engine(engine: Any) -> Any:
    return engine.checkpoint_engine


def set_checkpoint_engine(engine: Any, checkpoint_engine: Any) -> None:
    engine.checkpoint_engine = checkpoint_engine


# -- what the engine runs with ---------------------------------------------------------------------
def parallel_sizes(engine: Any) -> dict[str, int]:
    """``{"dp": data-parallel, "mp": model-parallel, "pp": pipeline-parallel}`` sizes of ``engine``."""
    return {"dp": int(engine.dp_world_size), "mp": int(engine.mp_world_size),
            "pp": int(getattr(engine, "num_stages", 1))}


def zero_stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def nvme_offload(engine: Any) -> list[str]:
    """What ``engine`` offloads to NVMe: ``"optimizer"``, ``"param"`` (files outside its checkpoint files)."""
    out = []
    if engine.zero_nvme_offload_optimizer() or _device(engine.zero_offload_optimizer()) == "nvme":
        out.append("optimizer")
    if _device(engine.zero_offload_param()) == "nvme":
        out.append("param")
    return out


def _device(offload: Any) -> str | None:
    device = getattr(offload, "device", None)
    return None if device is None else str(getattr(device, "value", device))


UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
"""The client-state key ``ds_to_universal`` requires in a checkpoint (its absence is an assertion error there)."""


def universal_info_needed(engine: Any) -> bool:
    """Whether a save must add :data:`UNIVERSAL_CHECKPOINT_INFO` to the client state: the module declares none
    (AutoTP models do) and no MoE layers (DeepSpeed reserves the key there)."""
    return getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is None and not has_moe(engine)


def is_pipeline(engine: Any) -> bool:
    return type(engine).__name__ == "PipelineEngine"


def has_moe(engine: Any) -> bool:
    return bool(getattr(engine, "has_moe_layers", False))


# -- which files a load reads ----------------------------------------------------------------------
def files_to_read(engine: Any, load_dir: str, tag: str, saved_dp: int) -> list[str]:
    """The names (in the tag directory) of the files this rank's ``load_checkpoint`` reads: its model states
    file and, with ZeRO, its optimizer partition (every partition with ``elastic_checkpoint``)."""
    names = [engine._get_ckpt_name(load_dir, tag)]
    if engine.zero_optimization():
        if engine.zero_elastic_checkpoint():
            names += [engine._get_rank_zero_ckpt_name(load_dir, tag, engine.checkpoint_mp_rank, dp,
                                                      engine.bfloat16_enabled()) for dp in range(saved_dp)]
        else:
            names.append(engine._get_zero_ckpt_name(load_dir, tag))
    return [os.path.relpath(n, os.path.join(load_dir, tag)) for n in names]


# -- a rank's files on their own -------------------------------------------------------------------
def writes_model_states(engine: Any) -> bool:
    """Whether this rank writes a model states file at ``save_checkpoint`` (ZeRO 0-2: data-parallel rank 0;
    ZeRO-3: every rank its own)."""
    return bool(engine.save_non_zero_checkpoint)


@contextlib.contextmanager
def model_states_on_every_rank(engine: Any) -> Iterator[None]:
    """Within it, ``save_checkpoint`` has this rank write the model states file too (``_save_checkpoint`` builds it
    on every rank and writes it where the flag is set; the flag is restored afterwards)."""
    before = engine.save_non_zero_checkpoint
    engine.save_non_zero_checkpoint = True
    try:
        yield
    finally:
        engine.save_non_zero_checkpoint = before
