"""Every use of Lightning's (and torch's DataLoader's) private API in lightning_ft, in one place.

Lightning offers no public way to do these things a fault-tolerant callback needs:

1. build the full checkpoint dict of a run without writing it (``_checkpoint_connector.dump_checkpoint``);
2. make ``fit()`` restore from a dict instead of a file (``_checkpoint_connector.resume_start`` and
   ``_loaded_checkpoint``);
3. put a plain ``DataLoader`` back at the batch where the interrupted epoch stopped (Lightning restarts
   the epoch's iterator from its first batch; ``fit_loop._data_fetcher`` / ``_combined_loader``, the
   DataLoader iterator's ``_next_index``);
4. see the RNG states an epoch's order comes from right before the first epoch's iterator is created
   (``fit_loop._load_combined_loader_states`` runs just before), and the samplers Lightning wrapped
   (``_DatasetSamplerWrapper._sampler``);
5. accept ``Trainer(enable_checkpointing=False)`` with this callback as the only ``Checkpoint``
   (``_CallbackConnector._configure_checkpoint_callbacks`` refuses any ``Checkpoint`` then);
6. let a LightningCLI job that restarts start again: its ``SaveConfigCallback`` refuses an existing
   ``config.yaml`` in its ``setup``, which runs before this callback's (Lightning moves every ``Checkpoint``
   to the end of the list); its public ``overwrite`` is set for that call (``SaveConfigCallback.setup``);
7. keep an epoch that a resume landed in as the uninterrupted run had it: Lightning calls no
   ``on_train_epoch_start`` there (``StochasticWeightAveraging._initialized``), steps no ``ReduceLROnPlateau`` at
   its end (``fit_loop._restarting``) and keeps no state of its epoch-level training metrics
   (``epoch_loop._results``: a warning names them);
8. keep a SIGTERM from ending the fit at the end of a batch a resume cannot start after (or of a validation
   batch), and from desynchronising DDP ranks: Lightning's handler sets ``_signal_connector.received_sigterm``,
   which its loops raise on, and broadcasts inside the signal handler; the chain it installs
   (``register_signal_handlers``) takes ``_signal_connector._sigterm_notifier_fn``, which is replaced.

Each use is a small function here. ``tests/lightning/test_lightning_internals.py`` exercises every one
of them against the installed Lightning and fails, naming this module, when a release changes one.
:data:`TESTED` is the range of Lightning versions that test passed on; pyproject pins the same range.

Example:
    >>> check_version("2.6.6")
    True
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

if TYPE_CHECKING:
    import lightning.pytorch as pl

TESTED = ((2, 5), (2, 7))
"""Lightning versions ``[low, high)`` the test suite passed with (2.5.6, 2.6.6; 2.4 resumes inexactly)."""

LIGHTNING_MIDEPOCH_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"
"""The start of the warning Lightning gives when it cannot restore a position inside an epoch."""


def check_version(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed Lightning) is in :data:`TESTED`; warns once if not."""
    if version is None:
        import lightning

        version = lightning.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    ok = bool(m) and TESTED[0] <= (int(m.group(1)), int(m.group(2))) < TESTED[1]
    if not ok:
        low, high = (".".join(map(str, v)) for v in TESTED)
        warnings.warn(f"lightning {version} is outside the range lightning_ft was tested with (>={low},<{high}); "
                      f"resume may fail or be inexact. HINT: pip install 'lightning>={low},<{high}'", stacklevel=2)
    return ok


# -- the checkpoint dict --------------------------------------------------------------------------
def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The dict ``trainer.save_checkpoint`` would write (its tensors alias the live state).

    Calls the ``on_save_checkpoint`` hooks of callbacks and the LightningModule, like a save does.
    Must be called on every rank (sharded strategies gather inside it).
    """
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def loops_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The ``"loops"`` entry of :func:`dump_checkpoint` alone (progress counters; cheap)."""
    return trainer._checkpoint_connector._get_loops_state_dict()


def intercept_resume(trainer: pl.Trainer, load: Callable[[Any], dict[str, Any] | None]) -> None:
    """Have this fit's restore call ``load(ckpt_path)`` first; a dict it returns is restored like a file.

    ``ckpt_path`` is what ``fit(ckpt_path=...)`` resolved to (None when the user gave none). When
    ``load`` returns None, Lightning does what it would have done without this.
    """
    connector = trainer._checkpoint_connector
    original = type(connector).resume_start.__get__(connector)

    def resume_start(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:  # 2.6 added weights_only
        connector.__dict__.pop("resume_start", None)  # once per fit
        loaded = load(checkpoint_path)
        original(checkpoint_path, *args, **kwargs)
        if loaded is not None and not checkpoint_path:
            connector._loaded_checkpoint = loaded

    connector.resume_start = resume_start


def release_resume(trainer: pl.Trainer) -> None:
    """Undo :func:`intercept_resume` if the fit ended before restoring, :func:`before_first_iterator`,
    :func:`after_module_batch_end` and :func:`leave_out_sigterm_handler`."""
    trainer._checkpoint_connector.__dict__.pop("resume_start", None)
    trainer.fit_loop.__dict__.pop("_load_combined_loader_states", None)
    trainer._logger_connector.__dict__.pop("on_batch_end", None)
    trainer._signal_connector.__dict__.pop("_sigterm_notifier_fn", None)


def after_module_batch_end(trainer: pl.Trainer, fn: Callable[[], None]) -> None:
    """Call ``fn()`` right after the LightningModule's own ``on_train_batch_end``, before anything else.

    Lightning calls every callback's ``on_train_batch_end`` before the module's, so a callback's hook sees a
    batch the module has not finished: an EMA update or random draws in the module's hook would be missing from a
    save taken there. The training loop calls ``trainer._logger_connector.on_batch_end()`` next (nothing changes
    its progress in between); the evaluation loop calls it too, so ``fn`` decides whether a training batch ended.
    A later call's ``fn`` runs after an earlier one's. Undone (all of them) by :func:`release_resume`.
    """
    connector = trainer._logger_connector
    original = connector.on_batch_end

    def on_batch_end() -> None:
        original()
        fn()

    connector.on_batch_end = on_batch_end


def leave_out_sigterm_handler(trainer: pl.Trainer) -> None:
    """Leave Lightning's own SIGTERM handler out of the chain it installs; the ones it chains still run.

    Lightning installs its handler when ``fit`` starts its stage (``_signal_connector.register_signal_handlers``),
    chaining the handlers found in place. Its own (``_sigterm_notifier_fn``) sets ``received_sigterm``, on which its
    loops raise ``SIGTERMException`` at the end of the batch, or of the validation batch, the signal came in: where
    no resume can start (a batch a validation follows, the last of an epoch, a validation) that exit saved nothing
    newer than the last committed step. Under DDP it also broadcasts rank 0's flag inside the signal handler, a
    collective its loops match once a batch: a SIGTERM to one rank only, or a second one, desynchronised the ranks'
    collectives (gloo's size mismatch, a hang). In its place the chain gets a handler that does nothing; the
    callback, which watches SIGTERM itself, agrees with every rank at the next batch a resume can start after, saves
    there and exits. Call before the fit starts its stage (``setup``); undone by :func:`release_resume`.
    """
    trainer._signal_connector._sigterm_notifier_fn = _left_out


def _left_out(signum: int, frame: Any) -> None:
    """Lightning's SIGTERM handler's place in its chain (see :func:`leave_out_sigterm_handler`)."""


def allow_without_lightning_checkpointing(callback_type: type) -> None:
    """Let ``Trainer(enable_checkpointing=False)`` take ``callback_type`` as its only ``Checkpoint`` callbacks.

    Lightning refuses any ``Checkpoint`` callback with ``enable_checkpointing=False`` (its message names
    ``ModelCheckpoint``), before any hook of a callback runs. With only ``callback_type`` there is nothing
    of Lightning's to add or refuse, so the check passes; every other case is Lightning's own. Patches
    Lightning's class once per process; idempotent.
    """
    from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

    original = _CallbackConnector._configure_checkpoint_callbacks
    if getattr(original, "_lightning_ft", False):
        return

    @functools.wraps(original)
    def configure_checkpoint_callbacks(self: Any, enable_checkpointing: bool) -> None:
        callbacks = self.trainer.checkpoint_callbacks
        if not enable_checkpointing and callbacks and all(isinstance(cb, callback_type) for cb in callbacks):
            return  # "not Lightning's checkpoints, ours": nothing to add, nothing to refuse
        original(self, enable_checkpointing)

    configure_checkpoint_callbacks._lightning_ft = True  # type: ignore[attr-defined]
    _CallbackConnector._configure_checkpoint_callbacks = configure_checkpoint_callbacks


def let_lightning_cli_restart(restarts: Callable[[pl.Trainer], bool]) -> None:
    """Have LightningCLI's ``SaveConfigCallback`` write its config file again, rather than refuse an existing
    one, in a fit where ``restarts(trainer)`` (asked on rank 0, the answer broadcast: the callback's check is a
    collective) says the job ran in the checkpoint directory before. Patches Lightning's class once per process, only
    when ``lightning.pytorch.cli`` was imported (LightningCLI imports it before it builds the callbacks).
    """
    cli = sys.modules.get("lightning.pytorch.cli")
    original = getattr(getattr(cli, "SaveConfigCallback", None), "setup", None)
    if original is None or getattr(original, "_lightning_ft", False):
        return

    @functools.wraps(original)
    def setup(self: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.overwrite and self.save_to_log_dir and not self.already_saved:
            restarting = trainer.strategy.broadcast(restarts(trainer) if trainer.is_global_zero else False)
            if restarting:
                self.overwrite = True
                from lightning.pytorch.utilities.rank_zero import rank_zero_info

                rank_zero_info(f"FaultTolerantCheckpoint: this LightningCLI job restarts: SaveConfigCallback writes "
                               f"{self.config_filename} in {trainer.log_dir} again (it refuses an existing one)")
        original(self, trainer, pl_module, stage)

    setup._lightning_ft = True  # type: ignore[attr-defined]
    cli.SaveConfigCallback.setup = setup


# -- where in the epoch are we --------------------------------------------------------------------
def batches_done_in_epoch(trainer: pl.Trainer) -> int:
    """How many batches of the current epoch the loop has fetched (restored from a checkpoint, too); 0 once the
    epoch has ended: its batch counter is reset only when the next epoch starts (a fit that stopped early
    mid-epoch keeps the stopped epoch's count, while the epoch counter has moved on)."""
    epoch = trainer.fit_loop.epoch_progress.current
    if epoch.processed >= epoch.ready:
        return 0
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


def restart_epoch_start_callbacks(trainer: pl.Trainer) -> None:
    """A resume inside an epoch: Lightning calls no ``on_train_epoch_start`` then (the interrupted process did).
    ``StochasticWeightAveraging`` builds its SWALR scheduler in that hook, from the state it restored, and
    without it the resumed epoch ran with no scheduler (its annealing step lost): call the hook of each one that
    has not built it yet, as the uninterrupted run did at this epoch's start (``_initialized``)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, StochasticWeightAveraging) and not callback._initialized:
            callback.on_train_epoch_start(trainer, trainer.lightning_module)


def epoch_metrics_of_batches(trainer: pl.Trainer, *, metric_objects: bool = True) -> list[str]:
    """The training metrics logged with ``on_epoch=True`` from the epoch's batches (not from ``on_train_epoch_end``):
    Lightning aggregates tensors in ``fit_loop.epoch_loop._results``, which no checkpoint holds. A torchmetrics object
    logged so keeps its own state (see :func:`metric_states`): ``metric_objects=False`` leaves those out."""
    results = trainer.fit_loop.epoch_loop._results
    metas = [getattr(m, "meta", None) for m in results.values() if metric_objects or getattr(m, "is_tensor", True)]
    return sorted({m.name for m in metas if m is not None and m.on_epoch and m.fx != "on_train_epoch_end"})


def _metric_class() -> type | None:
    """torchmetrics' ``Metric``, or None where nothing imported torchmetrics (then the module holds no metric)."""
    module = sys.modules.get("torchmetrics")
    return getattr(module, "Metric", None) if module is not None else None


def metric_states(module: Any) -> dict[str, dict[str, Any]]:
    """What each torchmetrics ``Metric`` in ``module`` accumulated since its last ``reset``, by module name: its
    states (the names in ``_defaults``) and ``_update_count``. A metric keeps them in non-persistent buffers and
    attributes, which no checkpoint holds; a resume inside an epoch needs them for the epoch's value."""
    metric = _metric_class()
    if metric is None:
        return {}
    return {name: {"states": {k: _joined(getattr(m, k)) for k in m._defaults}, "update_count": m._update_count}
            for name, m in module.named_modules() if isinstance(m, metric)}


def _joined(value: Any) -> Any:
    """A list state (one tensor per ``update``: ``CatMetric``, AUROC) as one tensor and the lengths of its parts, so that
    a save copies one tensor, not thousands; other values as they are."""
    if not isinstance(value, list) or not value or not all(isinstance(t, torch.Tensor) and t.dim() for t in value):
        return value
    first = value[0]
    if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or t.device != first.device for t in value):
        return value
    return {"joined": torch.cat(value), "lengths": [t.shape[0] for t in value]}


def _parted(value: Any, device: Any) -> Any:
    """The inverse of :func:`_joined`, on ``device``."""
    if isinstance(value, dict):
        return list(torch.split(value["joined"].to(device), value["lengths"]))
    return [t.to(device) for t in value] if isinstance(value, list) else value.to(device)


def restore_metric_states(module: Any, saved: dict[str, dict[str, Any]] | None) -> None:
    """Put back what :func:`metric_states` returned into the metrics of ``module`` of the same names (on their
    devices); the value a metric had computed is dropped, as an ``update`` drops it."""
    metric = _metric_class()
    if metric is None or not saved:
        return
    for name, m in module.named_modules():
        if not isinstance(m, metric) or name not in saved:
            continue
        for key, value in saved[name]["states"].items():
            if key in m._defaults:
                setattr(m, key, _parted(value, m.device))
        m._update_count, m._computed = saved[name]["update_count"], None


def let_plateau_schedulers_step(trainer: pl.Trainer) -> None:
    """At the end of the epoch a resume landed in: Lightning steps no ``ReduceLROnPlateau`` there while its fit loop
    is ``restarting`` (its metrics may be missing after its own resume), and the uninterrupted run stepped it. Let
    it step where every such scheduler's ``monitor`` is logged (``fit_loop._restarting``)."""
    configs = [c for c in trainer.lr_scheduler_configs if c.reduce_on_plateau and c.interval == "epoch"]
    if configs and trainer.fit_loop.restarting and all(c.monitor in trainer.callback_metrics for c in configs):
        trainer.fit_loop._restarting = False


def is_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch that just ran is the last of its epoch."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.is_last_batch or progress.current.ready >= trainer.num_training_batches


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs validation right after the current training batch (same answer on all ranks)."""
    loop = trainer.fit_loop
    follows = bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))
    if getattr(trainer, "_val_check_time_interval", None) is not None:  # time based: clocks differ per rank
        follows = trainer.strategy.reduce_boolean_decision(follows, all=False)
    return follows


# -- putting the data back where it was -----------------------------------------------------------
def train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The training dataloaders of this fit (after Lightning wrapped them, e.g. DistributedSampler)."""
    loader = trainer.fit_loop._combined_loader
    return list(loader.flattened) if loader is not None else []


def loaders_restore_themselves(trainer: pl.Trainer) -> bool:
    """Whether every train loader is stateful (``state_dict``/``load_state_dict``): Lightning restores those."""
    loaders = train_loaders(trainer)
    return bool(loaders) and all(callable(getattr(dl, "state_dict", None)) and callable(getattr(dl, "load_state_dict", None))
                                 for dl in loaders)


def before_first_iterator(trainer: pl.Trainer, fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever this fit has just loaded its train dataloaders, right before it creates their
    first iterator (the first epoch's, or the one after ``reload_dataloaders_every_n_epochs``).

    :func:`train_loaders` returns the new loaders inside ``fn``. Undone by :func:`release_resume`.
    """
    loop = trainer.fit_loop
    original = type(loop)._load_combined_loader_states.__get__(loop)

    def load_combined_loader_states() -> None:
        original()  # stateful loaders get their state here; nothing draws from an RNG
        fn()

    loop._load_combined_loader_states = load_combined_loader_states


def samplers(dataloader: Any) -> list[tuple[str, Any]]:
    """The index samplers of ``dataloader`` by attribute path, outermost first, each once (``sampler``,
    ``batch_sampler``, ``batch_sampler.sampler``, ...), including the sampler inside Lightning's
    ``DistributedSamplerWrapper`` (``sampler.dataset._sampler``)."""
    from lightning.fabric.utilities.distributed import _DatasetSamplerWrapper

    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    todo = [(name, getattr(dataloader, name, None)) for name in ("sampler", "batch_sampler")]
    while todo:
        path, node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.append((path, node))
        todo.append((f"{path}.sampler", getattr(node, "sampler", None)))
        dataset = getattr(node, "dataset", None)
        if isinstance(dataset, _DatasetSamplerWrapper):
            todo.append((f"{path}.dataset._sampler", dataset._sampler))
    return found


def replay_epoch(trainer: pl.Trainer, restore_epoch_start: Callable[[], None], skip: int) -> bool:
    """Re-create the current epoch's train iterator as it was first created, then skip ``skip`` batches.

    ``restore_epoch_start()`` is called after the samplers' ``set_epoch`` and right before the iterator is
    created: it puts back the RNG states the iterator draws its shuffle and worker seeds from (the torch
    RNG, the loader's and samplers' generators). Batches are skipped without loading them when that is
    exact (map-style dataset, no workers). Returns False, changing nothing, when the loaders have no
    length or the fetcher hands the iterator to ``training_step``.
    """
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

    loop = trainer.fit_loop
    fetcher, combined = loop._data_fetcher, loop._combined_loader
    if combined is None or fetcher is None or isinstance(fetcher, _DataLoaderIterDataFetcher):
        return False
    if loop.max_batches == float("inf"):
        return False
    epoch = loop.epoch_progress.current.processed
    for dl in combined.flattened:
        _set_sampler_epoch(dl, epoch)
    restore_epoch_start()
    iter(fetcher)  # a new iterator in the fetcher, fetched = 0 (the epoch loop adds the restored count)
    it = combined._iterator
    fast = len(it.iterators) == 1 and _can_skip_without_loading(it.iterators[0])
    for _ in range(skip):
        if fast:
            it.iterators[0]._next_index()
            it.iterators[0]._num_yielded += 1
            it._idx += 1
        else:
            next(it)
    return True


def cycled_loaders(trainer: pl.Trainer) -> list[Any]:
    """The train loaders that the current epoch's iterator started over (``CombinedLoader`` mode ``max_size_cycle``
    restarts the shorter loaders while the longest runs: ``_MaxSizeCycle._consumed``)."""
    combined = trainer.fit_loop._combined_loader
    consumed = getattr(getattr(combined, "_iterator", None), "_consumed", None) or []
    return [dl for dl, restarted in zip(combined.flattened, consumed) if restarted] if combined is not None else []


def _can_skip_without_loading(iterator: Any) -> bool:
    return isinstance(iterator, _SingleProcessDataLoaderIter) and iterator._dataset_kind == _DatasetKind.Map


def _set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler and batch sampler's sampler (DistributedSampler)."""
    samplers = [getattr(dataloader, "sampler", None), getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)]
    seen = set()
    for sampler in samplers:
        if sampler is not None and id(sampler) not in seen and callable(getattr(sampler, "set_epoch", None)):
            seen.add(id(sampler))
            sampler.set_epoch(epoch)


def silence_midepoch_warning() -> Callable[[], None]:
    """Hide Lightning's "not resumable" warning (the position was restored); returns the undo."""
    warnings.filterwarnings("ignore", message=re.escape(LIGHTNING_MIDEPOCH_WARNING))
    entry = warnings.filters[0]

    def undo() -> None:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
            mutated = getattr(warnings, "_filters_mutated", None)  # resets the "already warned" caches
            if callable(mutated):
                mutated()

    return undo
