"""The real CLI answers every bad argument or file with one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import json
import os

import pytest

from ft_checkpoint import CheckpointManager
from tests.cli.conftest import cli
from tests.helpers.toy import make

HUGE = "9" * 400  # a float of it is inf

BAD_ARGUMENTS = [
    ("plan", "--mtbf", "0", "--cost", "5m"),
    ("plan", "--mtbf", "6h", "--cost", "-1"),
    ("plan", "--mtbf", "6h", "--cost", "0"),
    ("plan", "--mtbf", "nan", "--cost", "5m"),
    ("plan", "--mtbf", "inf", "--cost", "5m"),
    ("plan", "--mtbf", "1e400", "--cost", "5m"),
    ("plan", "--mtbf", HUGE, "--cost", "5m"),
    ("plan", "--mtbf", f"{HUGE}w", "--cost", "5m"),
    ("plan", "--mtbf", "6h", "--cost", "5m", "--restart", "nan"),
    ("plan", "--mtbf", "1s", "--cost", "1s", "--restart", "36500d"),  # exp(restart / mtbf) overflows
    ("plan", "--mtbf", "6h"),
    ("simulate", "--seeds", "-1"),
    ("simulate", "--seeds", "0"),
    ("simulate", "--seeds", "1.5"),
    ("simulate", "--early-seeds", "0"),
    ("simulate", "--mtbf", "inf"),
    ("simulate", "--mtbf", ","),
    ("simulate", "--cost", "0"),
    ("simulate", "--weibull", "nan"),
    ("simulate", "--weibull", "-1"),
    ("simulate", "--work", "0"),
    ("simulate", "--work", "inf"),
    ("simulate", "--world-size", "0"),
    ("inspect", "{dir}", "--step", "10000000000000"),
    ("inspect", "{dir}", "--step", "1e3"),
    ("verify", "{dir}", "--step", "-3"),
    ("verify", "{dir}", "--step", "\u00b2"),  # a digit to str.isdigit, not to int()
    ("gc", "{dir}", "--keep", "0"),
    ("gc", "{dir}", "--keep", "10000000000000"),
    ("gc", "{dir}", "--keep", "3", "--keep-every", "x"),
    ("nosuch",),
]

BAD_ENVIRONMENT = [
    {"FT_CHECKPOINT_STORAGE_OPTIONS": "[" * 100_000},
    {"FT_CHECKPOINT_STORAGE_OPTIONS": "[1, 2]"},
    {"FT_CHECKPOINT_STORAGE_OPTIONS": '{"endpoint_url": ' + "7" * 5000 + "}"},
    {"FT_CHECKPOINT_RETRIES": "nan"},
    {"FT_CHECKPOINT_RETRIES": "1" * 5000},
    {"FT_CHECKPOINT_CONFIG": "{yaml_list}"},
    {"FT_CHECKPOINT_CONFIG": "{dir}"},  # a directory, not a file
]


def assert_one_line_error(proc, what) -> None:
    assert proc.returncode == 2, (what, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, (what, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ft-checkpoint") and "error: " in lines[0], (what, proc.stderr)


@pytest.mark.parametrize("args", BAD_ARGUMENTS, ids=lambda a: " ".join(a)[:60])
def test_a_bad_argument_is_one_line_and_exit_code_2(args, tmp_path):
    proc = cli(*[a.replace("{dir}", str(tmp_path)) for a in args])
    assert_one_line_error(proc, args)


@pytest.mark.parametrize(("args", "bound"), [(("--work", "1e300"), "at most 1000"),
                                             (("--seeds", "999999999999"), "from 1 to 10000"),
                                             (("--early-seeds", "999999999999"), "from 1 to 100000")])
def test_simulate_refuses_more_work_or_runs_than_it_can_finish(args, bound):
    """``--work 1e300`` (any finite number was taken) and a huge ``--seeds`` ran forever."""
    proc = cli("simulate", "--mtbf", "1h", "--cost", "1s", *args, timeout=30)
    assert_one_line_error(proc, args)
    assert f"argument {args[0]}: " in proc.stderr and bound in proc.stderr, proc.stderr


@pytest.mark.parametrize("variables", BAD_ENVIRONMENT, ids=lambda v: " ".join(f"{k}={v[k][:20]}" for k in v))
def test_a_bad_configuration_is_one_line_and_exit_code_2(variables, tmp_path):
    yaml_list = tmp_path / "list.yaml"
    yaml_list.write_text("- dirpath: /x\n")
    env = {k: v.replace("{yaml_list}", str(yaml_list)).replace("{dir}", str(tmp_path)) for k, v in variables.items()}
    proc = cli("ls", tmp_path, env=env)
    assert_one_line_error(proc, variables)
    assert next(iter(variables)).removeprefix("FT_CHECKPOINT_").lower() in proc.stderr.lower()


def test_a_misspelt_variable_is_warned_about_once(tmp_path):
    """``FT_CHECKPOINT_KEEPLAST=2 ft-checkpoint ls DIR`` warned twice: the storage and the signing key each read the
    configuration."""
    proc = cli("ls", tmp_path, env={"FT_CHECKPOINT_KEEPLAST": "2"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("FT_CHECKPOINT_KEEPLAST names no ft-checkpoint setting") == 1, proc.stderr


@pytest.fixture(scope="module")
def wrong_types(tmp_path_factory) -> str:
    """A directory with steps 1 and 2; step 2's manifest has ``"step": 2.0``, sizes as strings, ``"time": "noon"``."""
    url = str(tmp_path_factory.mktemp("types") / "run")
    with CheckpointManager(url, interval=1, keep_last=5) as ckpt:
        state = make()
        ckpt.save(1, state, block=True)
        ckpt.save(2, state, block=True)
    path = os.path.join(url, "step_000000000002", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest.update(step=2.0, time="noon")
    for entry in manifest["files"].values():
        entry["size"] = str(entry["size"])
    with open(path, "w") as f:
        json.dump(manifest, f)
    return url


def test_ls_reports_a_manifest_of_wrong_types_as_corrupt(wrong_types):
    proc = cli("ls", wrong_types, "--json")
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
    steps = {s["step"]: s["status"] for s in json.loads(proc.stdout)["steps"]}
    assert steps == {1: "committed", 2: "corrupt"}


@pytest.mark.parametrize("args", [("verify", "--step", "2"), ("verify", "--all"), ("inspect", "--step", "2"),
                                  ("gc", "--keep", "1", "--dry-run")])
def test_other_commands_on_a_manifest_of_wrong_types_never_print_a_traceback(wrong_types, args):
    proc = cli(args[0], wrong_types, *args[1:])
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode == 2:
        assert_one_line_error(proc, args)
    else:
        assert proc.returncode in (0, 1), (proc.returncode, proc.stderr)


@pytest.mark.parametrize("command", ["ls", "verify", "report", "gc --keep 1"])
def test_a_step_directory_or_a_file_given_as_dir_is_named_for_what_it_is(tmp_path, command):
    """``ls`` of a step directory (a path ``ls`` prints) said "0 step directories; a resume would start fresh"; of a
    file the same, with exit code 0, and ``report`` raised a NotADirectoryError."""
    run = tmp_path / "run"
    with CheckpointManager(str(run), interval=1, announce=False) as ckpt:
        ckpt.save(5, make(), block=True)
    (tmp_path / "notes.txt").write_text("x")
    files = sorted(os.listdir(run / "step_000000000005"))
    for target, expected in ((run / "step_000000000005", f"is step 5 of the run in {run}, not a run's checkpoint "
                                                         f"directory. HINT: pass {run} (and --step 5"),
                             (tmp_path / "notes.txt", "is a file, not a checkpoint directory. HINT:")):
        proc = cli(*command.split()[:1], target, *command.split()[1:])
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(os.listdir(run / "step_000000000005")) == files


@pytest.mark.parametrize(("fast", "expected"), [("notes.txt", "not a directory"), ("absent", "no such directory")])
def test_ls_fast_names_a_path_that_is_no_fast_tier_folder(tmp_path, fast, expected):
    """``--fast`` given a file failed with "unexpected NotADirectoryError (please report it)"; given a path that does
    not exist, ``ls`` silently showed no fast-tier step."""
    run = tmp_path / "run"
    with CheckpointManager(str(run), interval=1, announce=False) as ckpt:
        ckpt.save(1, make(), block=True)
    (tmp_path / "notes.txt").write_text("x")
    proc = cli("ls", run, "--fast", tmp_path / fast)
    assert proc.returncode == 2 and f"{expected}. HINT: pass the job's fast_dirpath" in proc.stderr, proc.stderr


@pytest.mark.slow  # a subprocess (over 5 s on a loaded machine): the quick tier stays under 3 minutes
def test_a_config_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """``FT_CHECKPOINT_CONFIG`` naming a FIFO (or ``/dev/stdin``) hung every command forever in ``open``."""
    fifo = tmp_path / "ft.yaml"
    os.mkfifo(fifo)
    proc = cli("ls", tmp_path, env={"FT_CHECKPOINT_CONFIG": str(fifo)}, timeout=60)
    assert_one_line_error(proc, "fifo")
    assert "FT_CHECKPOINT_CONFIG" in proc.stderr and "not a regular file" in proc.stderr, proc.stderr


def test_dir_wins_over_a_bad_training_dirpath_and_a_bad_setting_names_where_it_came_from(tmp_path):
    """With DIR given, a typo in ``FT_CHECKPOINT_DIRPATH`` (which the command does not use) stopped it; a bad value of
    a setting the user never passed to the command (``interval='abc'``) said nothing of where it came from."""
    proc = cli("ls", tmp_path, env={"FT_CHECKPOINT_DIRPATH": "gs:/bucket"})
    assert proc.returncode == 0, proc.stderr
    proc = cli("ls", env={"FT_CHECKPOINT_DIRPATH": "gs:/bucket"})
    assert_one_line_error(proc, "dirpath")
    assert "'gs://bucket' missing a slash" in proc.stderr, proc.stderr
    proc = cli("ls", tmp_path, env={"FT_CHECKPOINT_INTERVAL": "abc"})
    assert_one_line_error(proc, "interval")
    assert "in the training's configuration (FT_CHECKPOINT_* environment variables" in proc.stderr, proc.stderr
    assert "interval='abc' is invalid" in proc.stderr, proc.stderr


@pytest.mark.slow  # a subprocess (over 5 s on a loaded machine): the quick tier stays under 3 minutes
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_gc_whose_output_cannot_be_written_says_its_deletions_are_done(tmp_path):
    """``gc DIR --keep 1 > /dev/full`` deleted the steps, then said "unexpected OSError ... a file in the directory may
    be damaged": the user read that gc failed (nothing deleted) and blamed the checkpoint."""
    import subprocess
    import sys

    from tests.cli.conftest import ROOT

    run = tmp_path / "run"
    with CheckpointManager(str(run), interval=1, keep_last=5, announce=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, make(), block=True)
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "ft_checkpoint.tools.cli", "gc", str(run), "--keep", "1"],
                              stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    assert_one_line_error(proc, "gc > /dev/full")
    assert "cannot write the output to stdout" in proc.stderr and "deletions are done" in proc.stderr, proc.stderr
    assert "may be damaged" not in proc.stderr, proc.stderr
    assert "step_000000000001" not in os.listdir(run) and "step_000000000002" in os.listdir(run)


@pytest.mark.parametrize("url", ["memory://", "memory://run"])
def test_a_memory_url_is_refused_it_is_no_other_process_s(url):
    """``ls memory://`` said "0 step directories": a training's ``memory://`` lives in that process alone."""
    proc = cli("ls", url)
    assert_one_line_error(proc, "memory")
    assert "in the memory of the process that wrote it" in proc.stderr, proc.stderr
