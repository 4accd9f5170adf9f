"""Acceptance: the real ``ft-checkpoint`` CLI on a directory written by a real training job that was
SIGKILLed in the middle of a save and resumed (see ``conftest.killed_and_resumed``)."""

from __future__ import annotations

import os
import pickle
import random
import shutil
import subprocess
import sys

import pytest

from ft_checkpoint.format import layout
from ft_checkpoint.format.layout import UNLISTED
from tests.cli.conftest import HANG_AT, INTERVAL, ROOT, SCRIPT, STEPS, TIMEOUT, cli, cli_json, run_in_terminal

DISTCP = "__0_0.distcp"


def flip_byte(path: str, offset: int = 1000) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def copy(local_run, tmp_path) -> str:
    """A private copy of the run's directory, for tests that damage or delete."""
    dst = str(tmp_path / "copy")
    shutil.copytree(local_run.url, dst)
    return dst


def step_file(root: str, step: int, name: str = DISTCP) -> str:
    return os.path.join(root, layout.step_dir(step), name)


def test_ls_shows_the_partial_step_and_the_step_resume_then_picked(local_run):
    steps = {s["step"]: s["status"] for s in local_run.ls_between["steps"]}
    assert steps == {10: "committed", 20: "committed", HANG_AT: "partial"}
    assert local_run.ls_between["resume_step"] == local_run.resumed_from == HANG_AT - INTERVAL
    row = next(line for line in local_run.ls_between_text.splitlines() if line.split()[:1] == ["20"])
    assert "committed" in row and "<- newest committed" in row
    assert "no manifest.json" in next(line for line in local_run.ls_between_text.splitlines()
                                      if line.split()[:1] == [str(HANG_AT)])


def test_ls_does_not_promise_a_step_that_a_resume_would_skip(copy):
    """A flipped byte keeps the size: ``ls`` (sizes only) cannot see it, so it marks the step as the newest
    committed, not as the one a resume would pick, and says that ``verify`` decides (issue 22, point 8)."""
    flip_byte(step_file(copy, STEPS))
    text = cli("ls", copy).stdout
    assert "<- resume" not in text and "resume would pick" not in text, text
    row = next(line for line in text.splitlines() if line.split()[:1] == [str(STEPS)])
    assert "<- newest committed" in row
    assert f"newest committed: step {STEPS} (a resume tries it first)" in text.splitlines()[0]
    assert f"loads step {STEPS} only if its checksums match" in text and f"'ft-checkpoint verify {copy}'" in text
    verify = cli("verify", copy)
    assert verify.returncode == 1 and f"step {STEPS}: CORRUPT" in verify.stdout


def test_ls_counts_a_corrupt_steps_files_and_bytes_as_a_committed_steps(copy):
    """The files and size columns of a committed step are its data files (the manifest's list); a step whose manifest
    does not parse counted its ``manifest.json`` too: one file more, and its bytes, than the same step committed."""
    before = {s["step"]: s for s in cli_json("ls", copy)["steps"]}
    with open(step_file(copy, STEPS, layout.MANIFEST), "w") as f:
        f.write("{garbage")
    after = {s["step"]: s for s in cli_json("ls", copy)["steps"]}
    assert after[STEPS]["status"] == "corrupt"
    assert (after[STEPS]["files"], after[STEPS]["bytes"]) == (before[STEPS]["files"], before[STEPS]["bytes"])


def test_verify_calls_a_step_without_a_manifest_partial_not_corrupt(copy):
    """An interrupted save (or one being written) leaves a step without ``manifest.json``: ``ls`` says "partial",
    ``verify --step`` said CORRUPT, as of a damaged checkpoint."""
    partial = os.path.join(copy, layout.step_dir(STEPS + 10))
    os.makedirs(partial)
    shutil.copy(step_file(copy, STEPS), partial)
    verify = cli("verify", copy, "--step", STEPS + 10)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert f"step {STEPS + 10}: PARTIAL: never committed (an interrupted save" in verify.stdout, verify.stdout
    assert "CORRUPT" not in verify.stdout and "a resume skips a corrupt, partial or unverified step" in verify.stdout


def test_ls_after_the_resumed_attempt_finished(local_run):
    listing = cli_json("ls", local_run.url)
    assert [(s["step"], s["status"]) for s in listing["steps"]] == [(20, "committed"), (30, "committed"),
                                                                     (40, "committed")]  # keep_last=3
    assert listing["resume_step"] == STEPS
    newest = listing["steps"][-1]
    # 2 shard files (writers=2), metadata.json, the rank file
    assert newest["world_size"] == 1 and newest["files"] == 4 and newest["bytes"] > 3_000_000 and newest["time"]


def test_verify_passes_then_fails_after_a_byte_flip_naming_the_file(copy):
    ok = cli("verify", copy)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"step {STEPS}: ok" in ok.stdout

    flip_byte(step_file(copy, STEPS))
    bad = cli("verify", copy)
    assert bad.returncode == 1
    assert f"{step_file(copy, STEPS)}: does not match its checksum" in bad.stdout
    result = cli_json("verify", copy, rc=1)
    assert result["ok"] is False and result["steps"][0]["problems"] == [
        f"{step_file(copy, STEPS)}: does not match its checksum (corrupted)"]
    assert cli("verify", copy, "--step", 30).returncode == 0
    everything = cli_json("verify", copy, "--all", rc=1)
    assert [(s["step"], s["ok"]) for s in everything["steps"]] == [(20, True), (30, True), (40, False)]


def test_verify_names_a_truncated_file_and_a_missing_manifest(copy):
    with open(step_file(copy, 30, "rank_00000.pt"), "r+b") as f:
        f.truncate(10)
    bad = cli("verify", copy, "--step", 30)
    assert bad.returncode == 1 and f"{step_file(copy, 30, 'rank_00000.pt')}: has 10 bytes" in bad.stdout
    os.remove(step_file(copy, 20, layout.MANIFEST))
    missing = cli("verify", copy, "--step", 20)
    assert missing.returncode == 1 and "manifest.json is missing" in missing.stdout
    unknown = cli("verify", copy, "--step", 12345)
    assert unknown.returncode == 2 and "has no step 12345" in unknown.stderr and "ft-checkpoint ls" in unknown.stderr


def test_a_quarantined_step_is_corrupt_and_verify_checks_what_a_resume_would_load(copy):
    manifest = step_file(copy, STEPS, layout.MANIFEST)
    os.rename(manifest, manifest + ".skipped")  # what a resume does to a step it found corrupt
    listing = cli_json("ls", copy)
    assert listing["steps"][-1]["status"] == "corrupt" and "quarantined" in listing["steps"][-1]["reason"]
    assert listing["resume_step"] == 30
    assert [s["step"] for s in cli_json("verify", copy)["steps"]] == [30]
    everything = cli_json("verify", copy, "--all", rc=1)
    assert "quarantined" in everything["steps"][-1]["problems"][0]
    partial = cli("inspect", copy, "--step", STEPS)
    assert partial.returncode == 2 and "manifest.json is missing" in partial.stderr
    assert "ft-checkpoint ls" in partial.stderr


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_garbage_in_step_directories_is_reported_as_a_resume_then_skips_it(copy):
    """Files the manifest does not list (step 40), garbage bytes in place of a manifest (step 30)."""
    for name in ("__0_7.distcp", "notes.txt"):
        shutil.copy(step_file(copy, STEPS), step_file(copy, STEPS, name))
    with open(step_file(copy, 30, layout.MANIFEST), "wb") as f:
        f.write(random.Random(0).randbytes(300))

    bad = cli("verify", copy)
    assert bad.returncode == 1 and f"step {STEPS}: CORRUPT" in bad.stdout
    assert f"{step_file(copy, STEPS, 'notes.txt')}: {UNLISTED}" in bad.stdout
    assert cli_json("verify", copy, rc=1)["steps"][0]["problems"] == [
        f"{step_file(copy, STEPS, name)}: {UNLISTED}" for name in ("__0_7.distcp", "notes.txt")]
    everything = cli_json("verify", copy, "--all", rc=1)
    assert [(s["step"], s["ok"]) for s in everything["steps"]] == [(20, True), (30, False), (40, False)]
    assert "manifest.json: not valid JSON" in everything["steps"][1]["problems"][0]
    listing = cli_json("ls", copy)
    assert [s["status"] for s in listing["steps"]] == ["committed", "corrupt", "corrupt"]
    assert listing["resume_step"] == 20

    resumed = subprocess.run([sys.executable, SCRIPT, copy, "--steps", "20"], capture_output=True, text=True,
                             timeout=TIMEOUT)  # the real job: the same two steps skipped, the same one taken
    assert "START 20" in resumed.stdout, resumed.stdout + resumed.stderr
    skipped = [line for line in resumed.stderr.splitlines() if line.startswith("skipping step")]
    assert len(skipped) == 2 and f"__0_7.distcp, notes.txt: {UNLISTED}" in skipped[0] and \
        "not valid JSON" in skipped[1], resumed.stderr


def test_report_shows_one_failure_and_the_steps_really_recomputed(local_run):
    report = cli_json("report", local_run.url)
    total, (killed, resumed) = report["total"], report["attempts"]
    assert total["attempts"] == 2 and total["failures"] == 1 and total["preemptions"] == 0
    actually_recomputed = local_run.killed_at - local_run.resumed_from
    assert killed["recomputed_steps"] == total["recomputed_steps"] == actually_recomputed == INTERVAL, report
    assert killed["outcome"] == "failed" and killed["last_step"] == HANG_AT and killed["recomputed_s"] > 0
    assert resumed["outcome"] == "clean_end" and resumed["resumed_from"] == local_run.resumed_from
    assert resumed["recomputed_steps"] is None and resumed["load_s"] > 0 and killed["gap_after_s"] > 0
    assert total["stall_s"] > 0 and 0 < total["goodput"] < 1
    parts = total["useful_s"] + total["stall_s"] + total["load_s"] + total["recomputed_s"] + total["gap_s"]
    assert parts == pytest.approx(total["wall_s"], abs=1e-6)

    text = cli("report", local_run.url).stdout
    assert "2 attempts, 1 failure, 0 preemptions" in text
    assert f" {INTERVAL} steps" in text and ">=" not in text and "goodput" in text and "failed" in text
    assert killed["recomputed_exact"] and total["recomputed_exact"]  # on local disk every step is noted


def test_inspect_reads_tensors_from_metadata(local_run):
    info = cli_json("inspect", local_run.url, "--step", STEPS)
    assert info["step"] == STEPS and info["manifest"]["world_size"] == 1
    assert info["manifest"]["metadata"]["loss"] > 0 and info["manifest"]["epoch"] == 0
    tensors = {t["name"]: t for t in info["tensors"]}
    assert tensors["model/2.weight"] == {"name": "model/2.weight", "shape": [512, 512], "dtype": "float32",
                                         "bytes": 512 * 512 * 4, "chunks": 1}
    assert "optim/state/2/exp_avg_sq" in tensors
    text = cli("inspect", local_run.url, "--step", STEPS).stdout
    assert "model/2.weight" in text and "[512, 512]" in text and "torch" in text


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
@pytest.mark.parametrize("payload", ["reduce", "dotted-name"])
def test_inspect_never_unpickles_anything_but_checkpoint_metadata(tmp_path, payload):
    """A format-1 step (pickled ``.metadata``, as 0.1 wrote) with a payload whose checksum was recomputed."""
    from tests.core.test_untrusted import dotted_payload
    from tests.helpers.legacy import replace_legacy_file, write_legacy_step
    from tests.helpers.toy import make

    url, marker = str(tmp_path / "legacy"), str(tmp_path / "pwned")
    write_legacy_step(url, 5, make())
    good = cli_json("inspect", url, "--step", 5)
    assert good["manifest"]["format_version"] == 1 and any(t["name"] == "model/0.weight" for t in good["tensors"])
    evil = pickle.dumps(_Payload(marker)) if payload == "reduce" else dotted_payload(marker)
    with open(step_file(url, 5, ".metadata"), "wb") as f:
        f.write(evil)
    bad = cli("inspect", url, "--step", 5)  # its size and checksum no longer match: refused before reading
    assert bad.returncode == 2 and "the manifest says" in bad.stderr and "refusing to read it" in bad.stderr
    replace_legacy_file(url, 5, ".metadata", evil)  # a forged manifest too: the allowlist still refuses
    forged = cli("inspect", url, "--step", 5)
    assert forged.returncode == 2 and "refusing to load it" in forged.stderr and "Traceback" not in forged.stderr
    assert not os.path.exists(marker)


def test_inspect_reads_no_pickle_and_imports_no_torch(copy):
    """Format 2 keeps its tensor metadata as JSON: inspect needs neither pickle nor torch."""
    code = ("import sys; from ft_checkpoint.tools.cli import main; rc = main(['inspect', sys.argv[1], '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, copy], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"dtype": "float32"' in proc.stdout


def test_gc_dry_run_deletes_nothing_then_gc_keeps_the_newest(copy):
    plan = cli_json("gc", copy, "--keep", 1, "--dry-run")
    assert plan["delete"] == [20, 30] and plan["keep"] == [40] and plan["protected"] == 40 and plan["dry_run"]
    assert [s["step"] for s in cli_json("ls", copy)["steps"]] == [20, 30, 40]
    text = cli("gc", copy, "--keep", 1, "--dry-run").stdout
    assert "would delete: step 20, step 30" in text
    assert cli_json("gc", copy, "--keep", 1)["delete"] == [20, 30]
    assert [s["step"] for s in cli_json("ls", copy)["steps"]] == [40]


def test_gc_keeps_the_milestones_the_training_keeps_unless_told_otherwise(copy, tmp_path):
    """The training's config (``FT_CHECKPOINT_CONFIG``, whose key and storage options gc reads) keeps every 20th
    step: gc deleted step 20 all the same. ``--keep-every`` still decides when given; 0 keeps no milestone."""
    config = tmp_path / "train.yaml"
    config.write_text("keep_every_n_steps: 20\nkeep_last: 1\n")
    env = {"FT_CHECKPOINT_CONFIG": str(config)}
    text = cli("gc", copy, "--keep", 1, "--dry-run", env=env).stdout
    assert "would delete: step 30" in text and "every multiple of 20 (the training's keep_every_n_steps" in text, text
    assert cli_json("gc", copy, "--keep", 1, "--keep-every", 15, env=env)["delete"] == [20]
    assert cli_json("gc", copy, "--keep", 1, "--keep-every", 0, env=env)["delete"] == [30]
    assert [s["step"] for s in cli_json("ls", copy)["steps"]] == [40]


def test_gc_names_a_folder_it_left_in_a_deleted_steps_directory_and_never_calls_that_step_kept(copy):
    """A folder in a step's directory (a user's notes, say): gc deleted the step's manifest and every file, could not
    remove the directory, and then reported the step as kept."""
    twin = shutil.copytree(copy, copy + "-twin")
    for root in (copy, twin):
        os.mkdir(os.path.join(root, layout.step_dir(20), "notes"))
    done = cli_json("gc", copy, "--keep", 1)
    assert done["delete"] == [20, 30] and done["keep"] == [40]
    assert done["left_in_place"] == [os.path.join(copy, layout.step_dir(20), "notes")]
    assert os.listdir(os.path.join(copy, layout.step_dir(20))) == ["notes"]
    text = cli("gc", twin, "--keep", 1).stdout
    assert "deleted: step 20, step 30\nkept: step 40\n" in text, text
    assert f"left in place in deleted steps' directories (folders ft-checkpoint never writes; gc deletes only files): " \
           f"{os.path.join(twin, layout.step_dir(20), 'notes')}" in text, text


def test_gc_never_deletes_the_newest_verified_step(copy):
    flip_byte(step_file(copy, STEPS))  # step 40 still has its manifest, but no longer verifies
    plan = cli_json("gc", copy, "--keep", 1)
    assert plan["protected"] == 30 and plan["delete"] == [20]
    assert [s["step"] for s in cli_json("ls", copy)["steps"]] == [30, 40]
    assert cli("verify", copy, "--step", 30).returncode == 0


def test_quick_verify_draws_no_bar_even_on_a_terminal(local_run):
    """A bar shows only for work that takes longer than a few seconds (tests/cli/test_progress.py)."""
    rc, drawn = run_in_terminal([sys.executable, "-m", "ft_checkpoint.tools.cli", "verify", local_run.url, "--all"])
    assert rc == 0 and "intact" in drawn and "verifying" not in drawn
    piped = cli("verify", local_run.url, "--all")
    assert "verifying" not in piped.stdout + piped.stderr


def test_report_plot_needs_matplotlib_and_says_how_to_get_it(local_run, tmp_path):
    block = ("import sys\nclass B:\n def find_spec(self, name, path=None, target=None):\n"
             "  if name.split('.')[0] == 'matplotlib': raise ImportError('blocked: ' + name)\n"
             "sys.meta_path.insert(0, B())\nfrom ft_checkpoint.tools.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    png = str(tmp_path / "timeline.png")
    proc = subprocess.run([sys.executable, "-c", block, "report", local_run.url, "--plot", png],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "pip install 'ft-checkpoint[plot]'" in proc.stderr
    assert not os.path.exists(png)


def test_report_plot_draws_the_timeline(local_run, tmp_path):
    pytest.importorskip("matplotlib")
    png = str(tmp_path / "timeline.png")
    proc = cli("report", local_run.url, "--plot", png)
    assert proc.returncode == 0, proc.stderr
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_listing_commands_do_not_import_torch(local_run):
    """``ls`` and ``report`` (and ``inspect``, below) read no tensor and import no torch; ``verify`` and ``gc`` load each
    rank file as a resume does, with torch's weights-only loader (``test_forged_steps.py``)."""
    code = ("import sys\nclass B:\n def find_spec(self, name, path=None, target=None):\n"
            "  if name.split('.')[0] == 'torch': raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, B())\nfrom ft_checkpoint.tools.cli import main\n"
            f"for cmd in (['ls'], ['report']):\n"
            f"    assert main([*cmd[:1], {local_run.url!r}, *cmd[1:], '--json']) == 0, cmd\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_errors_say_what_to_do(tmp_path):
    missing = cli("ls", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "HINT" in missing.stderr
    no_dir = cli("ls", env={"FT_CHECKPOINT_DIRPATH": None, "FT_CHECKPOINT_CONFIG": None})
    assert no_dir.returncode == 2 and "pass DIR" in no_dir.stderr
    bad_options = cli("ls", str(tmp_path), env={"FT_CHECKPOINT_STORAGE_OPTIONS": "{not json"})
    assert bad_options.returncode == 2 and "storage_options" in bad_options.stderr
    empty = cli("verify", str(tmp_path))
    assert empty.returncode == 1 and "no committed step" in empty.stdout


def test_a_dir_with_an_end_space_quotes_or_an_unexpanded_variable_is_refused_as_a_dirpath_is(tmp_path):
    """``ls "run "`` said "does not exist" of a directory that exists (the space does not show); the training's
    ``dirpath`` check says what is wrong, and now so does the CLI's ``DIR``."""
    (tmp_path / "run").mkdir()
    for given, expected in [(f"{tmp_path / 'run'} ", "without spaces at its start or end"),
                            (f'"{tmp_path / "run"}"', "without the quotes"), ("$HOME/run", r"with $HOME expanded")]:
        out = cli("ls", given)
        assert out.returncode == 2 and expected in out.stderr and "does not exist" not in out.stderr, out.stderr


def test_dir_defaults_to_the_training_config(local_run):
    listing = cli_json("ls", env={"FT_CHECKPOINT_DIRPATH": local_run.url})
    assert listing["resume_step"] == STEPS


def test_ls_on_a_lightning_root_dir_points_at_its_ft_checkpoints(local_run, tmp_path):
    """A Lightning ``default_root_dir`` holds the steps in ``ft_checkpoints/``: ``ls`` of the root says so."""
    root = tmp_path / "lightning_logs_root"
    shutil.copytree(local_run.url, root / "ft_checkpoints")
    (root / "lightning_logs").mkdir()
    out = cli("ls", root)
    assert out.returncode == 0 and "0 step directories" in out.stdout
    assert f"HINT: checkpoints are in {root / 'ft_checkpoints'}: 'ft-checkpoint ls {root / 'ft_checkpoints'}'" in out.stdout


def test_verify_says_whether_a_resume_loads_a_step_whose_damage_is_outside_its_tensors(tmp_path):
    """On local disk each chunk of a shard file starts on a page boundary: the zero padding in between belongs to no
    tensor, and a resume, which reads and checks each tensor's byte range alone, loads a step whose padding changed.
    Before: ``verify`` called it CORRUPT and said "a resume skips a corrupt or unverified step", and the resume loaded
    it. Now both agree: the whole-file mismatch is still reported (exit 1), with whether a resume loads the step."""
    import json

    import torch

    from ft_checkpoint import CheckpointManager
    from ft_checkpoint.format import tensor_metadata

    url = str(tmp_path / "run")

    def state() -> dict:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}

    with CheckpointManager(url, interval=1) as ckpt:
        for step in (4, 5):
            ckpt.save(step, state(), block=True)
    path = step_file(url, 5)
    with open(step_file(url, 5, tensor_metadata.NAME), "rb") as f:
        chunks = [c for t in json.load(f)["tensors"].values() for c in t["chunks"] if c["file"] == DISTCP]
    end = max(c["offset"] + c["length"] for c in chunks)
    assert end < os.path.getsize(path), "no padding after the last chunk: nothing to test"
    flip_byte(path, end)  # the first byte after every tensor's bytes

    text = cli("verify", url)
    assert text.returncode == 1, text.stdout + text.stderr
    assert "step 5: CORRUPT outside its tensors (a resume loads it)" in text.stdout, text.stdout
    assert f"{path}: does not match its checksum (corrupted) in bytes that belong to no tensor" in text.stdout
    assert "a resume still loads step 5" in text.stdout and "a resume skips" not in text.stdout, text.stdout
    [step] = cli_json("verify", url, rc=1)["steps"]
    assert (step["ok"], step["resume_loads"]) == (False, True)
    with CheckpointManager(url, interval=1) as ckpt:
        assert ckpt.resume(state()) == 5  # what verify said

    flip_byte(path, chunks[0]["offset"])  # and now a tensor's byte too
    text = cli("verify", url)
    assert text.returncode == 1 and "step 5: CORRUPT\n" in text.stdout and "a resume skips" in text.stdout, text.stdout
    assert cli_json("verify", url, rc=1)["steps"][0]["resume_loads"] is False
    with CheckpointManager(url, interval=1) as ckpt:
        assert ckpt.resume(state()) == 4  # what verify said: skipped


LIVE_JOB = """
import sys, time
sys.path.insert(0, {root!r})
import torch
from ft_checkpoint import CheckpointManager
state = {{"w": torch.zeros(20000)}}
with CheckpointManager({url!r}, interval=1, keep_last=1) as ckpt:
    print("RUNNING", flush=True)
    for step in range(1, 100000):
        state["w"] += 1
        ckpt.save(step, state, block=True)
        time.sleep(0.02)
"""


@pytest.mark.slow
def test_verify_and_gc_on_a_directory_a_running_job_saves_to(tmp_path):
    """A real job commits a step every few milliseconds with keep_last=1, its retention deleting the step before.
    Before: ``verify`` and ``gc`` read a file of a step the job deleted meanwhile and stopped with "not found"
    (exit 2: 19 of 24 commands, helper-43), and gc deleted nothing. Now a step deleted as it is checked is said to be
    so, ``verify`` checks the newest step after it, and gc goes on."""
    url = str(tmp_path / "ckpt")
    job = subprocess.Popen([sys.executable, "-c", LIVE_JOB.format(root=ROOT, url=url)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "RUNNING"
        runs = [cli(command, url, *extra, process=True) for _ in range(4)
                for command, extra in (("verify", ()), ("gc", ("--keep", "1")))]
    finally:
        job.kill()
        job.wait()
    assert all(r.returncode == 0 for r in runs), [r.stdout + r.stderr for r in runs if r.returncode != 0]
    assert all("intact" in r.stdout for r in runs[::2]), [r.stdout for r in runs[::2]]
    # gc imported torch after listing: by then the job had deleted every step listed, and gc said "no step verifies"
    assert all("never deletes step" in r.stdout for r in runs[1::2]), [r.stdout for r in runs[1::2]]


def test_gc_never_claims_a_step_that_was_already_gone_when_it_came_to_it(copy, monkeypatch):
    """Another gc (or the running job's retention) deleted step 20 between this gc's plan and its deletions: before,
    ``delete_step`` said True for a directory that no longer existed, and both gcs printed "deleted: step 20"."""
    from ft_checkpoint.tools import catalog

    planned = catalog.plan_gc

    def plan_then_lose_step_20(storage, **kwargs):
        plan = planned(storage, **kwargs)
        shutil.rmtree(storage.path(layout.step_dir(20)))  # as another process would, after the plan
        return plan

    monkeypatch.setattr(catalog, "plan_gc", plan_then_lose_step_20)
    twin = shutil.copytree(copy, copy + "-twin")
    done = cli_json("gc", copy, "--keep", 1)
    assert done["delete"] == [30] and done["already_gone"] == [20] and done["keep"] == [40], done
    text = cli("gc", twin, "--keep", 1).stdout
    assert "deleted: step 30\n" in text and "step 20, step 30" not in text, text
    assert "already gone (another gc or the job's retention deleted them): step 20\n" in text, text
    assert "kept: step 40\n" in text, text


def test_warnings_of_steps_that_do_not_count_are_capped_and_in_step_order(tmp_path):
    """Anyone who can write the directory can plant garbage step directories: 100 of them printed 100 warning lines
    (in set order) in ``gc`` and in the training's log (its retention lists the directory). Now the first 20, by
    step, and one line saying how many more were left out and where to see them. (``ls`` warns of none: its table
    shows each such step, with why.)"""
    import torch

    from ft_checkpoint import CheckpointManager

    run = str(tmp_path / "run")
    with CheckpointManager(run, interval=1, announce=False) as ckpt:
        ckpt.save(1000, {"w": torch.zeros(4)}, block=True)
    for step in random.sample(range(1, 101), 100):  # created in no order: listings come back in set order
        os.makedirs(os.path.join(run, layout.step_dir(step)))
        with open(os.path.join(run, layout.step_dir(step), layout.MANIFEST), "w") as f:
            f.write("{}")
    proc = cli("gc", run, "--keep", 1, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "does not count as committed:" in line]
    assert len(warned) == 20, proc.stderr
    assert [int(line.split("step ")[1].split()[0]) for line in warned] == list(range(1, 21)), warned
    summary = [line for line in proc.stderr.splitlines() if "80 more" in line]
    assert len(summary) == 1 and "HINT:" in summary[0], proc.stderr
    assert len(proc.stderr.splitlines()) <= 22, proc.stderr
