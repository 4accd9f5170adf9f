"""The lazy snapshot (issue 25): a save returns before parameters and optimizer state are copied, and the next
optimizer step waits for their copy. Real training loops, resumed and compared bit for bit with uninterrupted
runs. The deferred copy is held (a phase hook on its own thread) until the next forward/backward is done, right
before the next optimizer step: the latest moment the copy may happen, where a save that deferred too much
(BatchNorm's running statistics, EMA weights) or missed an in-place edit would be caught."""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import textwrap
import threading
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ft_checkpoint import CheckpointManager
from ft_checkpoint.config import CheckpointConfig
from ft_checkpoint.format import layout
from ft_checkpoint.store.storage import Storage
from tests.helpers.toy import assert_same

FEATURES = 4096
"""BatchNorm's running statistics (16 KiB each) are large enough to be deferred, were they an optimizer's."""


def make(seed: int, *, ema: bool) -> dict[str, Any]:
    """A model with BatchNorm, Adam, optionally an EMA of the weights (not the optimizer's), and a counter."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, FEATURES), torch.nn.BatchNorm1d(FEATURES), torch.nn.ReLU(),
                                torch.nn.Linear(FEATURES, 4))
    state: dict[str, Any] = {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-3),
                             "progress": {"step": 0}}
    if ema:
        state["ema"] = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    return state


class HeldCopy:
    """Holds each save's deferred copy (its ``copying`` phase, on the copy thread) until :meth:`release`."""

    def __init__(self, timeout: float = 60) -> None:
        self.gate = threading.Event()
        self.copies, self.timeout, self.timed_out = 0, timeout, False

    def __call__(self, phase: str, step: int) -> None:
        if phase == "copying":
            self.copies += 1
            self.timed_out |= not self.gate.wait(self.timeout)

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()


EDITS = {"no_grad": lambda w: torch.no_grad()(w.mul_)(0.5), "data": lambda w: w.data.mul_(0.5),
         "numpy": lambda w: w.detach().numpy().__imul__(0.5)}
"""Three ways to halve a weight in place: the last two bypass its version counter."""


def iteration(state: dict[str, Any], step: int, *, accumulate: int = 1, edit_at: int | None = None,
              edit: str = "no_grad", before_step: Any = None) -> None:
    """One training iteration: an in-place edit of a weight (at ``edit_at``, one of :data:`EDITS`), the EMA
    update of the previous step's weights (right after the previous iteration's save), ``accumulate``
    forward/backward passes, the optimizer step."""
    model, opt = state["model"], state["optim"]
    if step == edit_at:
        EDITS[edit](model[0].weight)
    if "ema" in state and step > 1:
        state["ema"].update_parameters(model)
    for micro in range(accumulate):
        g = torch.Generator().manual_seed(1000 * step + micro)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        (torch.nn.functional.mse_loss(model(x), y) / accumulate).backward()
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad()
    state["progress"]["step"] = step


def uninterrupted(last: int, *, ema: bool, **kw: Any) -> dict[str, Any]:
    state = make(0, ema=ema)
    for step in range(1, last + 1):
        iteration(state, step, **kw)
    return state


def interrupted(dirpath: str, *, saves: tuple[int, ...], crash_at: int, ema: bool, after_save: Any = None,
                **kw: Any) -> list:
    """Train from step 1, saving at ``saves`` with each deferred copy held until the next optimizer step; stop
    (no final save) after ``crash_at``. ``after_save(ckpt, held, state)`` runs right after each save. Returns the
    saves' stats."""
    state, held = make(0, ema=ema), HeldCopy()
    ckpt = CheckpointManager(dirpath, interval=1000, keep_last=5, announce=False)
    ckpt.engine.phase_hook = held
    stats = []
    for step in range(1, crash_at + 1):
        iteration(state, step, before_step=held.release, **kw)
        if step in saves:
            held.hold()
            stats.append(ckpt.save(step, state))
            if after_save is not None:
                after_save(ckpt, held, state)
    ckpt.close(final=False)
    assert held.copies > 0, "no copy was deferred"
    return stats


def resumed(dirpath: str, last: int, *, ema: bool, **kw: Any) -> tuple[int | None, dict[str, Any]]:
    """A fresh process's view: other initial weights, resumed from ``dirpath``, trained on to ``last``."""
    state = make(1, ema=ema)
    with CheckpointManager(dirpath, interval=1000, announce=False, final_save=False) as ckpt:
        start = ckpt.resume(state)
        for step in range((start or 0) + 1, last + 1):
            iteration(state, step, **kw)
    return start, state


@pytest.mark.parametrize("ema,accumulate", [(False, 1), (True, 1), (False, 3)], ids=["batchnorm", "ema", "accumulation"])
def test_resume_is_bit_exact(tmp_path, ema, accumulate):
    """BatchNorm's statistics change in the forward pass and the EMA right after the save, the gradients of
    several forward/backward passes pile up before the step: each is copied (or untouched) as it was at the save."""
    stats = interrupted(str(tmp_path), saves=(3,), crash_at=5, ema=ema, accumulate=accumulate)
    assert stats[0].deferred > 0 and stats[0].committed and stats[0].abandoned is None
    start, state = resumed(str(tmp_path), 8, ema=ema, accumulate=accumulate)
    assert start == 3
    assert_same(state, uninterrupted(8, ema=ema, accumulate=accumulate))


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_parameter_edited_before_the_next_step_abandons_the_save(tmp_path, caplog, edit):
    """A weight edited in place between the save and the next optimizer step (here: before its copy is released)
    makes the snapshot torn: that save is never committed, later saves copy at once, and the resume (from the
    next save) is bit-exact. A torn step 3 would hold the edited weight, and its resume would edit it twice.
    Through ``.data`` or NumPy the version counter stays as it was: the ends read at the save tell."""
    with caplog.at_level(logging.WARNING, logger="ft_checkpoint.save.engine"):
        stats = interrupted(str(tmp_path), saves=(3, 5), crash_at=6, ema=False, edit_at=4, edit=edit)
    assert stats[0].abandoned is not None and "model/0.weight" in stats[0].abandoned and not stats[0].committed
    assert "step 3 abandoned" in caplog.text and "model/0.weight" in caplog.text
    assert stats[1].committed and stats[1].deferred == 0  # lazy snapshots are off after a torn one
    assert layout.committed_steps(Storage(str(tmp_path))) == [5]
    start, state = resumed(str(tmp_path), 8, ema=False, edit_at=4, edit=edit)
    assert start == 5
    assert_same(state, uninterrupted(8, ema=False, edit_at=4, edit=edit))


def test_weights_swapped_through_data_while_copied_abandon_the_save(tmp_path):
    """diffusers' ``EMAModel.store``, ``copy_to`` and ``restore`` around a validation right after a save swap
    the EMA weights into the model through ``.data`` and back: no version counter moves, and the weights are as
    at the save again by the next step. A copy made during the swap would commit the EMA weights as the model's
    (a silent wrong resume); the ends read at the save make that step torn, and the next save is exact."""
    def validate_with_ema(ckpt: CheckpointManager, held: HeldCopy, state: dict[str, Any]) -> None:
        lazy = ckpt.engine._lazy  # None once lazy snapshots are off
        live = list(state["model"].parameters())
        stored = [p.detach().clone() for p in live]
        for p, e in zip(live, state["ema"].module.parameters()):  # copy_to
            p.data.copy_(e.data)
        held.release()
        if lazy is not None:
            lazy.wait_copied()  # copied while the EMA weights are in place
        for p, s in zip(live, stored):  # restore
            p.data.copy_(s.data)

    stats = interrupted(str(tmp_path), saves=(3, 5), crash_at=6, ema=True, after_save=validate_with_ema)
    assert stats[0].abandoned is not None and "model/0.weight" in stats[0].abandoned and not stats[0].committed
    assert stats[1].committed and stats[1].deferred == 0
    start, again = resumed(str(tmp_path), 8, ema=True)
    assert start == 5
    assert_same(again, uninterrupted(8, ema=True))


@pytest.mark.parametrize("swap", [False, True], ids=["untouched", "swapped"])
def test_a_channels_last_model_is_checked_like_a_contiguous_one(tmp_path, swap):
    """A convolution net in ``channels_last`` (its weights and Adam's moments are not contiguous): the ends were read
    of contiguous tensors only, so EMA weights swapped in through ``.data`` while copied were committed as the
    model's, silently. Now their first and last elements are compared with the (contiguous) staged copy: the swap
    makes the step torn, and an untouched model commits, restored bit for bit."""
    def conv_net(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3))
        net = net.to(memory_format=torch.channels_last)
        return {"model": net, "optim": torch.optim.Adam(net.parameters(), lr=1e-3)}

    def train(state: dict[str, Any]) -> None:
        state["model"](torch.ones(2, 3, 8, 8).to(memory_format=torch.channels_last)).square().mean().backward()
        state["optim"].step()
        state["optim"].zero_grad()

    state, held = conv_net(0), HeldCopy()
    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        train(state)  # the optimizer's first step, with the manager's step hook in place: its tensors are deferred
        live = list(state["model"].parameters())
        at_save = [p.detach().clone() for p in live]
        assert not live[2].is_contiguous() and not state["optim"].state[live[2]]["exp_avg"].is_contiguous()
        ckpt.engine.phase_hook = held
        held.hold()
        saved = ckpt.save(1, state)
        if swap:  # copy_to of an EMA, the copy made while it is in place, then restore
            for p in live:
                p.data.copy_(p.data + 1)
        held.release()
        ckpt.engine._lazy.wait_copied()
        for p, s in zip(live, at_save):
            p.data.copy_(s)
        train(state)
    assert saved.deferred > 0
    if swap:
        assert saved.abandoned is not None and "model/2.weight" in saved.abandoned and not saved.committed
        return
    assert saved.committed and saved.abandoned is None
    again = conv_net(1)
    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        assert ckpt.resume(again) == 1
    assert all(torch.equal(p, s) for p, s in zip(again["model"].parameters(), at_save))


def test_a_last_save_found_torn_at_close_is_saved_again_by_the_final_save(tmp_path):
    """The loop's last save is lazy, and a weight is written in place after it (restored to the same values here,
    as a load of the best weights would): ``close``'s final save asked whether the step was saved before the copy
    was settled, skipped it, and the settling then abandoned the step: nothing of the run was committed. The
    final save now waits for that verdict and saves the step again, at once."""
    state = make(0, ema=False)
    with CheckpointManager(str(tmp_path), interval=2, announce=False) as ckpt:
        for step in (1, 2):
            iteration(state, step)
            ckpt.maybe_save(step, state)
        lazy = ckpt.last_save
        state["model"].load_state_dict({k: v.clone() for k, v in state["model"].state_dict().items()})
    assert lazy.deferred > 0 and lazy.abandoned is not None and not lazy.committed
    assert layout.committed_steps(Storage(str(tmp_path))) == [2]
    again = make(1, ema=False)
    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        assert ckpt.resume(again) == 2
    assert_same(again, state)


class Wrapped(torch.Tensor):
    """A tensor subclass with no storage of its own, wrapping a plain tensor (as torchao's low-bit optimizer states
    wrap theirs)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, size: Any, stride: Any) -> Wrapped:
        return Wrapped(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda x: x.inner if isinstance(x, Wrapped) else x  # noqa: E731
        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def test_an_optimizer_state_without_storage_of_its_own_is_copied_at_the_save(tmp_path):
    """Every save raised "Attempted to access the data pointer on an invalid python storage" while looking up the
    storages an optimizer owns, with lazy snapshots on (the default): such a state is copied at the save now, the
    plain tensors are still deferred, and the step resumes with its values."""
    def state(fill: float) -> dict[str, Any]:
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        opt.state[model.weight]["low_bit"] = Wrapped(torch.full((64, 64), fill))
        return {"model": model, "optim": opt}

    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        saved = state(2.0)
        stats = ckpt.save(1, saved, block=True)
    assert stats.committed and stats.deferred > 0
    again = state(0.0)
    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        assert ckpt.resume(again) == 1
    assert torch.equal(again["model"].weight, saved["model"].weight)
    assert torch.equal(again["optim"].state[again["model"].weight]["low_bit"].inner, torch.full((64, 64), 2.0))


def test_close_right_after_a_save_commits_it(tmp_path):
    """No optimizer step after the save: ``close`` settles the copy (no deadlock), and the step commits."""
    state = make(0, ema=False)
    iteration(state, 1)
    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        saved = ckpt.save(1, state)
    assert saved.deferred > 0 and saved.committed
    start, again = resumed(str(tmp_path), 1, ema=False)
    assert start == 1
    assert_same(again, state)


def test_lazy_snapshot_off_copies_everything_at_the_save(tmp_path, monkeypatch):
    """``FT_CHECKPOINT_LAZY_SNAPSHOT=0`` (or ``lazy_snapshot=False``): nothing is deferred."""
    monkeypatch.setenv("FT_CHECKPOINT_LAZY_SNAPSHOT", "0")
    assert CheckpointConfig.from_env().lazy_snapshot is False
    state = make(0, ema=False)
    iteration(state, 1)
    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        assert ckpt.save(1, state).deferred == 0


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_a_process_that_exits_right_after_a_save_does_not_hang(tmp_path, python):
    """The writer waits for the training thread to settle the copy; once that thread has ended (interpreter
    exit, no ``close``) the writer settles it itself instead of waiting forever."""
    script = textwrap.dedent(f"""
        import torch
        from ft_checkpoint import CheckpointManager
        ckpt = CheckpointManager({str(tmp_path)!r}, interval=1000, announce=False, final_save=False)
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 256)).sum().backward(); opt.step()
        print("deferred", ckpt.save(1, {{"model": model, "optim": opt}}).deferred)
    """)
    out = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and int(out.stdout.split()[-1]) > 0, out.stdout + out.stderr


def test_a_process_forked_while_a_copy_is_pending_exits_on_its_own(tmp_path):
    """A DataLoader starting its workers (a fork, as ``multiprocessing`` does here) while a save's copy is still
    pending: the child inherits the pending copy but not its thread, and its exit runs the threading exit hooks.
    Waiting for that copy there hung every worker at exit: 5 s per epoch until the loader terminated it, and
    forever once the training process was killed (the orphan kept the job's output open)."""
    state, held = make(0, ema=False), HeldCopy()
    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        ckpt.engine.phase_hook = held
        iteration(state, 1)  # the step hook learns the optimizer: its tensors are deferred from now on
        held.hold()
        saved = ckpt.save(1, state)
        child = multiprocessing.get_context("fork").Process(target=len, args=([],))
        child.start()
        child.join(timeout=60)
        hung = child.is_alive()
        if hung:
            child.kill()
        held.release()
    assert saved.deferred > 0 and saved.committed
    assert not hung and child.exitcode == 0, "the forked process waited at exit for its parent's copy"


def test_a_step_with_a_closure_waits_for_the_copy_after_the_closure(tmp_path):
    """``opt.step(closure)`` (Lightning's automatic optimization) runs the forward/backward inside the step: the
    copy is waited for when the closure returns, so it overlaps them (held until the backward is done here; a
    wait before the closure would wait out the hold)."""
    state, held = make(0, ema=False), HeldCopy(timeout=10)
    model, opt = state["model"], state["optim"]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(8, 16)).square().mean()
        loss.backward()
        held.release()
        return loss

    with CheckpointManager(str(tmp_path), interval=1000, announce=False, final_save=False) as ckpt:
        ckpt.engine.phase_hook = held
        opt.step(closure)
        held.hold()
        saved = ckpt.save(1, state)
        opt.step(closure)
        assert saved.deferred > 0 and held.copies == 1 and not held.timed_out
    assert saved.committed and saved.abandoned is None
