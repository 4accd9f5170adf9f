"""The real CLI with a signing key (issue 21, point 10): ``verify``, ``ls``'s resume mark, ``inspect`` and ``gc``
check signatures as a resume does, with the key from the environment (as the training takes it) or
``--key-file``; without a key they behave as before."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ft_checkpoint import CheckpointManager
from tests.cli.conftest import cli, cli_json
from tests.core.test_signing import (
    FORGED,
    KEY,
    OTHER_KEY,
    forge_with_recomputed_checksums,
    plant_unsigned_steps,
    resume,
    save,
    save_unsigned_into,
)

WITH_KEY = {"FT_CHECKPOINT_SIGNING_KEY": KEY}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> str:
    """Steps 1 and 2 signed with KEY; step 3 signed, then forged with recomputed checksums; step 4 unsigned."""
    root = tmp_path_factory.mktemp("signed")
    url, evil = str(root / "run"), str(root / "evil")
    save(url, [1, 2, 3], signing_key=KEY, keep_last=10)
    save(evil, [3], seed=7)
    forge_with_recomputed_checksums(url, 3, evil)
    save_unsigned_into(url, 4, seed=5)
    return url


def key_file(tmp_path, key: str) -> str:
    path = tmp_path / "ft.key"
    path.write_text(key + "\n")
    return str(path)


def test_verify_reports_forged_and_unsigned_steps_with_the_key_from_the_env(run):
    report = cli_json("verify", run, "--all", env=WITH_KEY, rc=1)
    by_step = {s["step"]: s for s in report["steps"]}
    assert [(s, by_step[s]["ok"], by_step[s]["signature"]) for s in (1, 2, 3, 4)] == [
        (1, True, "verified"), (2, True, "verified"), (3, False, "refused"), (4, False, "refused")]
    assert "does not verify" in by_step[3]["problems"][0] and "is not signed" in by_step[4]["problems"][0]
    text = cli("verify", run, "--step", 3, env=WITH_KEY)
    assert text.returncode == 1 and "step 3: UNVERIFIED" in text.stdout, text.stdout + text.stderr
    ok = cli("verify", run, "--step", 2, env=WITH_KEY)
    assert ok.returncode == 0 and "sizes, checksums and signature" in ok.stdout, ok.stdout + ok.stderr


def test_verify_takes_the_key_from_a_key_file_option(run, tmp_path):
    report = cli_json("verify", run, "--step", 2, "--key-file", key_file(tmp_path, KEY), env={
        "FT_CHECKPOINT_SIGNING_KEY": OTHER_KEY})  # the option wins over the environment
    assert report["ok"] and report["steps"][0]["signature"] == "verified"
    wrong = cli_json("verify", run, "--step", 2, "--key-file", key_file(tmp_path, OTHER_KEY), rc=1)
    assert "signed with another key" in wrong["steps"][0]["problems"][0]


def test_without_a_key_verify_and_ls_behave_as_before(run):
    listing = cli_json("ls", run)
    assert listing["resume_step"] == 4 and {s["status"] for s in listing["steps"]} == {"committed"}
    proc = cli("verify", run, "--step", 2)
    assert proc.returncode == 0 and "signed, signature not checked: no key given" in proc.stdout, proc.stdout


def test_ls_marks_the_newest_signed_step_for_resume(run, tmp_path):
    listing = cli_json("ls", run, env=WITH_KEY)
    copy = str(tmp_path / "copy")  # a resume sets the refused steps aside: not in the directory the others read
    shutil.copytree(run, copy)
    assert listing["resume_step"] == 2 == resume(copy, signing_key=KEY, run_name=run)[0]
    assert [s["status"] for s in listing["steps"]] == ["committed", "committed", "unverified", "unverified"]
    text = cli("ls", run, env=WITH_KEY).stdout
    assert "newest committed with a signature that verifies: step 2" in text and "sizes and signatures checked" in text, text


def test_inspect_shows_a_verified_signature_and_refuses_a_forged_step(run):
    info = cli_json("inspect", run, env=WITH_KEY)
    assert info["step"] == 2 and info["signature"] == "verified"
    assert "signature: verified with the key" in cli("inspect", run, env=WITH_KEY).stdout
    forged = cli("inspect", run, "--step", 3, env=WITH_KEY)
    assert forged.returncode == 2 and "does not verify" in forged.stderr, forged.stderr
    assert "signature: present, not checked" in cli("inspect", run, "--step", 2).stdout


def test_inspect_with_another_key_or_a_step_that_is_not_there_says_so(run):
    """It said "has no committed step" of a run of four steps (none verifies with that key), and "manifest.json is
    missing" of a step that does not exist."""
    wrong = cli("inspect", run, env={"FT_CHECKPOINT_SIGNING_KEY": OTHER_KEY})
    assert wrong.returncode == 2 and "has no committed step that verifies with the key given (4 steps refused" in \
        wrong.stderr, wrong.stderr
    missing = cli("inspect", run, "--step", 35)
    assert missing.returncode == 2 and "has no step 35" in missing.stderr, missing.stderr


def test_gc_with_the_key_never_deletes_the_newest_signed_step(run, tmp_path):
    """Without the key, gc kept the newest step that checks (step 4, unsigned, planted) and deleted every signed
    step (the red team's run: the training, with the key, then had no step left). Now it refuses, naming the key."""
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy)
    for dry_run in (["--dry-run"], []):
        refused = cli("gc", copy, "--keep", 1, *dry_run)
        assert refused.returncode == 2 and "are signed (3 signed steps, the newest 3), and no signing key was given" \
            in refused.stderr and "HINT: pass the run's key (--key-file" in refused.stderr, refused.stderr
    assert sorted(int(n[5:]) for n in os.listdir(copy) if n.startswith("step_")) == [1, 2, 3, 4], "gc deleted a step"
    plan = cli_json("gc", copy, "--keep", 1, "--run-name", run, env=WITH_KEY)
    assert plan["protected"] == 2 and 2 not in plan["delete"]
    assert resume(copy, signing_key=KEY, run_name=run)[0] == 2


def test_gc_with_the_key_counts_only_steps_that_verify(run, tmp_path):
    """Forged steps numbered above the run took the places of --keep: gc deleted every signed step but one."""
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy)
    plant_unsigned_steps(copy, FORGED)
    plan = cli_json("gc", copy, "--keep", 2, "--run-name", run, env=WITH_KEY)
    assert plan["delete"] == [] and plan["protected"] == 2
    assert plan["unverified"] == [3, 4, *FORGED], "refused steps are reported, neither kept nor deleted"
    second = cli("gc", copy, "--keep", 1, "--run-name", run, env=WITH_KEY)
    text = second.stdout
    assert "deleted: step 1\n" in text and "left as they are (their signature does not verify" in text, text
    assert "does not count as committed" in second.stderr, "each call warns as a new process does"
    assert sorted(int(n[5:]) for n in os.listdir(copy) if n.startswith("step_")) == [2, 3, 4, *FORGED]


def test_a_copied_run_verifies_with_run_name(run, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(run, copy)
    moved = cli_json("verify", copy, "--step", 2, env=WITH_KEY, rc=1)
    assert f"set run_name (FT_CHECKPOINT_RUN_NAME, or --run-name) to '{run}'" in moved["steps"][0]["problems"][0]
    assert cli_json("verify", copy, "--step", 2, "--run-name", run, env=WITH_KEY)["ok"]


@pytest.mark.parametrize("args,env,expected", [
    (("--key-file", "{short}"), {}, "the key has 20 bytes"),
    (("--key-file", "{dir}/ft.key"), {}, "lies inside the checkpoint directory"),
    ((), {"FT_CHECKPOINT_SIGNING_KEY": KEY[:20]}, "the key has 20 bytes"),
    ((), {"FT_CHECKPOINT_SIGNING_KEY": KEY, "FT_CHECKPOINT_SIGNING_KEY_FILE": "{good}"}, "give one"),
])
def test_a_bad_key_is_one_line_that_never_shows_it(tmp_path, args, env, expected):
    url = str(tmp_path / "run")
    with CheckpointManager(url):
        pass
    with open(os.path.join(url, "ft.key"), "w") as f:
        f.write(KEY)
    (tmp_path / "good").mkdir()
    fill = {"short": key_file(tmp_path, KEY[:20]), "good": key_file(tmp_path / "good", KEY), "dir": url}
    proc = cli("verify", url, *(a.format(**fill) for a in args), env={k: v.format(**fill) for k, v in env.items()})
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and KEY[:20] not in proc.stdout + proc.stderr, proc.stderr


def test_the_key_never_appears_in_any_output(run, tmp_path):
    outputs = [cli(*args, env=WITH_KEY) for args in (("ls", run), ("verify", run, "--all"), ("inspect", run),
                                                       ("verify", run, "--all", "--json"), ("inspect", run, "--json"))]
    assert all(KEY[:20] not in p.stdout + p.stderr for p in outputs)
    assert json.loads(outputs[-1].stdout)["manifest"]["signature"]["alg"] == "hmac-sha256"
    assert "unverified" in outputs[0].stdout and "UNVERIFIED" in outputs[1].stdout  # the key was used
