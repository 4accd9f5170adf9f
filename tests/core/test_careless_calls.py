"""A user calling the API carelessly reads what was wrong, at the call, and loses nothing (found by a red team: each
of these raised an AttributeError or TypeError from deep inside, or did the wrong thing silently)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from ft_checkpoint import CheckpointManager, manager
from ft_checkpoint.errors import ConfigError, SaveError


@pytest.mark.parametrize("state", [{"a/b": torch.zeros(3), "a": {"b": torch.ones(3)}},
                                   {"l": [torch.zeros(3)], "l/0": torch.ones(3)}])
def test_two_tensors_whose_keys_join_alike_are_refused_not_loaded_into_each_other(tmp_path, state):
    """Keys are joined with '/': ``{"a/b": zeros, "a": {"b": ones}}`` resumed with ``a/b`` holding ones, silently."""
    with CheckpointManager(str(tmp_path / "run"), interval=1, announce=False) as ckpt:
        with pytest.raises(ConfigError, match=r"two tensors at the key '(a/b|l/0)'.*HINT: rename the key that has a '/'"):
            ckpt.save(1, state)
        assert ckpt.latest() is None


def test_a_model_passed_as_the_state_is_refused_at_every_call(tmp_path):
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(str(tmp_path / "run"), interval=100, announce=False) as ckpt:
        for call in (lambda: ckpt.resume(model), lambda: ckpt.maybe_save(1, model), lambda: ckpt.save(1, model)):
            with pytest.raises(ConfigError, match=r"state must be a dict .*got Linear\. HINT: pass a dict, e\.g\. "
                                                  r"\{'model': model"):
                call()  # maybe_save too, though no save is due at step 1 (before, it returned False silently)


@pytest.mark.parametrize(("step", "expected"), [("10", "got str '10'"), (2.0, "got float 2.0"), (True, "got bool True"),
                                                (-1, r"step=-1 is invalid"), (10**12, r"step=1000000000000 is invalid")])
def test_a_step_that_is_no_step_count_is_refused_at_the_call(tmp_path, step, expected):
    with CheckpointManager(str(tmp_path / "run"), interval=1, announce=False) as ckpt:
        for call in (ckpt.maybe_save, ckpt.save):
            with pytest.raises(ConfigError, match=expected):
                call(step, {"w": torch.ones(2)})


def test_numpy_and_torch_integers_are_step_counts(tmp_path):
    """``np.int64`` (a step read from a NumPy array) failed in the background: its JSON could not be written."""
    with CheckpointManager(str(tmp_path / "run"), interval=1, announce=False) as ckpt:
        ckpt.save(np.int64(3), {"w": torch.ones(2)}, block=True)
        ckpt.save(torch.tensor(4), {"w": torch.ones(2)}, block=True)
        assert ckpt.latest() == 4


def test_a_second_manager_on_the_same_dirpath_in_one_process_is_named_as_the_cause(tmp_path, caplog):
    """The first manager's error blamed a hung process or a storage outage for a lease this process's second manager
    took (a notebook cell run again)."""
    url = str(tmp_path / "run")
    first = CheckpointManager(url, interval=1, announce=False)
    second = CheckpointManager(url, interval=1, announce=False)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"), pytest.raises(SaveError) as e:
        first.save(1, {"w": torch.ones(2)}, block=True)
    assert "another CheckpointManager in this process took the directory over" in str(e.value)
    assert "close() the first manager" in str(e.value) and "storage outage" not in str(e.value)
    first.close(clean=False)
    second.close()


@pytest.mark.parametrize(("value", "kind"), [(lambda x: x, "PicklingError"), ((i for i in range(3)), "TypeError")])
def test_a_value_that_cannot_be_saved_is_named_by_its_key(tmp_path, value, kind):
    """A lambda or a generator in the state raised pickle's error from inside the engine, naming no key."""
    with CheckpointManager(str(tmp_path / "run"), interval=1, announce=False) as ckpt:
        with pytest.raises(ConfigError, match=rf"state\['extra'\]\['fn'\] cannot be saved \({kind}: .*HINT: keep "
                                              "tensors"):
            ckpt.save(1, {"w": torch.ones(2), "extra": {"n": 1, "fn": value}})
        with pytest.raises(ConfigError, match=r"per_rank\['batch'\] cannot be saved"):
            ckpt.save(1, {"w": torch.ones(2)}, per_rank={"batch": value})
        ckpt.save(1, {"w": torch.ones(2)}, block=True)  # nothing was left half-done
        assert ckpt.latest() == 1


def test_a_fresh_start_in_a_runs_parent_directory_names_the_run_below(tmp_path, caplog):
    """``dirpath`` one level too high (the parent of a run, a Lightning ``default_root_dir``): the job started from
    scratch without a word, while ``ft-checkpoint ls`` of the same directory hinted at the run below."""
    with CheckpointManager(str(tmp_path / "run"), interval=1, announce=False) as ckpt:
        ckpt.save(3, {"w": torch.ones(2)}, block=True)
    (tmp_path / "notes").mkdir()
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        with CheckpointManager(str(tmp_path), interval=1, announce=False) as parent:
            assert parent.resume({"w": torch.zeros(2)}) is None
    assert f"no checkpoint in {tmp_path}, but {tmp_path / 'run'} right below it holds steps: this job starts from " \
           f"scratch. HINT: to resume that run, pass dirpath='{tmp_path / 'run'}'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        with CheckpointManager(str(tmp_path / "new"), interval=1, announce=False) as new:
            assert new.resume({"w": torch.zeros(2)}) is None
    assert "right below it" not in caplog.text, "a new directory: nothing to say"


def test_a_new_training_of_this_process_in_a_directory_it_saved_to_warns(tmp_path, caplog, monkeypatch):
    """Accelerate's ``cross_validation.py`` with one dirpath for every fold (``FT_CHECKPOINT_DIRPATH``): the next fold's
    fresh model resumed the last fold's final step and trained no batch, with nothing but the usual resume line. A
    resume from a directory an earlier manager of the same process saved to warns; another directory does not."""
    monkeypatch.setattr(manager, "_saved_by_this_process", set())  # as in a user's process (tests/conftest.py)
    url, other = str(tmp_path / "folds"), str(tmp_path / "other")
    with CheckpointManager(url, interval=1) as fold0:
        fold0.save(20, {"w": torch.ones(3)}, block=True)
    with CheckpointManager(other, interval=1) as elsewhere:
        elsewhere.save(1, {"w": torch.ones(3)}, block=True)
    caplog.set_level(logging.WARNING, logger="ft_checkpoint")
    with CheckpointManager(url, interval=1) as fold1:
        assert fold1.resume({"w": torch.zeros(3)}) == 20
    assert "which this process saved" in caplog.text and "a dirpath of its own" in caplog.text, caplog.text
    caplog.clear()
    manager._saved_by_this_process.discard(str(tmp_path / "other"))  # a new process: nothing saved to it yet
    with CheckpointManager(other, interval=1) as restarted:
        assert restarted.resume({"w": torch.zeros(3)}) == 1
    assert "which this process saved" not in caplog.text, caplog.text
