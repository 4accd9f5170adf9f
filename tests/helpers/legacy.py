"""Write a step exactly as ft-checkpoint 0.1 did (format 1): DCP's own FileSystemWriter shards and pickled
``.metadata``, the rank file, a manifest with SHA-256 checksums. For tests that old checkpoints keep
loading, and that a forged format-1 ``.metadata`` never runs code."""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from ft_checkpoint.format import layout
from ft_checkpoint.state import rng_state, split_tree, to_tree


def sha256(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def write_legacy_step(url: str, step: int, state: dict[str, Any], *, epoch: int | None = None) -> None:
    """Save ``state`` as ``step`` in format 1 into the local directory ``url`` (single process)."""
    rel = os.path.join(url, layout.step_dir(step))
    os.makedirs(rel, exist_ok=True)
    tensors, skeleton = split_tree(to_tree(state))
    buf = io.BytesIO()
    torch.save({"skeleton": skeleton, "per_rank": {"rng": rng_state()}}, buf)
    with open(os.path.join(rel, layout.rank_file(0)), "wb") as f:
        f.write(buf.getvalue())
    dcp.save(tensors, storage_writer=FsspecWriter(rel, sync_files=True), no_dist=True)  # as 0.1 did
    files = {}
    for name in sorted(os.listdir(rel)):
        with open(os.path.join(rel, name), "rb") as f:
            data = f.read()
        files[name] = {"size": len(data), "checksum": sha256(data)}
    manifest = {"format": "ft-checkpoint", "format_version": 1, "step": step, "world_size": 1, "files": files,
                "epoch": epoch, "time": time.time(), "metadata": {},
                "versions": {"ft_checkpoint": "0.1.0", "torch": torch.__version__, "python": platform.python_version()}}
    with open(os.path.join(rel, layout.MANIFEST), "w") as f:
        json.dump(manifest, f)


def replace_legacy_file(url: str, step: int, name: str, data: bytes) -> None:
    """Replace a file of a format-1 step and recompute its manifest entry (what an attacker can do)."""
    rel = os.path.join(url, layout.step_dir(step))
    with open(os.path.join(rel, name), "wb") as f:
        f.write(data)
    with open(os.path.join(rel, layout.MANIFEST)) as f:
        manifest = json.load(f)
    manifest["files"][name] = {"size": len(data), "checksum": sha256(data)}
    with open(os.path.join(rel, layout.MANIFEST), "w") as f:
        json.dump(manifest, f)
