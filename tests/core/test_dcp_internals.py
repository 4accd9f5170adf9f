"""The private parts of torch DCP and DTensor that ft_checkpoint/format/_dcp_internals.py names, checked on the
installed torch: a release that moves or changes one fails here, by name."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

from ft_checkpoint.format import _dcp_internals as internals


def test_storage_info_has_the_fields_format_1_metadata_uses():
    fields = {f.name for f in dataclasses.fields(internals.StorageInfo)}
    assert {"relative_path", "offset", "length", "transform_descriptors"} <= fields, fields
    module, name = internals.STORAGE_INFO_NAME
    assert (internals.StorageInfo.__module__, internals.StorageInfo.__name__) == (module, name)


def test_fsspec_filesystem_opens_through_create_stream():
    assert "create_stream" in vars(internals.FsspecFileSystem), "DCP's fsspec FileSystem no longer defines create_stream"
    assert list(inspect.signature(internals.FsspecFileSystem.create_stream).parameters) == ["self", "path", "mode"]
    assert {"read_metadata", "read_data"} <= set(dir(internals.FsspecReader))
    params = list(inspect.signature(internals.FsspecReader.__init__).parameters)
    assert params[:2] == ["self", "path"] and "kwargs" in params, params  # LegacyReader passes storage_options


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_dtensor_like_keeps_mesh_placements_and_shape_without_moving_the_shard(tmp_path):
    """On a 1-rank gloo group (a DTensor needs a mesh): the rewrapped host copy is a DTensor equal to the original,
    with its spec, and its local tensor is the very buffer given (no copy back to the mesh's device)."""
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from ft_checkpoint.format._dcp_internals import dtensor_like
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        host = d.to_local().clone()
        again = dtensor_like(d, host)
        assert type(again).__name__ == "DTensor" and again.placements == d.placements and again.device_mesh == mesh
        assert again.shape == d.shape and again.to_local().data_ptr() == host.data_ptr()
        assert torch.equal(again.full_tensor(), d.full_tensor())
        dist.destroy_process_group()
        print("OK")
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
