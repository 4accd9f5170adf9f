"""One plan for both tiers (issue 26): the multi-level model and its plan, failure classes learned from the journal,
the manager planning both tiers, ``ft-checkpoint plan --fast-cost`` and ``simulate --tiers``."""

from __future__ import annotations

import json
import logging
import math
import random
import re
import shutil
import statistics
import threading
import time

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.policies.adaptive import simulate_tiers as sim
from ft_checkpoint.policies.adaptive.classes import CRASH, MORE, NO_FAST_STEP, NODE, ClassRates, class_counts
from ft_checkpoint.policies.adaptive.failures import FailureModel
from ft_checkpoint.policies.adaptive.interval import expected_waste
from ft_checkpoint.policies.adaptive.multilevel import pattern_waste, plan_tiers
from ft_checkpoint.policies.adaptive.policy import FIRST_SAVE_BY
from ft_checkpoint.policies.adaptive.tier_policy import DURABLE, FAST, MultiLevelInterval
from ft_checkpoint.run.journal import attempt_summaries, read_journal
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.tiers.folder import Mark
from ft_checkpoint.tiers.node import Ring
from ft_checkpoint.tiers.sources import Holding, failure_class
from tests.cli.conftest import cli
from tests.helpers.toy import make, train_step

MIN, HOUR = 60.0, 3600.0


def figures(mtbf: float, crash: float, c: float, d: float, restart: float = 60.0) -> dict[str, float]:
    return {"fast_cost": c, "durable_cost": d, "fast_rate": crash / mtbf, "durable_rate": (1 - crash) / mtbf,
            "restart": restart}


# -- the model and the plan -------------------------------------------------------------------------
def test_one_tier_is_dalys_model():
    for interval, cost, mtbf in [(3600, 300, 6 * HOUR), (900, 60, HOUR), (60, 1, 10 * MIN)]:
        one = pattern_waste(interval, 1, fast_cost=5, durable_cost=cost, fast_rate=0, durable_rate=1 / mtbf, restart=90)
        assert one == pytest.approx(expected_waste(interval, cost, mtbf, 90), rel=1e-9)


@pytest.mark.parametrize("mtbf,interval,every,c,d,crash", [(HOUR, 120, 20, 1, 600, 0.75), (HOUR, 600, 3, 10, 60, 0.5),
                                                           (6 * HOUR, 300, 12, 1, 600, 0.9)])
def test_the_model_is_what_the_simulated_job_wastes(mtbf, interval, every, c, d, crash):
    """The expected waste of a fixed plan agrees with the simulation of 20 runs of 200 MTBFs (its failures and
    restarts, every k-th save durable, the durable save counted across restarts) within 3 standard errors."""
    runs = [sim._run(sim._Plan(interval, every), sim.failures(random.Random(seed), mtbf, crash), work=200 * mtbf,
                     fast_cost=c, durable_cost=d, restart=60.0)["all"] for seed in range(20)]
    error = statistics.stdev(runs) / math.sqrt(len(runs))
    model = pattern_waste(interval, every, **figures(mtbf, crash, c, d))
    assert abs(statistics.fmean(runs) - model) < 3 * error + 1e-4, (statistics.fmean(runs), model, error)


@pytest.mark.parametrize("mtbf,crash,c,d", [(HOUR, 0.75, 1, 600), (6 * HOUR, 0.5, 10, 60), (86400, 0.95, 1, 600),
                                            (HOUR, 0.0, 1, 60), (15 * MIN, 0.9, 10, 600)])
def test_the_plan_is_the_models_minimum(mtbf, crash, c, d):
    """No fast interval and no durable multiple on a fine grid does better than the plan."""
    f = figures(mtbf, crash, c, d)
    best = plan_tiers(**f)
    grid = min(pattern_waste(math.exp(x / 20), k, **f) for x in range(0, 240) for k in
               sorted({1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, best.every or 1}))
    assert best.expected_waste <= grid + 1e-9
    assert best.expected_waste <= best.durable_alone * (1 + 1e-6)
    if 0 < crash and c < d:  # failures of the fast tier's class and a cheaper fast save: it pays off
        assert best.expected_waste < 0.97 * best.durable_alone


def test_the_first_order_optimum_is_the_sum_over_tiers():
    """Benoit et al.: for small rates, the waste is sqrt(2 c lambda_fast) + sqrt(2 (d - c) lambda_durable)."""
    c, d, fast_rate, durable_rate = 1.0, 300.0, 1 / (2 * 86400), 1 / (30 * 86400)
    plan = plan_tiers(fast_cost=c, durable_cost=d, fast_rate=fast_rate, durable_rate=durable_rate)
    first = math.sqrt(2 * c * fast_rate) + math.sqrt(2 * (d - c) * durable_rate)
    assert plan.expected_waste == pytest.approx(first, rel=0.05)
    assert plan.every == pytest.approx(math.sqrt((d - c) * fast_rate / (c * durable_rate)), rel=0.1)


def test_the_plan_is_never_shorter_than_a_save_takes_and_keeps_its_bounds():
    f = figures(HOUR, 0.75, 1, 600)
    plan = plan_tiers(**f, min_fast=300.0, min_durable=3 * HOUR)
    assert plan.fast_interval >= 300.0 and plan.durable_interval >= 3 * HOUR
    capped = plan_tiers(**f, max_durable=20 * MIN)
    assert capped.durable_interval <= 20 * MIN * (1 + 1e-9)
    never = plan_tiers(**{**f, "durable_rate": 0.0})
    assert never.every is None and never.durable_interval == math.inf, "no failure needs the durable tier"


# -- failure classes ------------------------------------------------------------------------------
def test_the_nodes_folders_tell_the_failure_class():
    ring = Ring(("a", "a", "b", "b", "c", "c"))
    mark, old = Mark(9, 6, "s1"), Mark(9, 4, "s0")
    full = lambda node, ranks: Holding(node, {r: mark for r in ranks}, {})  # noqa: E731
    a, b, c = full("a", [0, 1, 4, 5]), full("b", [2, 3, 0, 1]), full("c", [4, 5, 2, 3])  # own ranks and copies
    empty = lambda node: Holding(node, {}, {})  # noqa: E731
    assert failure_class([a, a, b, b, c, c], ring) == CRASH
    assert failure_class([a, a, empty("b"), empty("b"), c, c], ring) == NODE
    assert failure_class([a, a, empty("b"), empty("b"), empty("c"), empty("c")], ring) == MORE
    assert failure_class([empty(n) for n in "aabbcc"], ring) == NO_FAST_STEP
    assert failure_class([Holding(n, {0: old}, {}) for n in "aabbcc"], ring) == MORE, "another world size"


def test_failure_classes_come_from_the_next_attempts_resume():
    def attempt(start: float, **fields) -> dict:
        return {"start": start, "end": start + 100, "ended": False, **fields}

    summaries = [attempt(0, fast_step=10),
                 attempt(200, failure_class=NO_FAST_STEP),  # every node's folder lost, after a fast-tier save: more
                 attempt(400, failure_class=CRASH),
                 attempt(600, failure_class=NO_FAST_STEP),  # no fast-tier save before this failure: unknown
                 {**attempt(800, failure_class="rm -rf /"), "ended": True},  # forged: no class; a clean end
                 attempt(1000, failure_class=NODE)]  # after a clean end: no failure
    counts, failures, exposure = class_counts(summaries, now=1050)
    assert counts == {CRASH: 1, NODE: 0, MORE: 1}
    assert failures == 4 and exposure == 5 * 100 + 50, "a failure of no known class still counts"


def test_each_class_rate_is_learned_from_a_jobs_own_failures():
    """Simulated journals of a job failing every 2 h, 3 in 4 failures process crashes: the learned rates of each
    class converge on the true ones from a prior 25 times too optimistic."""
    rates = ClassRates(FailureModel(prior_mtbf=50 * HOUR))
    rng = random.Random(7)
    n = 400
    classes = [CRASH if rng.random() < 0.75 else NODE for _ in range(n)]
    counts = {CRASH: classes.count(CRASH), NODE: classes.count(NODE), MORE: 0}
    learned = rates.estimate(counts, n, sum(rng.expovariate(1 / (2 * HOUR)) for _ in range(n)))
    assert 1 / (learned[CRASH] + learned[NODE] + learned[MORE]) == pytest.approx(2 * HOUR, rel=0.15)
    assert learned[CRASH] / learned[NODE] == pytest.approx(3, rel=0.25)
    assert learned[MORE] < 0.01 * learned[CRASH]
    few = rates.estimate({CRASH: 1, NODE: 0, MORE: 0}, 1, HOUR)
    assert few[NODE] > rates.estimate({CRASH: 0, NODE: 0, MORE: 0}, 0, HOUR)[NODE], \
        "a crash raises the rate to expect of every class: a job that fails often fails often in every way"


# -- the policy ---------------------------------------------------------------------------------
def test_the_plan_is_made_again_after_every_save_and_resume_and_logged_when_it_changes(caplog):
    now = [0.0]
    p = MultiLevelInterval(world_size=1024, clock=lambda: now[0])
    assert p.durable.seconds <= FIRST_SAVE_BY, "while the durable save's cost is a guess: a save within 30 min"
    caplog.set_level(logging.INFO, logger="ft_checkpoint")
    p.observe_save(FAST, cost=1.0, duration=3.0)
    p.observe_save(DURABLE, cost=600.0, duration=900.0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tier intervals")]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"tier intervals: fast [\d.]+ s -> [\d.]+ s, durable [\d.]+ s -> [\d.]+ s \(1 save in \d+ durable\): "
                        r"save cost c=1 s fast, d=600 s durable; failures the fast tier survives 1 per [\d.]+ h \(process "
                        r"crash 0, one node lost 0\), the durable tier only 1 per [\d.]+ h \(more 0\) in [\d.e-]+ h \(rates "
                        r"\+/-\d+%\); "
                        r"expected waste [\d.]+% \(durable tier alone [\d.]+%\)", lines[-1]), lines[-1]
    fresh = p.fast.seconds
    now[0] = 600.0
    p.observe_history({CRASH: 10}, exposure=10 * HOUR)  # a resume after 10 process crashes in 10 h
    assert p.fast.seconds < 0.7 * fresh, "frequent crashes: the fast tier saves more often"
    assert p.fast.seconds >= 3.0 and p.durable.seconds >= 900.0, "never shorter than a save of that tier takes"
    crashes = p.durable.seconds
    p.observe_history({MORE: 10}, exposure=10 * HOUR)  # as many failures, each needing the durable tier
    assert crashes > 3 * p.durable.seconds, "process crashes need no durable save: it comes less often"
    p.observe_history({CRASH: 10}, exposure=10 * HOUR)
    caplog.clear()
    p.observe_save(FAST, cost=1.0, duration=3.0)  # the same figures: no new line
    assert not [r for r in caplog.records if r.getMessage().startswith("tier intervals")]
    metrics = p.last_decision
    assert metrics["fast_interval_s"] == p.fast.seconds and metrics["durable_interval_s"] == p.durable.seconds
    assert metrics["failures_process_crash"] == 10 and metrics["expected_waste"] < metrics["durable_alone_waste"]


def test_the_manager_plans_both_tiers_when_both_are_adaptive(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ft_checkpoint")
    fast = str(tmp_path / "fast")
    with CheckpointManager(str(tmp_path / "two"), fast_dirpath=fast, fast_interval=5, announce=False) as two:
        assert two.tiers is None, "a fixed fast-tier interval: each tier its own policy"
    with CheckpointManager(str(tmp_path / "c"), fast_dirpath=fast, mtbf="2h", announce=False) as ckpt:
        assert ckpt.tiers is not None and ckpt.adaptive is None
        assert ckpt.describe_start().startswith(f"checkpoints go to {tmp_path}/c, multi-level adaptive intervals: the "
                                                "fast tier about every ")
        state = make()
        train_step(state)
        ckpt.save(1, state, block=True)
        metrics = ckpt.metrics()
    assert {"fast_interval_s", "durable_interval_s", "durable_every", "fast_cost_s", "durable_cost_s", "fast_mtbf_s",
            "durable_mtbf_s", "expected_waste", "durable_alone_waste", "failures_process_crash"} <= set(metrics)
    assert metrics["durable_interval_s"] == metrics["interval_s"] >= metrics["durable_s"]
    assert "tier intervals: fast" in caplog.text and f"d={metrics['durable_cost_s']:.3g} s durable" in caplog.text


def test_a_restart_records_which_failure_the_fast_tier_survived(tmp_path):
    """Attempts that crash (no clean end): the fast tier intact (a process crash), then every node's folder lost
    after the fast tier had a step (more), then a clean end; each resume records it, and the plan counts it."""
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    state, step = make(), 0
    for attempt in range(3):
        ckpt = CheckpointManager(url, fast_dirpath=fast, mtbf="2h", announce=False)
        start = ckpt.resume(state) or step
        for step in range(start + 1, start + 3):
            train_step(state)
            ckpt.save(step, state, block=True)
        if attempt == 2:
            assert ckpt.tiers is not None and (ckpt.tiers.counts, ckpt.tiers.failures) == ({CRASH: 1, NODE: 0, MORE: 1}, 2)
            ckpt.close()
            break
        ckpt.close(clean=False)  # a crash
        if attempt == 1:
            shutil.rmtree(fast)  # and the node's memory with it
    resumes = [e for e in read_journal(Storage(url)) if e["event"] == "resume"]
    assert [(e["failure_class"], e["tier"]) for e in resumes] == [(CRASH, "fast"), (NO_FAST_STEP, "durable")]
    assert resumes[1]["why"] == "no step of it is complete on the nodes of this job" and resumes[0]["why"] is None
    counts, failures, _ = class_counts(attempt_summaries(Storage(url)))
    assert (counts, failures) == ({CRASH: 1, NODE: 0, MORE: 1}, 2)


def test_each_tier_is_charged_its_own_saves_slowdown(tmp_path):
    """The slowdown of the steps while a save to the fast tier only is written is that save's cost (it used to
    go to the next durable save instead, and the fast tier's save cost was its stall alone)."""
    release = threading.Event()
    ckpt = CheckpointManager(str(tmp_path / "c"), interval=1000, fast_dirpath=str(tmp_path / "fast"),
                             fast_interval="adaptive", max_interval="1ms", mtbf="2h", announce=False)
    write = ckpt.fast.write
    ckpt.fast.write = lambda *args: release.wait(30) and write(*args)  # a slow node-local disk
    state = make()
    for step in range(1, 6):  # idle steps of 10 ms
        ckpt.note_step(step)
        time.sleep(0.01)
    assert ckpt.maybe_save(6, state) and not ckpt.last_save.durable, "a save to the fast tier only"
    for step in range(7, 10):  # three steps of 400 ms while it is written: about 1.2 s of slowdown
        time.sleep(0.4)
        ckpt.note_step(step)
    release.set()
    ckpt.wait()
    assert ckpt.fast.adaptive.cost > ckpt.last_save.stall + 0.5, "its stall and the slowdown while it was written"
    ckpt.close(final=False)

    durable = CheckpointManager(str(tmp_path / "d"), fast_dirpath=str(tmp_path / "fast2"), fast_interval=1,
                                mtbf="2h", announce=False)
    assert durable.adaptive is not None
    release.clear()
    write = durable.fast.write
    durable.fast.write = lambda *args: release.wait(30) and write(*args)
    for step in range(1, 6):
        durable.note_step(step)
        time.sleep(0.01)
    assert durable.maybe_save(6, state) and not durable.last_save.durable
    for step in range(7, 10):
        time.sleep(0.4)
        durable.note_step(step)
    release.set()
    durable.wait()
    stats = durable.save(10, state, block=True)  # durable: no step runs while it is written
    assert durable.adaptive.cost < stats.stall + 0.1, "the fast-tier save's slowdown is not this save's"
    durable.close()


def test_after_a_resume_from_the_fast_tier_the_durable_save_comes_as_planned(tmp_path):
    """The durable tier's interval counts from its newest step, across a restart that resumed from the fast tier: its
    next save comes with the first fast-tier save if that step is older than the interval (it came one interval
    after the restart, and a job that crashes more often than that never saved to the durable tier again)."""
    url, fast = str(tmp_path / "ckpt"), str(tmp_path / "fast")
    state = make()
    first = CheckpointManager(url, interval=1000, fast_dirpath=fast, fast_interval=1, announce=False)
    first.save(1, state, block=True)  # to both tiers
    time.sleep(3.5)
    for step in (2, 3):
        train_step(state)
        assert first.maybe_save(step, state) and not first.last_save.durable
    first.wait()
    first.close(clean=False)  # a crash, 3.5 s after the durable tier's newest step
    again = CheckpointManager(url, fast_dirpath=fast, max_interval="3s", announce=False)
    assert again.resume(state) == 3 and again.resumed_source == "fast tier, own node"
    assert again.tiers is not None and again.tiers.durable.seconds <= 3.0 + 1e-9
    train_step(state)
    assert again.maybe_save(4, state) and again.last_save.durable, "due: its newest durable step is 3.5 s old"
    again.close()


# -- the command line and the simulation --------------------------------------------------------
def test_plan_prints_each_tiers_interval_against_one_tier_and_fixed_intervals():
    args = ["plan", "--cost", "10m", "--fast-cost", "1s", "--crash-mtbf", "80m", "--node-mtbf", "4h", "--restart", "1m"]
    out = json.loads(cli(*args, "--fast-replicas", "0", "--json").stdout)
    rows = {r["name"]: r for r in out["plans"]}
    ours = rows["multi-level (ours)"]
    assert set(rows) == {"multi-level (ours)", "durable tier alone", "fast tier alone", "fixed 1m+1h", "fixed 1m+3h",
                         "fixed 10m+1h", "fixed 10m+3h"}
    assert all(ours["expected_waste"] <= r["expected_waste"] for r in rows.values())
    assert rows["fast tier alone"]["expected_waste"] == 1.0, "a node lost, without peer copies: the run is lost"
    assert ours["durable_interval_s"] == pytest.approx(ours["every"] * ours["fast_interval_s"])
    assert out["fast_tier_survives"] == [CRASH]
    with_copies = json.loads(cli(*args, "--json").stdout)
    assert with_copies["fast_tier_survives"] == [CRASH, NODE] and with_copies["plans"][0]["durable_interval_s"] is None
    text = cli(*args).stdout
    assert "survives a process crash (1 per 1.33 h) and one node lost (1 per 4 h)" in text
    assert re.search(r"multi-level \(ours\) +[\d.]+ min +never +[\d.]+%", text), text


@pytest.mark.parametrize("args,says", [
    (["--cost", "5m", "--crash-mtbf", "1h"], "go with --fast-cost"),
    (["--cost", "5m", "--fast-cost", "1s", "--mtbf", "1h"], "instead of --mtbf"),
    (["--cost", "5m", "--fast-cost", "1s"], "needs at least one failure class's MTBF"),
    (["--cost", "5m"], "--mtbf is required"),
])
def test_plan_says_what_a_job_with_two_tiers_needs(args, says):
    proc = cli("plan", *args)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and says in proc.stderr, proc.stderr
    assert "HINT:" in proc.stderr


def test_simulate_tiers_prints_its_cells_and_the_criteria():
    out = cli("simulate", "--tiers", "--mtbf", "1h", "--fast-cost", "1s", "--cost", "10m", "--mix", "75/25",
              "--seeds", "1", "--early-seeds", "20", "--work", "10").stdout
    head, row = out.splitlines()[1:3]
    assert head.split()[:4] == ["MTBF", "mix", "c", "d"] and head.split()[-6:] == \
        ["ratio", "ours>=5f", "oracle>=5f", "ratio", "single>=5f", "ratio"]
    cells = row.split()
    assert cells[:7] == ["1", "h", "75/25", "1", "s", "10", "min"]
    ours, fixed, ratio = map(float, cells[-8:-5])
    assert ratio == pytest.approx(ours / fixed, abs=2e-3)


def test_simulated_ours_learns_each_class_and_beats_the_durable_tier_alone():
    """A 1 h MTBF, 3 in 4 failures process crashes, a save of 1 s to the fast tier and of 10 min to the durable one
    (the full table, with more runs, is in the README)."""
    r = sim.simulate_tiers(HOUR, 1.0, 600.0, 0.75, seeds=3, early_seeds=100, work_mtbfs=40)
    assert sorted(r) == sorted(sim.POLICIES) and r["ours"]["failures"] >= 5
    assert r["ours"]["after"] <= 1.05 * r["oracle"]["after"], r
    assert r["ours"]["after"] < 0.8 * min(r["durable alone"]["after"], r["fast alone"]["after"]), r
