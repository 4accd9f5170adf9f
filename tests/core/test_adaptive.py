"""The adaptive interval: formulas, MTBF learning from journals, constraints, CLI and simulation."""

from __future__ import annotations

import json
import logging
import math
import random
import re
import statistics
import subprocess
import sys

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.policies.adaptive.failures import FailureModel, count_failures, prior_mtbf
from ft_checkpoint.policies.adaptive.interval import daly_interval, expected_waste, young_interval
from ft_checkpoint.policies.adaptive.policy import COST_GUESS, FIRST_SAVE_BY, AdaptiveInterval
from ft_checkpoint.policies.adaptive.simulate import POLICIES, _Fixed, _run, failure_times, simulate_scenario
from ft_checkpoint.policies.policy import SaveContext
from ft_checkpoint.run.journal import Journal, attempt_summaries
from ft_checkpoint.store.storage import Storage
from tests.helpers.toy import make

MIN, HOUR = 60.0, 3600.0


@pytest.mark.parametrize("mtbf,expected", [(24 * HOUR, 117), (6 * HOUR, 57), (15 * MIN, 9.1)])
def test_daly_2006_published_values(mtbf, expected):
    assert round(daly_interval(5 * MIN, mtbf) / MIN, 1 if expected < 10 else 0) == expected


def test_young_daly_and_waste():
    assert young_interval(5 * MIN, 6 * HOUR) == pytest.approx(HOUR)
    assert daly_interval(2 * HOUR, HOUR) == HOUR  # d >= 2M: tau = M
    d, m = 5 * MIN, 6 * HOUR
    best = daly_interval(d, m)
    for other in (best / 3, best * 3):
        assert expected_waste(other, d, m) > expected_waste(best, d, m)


def simulated_attempts(rng: random.Random, mtbf: float, failures: int) -> list[dict]:
    t, out = 0.0, []
    for _ in range(failures):
        life = rng.expovariate(1 / mtbf)
        out.append({"start": t, "end": t + life, "ended": False})
        t += life + 30.0
    out.append({"start": t, "end": t, "ended": False})  # the running attempt
    return out


def test_learned_mtbf_converges_on_simulated_journals():
    true = 2 * HOUR
    model = FailureModel(prior_mtbf=prior_mtbf(1024))  # a prior ~25x off
    errors = {n: [] for n in (20, 200)}
    for seed in range(20):
        for n in errors:
            attempts = simulated_attempts(random.Random(seed), true, n)
            failures, exposure = count_failures(attempts, now=attempts[-1]["start"])
            assert failures == n
            errors[n].append(abs(model.estimate(failures, exposure).mtbf / true - 1))
    assert statistics.median(errors[20]) < 0.20, errors[20]
    assert max(errors[200]) < 0.20, errors[200]


@pytest.mark.parametrize("failures,exposure", [(0, 60.0), (0, HOUR), (0, 100 * HOUR), (1, 0.1 * HOUR), (1, HOUR),
                                               (3, 3 * HOUR), (20, 40 * HOUR)])
def test_expected_rate_matches_quadrature(failures, exposure):
    model = FailureModel(prior_mtbf=prior_mtbf(1024))  # the widest prior: the hardest case for Laplace
    mu, sigma = -math.log(model.prior_mtbf), math.log(model.prior_spread)
    xs = [mu + sigma * (-12 + 24 * i / 20000) for i in range(20001)]
    ws = [math.exp(failures * x - math.exp(x) * exposure - (x - mu) ** 2 / (2 * sigma**2)) for x in xs]
    exact = sum(w * math.exp(x) for w, x in zip(ws, xs)) / sum(ws)
    assert model.estimate(failures, exposure).rate == pytest.approx(exact, rel=0.08)


def test_expected_rate_learns_from_survival_and_early_failures():
    model = FailureModel(prior_mtbf=prior_mtbf(1024))
    planned = lambda n, t: 1 / model.estimate(n, t).rate  # noqa: E731
    assert planned(0, 60.0) < planned(0, HOUR) < planned(0, 10 * HOUR) < planned(0, 100 * HOUR)
    assert planned(0, 60.0) < model.prior_mtbf / 5  # a wide prior: plan for its pessimistic side at first
    assert planned(1, 0.5 * HOUR) < 2 * HOUR  # one failure in the first half hour: strong evidence (prior: 49.5 h)
    assert planned(1, 48 * HOUR) > 20 * HOUR


def test_journal_attempts_count_failures_but_not_preemptions_or_clean_ends():
    s = Storage("memory://adaptive-journal")
    for i, (last, _ended) in enumerate([("commit", False), ("preempted", True), ("clean_end", True),
                                        ("commit", False), ("attempt_start", False)]):
        j = Journal(s, attempt=f"2026112{i}T000000.000000Z-a{i}")
        j.record("attempt_start")
        if last != "attempt_start":
            j.record(last)
    summaries = attempt_summaries(s)
    assert [a["ended"] for a in summaries] == [False, True, True, False, False]
    failures, _ = count_failures(summaries)
    assert failures == 2  # the crashed attempts 0 and 3; the last one is running


def test_constraints_min_max_durable_and_one_in_flight():
    p = AdaptiveInterval(mtbf="1h", min_interval="10m", max_interval="20m")
    p.observe_save(cost=0.01, durable=1.0)  # optimum ~ 27 s: raised to min_interval
    assert p.seconds == 600
    p = AdaptiveInterval(mtbf="1h", max_interval="20m")
    p.observe_save(cost=600.0, durable=1.0)  # optimum ~ 40 min: capped
    assert p.seconds == 1200
    p = AdaptiveInterval(mtbf="1h")
    p.observe_save(cost=0.01, durable=120.0)  # never shorter than a save takes to be durable
    assert p.seconds == 120
    assert not p.should_save(SaveContext(step=5, now=1e6, last_save_time=0.0, save_in_flight=True))
    assert p.should_save(SaveContext(step=5, now=1e6, last_save_time=0.0))


def test_interval_lengthens_with_exposure_and_shortens_after_failures():
    now = [0.0]
    p = AdaptiveInterval(world_size=1024, clock=lambda: now[0])
    guess = p.seconds  # the first save, planned with a guessed cost, measures it
    assert p.last_decision["cost_s"] == COST_GUESS and guess == daly_interval(COST_GUESS, p.last_decision["mtbf_s"])
    assert 10 * MIN < guess < 30 * MIN  # the prior's expected MTBF of a young 1024-GPU job: ~3.5 h
    p.observe_save(cost=60.0, durable=30.0)
    first = p.seconds
    now[0] = 10 * HOUR
    p.observe_save(cost=60.0, durable=30.0)
    survived = p.seconds
    assert survived > 3 * first  # ten hours without a failure: failures are rarer than feared at first
    p.observe_history(failures=3, exposure=10 * HOUR)
    assert p.seconds < survived / 3
    assert p.seconds == pytest.approx(daly_interval(60.0, p.last_decision["mtbf_s"]))
    resumed = AdaptiveInterval(world_size=1024, clock=lambda: now[0])
    resumed.observe_history(failures=3, exposure=10 * HOUR, cost=60.0)  # cost known: no probe save
    assert resumed.seconds == p.seconds


def test_manager_defaults_to_adaptive_and_explains_itself(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ft_checkpoint")
    with CheckpointManager(str(tmp_path / "c"), mtbf="2h") as ckpt:
        assert ckpt.adaptive is not None and ckpt.policy.deterministic is False
        state = make()
        ckpt.save(1, state, block=True)
        metrics = ckpt.metrics()
    assert {"interval_s", "mtbf_s", "cost_s", "expected_waste", "stall_s", "durable_s", "bytes"} <= set(metrics)
    assert metrics["interval_s"] >= metrics["durable_s"]
    assert re.search(r"checkpoint interval [\d.]+ s -> [\d.]+ s: save cost d=0\.\d+ s, MTBF M=", caplog.text)
    assert "expected waste" in caplog.text


def test_a_restarted_job_keeps_the_measured_save_cost(tmp_path):
    """The cost a save measured is in the journal: the next attempt plans with it, not with the guess."""
    url = str(tmp_path / "c")
    with CheckpointManager(url, mtbf="2h") as ckpt:
        ckpt.save(1, make(), block=True)
        cost = ckpt.adaptive.cost
    assert cost is not None
    with CheckpointManager(url, mtbf="2h") as again:
        assert again.adaptive.cost == cost and again.adaptive.last_decision["cost_s"] == cost != COST_GUESS


def test_cli_plan_reproduces_daly():
    out = subprocess.run([sys.executable, "-m", "ft_checkpoint.tools.cli", "plan", "--mtbf", "15m", "--cost", "5m",
                          "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["name"]: r for r in json.loads(out)["intervals"]}
    assert round(rows["daly"]["interval_s"] / MIN, 1) == 9.1
    assert {"young", "every 15 min", "every 1 h", "every 3 h"} <= set(rows)
    text = subprocess.run([sys.executable, "-m", "ft_checkpoint.tools.cli", "plan", "--mtbf", "1d", "--cost", "30s"],
                          capture_output=True, text=True, check=True).stdout
    assert "daly" in text and "expected waste" in text


def naive_run(interval, failures, *, work, cost, restart):
    """The reference the simulation's leaps must agree with: one segment at a time."""
    t = done = 0.0
    next_failure = next(failures)
    while done < work:
        end = t + min(interval, work - done) + cost
        if end <= next_failure:
            t, done = end, done + min(interval, work - done)
            continue
        t = next_failure + restart
        while next_failure < t:  # failures during the restart restart it again
            next_failure = next(failures)
            if next_failure < t:
                t = next_failure + restart
    return 1 - work / t


@pytest.mark.parametrize("mtbf,cost,interval", [(HOUR, 10.0, 900.0), (6 * HOUR, 600.0, 3 * HOUR), (HOUR, 60.0, 123.4)])
def test_simulation_leaps_agree_with_one_segment_at_a_time(mtbf, cost, interval):
    for seed in range(3):
        fast = _run(_Fixed(interval), failure_times(random.Random(seed), mtbf), work=20 * mtbf, cost=cost, restart=60.0)
        slow = naive_run(interval, failure_times(random.Random(seed), mtbf), work=20 * mtbf, cost=cost, restart=60.0)
        assert fast["all"] == pytest.approx(slow, rel=1e-9)


@pytest.mark.parametrize("mtbf,cost", [(HOUR, 1.0), (6 * HOUR, 60.0)])
def test_simulation_ours_close_to_oracle_once_learned_and_to_best_fixed_before(mtbf, cost):
    r = simulate_scenario(mtbf, cost, seeds=3, early_seeds=300, work_mtbfs=40)
    assert sorted(r) == sorted(POLICIES)
    assert r["ours"]["failures"] >= 5
    assert r["ours"]["after"] <= 1.05 * r["oracle"]["after"], r
    fixed = [p for p in POLICIES if p.startswith("fixed")]
    assert r["ours"]["before"] <= 1.10 * min(r[p]["before"] for p in fixed), r
    assert r["ours"]["all"] <= 1.10 * min(r[p]["all"] for p in fixed), r


def test_cli_simulate_prints_the_criteria():
    out = subprocess.run([sys.executable, "-m", "ft_checkpoint.tools.cli", "simulate", "--mtbf", "1h", "--cost", "1m",
                          "--seeds", "1", "--early-seeds", "20", "--work", "10"], capture_output=True, text=True,
                         check=True).stdout
    head, row = out.splitlines()[1:3]
    assert head.split()[-7:] == ["ours<5f", "best", "fixed<5f", "ratio", "ours>=5f", "oracle>=5f", "ratio"]
    cells = row.split()
    assert cells[:4] == ["1", "h", "1", "min"]
    ours, best, ratio = map(float, cells[-6:-3])
    assert ratio == pytest.approx(ours / best, abs=2e-3)


def test_the_first_save_of_a_small_job_comes_within_half_an_hour():
    """One GPU at Llama 3's rate: a prior MTBF of years. Planned with the guessed minute the interval
    would be hours; until a save has measured the cost it is at most ``FIRST_SAVE_BY``."""
    p = AdaptiveInterval(world_size=1)
    assert daly_interval(COST_GUESS, p.last_decision["mtbf_s"]) > 5 * HOUR
    assert p.seconds == FIRST_SAVE_BY == 30 * MIN
    p.observe_save(cost=0.1, durable=0.5)  # a cheap save: planned with the measured cost, uncapped
    assert p.seconds == pytest.approx(daly_interval(0.1, p.last_decision["mtbf_s"]))
    assert AdaptiveInterval(world_size=1, min_interval="1h").seconds == HOUR  # the user's bounds still win
