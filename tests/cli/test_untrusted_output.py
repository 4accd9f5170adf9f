"""One bad step never hides the others, and nothing the CLI prints carries a raw control character from the
directory (an escape sequence in a manifest's ``versions``, a tensor name or a file name could rewrite the
terminal of whoever runs ``ls`` or ``inspect``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ft_checkpoint import CheckpointManager
from tests.cli.conftest import cli
from tests.helpers.toy import make

ESCAPES = "\x1b[2J\x1b]0;owned\x07\r"
"""Clear the screen, retitle the terminal, ring the bell, return to the start of the line."""


def raw_controls(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) < 0xA0]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> str:
    """Steps 1 to 3; step 1's manifest has ``"time": 1e300`` and escape sequences in ``versions``, step 2 holds
    a tensor whose name is escape sequences, and the journal an attempt directory named with them."""
    url = str(tmp_path_factory.mktemp("hostile") / "run")
    with CheckpointManager(url, interval=1, keep_last=5) as ckpt:
        ckpt.save(1, make(), block=True)
        ckpt.save(2, {"w" + ESCAPES: torch.ones(2)}, block=True)
        ckpt.save(3, make(), block=True)
    path = os.path.join(url, "step_000000000001", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["time"] = 1e300
    manifest["versions"]["torch" + ESCAPES] = "2.13" + ESCAPES
    with open(path, "w") as f:
        json.dump(manifest, f)
    os.makedirs(os.path.join(url, "journal", "20261129T000000.000000Z-x" + ESCAPES))
    return url


def test_a_manifest_time_of_1e300_hides_no_step_from_ls(hostile):
    listing = cli("ls", hostile, "--json")
    assert listing.returncode == 0, listing.stderr
    steps = {s["step"]: s for s in json.loads(listing.stdout)["steps"]}
    assert sorted(steps) == [1, 2, 3] and steps[1]["time"] == 1e300
    text = cli("ls", hostile)
    assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
    assert [line.split()[0] for line in text.stdout.splitlines()[2:5]] == ["1", "2", "3"], text.stdout
    assert "not a date" in text.stdout


@pytest.mark.parametrize("args", [("ls",), ("verify", "--all"), ("inspect",), ("inspect", "--step", "1"),
                                  ("inspect", "--step", "2"), ("report",), ("gc", "--keep", "5", "--dry-run")],
                         ids=" ".join)
def test_no_command_prints_a_raw_control_character(hostile, args):
    proc = cli(args[0], hostile, *args[1:])
    assert proc.returncode in (0, 1), (proc.returncode, proc.stderr)
    assert not raw_controls(proc.stdout), proc.stdout
    assert not raw_controls(proc.stderr), proc.stderr


def test_inspect_shows_an_escaped_name_and_versions(hostile):
    names = cli("inspect", hostile, "--step", "2").stdout
    assert "w\\x1b[2J\\x1b]0;owned\\x07\\r" in names, names
    versions = cli("inspect", hostile, "--step", "1").stdout
    assert "torch\\x1b[2J" in versions and "2.13\\x1b[2J" in versions and "not a date" in versions, versions
