"""What cannot be saved or resumed faithfully is refused, with a HINT: NVMe offload, another checkpoint
writer, a restart on another data-parallel size (and DeepSpeed's documented way around it works), two
engines whose files would take the same names. Also: what inspect shows, and DeepSpeed's tools reading a step."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.testing import jobs
from tests.deepspeed.conftest import ENV, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REFUSALS = ["refuses optimizer offload to NVMe", "refuses parameter offload to NVMe",
            "refuses another checkpoint writer", "accepts offload to CPU", "two engines: files prefixed by key",
            "two engines: both resumed", "two engines: the same file name twice is refused"]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds-refusals")
    run = torchrun("ds_checks.py", 1, out, "refusals", out=out)
    assert run.returncode == 0, run.explain()
    return {r["check"]: r for r in run.rows}, run


@pytest.mark.parametrize("name", REFUSALS)
def test_configurations_that_cannot_be_honoured_are_refused(refusals, name):
    rows, run = refusals
    assert name in rows and rows[name]["ok"], rows.get(name) or run.explain()


def test_a_restart_on_another_data_parallel_size_is_refused_with_a_hint(uninterrupted, tmp_path):
    base, _ = uninterrupted(2, 2)
    shutil.copytree(os.path.join(base, "ckpt"), tmp_path / "ckpt")
    run = torchrun("ds_checks.py", 1, tmp_path / "out", "dp-change", tmp_path / "ckpt", out=tmp_path / "out")
    assert run.returncode == 0, run.explain()
    assert run.where(check="refuses another data-parallel size", ok=True), run.rows


def test_the_hinted_universal_conversion_loads_on_another_data_parallel_size(uninterrupted, tmp_path):
    """The HINT's way: DeepSpeed's ds_to_universal converts a step saved on 2 ranks, which loads on 1."""
    base, _ = uninterrupted(2, 2)
    newest = layout.committed_steps(Storage(os.path.join(base, "ckpt")))[-1]
    os.makedirs(tmp_path / "uni")
    shutil.copy(os.path.join(base, "out", "final_rank0.pt"), tmp_path / "uni")
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           os.path.join(base, "ckpt", layout.step_dir(newest)), "--output_folder",
                           str(tmp_path / "uni" / "universal")], capture_output=True, text=True,
                          env=jobs.job_env(ENV), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = torchrun("ds_checks.py", 1, tmp_path / "out", "universal", tmp_path / "uni", out=tmp_path / "out")
    assert run.returncode == 0, run.explain()
    assert run.where(check="a ds_to_universal conversion of a 2-rank step loads on 1 rank", ok=True), run.rows


def test_inspect_shows_the_zero_stage_and_parallel_sizes(uninterrupted):
    base, _ = uninterrupted(3, 2)
    cli = [sys.executable, "-m", "ft_checkpoint.tools.cli", "inspect", os.path.join(base, "ckpt")]
    text = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    assert "deepspeed engine 'engine': ZeRO stage 3, data-parallel 2, model-parallel 1, pipeline-parallel 1" in text
    info = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True).stdout)
    assert info["manifest"]["metadata"]["engine"]["zero_stage"] == 3
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} \
        <= set(info["manifest"]["files"])


def test_a_step_is_a_deepspeed_checkpoint_that_zero_to_fp32_reads(uninterrupted, tmp_path):
    """A step directory holds DeepSpeed's own files under their names: DeepSpeed's tools read it as a tag."""
    base, _ = uninterrupted(3, 2)
    newest = layout.committed_steps(Storage(os.path.join(base, "ckpt")))[-1]
    package = importlib.util.find_spec("deepspeed").submodule_search_locations[0]
    script = shutil.copy(os.path.join(package, "utils", "zero_to_fp32.py"), tmp_path)  # its directory shadows torch
    proc = subprocess.run([sys.executable, script, os.path.join(base, "ckpt"), str(tmp_path / "fp32"), "--tag",
                           layout.step_dir(newest)], capture_output=True, text=True, env=jobs.job_env(ENV), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import torch

    weights = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    final = torch.load(os.path.join(base, "out", "final_rank0.pt"), weights_only=True)["full"]
    assert set(weights) == set(final) and all(torch.equal(weights[k], final[k]) for k in final)
