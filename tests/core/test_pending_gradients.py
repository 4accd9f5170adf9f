"""Gradients an optimizer holds for a later step (``ft_checkpoint.save.pending_gradients``) and the save they put
off (``CheckpointManager.agree_to_save(hold=)``)."""

from __future__ import annotations

import threading

import torch

from ft_checkpoint import CheckpointManager
from ft_checkpoint.format import shards
from ft_checkpoint.save.pending_gradients import PendingGradients


def gan() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    d, g = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)), torch.nn.Linear(2, 1)
    return d, g, torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)


def test_gradients_zeroed_in_place_after_a_step_are_not_held():
    """``zero_grad(set_to_none=False)`` after the generator's step bumps its gradients' version counters: they were
    taken for held gradients, and with a step interval no save came while they stayed zero."""
    d, g, opt_d, opt_g = gan()
    watch = PendingGradients([opt_d, opt_g])
    (d(torch.ones(2)) + g(torch.ones(2))).sum().backward()
    opt_d.step(), opt_g.step()
    opt_g.zero_grad(set_to_none=False)
    assert watch.held() == []
    d(torch.ones(2)).sum().backward()
    opt_d.step()
    assert watch.held() == [], "zeros are no gradients held for a later step"
    g(torch.ones(2)).sum().backward()  # accumulated in place into the zeroed tensors
    opt_d.step()
    assert watch.held() == [1]


def test_a_backward_that_reaches_the_last_layers_only_is_seen():
    """The discriminator's first layer frozen for a while: its gradients stay None, the last layer's accumulate."""
    d, g, opt_d, opt_g = gan()
    watch = PendingGradients([opt_d, opt_g])
    (d(torch.ones(2)) + g(torch.ones(2))).sum().backward()
    opt_d.step(), opt_g.step()
    opt_d.zero_grad(), opt_g.zero_grad()
    watch.held()
    d[1](torch.ones(2)).sum().backward()  # only the last layer of d
    opt_g.step()
    assert watch.held() == [0]


def test_a_step_in_a_batch_the_loop_left_is_no_step_of_the_next_boundary():
    d, g, opt_d, opt_g = gan()
    watch = PendingGradients([opt_d, opt_g])
    g(torch.ones(2)).sum().backward()
    opt_g.step()
    watch.forget_steps()  # the loop left that batch by a break
    g(torch.ones(2)).sum().backward()  # new gradients, not stepped on
    d(torch.ones(2)).sum().backward()
    opt_d.step()
    assert watch.held() == [1]


def test_a_held_save_comes_at_the_next_step_without_a_hold_and_a_preemption_notice_does_not_wait(tmp_path):
    """With ``interval=4`` (every 4th step) a due save put off at step 4 was dropped, and a loop whose held steps
    were the multiples of 4 never saved. It comes at step 5, whatever the policy says there."""
    with CheckpointManager(str(tmp_path / "a"), interval=4, announce=False) as m:
        assert [m.agree_to_save(s, hold=s % 2 == 0) for s in range(1, 10)] == \
               [False, False, False, False, True, False, False, False, True]
    with CheckpointManager(str(tmp_path / "b"), interval=1000, announce=False) as m:
        m.preempted = True  # a preemption notice: the final save goes ahead, gradients held or not
        assert m.agree_to_save(3, hold=True)


def test_shard_files_are_written_on_the_calling_thread_where_no_thread_can_start(monkeypatch):
    """Python 3.12.0 and 3.12.1 start no thread once the interpreter exits: the jobs run on the calling thread."""
    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert shards._each_on_a_thread(lambda job: job * 2, [1, 2, 3]) == [2, 4, 6]
