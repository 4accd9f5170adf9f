"""The adaptive interval: formulas, MTBF learning from journals, constraints, CLI and simulation."""

from __future__ import annotations

import json
import logging
import random
import statistics
import subprocess
import sys

import pytest

from ft_checkpoint import CheckpointManager
from ft_checkpoint.failures import FailureModel, count_failures, prior_mtbf
from ft_checkpoint.interval import bayes_interval, daly_interval, expected_waste, young_interval
from ft_checkpoint.journal import Journal, attempt_summaries
from ft_checkpoint.policy import AdaptiveInterval, SaveContext
from ft_checkpoint.simulate import simulate_scenario
from ft_checkpoint.storage import Storage
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
    assert bayes_interval(d, [m], [1.0]) == pytest.approx(best, rel=0.05)


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


def test_journal_attempts_count_failures_but_not_preemptions_or_clean_ends():
    s = Storage("memory://adaptive-journal")
    for i, (last, ended) in enumerate([("commit", False), ("preempted", True), ("clean_end", True),
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


def test_manager_defaults_to_adaptive_and_explains_itself(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ft_checkpoint")
    with CheckpointManager(str(tmp_path / "c"), mtbf="2h") as ckpt:
        assert ckpt.adaptive is not None and ckpt.policy.deterministic is False
        state = make()
        ckpt.save(1, state, block=True)
        metrics = ckpt.metrics()
    assert {"interval_s", "mtbf_s", "cost_s", "expected_waste", "stall_s", "durable_s", "bytes"} <= set(metrics)
    assert metrics["interval_s"] >= metrics["durable_s"]
    assert "checkpoint interval 60 s ->" in caplog.text and "MTBF M=" in caplog.text
    assert "expected waste" in caplog.text


def test_cli_plan_reproduces_daly():
    out = subprocess.run([sys.executable, "-m", "ft_checkpoint.cli", "plan", "--mtbf", "15m", "--cost", "5m",
                          "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["name"]: r for r in json.loads(out)["intervals"]}
    assert round(rows["daly"]["interval_s"] / MIN, 1) == 9.1
    assert {"young", "every 15 min", "every 1 h", "every 3 h"} <= set(rows)
    text = subprocess.run([sys.executable, "-m", "ft_checkpoint.cli", "plan", "--mtbf", "1d", "--cost", "30s"],
                          capture_output=True, text=True, check=True).stdout
    assert "daly" in text and "expected waste" in text


@pytest.mark.parametrize("mtbf,cost", [(HOUR, 1.0), (6 * HOUR, 60.0)])
def test_simulation_ours_close_to_oracle_once_learned(mtbf, cost):
    r = simulate_scenario(mtbf, cost, seeds=3, work_mtbfs=40)
    assert r["ours"]["failures"] >= 5
    assert r["ours"]["after"] <= 1.05 * r["oracle"]["after"], r
    assert r["ours"]["all"] < min(r[p]["all"] for p in ("fixed 15m", "fixed 1h", "fixed 3h")) * 1.10
