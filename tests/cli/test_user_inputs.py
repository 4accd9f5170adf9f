"""The CLI reads durations as it prints them, warns about inputs that make no sense, explains ``plan`` and
``simulate``, and ``simulate`` prints each row as soon as it is computed (issue 22, points 6 and 7)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from ft_checkpoint.units import human_seconds, parse_duration
from tests.cli.conftest import ROOT, cli


@pytest.mark.parametrize("text,seconds", [
    ("15 min", 900), ("56.7 min", 3402), ("15min", 900), ("1h30m", 5400), ("1 h 30 min", 5400), ("2d 6h", 194400),
    ("1.5 h", 5400), ("12.3 ms", 0.0123), ("90", 90), ("5m", 300), ("1w", 604800), ("3 hours", 10800),
])
def test_plan_takes_every_form_the_tools_print(text, seconds):
    out = json.loads(cli("plan", "--mtbf", "6h", "--cost", text, "--json").stdout)
    assert out["cost_s"] == pytest.approx(seconds)


def test_every_duration_plan_prints_is_read_back():
    """The lengths ``plan`` prints (``1.73 h``, ``56.7 min``, ``15 min``) are valid ``--cost`` and ``--mtbf``."""
    text = cli("plan", "--mtbf", "6h", "--cost", "5m", "--restart", "2m").stdout
    printed = re.findall(r"\d+(?:\.\d+)? (?:ms|s|min|h|d)\b", text)
    assert {"5 min", "6 h", "2 min", "56.7 min", "15 min"} <= set(printed), text
    for p in printed:
        proc = cli("plan", "--mtbf", "6h", "--cost", p, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["cost_s"] == pytest.approx(parse_duration(p))


@pytest.mark.parametrize("seconds", [0.0042, 0.5, 1, 59.9, 61, 899, 5400, 86399, 200 * 86400, 5000 * 86400])
def test_human_seconds_reads_back(seconds):
    assert parse_duration(human_seconds(seconds)) == pytest.approx(seconds, rel=5e-3)


@pytest.mark.parametrize("bad", ["1h1h", "1h30", "ten minutes", "5 lightyears", "-1", "1e3"])
def test_a_bad_duration_says_what_a_command_line_takes(bad):
    proc = cli("plan", "--mtbf", "6h", "--cost", bad)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "is not a duration" in proc.stderr and "1h30m" in proc.stderr and "15 min" in proc.stderr
    assert "timedelta" not in proc.stderr, "no timedelta on a command line"
    assert "'ft-checkpoint plan --help'" in proc.stderr


def test_plan_warns_about_a_checkpoint_longer_than_the_mtbf():
    proc = cli("plan", "--cost", "7h", "--mtbf", "6h")
    assert proc.returncode == 0 and "daly" in proc.stdout  # the figures still come
    assert "warning: a checkpoint that costs 7 h against an MTBF of 6 h" in proc.stderr and "HINT:" in proc.stderr
    assert cli("plan", "--cost", "5m", "--mtbf", "6h").stderr == "", "sensible inputs: no warning"


def test_simulate_warns_that_a_bare_number_is_seconds():
    proc = cli("simulate", "--mtbf", "6", "--cost", "1s", "--seeds", "1", "--early-seeds", "2", "--json")
    assert proc.returncode == 0
    assert "warning: an MTBF of 6 s" in proc.stderr and "a number without a unit is seconds" in proc.stderr
    assert "--mtbf 6h" in proc.stderr


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_plan_and_simulate_explain_themselves_and_each_option(command):
    text = cli(command, "--help").stdout
    usage, _, rest = text.partition("\n\n")
    description, _, options = rest.partition("options:")
    assert len(description.split()) > 20, text
    for line in options.splitlines():  # every option has a help text after it
        if line.strip().startswith("--") and len(line.split()) <= 2:
            continue  # the help text wraps onto the next line
        assert not re.fullmatch(r"\s+--[\w-]+( [A-Z_]+)?", line), f"no help for {line.strip()}"
    assert "a number without a unit is seconds" in " ".join(text.split())


def test_usage_errors_name_the_subcommands_own_help():
    assert "'ft-checkpoint simulate --help'" in cli("simulate", "--seeds", "0").stderr
    assert "'ft-checkpoint gc --help'" in cli("gc", "somewhere").stderr
    assert "'ft-checkpoint --help'" in cli("nosuch").stderr


def test_simulate_prints_each_row_as_soon_as_it_is_computed():
    """The process is killed right after its first row: before, no row came out until all were computed."""
    cmd = [sys.executable, "-m", "ft_checkpoint.tools.cli", "simulate", "--mtbf", "1h,6h,1d", "--cost", "10s,1m"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    guard = threading.Timer(300, proc.kill)  # a hang guard, not a time bound
    guard.start()
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]  # the two header lines
        first_row = proc.stdout.readline()
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()
        proc.wait()
    finally:
        guard.cancel()
    assert lines[1].split()[:2] == ["MTBF", "cost"], lines
    assert first_row.split()[:4] == ["1", "h", "10", "s"], first_row
    rows = [line for line in [first_row, *rest.splitlines()] if line.strip()]
    assert len(rows) < 6, "every row was already there: nothing was streamed"


def test_python_m_ft_checkpoint_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "ft_checkpoint", "plan", "--mtbf", "6h", "--cost", "5m"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0 and "daly" in proc.stdout, proc.stderr
    version = subprocess.run([sys.executable, "-m", "ft_checkpoint", "--version"], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
    assert version.stdout.startswith("ft-checkpoint ")
