"""Signed manifests (issue 21, point 10): with a key, a job resumes only steps whose manifest is signed with
that key, for this run and this step. Each attack is built for real by someone who can write the directory
but has no key: checksums recomputed, another key, a step copied from another run or under another number,
newer steps deleted. Without a key, everything stays as it was."""

from __future__ import annotations

import copy
import hmac
import json
import logging
import os
import shutil
import threading

import pytest

from ft_checkpoint import CheckpointConfig, CheckpointManager
from ft_checkpoint.errors import ConfigError, SignatureError
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from tests.helpers.toy import assert_same, make, train_step

KEY = "5f0c9e2a7d41b8363ac2e9f17b0d4c5a" * 2  # 64 hex digits, as `openssl rand -hex 32` prints
OTHER_KEY = "0d9b1e7c3a5f2468ace13579bdf02468" * 2
BEFORE = {"format", "format_version", "step", "epoch", "time", "world_size", "files", "versions", "metadata"}
"""The fields of a manifest before signing existed: an unsigned one still has exactly these."""


def save(url: str, steps: list[int], *, seed: int = 0, **config) -> dict[int, dict]:
    """A toy run that trains one step before each save of ``steps``; returns a copy of each saved state."""
    state, saved = make(seed), {}
    with CheckpointManager(url, interval=1, **config) as ckpt:
        for step in steps:
            train_step(state)
            ckpt.save(step, state, block=True)
            saved[step] = copy.deepcopy(state)
    return saved


def resume(url: str, **config) -> tuple[int | None, dict]:
    """A new job's resume into a fresh state: (the step it resumed, the state)."""
    state = make(seed=9)
    with CheckpointManager(url, **config) as ckpt:
        return ckpt.resume(state), state


def manifest_of(url: str, step: int) -> dict:
    return json.loads(Storage(url).read_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}"))


def write_manifest(url: str, step: int, manifest: dict) -> None:
    Storage(url).write_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}", json.dumps(manifest).encode())


def skip_warning(caplog, step: int) -> str:
    messages = [r.getMessage() for r in caplog.records if f"skipping step {step} " in r.getMessage()]
    assert messages, caplog.text
    return messages[0]


def resumes_skipping(url: str, caplog, saved: dict[int, dict], *, resumed: int, skipped: int, reason: str) -> None:
    """A resume with KEY loads step ``resumed`` bit-exactly, after a warning that ``skipped`` was skipped for ``reason``."""
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    step, state = resume(url, signing_key=KEY)
    assert step == resumed
    assert_same(state, saved[resumed])
    assert reason in skip_warning(caplog, skipped)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def forge_with_recomputed_checksums(url: str, step: int, evil_url: str) -> None:
    """Put the attacker's own save of ``step`` (another job, no key) in place of the victim's files, and the new
    files' sizes and checksums into the victim's signed manifest: every checksum matches, the signature stays."""
    victim, evil = Storage(url), Storage(evil_url)
    rel = layout.step_dir(step)
    forged, theirs = manifest_of(url, step), manifest_of(evil_url, step)
    for name in theirs["files"]:
        victim.write_bytes(f"{rel}/{name}", evil.read_bytes(f"{rel}/{name}"))
    forged["files"] = theirs["files"]
    write_manifest(url, step, forged)


@pytest.fixture
def signed_run(tmp_path) -> tuple[str, dict[int, dict]]:
    """Steps 1 and 2 of a run signed with KEY."""
    url = str(tmp_path / "run")
    return url, save(url, [1, 2], signing_key=KEY)


# -- a resume with the key -----------------------------------------------------------------------
def test_a_resume_with_the_key_loads_the_newest_signed_step_bit_exact(signed_run, caplog):
    url, saved = signed_run
    signature = manifest_of(url, 2)["signature"]
    assert signature["alg"] == "hmac-sha256" and signature["run"] == url and len(signature["mac"]) == 64
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    step, state = resume(url, signing_key=KEY)
    assert step == 2
    assert_same(state, saved[2])
    assert not warnings(caplog), caplog.text  # no skipped step, no rollback warning


def test_a_resume_with_the_key_from_env_and_run_name_from_the_config_file(tmp_path, monkeypatch):
    """The key as every other setting: from FT_CHECKPOINT_SIGNING_KEY_FILE, the run name from the YAML file."""
    key_file, config = tmp_path / "secret" / "ft.key", tmp_path / "ft.yaml"
    key_file.parent.mkdir()
    key_file.write_text(KEY + "\n")  # as `openssl rand -hex 32 > ft.key` writes it: the line ending is dropped
    config.write_text("run_name: llama-run-3\n")
    monkeypatch.setenv("FT_CHECKPOINT_SIGNING_KEY_FILE", str(key_file))
    monkeypatch.setenv("FT_CHECKPOINT_CONFIG", str(config))
    url = str(tmp_path / "run")
    saved = save(url, [1, 2])
    assert manifest_of(url, 2)["signature"]["run"] == "llama-run-3"
    monkeypatch.delenv("FT_CHECKPOINT_SIGNING_KEY_FILE")
    monkeypatch.delenv("FT_CHECKPOINT_CONFIG")
    step, state = resume(url, signing_key=KEY, run_name="llama-run-3")  # the same key, given directly
    assert step == 2
    assert_same(state, saved[2])


# -- refused: unsigned, forged, another key, another step, another run ---------------------------------
def test_an_unsigned_step_is_skipped_with_a_key_and_set_aside_once_a_step_verifies(signed_run, caplog):
    url, saved = signed_run
    save_unsigned_into(url, 3, seed=5)
    assert "signature" not in manifest_of(url, 3)
    resumes_skipping(url, caplog, saved, resumed=2, skipped=3, reason="is not signed")
    skipped = os.path.join(url, layout.step_dir(3), layout.MANIFEST + layout.SKIPPED_SUFFIX)
    assert os.path.exists(skipped), "set aside as a corrupt step is: no later resume or save takes it for a commit"
    saved.update(save(url, [3], seed=1, signing_key=KEY))  # the run goes on past it: no crash at its next save
    assert resume(url, signing_key=KEY)[0] == 3


def test_a_job_whose_key_verifies_no_step_raises_and_keeps_every_step(tmp_path):
    """The key (or run name) is what is wrong here, or signing was just turned on: nothing is set aside."""
    url = str(tmp_path / "run")
    saved = save(url, [1, 2])
    for config in ({"signing_key": KEY}, {"signing_key": KEY, "run_name": "elsewhere"}):
        with pytest.raises(SignatureError, match=r"no step in .* verifies with this job's signing key, and 2 were "
                                                 r"refused \(step 2: manifest.json is not signed"):
            resume(url, **config)
    assert layout.list_steps(Storage(url)) == {1: True, 2: True}
    step, state = resume(url)
    assert step == 2
    assert_same(state, saved[2])


def test_a_forged_manifest_with_recomputed_checksums_is_refused(signed_run, tmp_path, caplog):
    url, saved = signed_run
    evil_url = str(tmp_path / "evil")
    save(evil_url, [1, 2], seed=7)
    forge_with_recomputed_checksums(url, 2, evil_url)
    resumes_skipping(url, caplog, saved, resumed=1, skipped=2, reason="does not verify")
    save(url, [2], seed=3, signing_key=KEY)  # the run goes on past the forged step
    assert resume(url, signing_key=KEY)[0] == 2


def test_without_the_key_a_forged_step_loads(signed_run, tmp_path):
    """The attack of the test above is real: without a key, the step forged with recomputed checksums loads (its
    signature dropped: a job without the key refuses a run whose newest step is signed)."""
    url, _ = signed_run
    evil_url = str(tmp_path / "evil")
    evil = save(evil_url, [1, 2], seed=7)
    forge_with_recomputed_checksums(url, 2, evil_url)
    with pytest.raises(ConfigError, match="is signed, and this job has no signing key"):
        resume(url)
    write_manifest(url, 2, {k: v for k, v in manifest_of(url, 2).items() if k != "signature"})
    step, state = resume(url)
    assert step == 2
    assert_same(state["model"], evil[2]["model"])


def test_a_signature_made_with_another_key_is_refused(signed_run, caplog):
    url, saved = signed_run
    save(url, [3], seed=5, signing_key=OTHER_KEY)  # the attacker's own key, for this very run
    resumes_skipping(url, caplog, saved, resumed=2, skipped=3, reason="signed with another key")


@pytest.mark.parametrize("edit_step", [True, False], ids=["step-edited", "as-is"])
def test_a_step_copied_under_another_step_number_is_refused(signed_run, caplog, edit_step):
    """Step 1 copied as step 3 would roll the weights back while the step count goes on."""
    url, saved = signed_run
    shutil.copytree(os.path.join(url, layout.step_dir(1)), os.path.join(url, layout.step_dir(3)))
    if edit_step:
        manifest = manifest_of(url, 3)
        manifest["step"] = 3
        write_manifest(url, 3, manifest)
    resumes_skipping(url, caplog, saved, resumed=2, skipped=3, reason="belongs to another step")


def test_a_step_copied_from_another_run_is_refused(signed_run, tmp_path, caplog):
    url, saved = signed_run
    other = str(tmp_path / "other-run")
    save(other, [1, 2, 3], seed=5, signing_key=KEY)  # the same key, another run
    shutil.copytree(os.path.join(other, layout.step_dir(3)), os.path.join(url, layout.step_dir(3)))
    resumes_skipping(url, caplog, saved, resumed=2, skipped=3, reason=f"signed for run '{other}', not for this run '{url}'")


def test_a_moved_run_verifies_once_run_name_names_it(signed_run, tmp_path, caplog):
    url, saved = signed_run
    moved = str(tmp_path / "moved")
    shutil.move(url, moved)
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    with pytest.raises(SignatureError, match="no step in .* verifies"):  # by default the directory is the identity
        resume(moved, signing_key=KEY)
    assert f"set run_name (FT_CHECKPOINT_RUN_NAME, or --run-name) to '{url}'" in skip_warning(caplog, 2)
    step, state = resume(moved, signing_key=KEY, run_name=url)
    assert step == 2
    assert_same(state, saved[2])


def test_a_run_named_from_the_start_verifies_after_a_copy(tmp_path):
    url, copied = str(tmp_path / "run"), str(tmp_path / "copy")
    saved = save(url, [1, 2], signing_key=KEY, run_name="exp-1")
    shutil.copytree(url, copied)
    step, state = resume(copied, signing_key=KEY, run_name="exp-1")
    assert step == 2
    assert_same(state, saved[2])


# -- with the key, only steps that verify count: forged steps drive neither retention nor the step count ------
FORGED = [9 * 10**11, 9 * 10**11 + 1, 9 * 10**11 + 2]
"""Step numbers far above the run's, as a forger without the key picks them: retention keeps the highest steps."""


def save_unsigned_into(url: str, step: int, *, seed: int) -> None:
    """A whole unsigned ``step`` put into the run at ``url`` by someone without the key (a job without it is refused
    on a signed run: it saves elsewhere, and the step directory is copied in)."""
    elsewhere = f"{url}-unsigned-{step}"
    save(elsewhere, [step], seed=seed)
    shutil.copytree(os.path.join(elsewhere, layout.step_dir(step)), os.path.join(url, layout.step_dir(step)))


def plant_unsigned_steps(url: str, steps: list[int]) -> None:
    """What anyone who can write the directory can do without the key (a put-only role will do): empty steps."""
    for step in steps:
        write_manifest(url, step, {"format": "ft-checkpoint", "format_version": 2, "step": step, "world_size": 1,
                                   "files": {}})


def test_forged_steps_never_make_the_jobs_retention_delete_its_signed_steps(tmp_path, caplog):
    """They took the places of keep_last: after the next commit only the step just saved and the forged ones were left.
    Each forged step is warned about once, not at every save's retention."""
    url, state = str(tmp_path / "run"), make(0)
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    with CheckpointManager(url, interval=1, keep_last=3, signing_key=KEY) as ckpt:
        for step in (1, 2, 3, 4, 5, 6, 7):
            if step == 5:
                plant_unsigned_steps(url, FORGED)  # mid-run
            train_step(state)
            ckpt.save(step, state, block=True)
            ckpt.wait(retention=True)
        assert sorted(layout.list_steps(Storage(url))) == [5, 6, 7, *FORGED], "forged steps neither kept nor deleted"
        saved = copy.deepcopy(state)
    warning = f"step {FORGED[0]} in {url} does not count as committed: manifest.json is not signed"
    assert sum(r.getMessage().startswith(warning) for r in caplog.records) == 1
    step, resumed = resume(url, signing_key=KEY)
    assert step == 7
    assert_same(resumed, saved)


def test_forged_steps_never_make_a_save_of_a_job_with_the_key_look_like_a_restarted_step_count(tmp_path):
    url = str(tmp_path / "run")
    save(url, [1, 2], signing_key=KEY)
    plant_unsigned_steps(url, FORGED[:1])
    with CheckpointManager(url, interval=1, signing_key=KEY) as ckpt:
        assert ckpt.latest() == 2
        ckpt.save(3, make(), block=True)  # was: "cannot save step 3 ...: step 900000000000 is committed there already"
    assert resume(url, signing_key=KEY)[0] == 3


# -- what signing cannot stop, the journal tells -------------------------------------------------------
def test_deleting_newer_steps_to_roll_back_is_warned_from_the_journal(tmp_path, caplog):
    url = str(tmp_path / "run")
    saved = save(url, [1, 2, 3], signing_key=KEY)
    for step in (2, 3):  # every step left verifies: a signature cannot tell
        shutil.rmtree(os.path.join(url, layout.step_dir(step)))
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    step, state = resume(url, signing_key=KEY)
    assert step == 1
    assert_same(state, saved[1])
    warning = next(r.getMessage() for r in caplog.records if "rolled back" in r.getMessage())
    assert "records step 3 as committed" in warning and "the newest step that verifies is 1" in warning


def test_a_fresh_start_after_every_step_was_deleted_is_warned(tmp_path, caplog):
    url = str(tmp_path / "run")
    save(url, [1], signing_key=KEY)
    shutil.rmtree(os.path.join(url, layout.step_dir(1)))
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    assert resume(url, signing_key=KEY)[0] is None
    assert "records step 1 as committed" in caplog.text and "no step verifies" in caplog.text


def test_the_rollback_check_never_reads_a_fifo_named_like_a_journal_event(tmp_path):
    url = str(tmp_path / "run")
    save(url, [1], signing_key=KEY)
    attempt = sorted(os.listdir(os.path.join(url, "journal")))[-1]
    os.mkfifo(os.path.join(url, "journal", attempt, "999999-commit.json"))
    outcome: list[int | None] = []
    resume_job = lambda: outcome.append(resume(url, signing_key=KEY, interval=1)[0])  # noqa: E731 - not adaptive:
    thread = threading.Thread(target=resume_job, daemon=True)  # only the rollback check reads the journal then
    thread.start()
    thread.join(timeout=30)  # a hang guard: reading a FIFO blocks until a writer comes
    assert not thread.is_alive(), "the resume blocked on the FIFO"
    assert outcome == [1]


# -- no key: today's behaviour -------------------------------------------------------------------------
def test_without_a_key_manifests_are_unsigned_and_a_job_without_the_key_refuses_a_signed_run(tmp_path, caplog):
    """A signed run restarted once without its key (a requeue that lost its environment) resumed its newest step
    unchecked, saved unsigned steps, and its retention deleted every signed one: the next job with the key then
    found no step to resume. Now the job without the key refuses to start, and changes nothing."""
    url = str(tmp_path / "run")
    saved = save(url, [1])
    assert set(manifest_of(url, 1)) == BEFORE  # not even "signature": null
    saved.update(save(url, [2, 3, 4], seed=1, signing_key=KEY))  # this job warns that step 1 does not count for it
    before = sorted(os.listdir(url))
    with pytest.raises(ConfigError, match=r"step 4\) is signed, and this job has no signing key.*HINT: set the run's key"):
        CheckpointManager(url, interval=1)
    assert sorted(os.listdir(url)) == before, "refused before anything was written or deleted"
    assert not os.path.exists(os.path.join(url, "lease.json")), "the lease taken while listing is given back"
    step, state = resume(url, signing_key=KEY)  # the job with the key resumes the run's newest step
    assert step == 4
    assert_same(state, saved[4])


# -- the key: where it comes from, where it never goes -----------------------------------------------------
def test_the_key_is_never_printed_logged_or_written(tmp_path, caplog, monkeypatch):
    url = str(tmp_path / "run")
    caplog.set_level(logging.DEBUG, logger="ft_checkpoint")
    save(url, [1, 2], signing_key=KEY)
    save(url, [3], seed=5, signing_key=OTHER_KEY)
    with CheckpointManager(url, signing_key=KEY) as ckpt:
        ckpt.resume(make(seed=9))
        shown = [repr(ckpt.config), str(ckpt.config), repr(ckpt.signer), ckpt.describe_start()]
    for bad in ({"signing_key": KEY[:20]}, {"signing_key": KEY, "signing_key_file": str(tmp_path / "k")},
                {"signing_key": KEY.encode()}):
        with pytest.raises(ConfigError, match="signing_key") as e:
            CheckpointConfig(**bad)
        shown.append(str(e.value))
    monkeypatch.setenv("FT_CHECKPOINT_SIGNING_KEY", KEY[:20])
    with pytest.raises(ConfigError, match="the key has 20 bytes") as e:
        CheckpointConfig.from_env()
    shown += [str(e.value), caplog.text]
    for root, _, files in os.walk(url):
        shown += [open(os.path.join(root, f), "rb").read().decode("latin-1") for f in files]
    leaks = [text[:200] for text in shown if KEY[:20] in text or OTHER_KEY[:20] in text]
    assert not leaks, leaks
    assert "skipping step 3" in caplog.text  # the logs were captured


def test_signatures_are_compared_in_constant_time(signed_run, monkeypatch):
    url, _ = signed_run
    compared = []

    def compare_digest(a, b):
        compared.append((a, b))
        return real(a, b)

    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    assert resume(url, signing_key=KEY)[0] == 2
    assert (manifest_of(url, 2)["signature"]["mac"],) * 2 in compared


def test_a_key_file_inside_the_checkpoint_directory_is_refused(tmp_path):
    url = tmp_path / "run"
    save(str(url), [1], signing_key=KEY)
    inside, link = url / "ft.key", tmp_path / "link.key"
    inside.write_text(KEY)
    link.symlink_to(inside)
    for path in (inside, link):
        with pytest.raises(ConfigError, match="lies inside the checkpoint directory"):
            CheckpointManager(str(url), signing_key_file=str(path))


@pytest.mark.parametrize("content,expected", [
    (KEY[:31], "the key has 31 bytes, expected 32"),
    ("", "the key has 0 bytes"),
    ("x" * 5000, "expected 32 to 4096"),
])
def test_a_key_file_that_holds_no_usable_key_is_a_config_error(tmp_path, content, expected):
    path = tmp_path / "ft.key"
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"signing_key_file=.*{expected}"):
        CheckpointConfig(signing_key_file=str(path))


def test_a_key_file_that_is_a_fifo_or_a_directory_is_a_config_error_not_a_hang(tmp_path):
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo)
    errors: list[str] = []

    def build(path) -> None:
        try:
            CheckpointConfig(signing_key_file=str(path))
        except ConfigError as e:
            errors.append(str(e))

    thread = threading.Thread(target=build, args=(fifo,), daemon=True)
    thread.start()
    thread.join(timeout=30)  # a hang guard: opening a FIFO for reading blocks until a writer comes
    assert not thread.is_alive(), "reading the key file blocked"
    build(tmp_path)
    build(tmp_path / "missing.key")
    assert [e.split(": ", 1)[1][:22] for e in errors] == ["cannot read the key fi"] * 3, errors
    assert "not a regular file (a FIFO)" in errors[0] and "not a regular file (a directory)" in errors[1], errors


def test_a_manifest_with_deeply_nested_metadata_is_skipped_not_a_crash_loop(signed_run, caplog):
    """600 levels of lists in the newest manifest's ``metadata`` (JSON parses up to ~990): checking its
    signature walked it recursively, and every signed start crashed with RecursionError."""
    url, saved = signed_run
    forged = manifest_of(url, 2)
    deep: list = []
    for _ in range(600):
        deep = [deep]
    forged["metadata"]["x"] = deep
    write_manifest(url, 2, forged)
    resumes_skipping(url, caplog, saved, resumed=1, skipped=2, reason="nested at most 32 levels")
    caplog.clear()
    resumes_skipping(url, caplog, saved, resumed=1, skipped=2, reason="quarantined")  # set aside at the first


def test_metadata_a_manifest_could_not_hold_is_refused_at_the_save(tmp_path):
    deep: dict = {}
    for _ in range(40):
        deep = {"d": deep}
    with CheckpointManager(str(tmp_path / "run"), interval=1) as ckpt:
        with pytest.raises(ConfigError, match="nests deeper than 32 levels"):
            ckpt.save(1, make(0), metadata=deep)
        ckpt.save(1, make(0), metadata={"ok": [{"a": 1}]}, block=True)
        assert ckpt.latest() == 1


def test_a_key_file_written_as_the_readme_writes_it_in_a_yaml_file_is_found_and_a_careless_one_refused(
        tmp_path, monkeypatch):
    """``signing_key_file: ~/.ft-checkpoint.key`` in the YAML file (nothing expands it there) was a file named '~'
    not found, and the error's hint said to make a key: followed, it replaced the run's key, and every signed step
    was refused from then on. ``~`` is expanded now; a variable nobody expanded, quotes or spaces are refused as in
    ``dirpath``; a path not found says to check it first."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".ft-checkpoint.key").write_text(KEY + "\n")
    config = tmp_path / "ft.yaml"
    config.write_text("signing_key_file: ~/.ft-checkpoint.key\n")
    monkeypatch.setenv("FT_CHECKPOINT_CONFIG", str(config))
    url = str(tmp_path / "run")
    save(url, [1])
    monkeypatch.delenv("FT_CHECKPOINT_CONFIG")
    assert resume(url, signing_key=KEY)[0] == 1, "signed with the key in ~/.ft-checkpoint.key"
    for careless, expected in [("$HOME/.ft-checkpoint.key", r"with \$HOME expanded"),
                               ('"~/.ft-checkpoint.key"', "without the quotes"),
                               ("~/.ft-checkpoint.key ", "without spaces at its start or end")]:
        with pytest.raises(ConfigError, match=expected):
            CheckpointConfig(signing_key_file=careless)
    with pytest.raises(ConfigError, match=r"cannot read the key file .*HINT: check the path .*only for a run that has "
                                          r"no key yet, make one"):
        CheckpointConfig(signing_key_file="~/.ft-checkpoint.kye")
