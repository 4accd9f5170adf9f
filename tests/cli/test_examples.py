"""The CLI on directories written by the project's own examples: the Lightning and the Accelerate one,
each SIGKILLed partway and resumed, on local disk and (Accelerate) on the GCS emulator.

What the report can know of a killed attempt is its last progress note. On local disk every step is noted
(one write in place) with the default settings, so the report's recomputed steps must equal what the example
says it recomputed, exactly (issue 22, point 9: it said "at least 0" where the example recomputed 6). On an
object store a note is written at most every ``progress_interval`` (10 s by default): the GCS run sets
``FT_CHECKPOINT_PROGRESS_INTERVAL=0`` (a note at every step, written before the step goes on).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid

import fsspec
import pytest

from ft_checkpoint.format import layout
from tests.cli.conftest import ROOT, cli, cli_json

pytestmark = pytest.mark.slow

TIMEOUT = 300
EXACT = {"FT_CHECKPOINT_PROGRESS_INTERVAL": "0"}


def run_example(*args: str, env: dict[str, str] | None = None, rc: int = 0) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
    assert proc.returncode == rc, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the example's output:\n{text}"
    return int(match.group(1))


def check_directory(url: str, resumed_from: int, recomputed: int, env: dict[str, str] | None = None) -> None:
    """ls, verify, a byte flip, and the report, against what the example says happened."""
    listing = cli_json("ls", url, env=env, process=True)
    assert listing["resume_step"] == max(s["step"] for s in listing["steps"])
    assert all(s["status"] == "committed" for s in listing["steps"])
    assert cli("verify", url, "--all", env=env, process=True).returncode == 0

    report = cli_json("report", url, env=env, process=True)
    killed, resumed = report["attempts"]
    assert report["total"]["failures"] == 1 and killed["outcome"] == "failed"
    assert resumed["resumed_from"] == resumed_from and resumed["outcome"] == "clean_end"
    assert killed["recomputed_steps"] == recomputed > 0 and killed["recomputed_exact"]  # see the module docstring
    assert report["total"]["recomputed_exact"] and report["total"]["recomputed_steps"] == recomputed
    assert 0 < report["total"]["goodput"] < 1

    copy = url.rstrip("/") + "-copy"
    fs, root = fsspec.core.url_to_fs(url, **json.loads((env or {}).get("FT_CHECKPOINT_STORAGE_OPTIONS", "{}")))
    fs.copy(root, fs._strip_protocol(copy), recursive=True)
    newest = f"{layout.step_dir(listing['resume_step'])}/__0_0.distcp"
    path = f"{fs._strip_protocol(copy)}/{newest}"
    data = bytearray(fs.cat_file(path))
    data[100] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    bad = cli("verify", copy, env=env, process=True)
    assert bad.returncode == 1 and f"{newest}: does not match its checksum" in bad.stdout, bad.stdout + bad.stderr


def test_lightning_example(tmp_path):
    pytest.importorskip("lightning")
    workdir = tmp_path / "lightning"
    workdir.mkdir()
    out = run_example("examples/lightning_resume.py", "--workdir", str(workdir), "--steps", "50", "--kill-after", "27")
    killed_at = number(r"killed \(SIGKILL\)\s+after step (\d+)", out)
    resumed_from = number(r"resumed from\s+step (\d+)", out)
    check_directory(str(workdir / "ft_checkpoints"), resumed_from, killed_at - resumed_from)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_accelerate_example(tmp_path, request, where):
    pytest.importorskip("accelerate")
    env = {"FT_CHECKPOINT_DIRPATH": str(tmp_path / "accelerate")}  # default settings
    if where == "gcs":
        env.update(EXACT)
        gcs = request.getfixturevalue("gcs_server")
        bucket = f"examples-{uuid.uuid4().hex[:8]}"
        gcs.make_bucket(bucket)
        env.update(FT_CHECKPOINT_DIRPATH=f"{gcs.protocol}://{bucket}/run",
                   FT_CHECKPOINT_STORAGE_OPTIONS=json.dumps(gcs.storage_options),
                   GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    first = run_example("examples/accelerate_resume.py", "--crash-at-step", "40", env=env, rc=-signal.SIGKILL)
    killed_at = number(r"SIGKILL after optimizer step (\d+)", first)
    second = run_example("examples/accelerate_resume.py", env=env)
    resumed_from = number(r"resumed from (\d+)", second)
    check_directory(env["FT_CHECKPOINT_DIRPATH"], resumed_from, killed_at - resumed_from, env)
