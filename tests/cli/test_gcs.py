"""Acceptance on GCS (the emulator): the same killed-and-resumed job writes to ``gs://``, and the CLI
reads it with storage options from ``FT_CHECKPOINT_STORAGE_OPTIONS``, like the training did."""

from __future__ import annotations

import json
import uuid

import pytest

from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from tests.cli.conftest import HANG_AT, INTERVAL, STEPS, cli, cli_json, killed_and_resumed

pytestmark = pytest.mark.slow  # a job killed and resumed on the GCS emulator first: about 20 s


@pytest.fixture(scope="module")
def gcs_run(gcs_server):
    bucket = f"cli-{uuid.uuid4().hex[:8]}"
    gcs_server.make_bucket(bucket)
    env = {"FT_CHECKPOINT_STORAGE_OPTIONS": json.dumps(gcs_server.storage_options),
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return killed_and_resumed(f"{gcs_server.protocol}://{bucket}/run-7", env)


def test_ls_on_gcs_shows_the_partial_step_and_the_step_resume_picked(gcs_run):
    steps = {s["step"]: s["status"] for s in gcs_run.ls_between["steps"]}
    assert steps == {10: "committed", 20: "committed", HANG_AT: "partial"}
    assert gcs_run.ls_between["resume_step"] == gcs_run.resumed_from == HANG_AT - INTERVAL
    assert gcs_run.ls_between["url"] == gcs_run.url
    assert cli_json("ls", gcs_run.url, env=gcs_run.env)["resume_step"] == STEPS


def test_report_on_gcs_counts_the_failure_and_the_recomputed_steps(gcs_run):
    total, (killed, _) = (r := cli_json("report", gcs_run.url, env=gcs_run.env))["total"], r["attempts"]
    assert total["failures"] == 1 and total["attempts"] == 2
    assert killed["recomputed_steps"] == gcs_run.killed_at - gcs_run.resumed_from == INTERVAL


def test_inspect_on_gcs(gcs_run):
    info = cli_json("inspect", gcs_run.url, "--step", STEPS, env=gcs_run.env)
    assert {t["name"] for t in info["tensors"]} >= {"model/0.weight", "optim/state/0/exp_avg"}


def test_verify_on_gcs_fails_after_a_byte_flip_and_names_the_object(gcs_run, gcs_server):
    assert cli("verify", gcs_run.url, env=gcs_run.env).returncode == 0
    storage = Storage(gcs_run.url, gcs_server.storage_options)
    rel = f"{layout.step_dir(STEPS)}/__0_0.distcp"
    data = bytearray(storage.read_bytes(rel))
    data[1000] ^= 0xFF
    storage.write_bytes(rel, bytes(data))
    bad = cli("verify", gcs_run.url, env=gcs_run.env)
    assert bad.returncode == 1 and f"{gcs_run.url}/{rel}: does not match its checksum" in bad.stdout
    plan = cli_json("gc", gcs_run.url, "--keep", 1, "--dry-run", env=gcs_run.env)
    assert plan["protected"] == 30 and plan["delete"] == [20]


def test_without_storage_options_the_error_says_where_they_come_from(gcs_run):
    proc = cli("ls", gcs_run.url.replace("run-7", "nothing-here"), env=gcs_run.env)
    assert proc.returncode == 2 and "FT_CHECKPOINT_STORAGE_OPTIONS" in proc.stderr
