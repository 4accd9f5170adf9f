"""Acceptance 3-5 and the rest of the callback's behaviour, with real Trainers in this process.

A "crash" here is an exception raised inside training (the SIGKILL tests are in test_kill_resume.py);
each resume is a new Trainer, model and datamodule, as after a restart.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import logging
import os
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from ft_checkpoint import ConfigError, StateMismatchError
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from lightning_ft import FaultTolerantCheckpoint
from lightning_ft.testing import Crash, Data, IndexedData, Net, assert_same, final_state, fit, trainer


def ft(dirpath, **kw) -> FaultTolerantCheckpoint:
    kw.setdefault("interval", 4)
    return FaultTolerantCheckpoint(str(dirpath), **kw)


class RecordStart(pl.Callback):
    """Remembers the global step at which training (re)started."""

    step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


class CrashAtBatchStart(pl.Callback):
    """Raises at the start of the batch after ``step``: inside a step, before its optimizer update."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("training failed")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (interval 4, 3 epochs, validation twice per epoch)."""
    model, data, trainer, _ = fit([ft(tmp_path_factory.mktemp("ref") / "ckpt")])
    return final_state(model, trainer), data.train_epochs


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, caplog, reference):
    _, _, _, crashed = fit([ft(tmp_path / "ckpt")], crash_at=22)
    assert crashed
    newest = tmp_path / "ckpt" / layout.step_dir(20)
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    cb = ft(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING):
        model, data_module, trainer, _ = fit([cb])
    assert cb.resumed_from == 16
    assert any(r.levelno == logging.WARNING and "skipping step 20" in r.getMessage() for r in caplog.records), \
        caplog.text
    assert_same(reference[0], final_state(model, trainer))
    assert data_module.train_epochs == reference[1]


def test_explicit_ckpt_path_wins(tmp_path, caplog):
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=3, save_top_k=-1)
    fit([ft(tmp_path / "ckpt"), mc], crash_at=9)
    path = str(tmp_path / "mc" / "epoch=0-step=3.ckpt")
    assert os.path.exists(path), os.listdir(tmp_path / "mc")

    cb, start = ft(tmp_path / "fresh"), RecordStart()
    with caplog.at_level(logging.INFO, logger="lightning_ft"):
        _, _, trainer, _ = fit([cb, start], ckpt_path=path, max_steps=5)
    assert start.step == 3 and cb.resumed_from is None and trainer.ckpt_path == path
    lines = [r.getMessage() for r in caplog.records if "was given" in r.getMessage()]
    assert len(lines) == 1 and path in lines[0], caplog.text


def test_explicit_ckpt_path_behind_the_directorys_steps_stops_before_training(tmp_path):
    """Rolling back to step 3 in a directory that holds step 8: retention would delete each new step right
    after its commit, and a crash would resume step 8. It stops at the start, saying what to do."""
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=3, save_top_k=-1)
    fit([ft(tmp_path / "ckpt"), mc], crash_at=9)
    path = str(tmp_path / "mc" / "epoch=0-step=3.ckpt")
    with pytest.raises(StateMismatchError, match=r"continues from step 3.*step_000000000008"):
        fit([ft(tmp_path / "ckpt")], ckpt_path=path, max_steps=5)


def test_early_stopping_model_checkpoint_and_lr_scheduler_continue_exactly(tmp_path):
    def callbacks(run: str) -> list[pl.Callback]:
        return [EarlyStopping(monitor="val_loss", patience=3),
                ModelCheckpoint(dirpath=tmp_path / run / "mc", monitor="val_loss", save_top_k=2),
                ft(tmp_path / run / "ckpt")]

    ref_cbs = callbacks("ref")
    ref_model, _, ref_trainer, _ = fit(ref_cbs, max_epochs=8)
    assert ref_cbs[0].stopped_epoch == 1 and ref_trainer.global_step == 24  # stopped early, by its wait count

    fit(callbacks("run"), max_epochs=8, crash_at=21)  # after the validation at step 18 (wait count 2)
    cbs = callbacks("run")
    model, _, trainer, _ = fit(cbs, max_epochs=8)
    assert cbs[2].resumed_from == 20
    assert_same(ref_cbs[0].state_dict(), cbs[0].state_dict())
    assert_same(final_state(ref_model, ref_trainer), final_state(model, trainer))  # weights, optimizer, scheduler
    scores = {os.path.basename(p): float(s) for p, s in ref_cbs[1].best_k_models.items()}
    assert scores == {os.path.basename(p): float(s) for p, s in cbs[1].best_k_models.items()}
    assert trainer.checkpoint_callback is cbs[1]  # the callback runs last; ModelCheckpoint stays Lightning's


def test_save_on_exception_saves_the_last_completed_step(tmp_path, reference):
    with pytest.raises(RuntimeError, match="training failed"):
        fit([ft(tmp_path / "ckpt", save_on_exception=True), CrashAtBatchStart(10)])
    cb = ft(tmp_path / "ckpt")
    model, _, trainer, _ = fit([cb])
    assert cb.resumed_from == 10  # not a multiple of the interval: saved on the exception
    assert_same(reference[0], final_state(model, trainer))


def test_save_on_exception_skips_a_point_resume_cannot_start_from(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError):
        fit([ft(tmp_path / "ckpt", save_on_exception=True), CrashAtBatchStart(6)])  # validation follows step 6
    assert "save_on_exception: not saving" in caplog.text
    cb = ft(tmp_path / "ckpt")
    fit([cb], max_steps=5)
    assert cb.resumed_from == 4


def test_metrics_reach_the_trainer_logger(tmp_path):
    logger = CSVLogger(tmp_path / "logs", name="run")
    fit([ft(tmp_path / "ckpt")], logger=logger, max_steps=10, log_every_n_steps=1)
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    for name in ("stall_s", "durable_s", "bytes", "interval_steps", "saved_step"):
        assert f"ft_checkpoint/{name}" in columns, columns
    durable = [float(r["ft_checkpoint/durable_s"]) for r in rows if r.get("ft_checkpoint/durable_s")]
    assert len(durable) == 3 and all(d > 0 for d in durable)  # steps 4, 8 and the final 10, each reported once


def test_default_dirpath_is_under_default_root_dir(tmp_path):
    cb = FaultTolerantCheckpoint(interval=4)
    fit([cb], max_steps=5, default_root_dir=str(tmp_path))
    assert cb.manager is not None and cb.manager.storage.url.rstrip("/").endswith("ft_checkpoints")
    assert (tmp_path / "ft_checkpoints" / layout.step_dir(4) / layout.MANIFEST).exists()


def test_bad_config_fails_at_construction():
    with pytest.raises(ConfigError, match="keep_lst"):
        FaultTolerantCheckpoint("/tmp/x", keep_lst=2)
    with pytest.raises(ConfigError, match="keep_last"):
        FaultTolerantCheckpoint("/tmp/x", keep_last=0)


def test_a_tensor_left_out_of_the_metadata_falls_back_to_the_previous_step(tmp_path, caplog, reference):
    """metadata.json of the newest step without one weight, its manifest entry recomputed (as anyone who can
    write the directory can): every restart raised in Lightning's load_state_dict ("expected torch.Tensor
    ... received NoneType"). Now the step is skipped, with a warning naming the tensor, and set aside."""
    _, _, _, crashed = fit([ft(tmp_path / "ckpt")], crash_at=22)
    assert crashed
    storage = Storage(str(tmp_path / "ckpt"))
    rel = layout.step_dir(20)
    doc = json.loads(storage.read_bytes(f"{rel}/{layout.METADATA}"))
    dropped = next(k for k in doc["tensors"] if k.startswith("lightning/state_dict/"))
    del doc["tensors"][dropped]
    data = json.dumps(doc).encode()
    storage.write_bytes(f"{rel}/{layout.METADATA}", data)
    manifest = json.loads(storage.read_bytes(f"{rel}/{layout.MANIFEST}"))
    manifest["files"][layout.METADATA] = {"size": len(data), "checksum": layout.checksum([data])}
    storage.write_bytes(f"{rel}/{layout.MANIFEST}", json.dumps(manifest).encode())

    cb = ft(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING):
        model, data_module, trainer, _ = fit([cb])
    assert cb.resumed_from == 16
    warning = next(r.getMessage() for r in caplog.records if "skipping step 20" in r.getMessage())
    assert dropped.removeprefix("lightning/state_dict/") in warning, warning
    assert_same(reference[0], final_state(model, trainer))  # saved step 20 again and went on to the end
    assert data_module.train_epochs == reference[1]


class Wider(Net):
    """Net with a buffer the saved steps lack, loaded non-strictly (``strict_loading = False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.strict_loading = False
        self.register_buffer("added", torch.full((3,), 7.0))


def test_a_module_loaded_non_strictly_resumes_with_a_tensor_the_step_lacks(tmp_path):
    """A module that loads non-strictly and gained a tensor since the save resumes from the newest step, its new
    tensor as initialised (a resume that read into the model's own tensors would be strict)."""
    fit([ft(tmp_path / "ckpt")], crash_at=22)
    pl.seed_everything(0, verbose=False)
    model, cb = Wider(), ft(tmp_path / "ckpt")
    trainer([cb], max_steps=23).fit(model, datamodule=Data())
    assert cb.resumed_from == 20
    assert torch.equal(model.added, torch.full((3,), 7.0))


class Swapped(Net):
    """Saves its two linear layers' biases under each other's names and swaps them back at the load (a checkpoint
    format of its own), and keeps its last layer's weight as initialised at a load."""

    def on_save_checkpoint(self, checkpoint) -> None:
        sd = checkpoint["state_dict"]
        sd["net.0.bias"], sd["net.4.bias"] = sd["net.4.bias"], sd["net.0.bias"]

    def on_load_checkpoint(self, checkpoint) -> None:
        sd = checkpoint["state_dict"]
        sd["net.0.bias"], sd["net.4.bias"] = sd["net.4.bias"], sd["net.0.bias"]
        sd["net.4.weight"] = self.net[4].weight.detach().clone()


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_a_resume_gives_the_checkpoint_to_the_modules_hooks_and_the_precision_as_saved(tmp_path, precision):
    """Lightning restores a checkpoint before ``bf16-true`` converts the module (its weights are float32 then, the
    saved ones bfloat16), and hands it to ``on_load_checkpoint``, which may rename, swap or replace what was saved:
    a resume that wrote the saved tensors into the module's own before Lightning's restore refused every step of a
    bf16-true run (StateMismatchError), loaded swapped tensors onto each other and showed the hook the saved weights
    as the module's. Both resume as Lightning restores them (the red team's reproductions of d28ff7b)."""
    pl.seed_everything(0, verbose=False)
    model = Swapped()
    model.kill = lambda t: (_ for _ in ()).throw(Crash("crash")) if t.global_step == 10 else None
    with pytest.raises(Crash):
        trainer([ft(tmp_path / "ckpt")], max_steps=12, precision=precision).fit(model, datamodule=Data())

    class Start(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}

    from ft_checkpoint import CheckpointManager

    with CheckpointManager(str(tmp_path / "ckpt"), announce=False) as manager:  # the step as saved
        state: dict = {"lightning": {}, "loader": {}}
        assert manager.resume(state) == 8
    saved = state["lightning"]["state_dict"]
    pl.seed_everything(0, verbose=False)
    model, cb, start = Swapped(), ft(tmp_path / "ckpt"), Start()
    initial = model.net[4].weight.detach().clone()
    trainer([cb, start], max_steps=9, precision=precision).fit(model, datamodule=Data())
    assert cb.resumed_from == 8
    assert torch.equal(start.state["net.0.bias"].float(), saved["net.4.bias"].float())  # swapped back by the hook
    assert torch.equal(start.state["net.4.bias"].float(), saved["net.0.bias"].float())
    assert torch.equal(start.state["net.4.weight"].float(), initial.to(start.state["net.4.weight"].dtype).float())
    assert torch.equal(start.state["net.1.running_mean"].float(), saved["net.1.running_mean"].float())


def committed(dirpath) -> list[int]:
    from ft_checkpoint.store.storage import Storage

    return layout.committed_steps(Storage(str(dirpath)))


def test_a_clean_end_of_fit_saves_its_last_step_and_a_restart_trains_no_step(tmp_path, reference, caplog):
    """Issue 22: before, the newest step was 32 of 36 (the last batch of an epoch defers a save), so a finished
    job that Slurm or Kubernetes started again trained steps 33 to 36 again, and the final weights were not in
    the directory."""
    fit([ft(tmp_path / "ckpt")])
    assert committed(tmp_path / "ckpt")[-1] == 36
    caplog.set_level(logging.INFO)
    cb, start = ft(tmp_path / "ckpt"), RecordStart()
    model, data, trainer, _ = fit([cb, start])
    assert cb.resumed_from == 36 and model.seen == [] and start.step is None  # no training step, not even started
    assert_same(final_state(model, trainer), reference[0])
    assert "FaultTolerantCheckpoint: resuming from step 36 (" in caplog.text and "the run had reached its end, so " \
        "this fit trains no step" in caplog.text
    assert committed(tmp_path / "ckpt")[-1] == 36 and cb.saves == []


def test_with_a_fast_tier_the_durable_tier_keeps_its_interval_and_gets_the_last_step(tmp_path, reference, caplog):
    """A fast tier every step, the durable tier every 100: a fast save due at a batch a validation follows (no resume
    starts there) was made at the next batch on both tiers, so the durable tier got a step after every validation
    (7, 13, 19, ...); the fit's last batch is such a batch, so its final save went to the fast tier only, which the
    clean end deletes, and the close saved step 35 with step 36's weights. Now the durable tier holds step 36 only,
    and a restart of the finished run trains no step."""
    kw = {"interval": 100, "fast_dirpath": str(tmp_path / "shm"), "fast_interval": 1}
    with caplog.at_level(logging.INFO):
        fit([ft(tmp_path / "ckpt", **kw)])
    assert re.search(r"starting fresh; first save at step 100 \(every 100 steps\); a fast tier in .*shm.*: a save "
                     r"every step", caplog.text), "the start line names the fast tier (it did not)"
    assert committed(tmp_path / "ckpt") == [36]
    cb = ft(tmp_path / "ckpt", **kw)
    model, _, trainer, _ = fit([cb])
    assert cb.resumed_from == 36 and model.seen == []
    assert_same(final_state(model, trainer), reference[0])


class DieAtTrainEnd(pl.Callback):
    """Fails at the end of fit, before the next callback's ``on_train_end`` (the final save) runs; keeps the state the
    fit ended with."""

    state: dict[str, Any] | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = final_state(pl_module, trainer)
        raise RuntimeError("the job died at its end")


def test_a_finished_run_resumed_from_the_fast_tier_saves_its_last_step_to_the_durable_tier(tmp_path):
    """A failure after the last step's fast save (``max_steps=10``), before the final save: the restart resumes step
    10 from the fast tier and trains no step, so the end of the fit loop (which saves) never runs, and its clean end
    deleted the fast tier: the finished run's last step was nowhere (a later restart trained steps again)."""
    kw = {"interval": 100, "fast_dirpath": str(tmp_path / "shm"), "fast_interval": 1}
    died = DieAtTrainEnd()
    with pytest.raises(RuntimeError, match="died at its end"):
        fit([died, ft(tmp_path / "ckpt", **kw)], max_steps=10)
    assert committed(tmp_path / "ckpt") == [] and died.state is not None
    cb = ft(tmp_path / "ckpt", **kw)
    model, _, trainer, _ = fit([cb], max_steps=10)
    assert cb.resumed_from == 10 and cb.manager.resumed_source.startswith("fast tier") and model.seen == []
    assert committed(tmp_path / "ckpt") == [10]
    resumed = final_state(model, trainer)
    del resumed["epoch"], died.state["epoch"]  # 1 at a fit's end by max_steps; 0 as saved at step 10, no loop run
    assert_same(resumed, died.state)


def test_the_final_save_can_be_turned_off(tmp_path):
    fit([ft(tmp_path / "ckpt", final_save=False)])
    assert committed(tmp_path / "ckpt")[-1] == 32


def test_a_resume_is_one_line_with_logging_on(tmp_path, caplog):
    """Issue 22: the core's log record said it a second time."""
    fit([ft(tmp_path / "ckpt")], crash_at=10)
    caplog.set_level(logging.INFO)
    fit([ft(tmp_path / "ckpt")])
    resumed = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert len(resumed) == 1 and re.fullmatch(r"FaultTolerantCheckpoint: resuming from step 8 \(epoch 0, 8 batches of it "
                                              r"done; [\d.]+ kB verified and loaded in [\d.]+ m?s\); next save at step 12 "
                                              r"\(every 4 steps\)", resumed[0]), resumed


class Stream(torch.utils.data.IterableDataset):
    """48 fixed samples (6 batches of 8) as a stream: the loader has no length."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(48):
            x = torch.randn(8, generator=g)
            yield x, x[:1] * 0.5, i


class StreamData(Data):
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Stream(), batch_size=8)


def test_an_iterable_dataset_resumed_mid_epoch_warns_that_the_epoch_runs_longer(tmp_path, caplog):
    """Issue 22: the stream restarts from its first batch while Lightning keeps counting from batch 4, so the
    resumed epoch runs 4 batches longer; the warning said only that the epoch restarts."""
    kw = dict(max_epochs=2, val_check_interval=1.0, data=StreamData)
    fit([ft(tmp_path / "ckpt", interval=2)], crash_at=5, **kw)
    caplog.set_level(logging.WARNING, logger="lightning_ft")
    model, _, _, _ = fit([ft(tmp_path / "ckpt", interval=2)], **kw)
    epoch_0 = [batch_idx for epoch, batch_idx, _ in model.seen if epoch == 0]
    assert epoch_0 == list(range(4, 10))  # 6 batches after the 4 done: 10 in this epoch, 4 more than 6
    assert [idx[0] for epoch, _, idx in model.seen if epoch == 0] == [0, 8, 16, 24, 32, 40]  # the stream again
    assert "the epoch restarts from its first batch while Lightning keeps counting from batch 4, so this epoch " \
           "runs 4 batches longer than in an uninterrupted run" in caplog.text


class HoldCopy(pl.Callback):
    """Holds each save's deferred copy (``lazy_snapshot``) until the next batch's forward and backward are done
    (BatchNorm's running statistics changed), right before its optimizer step: the latest moment allowed."""

    def __init__(self, cb: FaultTolerantCheckpoint) -> None:
        self.cb, self.gate, self.copies = cb, threading.Event(), 0

    def _phase(self, phase: str, step: int) -> None:
        if phase == "copying":
            self.copies += 1
            assert self.gate.wait(60), "the deferred copy was never released"

    def on_train_start(self, trainer, pl_module) -> None:
        assert self.cb.manager is not None
        self.cb.manager.engine.phase_hook = self._phase

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.gate.clear()  # runs before the checkpoint callback's save

    def release(self, *_: object) -> None:
        """Inside the step's closure, after the backward; and wherever the checkpoint callback settles the copy."""
        self.gate.set()

    on_before_optimizer_step = on_validation_start = on_train_epoch_end = on_train_end = on_exception = release


def test_lazy_snapshot_resumes_exactly(tmp_path, reference):
    """Parameters and optimizer state copied during the next batch's forward/backward (held to its optimizer
    step), BatchNorm's statistics at the save: a crash and a restart end bit-exact with the uninterrupted run."""
    cb = ft(tmp_path / "ckpt", lazy_snapshot=True)
    held = HoldCopy(cb)
    _, _, _, crashed = fit([cb, held], crash_at=22)
    assert crashed and held.copies > 0
    assert all(s.deferred > 0 and s.committed for s in cb.saves), cb.saves
    cb = ft(tmp_path / "ckpt")
    model, data_module, trainer, _ = fit([cb])
    assert cb.resumed_from == 20
    assert_same(reference[0], final_state(model, trainer))
    assert data_module.train_epochs == reference[1]


class _TwoLoaders(Net):
    def training_step(self, batch, batch_idx):  # CombinedLoader's dict batch: both loaders' samples at once
        return super().training_step(tuple(torch.cat(parts) for parts in zip(batch["a"], batch["b"])), batch_idx)


def _warnings_of(match: str, fn: Callable[[], Any]) -> tuple[list[str], Any]:
    """Run ``fn()``: the messages of the warnings it raised that contain ``match``, and what it returned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return [str(w.message) for w in caught if match in str(w.message)], result


def _fit_on(model: Net, loader: Any, url: str, crash_at: int | None, **trainer_kw: Any) -> pl.Trainer:
    """Fit ``model`` on the train ``loader`` in this process with the callback (a save every 4 steps, no validation),
    crashing after step ``crash_at``; returns the trainer."""
    def kill(t: pl.Trainer) -> None:
        if t.global_step == crash_at:
            raise Crash(f"crash after step {crash_at}")

    model.kill = kill
    t = trainer([FaultTolerantCheckpoint(url, interval=4)], limit_val_batches=0, **trainer_kw)
    with contextlib.suppress(Crash):
        t.fit(model, train_dataloaders=loader)
    return t


@pytest.mark.parametrize("generator", [False, True])
def test_a_loader_started_over_before_the_resume_point_warns_unless_it_has_a_generator(tmp_path, generator):
    """``CombinedLoader(mode="max_size_cycle")`` starts a shorter loader over inside the epoch: replaying the epoch
    to the resume point drew its new shuffle from the torch RNG of the epoch's start, not the one the uninterrupted
    run drew it from, and the rest of the epoch trained other samples of it, silently. A generator of its own is
    restored exactly: no warning then."""
    def run(crash_at: int | None, ckpt: str = "ckpt") -> tuple[list[str], dict]:
        pl.seed_everything(0, verbose=False)
        model = _TwoLoaders()
        own = {"generator": torch.Generator().manual_seed(5)} if generator else {}
        loaders = CombinedLoader({"a": DataLoader(IndexedData(96), batch_size=8, shuffle=True),  # 12 batches
                                  "b": DataLoader(IndexedData(40), batch_size=8, shuffle=True, **own)}, "max_size_cycle")
        warned, t = _warnings_of("started over", lambda: _fit_on(model, loaders, str(tmp_path / ckpt), crash_at,
                                                                 max_epochs=2))
        return warned, final_state(model, t)

    assert run(crash_at=20)[0] == []  # epoch 1, 8 batches done; the 5 batches of "b" started over at the 6th
    warned, resumed = run(crash_at=None)
    assert len(warned) == (0 if generator else 1), warned
    if not generator:
        assert "1 of the train loaders started over inside the 8 batches of epoch 1" in warned[0]
        assert "HINT: give each such DataLoader its own generator" in warned[0]
    else:  # exact: as an uninterrupted run
        assert_same(run(crash_at=None, ckpt="ref")[1], resumed)


def test_a_stateful_dataloader_with_workers_warns_that_their_random_state_is_not_restored(tmp_path):
    """torchdata's ``StatefulDataLoader`` restores its position (Lightning calls its ``load_state_dict``), not its
    workers' RNG: the resumed epoch's augmented inputs differed from an uninterrupted run's, silently."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def run(crash_at: int | None) -> list[str]:
        pl.seed_everything(0, verbose=False)
        model = Net()
        loader = stateful.StatefulDataLoader(IndexedData(96, augment=True), batch_size=8, shuffle=True, num_workers=1)
        return _warnings_of("workers' random state",
                            lambda: _fit_on(model, loader, str(tmp_path / "ckpt"), crash_at, max_epochs=1))[0]

    assert run(crash_at=5) == []
    warned = run(crash_at=None)
    assert len(warned) == 1 and "rest of epoch 0 (not exact)" in warned[0], warned


def test_a_restart_with_another_accumulate_grad_batches_warns(tmp_path):
    """A restart that accumulates over another number of batches (after an out-of-memory error, say) resumed without a
    word, though each step from there takes other batches than in the run that saved."""
    url = str(tmp_path / "ckpt")
    assert fit([FaultTolerantCheckpoint(url, interval=2)], crash_at=5, accumulate_grad_batches=2)[3]
    for max_steps, expected in ((7, 1), (9, 0)):  # the second restart resumes a step saved with 1: no warning
        warned, _ = _warnings_of("accumulate_grad_batches=", functools.partial(
            fit, [FaultTolerantCheckpoint(url, interval=2)], max_steps=max_steps, accumulate_grad_batches=1))
        assert len(warned) == expected, warned
        if warned:
            assert "saved with accumulate_grad_batches=2, in a run with accumulate_grad_batches=1" in warned[0]
            assert "HINT: restart with accumulate_grad_batches=2" in warned[0]


def test_a_sigterm_during_the_sanity_check_saves_the_first_step_a_resume_can_start_after(tmp_path):
    """Lightning installs its SIGTERM handler before the sanity check, whose loop raised at the end of its batch:
    the preemption ended the fit before any training, and a restart trained from scratch again. Now the sanity check
    finishes and the first step is saved before the job exits."""
    import signal

    from ft_checkpoint import read_journal

    pl.seed_everything(0, verbose=False)
    model, cb = Net(), ft(tmp_path / "ckpt", interval=100)

    def term(tr: pl.Trainer) -> None:
        if tr.sanity_checking:
            model.in_validation_step = None
            os.kill(os.getpid(), signal.SIGTERM)

    model.in_validation_step = term
    with pytest.raises(SystemExit) as stopped:
        trainer([cb], num_sanity_val_steps=2).fit(model, datamodule=Data())
    assert stopped.value.code == 0
    assert committed(tmp_path / "ckpt") == [1]
    assert [(e["step"], e["reason"]) for e in read_journal(Storage(str(tmp_path / "ckpt")))
            if e["event"] == "preempted"] == [(1, "SIGTERM")]
