"""The private parts of torch.distributed.checkpoint (and DTensor) that ft-checkpoint uses, in one place.

Each is checked against the installed torch by ``tests/core/test_dcp_internals.py``; a torch release that
moves one fails there, naming it, rather than somewhere inside a save or a resume.

- ``FsspecFileSystem`` and ``FsspecReader``: DCP's fsspec storage layer, used only to read format-1 steps
  (``legacy``); its ``FileSystem.create_stream`` is where we put our retried opens.
- ``StorageInfo``: where DCP's own writer stored a chunk (``relative_path``, ``offset``, ``length``,
  ``transform_descriptors``), named in format 1's pickled metadata.
- :func:`dtensor_like`: a host copy of a DTensor's local shard wrapped back into a DTensor with the same spec
  (``DTensor.from_local`` would move the shard back to the mesh's device).

Example:
    >>> sorted(f for f in ("relative_path", "offset", "length") if f in StorageInfo.__dataclass_fields__)
    ['length', 'offset', 'relative_path']
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

__all__ = ["FsspecFileSystem", "FsspecReader", "StorageInfo", "STORAGE_INFO_NAME", "dtensor_like"]

STORAGE_INFO_NAME = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
"""Where format 1's pickles name :data:`StorageInfo` (for the unpickler's allowlist)."""


def dtensor_like(t: Any, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a host copy of DTensor ``t``'s shard) as a DTensor with ``t``'s spec: mesh, placements,
    global shape. Not ``DTensor.from_local``, which moves the local tensor back to the mesh's device (a GPU)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, t._spec, requires_grad=False)
