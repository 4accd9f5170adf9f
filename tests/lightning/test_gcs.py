"""Acceptance 2: end to end on GCS (the emulator), configured only through ``storage_options``.

A real training process writes to ``gs://``, is SIGKILLed, restarts, resumes from the bucket and ends
bit-identical to the uninterrupted local run.
"""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import pytest
import torch

from ft_checkpoint.format import layout
from lightning_ft.testing import assert_same

pytestmark = pytest.mark.slow


def test_kill_and_resume_on_gcs_emulator(job, tmp_path, gcs_server, single_reference):
    bucket = f"lightning-{uuid.uuid4().hex[:8]}"
    gcs_server.make_bucket(bucket)
    url = f"{gcs_server.protocol}://{bucket}/run-7"
    args = ("--interval", 4, "--storage-options", json.dumps(gcs_server.storage_options))
    out = str(tmp_path / "out")

    job.run(url, out, *args, "--kill-at", 15, killed=True)
    job.run(url, out, *args)

    with open(os.path.join(out, "runs.jsonl")) as f:
        resumed = [json.loads(line)["resumed_from"] for line in f]
    assert resumed[0] is None and resumed[1] in (8, 13), resumed
    assert_same(torch.load(single_reference, weights_only=False),
                torch.load(os.path.join(out, "final.pt"), weights_only=False))
    fs = fsspec.filesystem(gcs_server.protocol, **gcs_server.storage_options)
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run-7")}
    assert layout.step_dir(32) in names and layout.JOURNAL_DIR in names, names
    assert fs.exists(f"{bucket}/run-7/{layout.step_dir(32)}/{layout.MANIFEST}")
