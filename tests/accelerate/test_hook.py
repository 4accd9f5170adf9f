"""The hook in-process: configuration the Accelerate way, errors that say what to do, metrics, imports."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
import uuid

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.tracking import GeneralTracker

from accelerate_ft import FaultTolerantCheckpoint, FaultTolerantCheckpointPlugin
from ft_checkpoint import CheckpointConfig, ConfigError, StateMismatchError
from ft_checkpoint.format import layout
from ft_checkpoint.format.layout import committed_steps
from ft_checkpoint.policies.adaptive.policy import AdaptiveInterval
from tests.helpers.settings import assert_takes_every_setting
from tests.helpers.toy import assert_same

EXAMPLE_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "accelerate_ft.yaml")


class MemoryTracker(GeneralTracker):
    """A tracker that keeps what ``accelerator.log`` sends it."""

    name = "memory"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict]] = []

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.logged.append((step, dict(values)))


@pytest.fixture
def make_accelerator():
    """A fresh ``Accelerator(cpu=True)`` (Accelerate keeps its state in process-wide singletons)."""

    def make(**kwargs) -> Accelerator:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return Accelerator(cpu=True, **kwargs)

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FT_CHECKPOINT_"):
            monkeypatch.delenv(name)
    return monkeypatch


def prepared(acc: Accelerator, batches: int = 8):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(4 * batches, 4), batch_size=4, shuffle=True)
    return acc.prepare(model, opt, loader)


def test_plugin_falls_back_to_env_vars_then_yaml_and_explicit_wins(clean_env):
    clean_env.setenv("FT_CHECKPOINT_CONFIG", EXAMPLE_YAML)
    plugin = FaultTolerantCheckpointPlugin()
    assert (plugin.dirpath, plugin.interval, plugin.keep_last) == ("checkpoints/accelerate_resume", 20, 3)

    clean_env.setenv("FT_CHECKPOINT_DIRPATH", "s3://bucket/run")
    clean_env.setenv("FT_CHECKPOINT_INTERVAL", "30m")
    clean_env.setenv("FT_CHECKPOINT_STORAGE_OPTIONS", '{"endpoint_url": "http://127.0.0.1:9000"}')
    plugin = FaultTolerantCheckpointPlugin(keep_last=7)
    assert plugin.dirpath == "s3://bucket/run" and plugin.interval.total_seconds() == 1800
    assert plugin.storage_options == {"endpoint_url": "http://127.0.0.1:9000"} and plugin.keep_last == 7
    assert FaultTolerantCheckpointPlugin(dirpath="/explicit").dirpath == "/explicit"


def test_plugin_has_every_core_setting():
    plugin_fields = [f.name for f in dataclasses.fields(FaultTolerantCheckpointPlugin) if f.init]
    assert plugin_fields == [f.name for f in dataclasses.fields(CheckpointConfig)]


def test_the_plugin_never_shows_the_signing_key(clean_env):
    """The plugin holds the resolved key (here from the environment, as ``accelerate launch`` passes it)."""
    key = "5f0c9e2a7d41b8363ac2e9f17b0d4c5a" * 2
    clean_env.setenv("FT_CHECKPOINT_SIGNING_KEY", key)
    plugin = FaultTolerantCheckpointPlugin(dirpath="/tmp/ft-doc/signed")
    assert plugin.signing_key == key and plugin.manager_kwargs()["signing_key"] == key
    assert key not in repr(plugin) and key not in str(plugin) and "run_name=None" in repr(plugin)


def test_every_setting_is_a_typed_keyword_argument_of_the_hook_and_the_plugin():
    """Issue 22: ``**config`` hid them from IDEs, ``help()`` and jsonargparse."""
    assert_takes_every_setting(FaultTolerantCheckpoint.__init__)
    assert_takes_every_setting(FaultTolerantCheckpointPlugin.__init__)


def test_errors_say_what_to_do(make_accelerator, clean_env, tmp_path):
    acc = make_accelerator()
    with pytest.raises(ConfigError, match="after `model, optimizer, ... = accelerator.prepare"):
        FaultTolerantCheckpoint(acc, str(tmp_path))
    prepared(acc)
    with pytest.raises(ConfigError, match="did you mean 'keep_last'"):
        FaultTolerantCheckpoint(acc, str(tmp_path), keep_lst=2)
    with pytest.raises(ConfigError, match="either plugin= or"):
        FaultTolerantCheckpoint(acc, str(tmp_path), plugin=FaultTolerantCheckpointPlugin(dirpath=str(tmp_path)))
    with pytest.raises(ConfigError, match="FT_CHECKPOINT_DIRPATH"):
        FaultTolerantCheckpoint(acc)


def test_metrics_go_to_accelerator_log(make_accelerator, clean_env):
    tracker = MemoryTracker()
    acc = make_accelerator(log_with=[tracker])
    acc.init_trackers("ft-test")
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, f"memory://accelerate-metrics-{uuid.uuid4().hex}", interval=2) as ft:
        for _ in ft.epochs(1):
            for x in ft.batches(loader):
                acc.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
    started = [(step, v) for step, v in tracker.logged if "ft_checkpoint/stall_s" in v]
    assert [step for step, _ in started] == [2, 4, 6, 8]
    assert all(v["ft_checkpoint/interval_steps"] == 2 and v["ft_checkpoint/stall_s"] >= 0 for _, v in started)
    durable = [v for _, v in tracker.logged if "ft_checkpoint/durable_s" in v]
    assert sorted(v["ft_checkpoint/saved_step"] for v in durable) == [2, 4, 6, 8]
    assert all(v["ft_checkpoint/bytes"] > 0 and v["ft_checkpoint/durable_s"] > 0 for v in durable)


def test_resumes_at_construction_with_counters_and_scheduler(make_accelerator, clean_env, tmp_path):
    url = str(tmp_path / "ckpt")
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5))
    with FaultTolerantCheckpoint(acc, url, interval=5, async_save=False, final_save=False) as ft:
        for _ in ft.epochs(1):
            for i, x in enumerate(ft.batches(loader)):
                acc.backward(model(x).sum())
                opt.step()
                sched.step()
                opt.zero_grad()
                if i == 4:
                    weight_at_5 = model.weight.detach().clone()
                if i == 5:
                    break  # step 5 was saved when batch 5 was requested; step 6 is counted, not saved

    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5))
    ft = FaultTolerantCheckpoint(acc, url, interval=5)
    assert (ft.resumed_from, ft.global_step, ft.epoch, ft.batches_done) == (5, 5, 0, 5)
    assert torch.equal(model.weight, weight_at_5)
    assert sched.get_last_lr() == pytest.approx([0.1 * 0.5**5])
    ft.close()



def test_defaults_to_the_adaptive_interval_and_logs_its_decisions(make_accelerator, clean_env, caplog):
    """No ``interval``: the adaptive one. With a 1 s MTBF its first save comes about 1 s in (planned with
    the guessed cost), after which the measured cost shortens the interval; the log says why, and the
    tracker gets the decision's numbers."""
    caplog.set_level(logging.INFO, logger="ft_checkpoint")
    tracker = MemoryTracker()
    acc = make_accelerator(log_with=[tracker])
    acc.init_trackers("ft-test")
    model, opt, loader = prepared(acc, batches=10)
    with FaultTolerantCheckpoint(acc, f"memory://accelerate-adaptive-{uuid.uuid4().hex}", mtbf="1s") as ft:
        assert isinstance(ft.manager.adaptive, AdaptiveInterval)
        for _ in ft.epochs(6):
            for x in ft.batches(loader):
                acc.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
                time.sleep(0.05)
    assert re.search(r"checkpoint interval [\d.]+ s -> [\d.]+ s: save cost d=\d+\.\d+ s, MTBF M=", caplog.text)
    decisions = [v for _, v in tracker.logged if "ft_checkpoint/mtbf_s" in v]
    assert len(decisions) >= 2 and all(v["ft_checkpoint/interval_s"] > 0 for v in decisions)
    assert decisions[-1]["ft_checkpoint/cost_s"] < 60  # measured, no longer the guess


def test_says_on_stderr_where_checkpoints_go_and_when_the_first_save_is_due(make_accelerator, clean_env, capsys,
                                                                             tmp_path):
    """A line on stderr whatever the logging setup: a short job under the default (adaptive) interval learns
    that it may never save."""
    acc = make_accelerator()
    prepared(acc)
    FaultTolerantCheckpoint(acc, str(tmp_path / "ckpt")).close()
    err = capsys.readouterr().err
    assert re.search(r"^ft-checkpoint: checkpoints go to \S+ckpt, adaptive interval: the first save comes about "
                     r"[\d.]+ min in .*a run that fails sooner has nothing to resume from", err, re.M), err


def test_a_misspelt_variable_is_warned_about_once(make_accelerator, clean_env, tmp_path, caplog):
    """``FT_CHECKPOINT_KEEPLAST=2`` was warned about twice: the plugin and the manager each read the environment."""
    clean_env.setenv("FT_CHECKPOINT_KEEPLAST", "2")
    acc = make_accelerator()
    prepared(acc)
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint"):
        FaultTolerantCheckpoint(acc, str(tmp_path / "ckpt"), interval=5).close()
    warned = [r.getMessage() for r in caplog.records if "names no ft-checkpoint setting" in r.getMessage()]
    assert warned == ["FT_CHECKPOINT_KEEPLAST names no ft-checkpoint setting and is ignored. HINT: did you mean "
                      "FT_CHECKPOINT_KEEP_LAST?"], warned


def test_manual_accumulation_saves_only_after_optimizer_steps(make_accelerator, clean_env):
    """No ``accelerator.accumulate`` (so ``sync_gradients`` is always True): a global step is a batch whose
    optimizer step ran, and only such a batch may be followed by a save; ``enumerate`` gives the index."""
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    steps_before = []
    with FaultTolerantCheckpoint(acc, f"memory://accelerate-manual-{uuid.uuid4().hex}", interval=1,
                                 async_save=False) as ft:
        for _ in ft.epochs(1):
            for step, x in ft.enumerate(loader):
                steps_before.append(ft.global_step)
                acc.backward(model(x).sum() / 4)
                if step % 4 == 0:
                    opt.step()
                    opt.zero_grad()
    assert steps_before == [0, 1, 1, 1, 1, 2, 2, 2] and ft.global_step == 2
    manifests = [json.loads(ft.manager.storage.read_bytes(f"{layout.step_dir(s)}/{layout.MANIFEST}")) for s in (1, 2)]
    assert [m["metadata"]["batches_done"] for m in manifests] == [1, 5]


def test_persistent_workers_resumed_after_the_first_epoch_warn(make_accelerator, caplog):
    """Their random state carries over from earlier epochs: a resume cannot restore it, and says so."""
    from accelerate_ft.data import EpochReader

    acc = make_accelerator()
    loader = acc.prepare(torch.utils.data.DataLoader(torch.arange(8.0), batch_size=2, num_workers=1,
                                                     persistent_workers=True))
    with caplog.at_level(logging.INFO, logger="accelerate_ft"):
        batches = [(i, b.tolist()) for i, b in EpochReader(loader, skip=2, epoch=1)]
    assert batches == [(2, [4.0, 5.0]), (3, [6.0, 7.0])]
    assert "persistent_workers=True" in caplog.text and "HINT: persistent_workers=False" in caplog.text
    assert re.search(r"its 2 consumed batches were loaded again in the loader's 1 workers", caplog.text)


def train(ft: FaultTolerantCheckpoint, acc: Accelerator, model, opt, loader, *, epochs: int = 1,
          stop_after: int | None = None, by_hand: int | None = None) -> list[int]:
    """Train through the hook; returns the index of every batch trained on. ``stop_after``: break out of the
    epoch after that many batches of this run; ``by_hand``: step every N batches by an index from
    ``enumerate(ft.batches(loader))``, as Accelerate's ``complete_nlp_example.py`` does."""
    seen: list[int] = []
    for _ in ft.epochs(epochs):
        for i, x in enumerate(ft.batches(loader)):
            seen.append(ft.batches_done)
            acc.backward(model(x).sum())
            if by_hand is None or i % by_hand == 0:
                opt.step()
                opt.zero_grad()
            if stop_after is not None and len(seen) == stop_after:
                return seen
    return seen


def test_the_end_of_epochs_saves_the_last_step_and_a_restart_trains_no_step(make_accelerator, clean_env, tmp_path):
    """Issue 22: before, the newest step was 6 of 8, and a restart of the finished job trained steps 7 and 8 again."""
    url = str(tmp_path / "ckpt")
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, url, interval=3) as ft:
        assert len(train(ft, acc, model, opt, loader)) == 8
        assert committed_steps(ft.manager.storage) == [3, 6, 8]  # committed when epochs() ended
    weight = model.weight.detach().clone()

    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, url, interval=3) as ft:
        assert ft.resumed_from == 8 and train(ft, acc, model, opt, loader) == []
    assert torch.equal(model.weight, weight) and committed_steps(ft.manager.storage) == [3, 6, 8]


def test_the_final_save_can_be_turned_off(make_accelerator, clean_env, tmp_path):
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, str(tmp_path / "ckpt"), interval=3, final_save=False) as ft:
        train(ft, acc, model, opt, loader)
    assert committed_steps(ft.manager.storage) == [3, 6]


def test_a_resume_is_one_line_with_the_epoch_and_the_batch(make_accelerator, clean_env, tmp_path, caplog, capsys):
    """Issue 22: with logging on a resume was announced three times (the manager's record, its stderr line and
    the hook's own record), and the stderr line had no data position."""
    caplog.set_level(logging.INFO)
    url = str(tmp_path / "ckpt")
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, url, interval=5, async_save=False) as ft:
        train(ft, acc, model, opt, loader, epochs=2, stop_after=12)  # the end of the with block saves step 12
    capsys.readouterr()
    caplog.clear()
    acc = make_accelerator()
    prepared(acc, batches=8)
    FaultTolerantCheckpoint(acc, url, interval=5).close()
    lines = capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records]
    resumed = [line for line in lines if "resuming from" in line or "resumed" in line]
    assert len(resumed) == 1, lines
    assert re.fullmatch(rf"ft-checkpoint: resuming from step 12 \(epoch 1, 4 batches of it done\) of {re.escape(url)}, "
                        r"a save every 5 steps \([\d.]+ kB verified and loaded in [\d.]+ m?s\)", resumed[0]), resumed


@pytest.mark.parametrize("index", ["enumerate(ft.batches(loader))", "ft.enumerate(loader)"])
def test_accumulation_by_hand_resumed_mid_epoch_warns_to_take_the_index_from_ft_enumerate(make_accelerator, clean_env,
                                                                                           tmp_path, caplog, index):
    """Issue 22: with ``enumerate(ft.batches(loader))`` the index restarts at 0 in the resumed epoch, so other
    batches step the optimizer and the run ends with other weights, silently. The hook knows both facts."""
    url = str(tmp_path / "ckpt")
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=12)
    with FaultTolerantCheckpoint(acc, url, interval=2, async_save=False) as ft:
        train(ft, acc, model, opt, loader, by_hand=2, stop_after=5)  # steps after batches 0, 2, 4
    assert ft.manager.latest() == 3  # saved at the end of the with block, after batch 4

    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=12)
    caplog.set_level(logging.WARNING, logger="accelerate_ft")
    with FaultTolerantCheckpoint(acc, url, interval=2) as ft:
        assert (ft.resumed_from, ft.batches_done) == (3, 5)
        for _ in ft.epochs(1):
            batches = ft.enumerate(loader) if index == "ft.enumerate(loader)" else enumerate(ft.batches(loader))
            first = next(iter(batches))[0]
            break
    warned = [r.getMessage() for r in caplog.records if "ft.enumerate(loader)" in r.getMessage()]
    if index == "ft.enumerate(loader)":
        assert first == 5 and not warned
    else:
        assert first == 0 and warned == [
            "epoch 0 resumes at batch 5, and this loop steps the optimizer on some batches only (accumulation by "
            "hand): an index from enumerate(ft.batches(loader)) starts at 0 again, so other batches step than in "
            "the uninterrupted run and the result differs. HINT: for step, batch in ft.enumerate(loader) continues "
            "the index at 5"]


def test_without_a_dirpath_checkpoints_go_to_the_accelerators_project_dir(make_accelerator, clean_env, tmp_path):
    """Issue 22: the Lightning callback has a default directory; the hook required one."""
    acc = make_accelerator(project_dir=str(tmp_path / "project"))
    prepared(acc)
    with FaultTolerantCheckpoint(acc, interval=5) as ft:
        assert ft.manager.storage.url == str(tmp_path / "project" / "ft_checkpoints")
    clean_env.setenv("FT_CHECKPOINT_DIRPATH", str(tmp_path / "from-env"))  # a dirpath given anywhere wins
    with FaultTolerantCheckpoint(acc, interval=5) as ft:
        assert ft.manager.storage.url == str(tmp_path / "from-env")
    clean_env.delenv("FT_CHECKPOINT_DIRPATH")
    acc = make_accelerator()
    prepared(acc)
    with pytest.raises(ConfigError, match=r"HINT: .*project_dir="):
        FaultTolerantCheckpoint(acc)


def test_a_loop_that_breaks_after_a_step_ends_with_that_step_saved(make_accelerator, clean_env, tmp_path):
    """The end of a ``with`` block is a clean end too: a loop that stops early (``max_steps``) is saved where it
    stopped, its last step counted although the loop left before the hook saw the batch end."""
    url = str(tmp_path / "ckpt")
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, url, interval=4) as ft:
        train(ft, acc, model, opt, loader, stop_after=6)
    weight = model.weight.detach().clone()
    assert (ft.global_step, ft.batches_done, committed_steps(ft.manager.storage)) == (6, 6, [4, 6])

    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, url, interval=4) as ft:
        assert (ft.resumed_from, ft.batches_done) == (6, 6) and torch.equal(model.weight, weight)
        assert train(ft, acc, model, opt, loader) == [6, 7]  # the last two batches of the epoch


@pytest.mark.parametrize("per_epoch", [6, 8])
def test_an_iterator_kept_past_its_epoch_leaves_the_next_epoch_whole(make_accelerator, clean_env, tmp_path, per_epoch):
    """A loop that keeps the batch iterator in a variable (``it = ft.batches(loader)``; ``next(it)``, as Accelerate's
    ``gradient_accumulation_for_autoregressive_models.py``) and takes 6 or all 8 batches of each epoch without running
    it to its end: the iterator is closed only when the next epoch's replaces it. It counted its last batch into the
    next epoch, which then skipped as many batches (all 8 of them: StopIteration in the user's ``next``)."""
    url = str(tmp_path / "ckpt")
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    seen = []
    with FaultTolerantCheckpoint(acc, url, interval=4) as ft:
        for epoch in ft.epochs(3):
            it = ft.batches(loader)
            for _ in range(per_epoch):
                x = next(it)
                seen.append((epoch, ft.batches_done))
                acc.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
    assert seen == [(epoch, i) for epoch in range(3) for i in range(per_epoch)]
    assert ft.global_step == 3 * per_epoch and committed_steps(ft.manager.storage)[-1] == 3 * per_epoch

    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, url, interval=4) as ft:
        assert (ft.resumed_from, ft.epoch) == (3 * per_epoch, 3)


def test_weights_swapped_in_through_data_at_an_epochs_end_stay_out_of_its_last_save(make_accelerator, clean_env,
                                                                                    tmp_path):
    """diffusers' validation with EMA weights at an epoch's end (``EMAModel.store``/``copy_to``/``restore`` edit the
    parameters through ``.data``, which moves no version counter) right after the save of the epoch's last step: its
    lazy copy, still running, took some of the EMA weights. The hook settles the copy when the epoch's batches end."""
    url = str(tmp_path / "ckpt")

    def build():
        acc = make_accelerator()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
        opt = torch.optim.AdamW(model.parameters())
        loader = torch.utils.data.DataLoader(torch.randn(16, 1024), batch_size=4)
        return (acc, *acc.prepare(model, opt, loader))

    acc, model, opt, loader = build()
    with FaultTolerantCheckpoint(acc, url, interval=4) as ft:
        for _ in ft.epochs(1):
            for x in ft.batches(loader):
                acc.backward(model(x).pow(2).mean())
                opt.step()
                opt.zero_grad()
            trained = [p.detach().clone() for p in model.parameters()]
            for p in model.parameters():
                p.data.copy_(torch.full_like(p, 7.0))  # the EMA weights in, for validation
            for p, t in zip(model.parameters(), trained):
                p.data.copy_(t)  # and the trained ones back
    assert committed_steps(ft.manager.storage) == [4]

    acc, model, opt, loader = build()
    with FaultTolerantCheckpoint(acc, url, interval=4) as ft:
        assert ft.resumed_from == 4
        assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained)), "EMA weights in the save"


def test_a_restart_with_another_batch_size_warns_that_the_position_is_off(make_accelerator, clean_env, tmp_path,
                                                                          caplog):
    """A job restarted with a smaller batch (``find_executable_batch_size`` after an out-of-memory error) resumed "3
    batches done" of a loader whose batches are other samples, without a word."""
    url = str(tmp_path / "ckpt")
    acc = make_accelerator()
    model, opt, loader = prepared(acc, batches=8)
    with FaultTolerantCheckpoint(acc, url, interval=3) as ft:
        train(ft, acc, model, opt, loader, stop_after=4)
    assert committed_steps(ft.manager.storage)[0] == 3

    caplog.set_level(logging.WARNING, logger="accelerate_ft")
    acc = make_accelerator()
    model = torch.nn.Linear(4, 1)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=2, shuffle=True))
    with FaultTolerantCheckpoint(acc, url, interval=3) as ft:
        assert ft.resumed_from == 4
        train(ft, acc, model, opt, loader, stop_after=1)
    assert "had 8 batches per process, this run's loader has 16" in caplog.text, caplog.text


class Augmented(torch.utils.data.Dataset):
    """16 samples, each its index and a random number drawn in ``__getitem__`` (a random augmentation)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.rand(())


def _stateful_run(make_accelerator, url: str, workers: int, *, stop_after: int | None = None,
                  seed: int = 0) -> list[tuple]:
    """Two epochs of 8 batches of :class:`Augmented` through the hook, shuffled by a loader prepared with
    ``use_stateful_dataloader=True``; returns each batch trained on: its sample indices, their augmentation and a
    random number the loop body draws. ``stop_after``: leave after that many batches (the hook saves there)."""
    from accelerate.utils import DataLoaderConfiguration

    torch.manual_seed(seed)
    acc = make_accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model = torch.nn.Linear(1, 1)
    data = torch.utils.data.DataLoader(Augmented(), batch_size=2, shuffle=True, num_workers=workers)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)

    def loop(ft: FaultTolerantCheckpoint) -> list[tuple]:
        seen = []
        for _ in ft.epochs(2):
            for indices, augmented in ft.batches(loader):
                seen.append((indices.tolist(), augmented.tolist(), torch.rand(()).item()))
                acc.backward(model(augmented[:, None]).sum())
                opt.step()
                opt.zero_grad()
                if len(seen) == stop_after:
                    return seen
        return seen

    with FaultTolerantCheckpoint(acc, url, interval=1000) as ft:
        return loop(ft)


@pytest.mark.parametrize("stop_after", [1, 4, 7, 8, 11])
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: ~11 s (the workers' shutdown)
def test_a_resumed_stateful_dataloader_is_exact(make_accelerator, clean_env, tmp_path, caplog, workers, stop_after):
    """``use_stateful_dataloader=True``: Accelerate's ``skip_first_batches`` rebuilt the resumed epoch as a plain
    DataLoader, and the prepared loader had made its first iterator at ``prepare`` (``state_dict()``), drawing its
    workers' seed there: the resumed run trained other samples with other augmentations (a warning said so). Stops
    after batches 1, 4, 7 of epoch 0's 8, at its end, and in epoch 1; the resumed process starts from another seed."""
    pytest.importorskip("torchdata")
    reference = _stateful_run(make_accelerator, str(tmp_path / "ref"), workers)
    url = str(tmp_path / "ckpt")
    assert _stateful_run(make_accelerator, url, workers, stop_after=stop_after) == reference[:stop_after]
    with caplog.at_level(logging.WARNING, logger="accelerate_ft"):
        resumed = _stateful_run(make_accelerator, url, workers, seed=1)
    assert resumed == reference[stop_after:]
    assert not [r.message for r in caplog.records if r.name.startswith("accelerate_ft")]


def test_a_stateful_dataloader_given_to_prepare_warns_at_a_resume_that_it_is_not_exact(make_accelerator, clean_env,
                                                                                       tmp_path, caplog):
    """Its own samplers: torchdata's ``RandomSampler`` draws a permutation whenever an iterator of it is made (twice an
    epoch with workers, once in a resume's run through a finished epoch), so the next epoch may be shuffled otherwise."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    url = str(tmp_path / "ckpt")
    for stop_after in (4, 1):
        acc = make_accelerator()
        model = torch.nn.Linear(4, 1)
        model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         stateful.StatefulDataLoader(torch.randn(32, 4), batch_size=4, shuffle=True))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="accelerate_ft"), FaultTolerantCheckpoint(acc, url) as ft:
            train(ft, acc, model, opt, loader, stop_after=stop_after)
    assert ft.resumed_from == 4
    assert "resumed epoch 0 of a loader from torchdata" in caplog.text and "not exact" in caplog.text, caplog.text


@pytest.mark.parametrize(("g_steps_after", "interval", "saved"), [(1, 1, [2, 4, 6, 8]), (0, 4, [5, 8])])
def test_a_save_waits_for_a_batch_where_no_optimizer_holds_gradients_for_a_later_step(make_accelerator, clean_env,
                                                                                     g_steps_after, interval, saved):
    """A GAN whose generator accumulates its gradients over 2 batches while the discriminator steps every batch: a
    save after a batch where the generator held one batch's gradients (not saved) resumed without them and ended with
    other weights. Saves wait for the batches where the generator stepped; with ``interval=4`` and the generator
    holding at every 4th step, the due save comes one step later (it was dropped: only the final save remained)."""
    acc = make_accelerator()
    d, g = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt_d, opt_g = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4)
    d, g, opt_d, opt_g, loader = acc.prepare(d, g, opt_d, opt_g, loader)
    with FaultTolerantCheckpoint(acc, f"memory://accelerate-gan-{uuid.uuid4().hex}", interval=interval,
                                 keep_last=100, async_save=False) as ft:
        for _ in ft.epochs(1):
            for i, x in ft.enumerate(loader):
                opt_d.zero_grad()
                acc.backward(d(x).sum() + g(x).sum() / 2)
                opt_d.step()
                if i % 2 == g_steps_after:
                    opt_g.step()
                    opt_g.zero_grad()
    assert ft.global_step == 8 and committed_steps(ft.manager.storage) == saved


def test_a_resume_loads_a_fresh_adams_state_without_stepping_it(make_accelerator, clean_env, tmp_path):
    """Issue 27: DCP's state-dict helpers created a fresh optimizer's state by a step over zero gradients before
    a resume could load into it (a full Adam step and a zero tensor per parameter: most of the Accelerate
    resume's time). The saved state is now loaded as it is: no optimizer step runs before the first training
    step, and the state is the saved one, bit for bit."""
    url = str(tmp_path / "ckpt")

    def adam(acc: Accelerator):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4)
        return acc.prepare(model, opt, loader)

    acc = make_accelerator()
    model, opt, loader = adam(acc)
    with FaultTolerantCheckpoint(acc, url, interval=100) as ft:  # step 3 saved at the end (final_save)
        train(ft, acc, model, opt, loader, stop_after=3)
    saved = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.optimizer.state_dict()["state"].items()}

    acc = make_accelerator()
    model, opt, loader = adam(acc)
    steps = []
    hook = opt.optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    ft = FaultTolerantCheckpoint(acc, url, interval=100, final_save=False)
    hook.remove()
    loaded = opt.optimizer.state_dict()["state"]
    assert ft.resumed_from == 3 and steps == [], "an optimizer step ran during the resume"
    assert sorted(loaded) == sorted(saved) and all(
        torch.equal(loaded[k][n], saved[k][n]) for k in saved for n in saved[k])
    assert all(p.grad is None for p in model.parameters())
    train(ft, acc, model, opt, loader)  # and the training goes on from it
    ft.close()
    assert int(opt.optimizer.state_dict()["state"][0]["step"]) == 8


def test_a_path_given_where_the_accelerator_goes_is_named(tmp_path):
    """``FaultTolerantCheckpoint("/path")`` (the accelerator forgotten) raised "'str' object has no attribute
    'distributed_type'" from deep inside."""
    with pytest.raises(ConfigError, match=r"first argument is the Accelerator; got '.*run'\. HINT: "
                                          r"FaultTolerantCheckpoint\(accelerator, '.*run', \.\.\.\)"):
        FaultTolerantCheckpoint(str(tmp_path / "run"))


def test_a_misspelt_plugin_setting_gets_the_closest_name():
    """The README promises an unknown keyword fails with the closest name; the plugin's dataclass raised a plain
    TypeError ("unexpected keyword argument 'intervall'")."""
    with pytest.raises(ConfigError, match="unknown checkpoint config argument 'intervall'. HINT: did you mean 'interval'"):
        FaultTolerantCheckpointPlugin(intervall=3)



def _closure_run(make_accelerator, url: str, *, stop_after: int | None = None, add_group_at: int | None = None):
    """Two epochs of 8 batches through the hook, saving every 3 steps: ``torch.optim.LBFGS`` (a closure step; its
    state sits under its first parameter only), or with ``add_group_at``, Adam over the first layer, which the second
    joins as a param group of its own once ``ft.global_step`` shows that many steps (0: before the hook resumes).
    ``stop_after``: return once it shows that many (the step after it is saved as the loop ends). Returns
    ``(model, optimizer, ft)``."""
    torch.manual_seed(0)
    acc = make_accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3) if add_group_at is None else \
        torch.optim.Adam(model[0].parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, data)

    def add_group() -> None:
        opt.optimizer.add_param_group({"params": list(model[1].parameters()), "lr": 0.02})

    if add_group_at == 0:
        add_group()
    with FaultTolerantCheckpoint(acc, url, interval=3) as ft:
        for _ in ft.epochs(2):
            for x in ft.batches(loader):
                def closure(x: torch.Tensor = x) -> torch.Tensor:
                    opt.zero_grad()
                    loss = model(x).pow(2).mean()
                    acc.backward(loss)
                    return loss

                opt.step(closure)
                if ft.global_step == add_group_at:
                    add_group()
                if ft.global_step == stop_after:
                    return model, opt, ft
    return model, opt, ft


def test_lbfgs_resumes_exactly(make_accelerator, clean_env, tmp_path):
    """LBFGS keeps its state under its first parameter only: DCP's strict load refused every step ("Missing
    optimizer state for parameter ..."), so no restart could resume."""
    ref, ref_opt, _ = _closure_run(make_accelerator, str(tmp_path / "ref"))
    _closure_run(make_accelerator, str(tmp_path / "ckpt"), stop_after=4)
    model, opt, ft = _closure_run(make_accelerator, str(tmp_path / "ckpt"))
    assert ft.resumed_from == 5
    assert_same(ref.state_dict(), model.state_dict())
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_a_param_group_added_during_training_must_be_there_before_the_resume(make_accelerator, clean_env, tmp_path):
    """A group added with ``add_param_group`` after step 2 and not yet added at the resume: the resume dropped that
    group's optimizer state without a word, and the second layer never trained again. Refused now, naming the
    groups; added before the hook, it resumes."""
    url = str(tmp_path / "ckpt")
    _closure_run(make_accelerator, url, stop_after=6, add_group_at=2)
    with pytest.raises(StateMismatchError, match="the checkpoint's optimizers have 2 param groups, this run's 1"):
        _closure_run(make_accelerator, url, stop_after=8, add_group_at=99)
    _, opt, ft = _closure_run(make_accelerator, url, stop_after=8, add_group_at=0)
    assert ft.resumed_from == 7 and len(opt.param_groups) == 2 and len(opt.state) == 4
