"""Every private Lightning (and DataLoader) API lightning_ft uses, checked against the installed release.

If one of these fails after a Lightning upgrade, lightning_ft/_lightning_internals.py needs updating
for that release (and pyproject's lightning pin with it) before the callback can be trusted there.
"""

from __future__ import annotations

import inspect
import warnings

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loops import training_epoch_loop

from lightning_ft import _lightning_internals as internals
from lightning_ft.testing import fit

HINT = (f"lightning {lightning.__version__} changed a private API that lightning_ft/_lightning_internals.py "
        "relies on: update that module for it")


def test_installed_lightning_is_in_the_tested_range():
    assert internals.check_version(), f"lightning {lightning.__version__} is outside {internals.TESTED}"
    with pytest.warns(UserWarning, match="outside the range"):
        assert not internals.check_version("2.99.0")


def test_private_names_exist():
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

    for name in ("dump_checkpoint", "_get_loops_state_dict", "resume_start"):
        assert callable(getattr(_CheckpointConnector, name, None)), f"{HINT}: _CheckpointConnector.{name}"
    params = list(inspect.signature(_CheckpointConnector.resume_start).parameters)
    assert params[:2] == ["self", "checkpoint_path"], f"{HINT}: resume_start{params}"
    assert "self._loaded_checkpoint" in inspect.getsource(_CheckpointConnector.restore_model), HINT
    assert "_should_check_val_fx" in vars(training_epoch_loop._TrainingEpochLoop), HINT
    assert callable(getattr(_SingleProcessDataLoaderIter, "_next_index", None)) and hasattr(_DatasetKind, "Map"), HINT
    assert internals.LIGHTNING_MIDEPOCH_WARNING in inspect.getsource(training_epoch_loop), \
        f"{HINT}: the mid-epoch resume warning changed"


def test_the_save_after_the_modules_batch_end_and_the_cycled_loaders_rely_on_what_lightning_does():
    """The training loop calls the module's ``on_train_batch_end`` after the callbacks' and the logger connector's
    ``on_batch_end`` right after it; ``max_size_cycle`` marks the loaders it started over in ``_consumed``."""
    from lightning.pytorch.utilities.combined_loader import _MaxSizeCycle

    source = inspect.getsource(training_epoch_loop._TrainingEpochLoop.advance)
    calls = ['_call_callback_hooks(trainer, "on_train_batch_end"', '_call_lightning_module_hook(trainer, '
             '"on_train_batch_end"', "trainer._logger_connector.on_batch_end()"]
    at = [source.find(call) for call in calls]
    assert -1 not in at and at == sorted(at), f"{HINT}: the order of the training loop's batch-end calls changed"
    cycle = iter(_MaxSizeCycle([[1, 2, 3], [1]]))
    next(cycle), next(cycle)
    assert cycle._consumed == [False, True], f"{HINT}: _MaxSizeCycle._consumed"


def test_what_a_lightning_cli_restart_relies_on_exists():
    """``SaveConfigCallback.setup`` refuses an existing config file unless ``overwrite``; Lightning moves every
    ``Checkpoint`` callback after it. The whole path runs in tests/lightning/test_cli.py."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import SaveConfigCallback
    from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

    setup = inspect.getsource(getattr(SaveConfigCallback.setup, "__wrapped__", SaveConfigCallback.setup))
    for name in ("self.overwrite", "self.save_to_log_dir", "self.already_saved", "self.config_filename"):
        assert name in setup, f"{HINT}: SaveConfigCallback.setup no longer reads {name}"
    assert "Checkpoint" in inspect.getsource(_CallbackConnector._reorder_callbacks), f"{HINT}: _reorder_callbacks"


def test_private_names_for_the_epoch_start_and_enable_checkpointing_exist():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

    setup_data = inspect.getsource(_FitLoop.setup_data)
    before, after = "self._load_combined_loader_states()", "iter(self._data_fetcher)"
    assert before in setup_data and setup_data.index(before) < setup_data.index(after), f"{HINT}: _FitLoop.setup_data"
    inner = torch.utils.data.RandomSampler(range(4))
    wrapper = DistributedSamplerWrapper(inner, num_replicas=2, rank=0)
    assert wrapper.dataset._sampler is inner, f"{HINT}: _DatasetSamplerWrapper._sampler"
    configure = _CallbackConnector._configure_checkpoint_callbacks
    source = inspect.getsource(getattr(configure, "__wrapped__", configure))
    assert "self.trainer.checkpoint_callbacks" in source and "enable_checkpointing=False" in source, \
        f"{HINT}: _CallbackConnector._configure_checkpoint_callbacks"


class FirstIterator(pl.Callback):
    """Records each call of the before_first_iterator hook: the loaders it sees, and whether an iterator exists."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def setup(self, trainer, pl_module, stage) -> None:
        def seen() -> None:
            combined = trainer.fit_loop._combined_loader
            self.calls.append((len(internals.train_loaders(trainer)), combined._iterator is not None))

        internals.before_first_iterator(trainer, seen)


@pytest.mark.parametrize("reload", [0, 1])
def test_before_first_iterator_runs_when_loaders_are_loaded_before_their_iterator(reload):
    probe = FirstIterator()
    _, _, trainer, _ = fit([probe], max_epochs=2, enable_checkpointing=False, reload_dataloaders_every_n_epochs=reload)
    assert probe.calls == [(1, False)] * (1 + reload), f"{HINT}: before_first_iterator ({probe.calls})"
    internals.release_resume(trainer)
    assert "_load_combined_loader_states" not in vars(trainer.fit_loop)


class Probe(pl.Callback):
    """Checks the position helpers at every batch against what Lightning then does."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, bool, bool, int]] = []
        self.validated_after: list[tuple[int, int]] = []
        self.checkpoint: dict | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append((trainer.current_epoch, batch_idx, internals.is_last_batch(trainer),
                          internals.validation_follows(trainer), internals.batches_done_in_epoch(trainer)))
        if trainer.global_step == 5:
            dumped = internals.dump_checkpoint(trainer)
            assert dumped["loops"] == internals.loops_state(trainer), HINT
            self.checkpoint = {k: v for k, v in dumped.items()}
            self.checkpoint["state_dict"] = {k: v.clone() for k, v in dumped["state_dict"].items()}

    def on_validation_start(self, trainer, pl_module) -> None:
        self.validated_after.append(self.rows[-1][:2])


def test_position_helpers_match_what_lightning_does():
    probe = Probe()
    fit([probe], max_epochs=2, val_check_interval=5, enable_checkpointing=False)
    batches = 12
    for epoch, idx, last, follows, done in probe.rows:
        assert done == idx + 1, f"{HINT}: batch_progress.current.ready"
        assert last == (idx == batches - 1), f"{HINT}: is_last_batch at {(epoch, idx)}"
        assert follows == ((epoch, idx) in probe.validated_after), f"{HINT}: validation_follows at {(epoch, idx)}"
    assert probe.validated_after == [(0, 4), (0, 9), (1, 4), (1, 9)]
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "global_step"} <= set(
        probe.checkpoint), f"{HINT}: dump_checkpoint keys {sorted(probe.checkpoint)}"


class Restore(pl.Callback):
    def __init__(self, checkpoint: dict | None) -> None:
        self.checkpoint, self.seen_path, self.step = checkpoint, "unset", None

    def setup(self, trainer, pl_module, stage) -> None:
        def load(path):
            self.seen_path = path
            return self.checkpoint

        internals.intercept_resume(trainer, load)

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step
        assert "resume_start" not in vars(trainer._checkpoint_connector), "intercept_resume must act once"


def test_intercept_resume_restores_from_a_dict():
    probe = Probe()
    fit([probe], max_steps=6, enable_checkpointing=False)
    restore = Restore(probe.checkpoint)
    model, _, _, _ = fit([restore], max_steps=7, enable_checkpointing=False)
    assert restore.seen_path is None and restore.step == 5, f"{HINT}: resume_start / _loaded_checkpoint"
    assert internals.train_loaders(model.trainer) and not internals.loaders_restore_themselves(model.trainer)


class Replay(pl.Callback):
    """In epoch 1 after batch 4, rebuild the epoch's iterator and skip 5 batches: nothing may change."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.iterator_rng = torch.get_rng_state()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.current_epoch, batch_idx) == (1, 4):
            rng = torch.get_rng_state()
            assert internals.replay_epoch(trainer, lambda: torch.set_rng_state(self.iterator_rng), skip=5), HINT
            torch.set_rng_state(rng)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_replay_epoch_recreates_the_same_batches(num_workers):
    from lightning_ft.testing import Data

    def run(callbacks):
        pl.seed_everything(0, verbose=False)
        from lightning_ft.testing import Net
        from lightning_ft.testing import trainer as make_trainer
        model = Net()
        make_trainer(callbacks, max_epochs=2, limit_val_batches=0, enable_checkpointing=False).fit(
            model, datamodule=Data(num_workers=num_workers))
        return model.seen

    assert run([Replay()]) == run([]), f"{HINT}: replay_epoch (fit_loop._data_fetcher, _combined_loader)"


def test_silence_midepoch_warning_is_scoped():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        undo = internals.silence_midepoch_warning()
        warnings.warn(internals.LIGHTNING_MIDEPOCH_WARNING + " and ...", UserWarning, stacklevel=1)
        assert not caught
        undo()
        warnings.warn(internals.LIGHTNING_MIDEPOCH_WARNING + " and ...", UserWarning, stacklevel=1)
    assert len(caught) == 1


def test_the_torchmetrics_state_a_resume_puts_back_is_the_metrics_whole_state():
    """``metric_states``/``restore_metric_states`` read and set torchmetrics' ``_defaults`` names, ``_update_count``
    and ``_computed``: a metric restored from them computes what the original does, and updates on from there."""
    import torchmetrics

    module = torch.nn.ModuleDict({"mean": torchmetrics.MeanMetric(), "cat": torchmetrics.CatMetric()})
    for value in (1.0, 2.0, 6.0):
        module["mean"].update(torch.tensor(value))
        module["cat"].update(torch.tensor([value]))
    saved = internals.metric_states(module)
    assert set(saved) == {"mean", "cat"} and saved["mean"]["update_count"] == 3, saved
    assert saved["cat"]["states"]["value"]["lengths"] == [1, 1, 1], "a list state is saved as one tensor"

    fresh = torch.nn.ModuleDict({"mean": torchmetrics.MeanMetric(), "cat": torchmetrics.CatMetric()})
    fresh["mean"].update(torch.tensor(100.0))
    fresh["mean"].compute()  # a value computed before the restore is not returned after it
    internals.restore_metric_states(fresh, saved)
    assert fresh["mean"].compute() == 3.0 and torch.equal(fresh["cat"].compute(), torch.tensor([1.0, 2.0, 6.0]))
    fresh["mean"].update(torch.tensor(7.0))
    assert fresh["mean"].compute() == 4.0 and fresh["mean"]._update_count == 4
    assert [t.tolist() for t in fresh["cat"].value] == [[1.0], [2.0], [6.0]], "the list state's parts as they were"


def test_leave_out_sigterm_handler_lets_the_fit_run_past_a_sigterm_and_keeps_the_handler_chain():
    """Lightning's loops raise on ``_signal_connector.received_sigterm``, which its SIGTERM handler sets (and, under
    DDP, broadcasts from inside the handler); the chain it installs takes it from ``_sigterm_notifier_fn``."""
    import os
    import signal

    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

    source = inspect.getsource(_SignalConnector._sigterm_notifier_fn)
    assert "received_sigterm = True" in source and "dist.broadcast" in source, HINT
    assert "[self._sigterm_notifier_fn]" in inspect.getsource(_SignalConnector.register_signal_handlers), HINT
    seen: list[int] = []
    installed: list[object] = []

    class Keep(pl.Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            internals.leave_out_sigterm_handler(trainer)

        def on_train_start(self, trainer, pl_module) -> None:
            installed.append(signal.getsignal(signal.SIGTERM))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen.append(trainer.global_step)
            if trainer.global_step == 6:  # a validation follows: Lightning would raise at its first batch's end
                os.kill(os.getpid(), signal.SIGTERM)

    def before(*_: object) -> None:
        seen.append(-1)

    previous = signal.signal(signal.SIGTERM, before)  # a handler from before the fit
    try:
        _, _, trainer, _ = fit([Keep()], max_steps=9, enable_checkpointing=False)
        assert signal.getsignal(signal.SIGTERM) is before  # Lightning's teardown put it back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen[-1] == 9 and seen.count(-1) == 1, seen  # the fit went on; the handler from before ran once
    assert not trainer.received_sigterm
    chain = installed[0].signal_handlers if isinstance(installed[0], _HandlersCompose) else []
    assert chain[0] is internals._left_out and before in chain, installed  # the handler from before is chained
    assert "_sigterm_notifier_fn" not in trainer._signal_connector.__dict__  # release_resume (Net.teardown)
