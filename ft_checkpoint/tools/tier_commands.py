"""``ft-checkpoint plan`` and ``simulate`` for a job with a fast tier: the multi-level plan (``--fast-cost``) and the
simulation of its cells (``simulate --tiers``). ``cli`` parses the common arguments and calls these.

Example:
    >>> from ft_checkpoint.tools.cli import main
    >>> main(["plan", "--cost", "10m", "--fast-cost", "1s", "--crash-mtbf", "80m", "--node-mtbf", "4h",
    ...       "--more-mtbf", "1w", "--restart", "1m"])
    fast tier: save cost 1 s, survives a process crash (1 per 1.33 h) and one node lost (1 per 4 h)
    durable tier: save cost 10 min, survives the rest too: more than one node lost (1 per 7 d)
    plan                    fast tier         durable tier   expected waste
    multi-level (ours)       1.37 min    7.59 h (1 in 332)            8.40%
    durable tier alone              -             28.2 min           48.19%
    fast tier alone           1.4 min                never          100.00%
    fixed 1m+1h                 1 min        1 h (1 in 60)           18.98%
    fixed 1m+3h                 1 min       3 h (1 in 180)           10.38%
    fixed 10m+1h               10 min         1 h (1 in 6)           24.88%
    fixed 10m+3h               10 min        3 h (1 in 18)           16.20%
    0
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from ft_checkpoint.errors import UsageError
from ft_checkpoint.units import human_seconds

CLASS_OPTIONS = {"crash_mtbf": "process crash", "node_mtbf": "one node lost", "more_mtbf": "more"}


def add_plan_arguments(plan: argparse.ArgumentParser, duration: Any, positive_duration: Any) -> None:
    """``plan``'s options for a job with a fast tier."""
    plan.add_argument("--fast-cost", type=positive_duration, default=None,
                      help="what one save to the fast tier costs the training, e.g. 1s: plans both tiers' intervals "
                           "(give each failure class's MTBF instead of --mtbf)")
    plan.add_argument("--crash-mtbf", type=positive_duration, default=None,
                      help="with --fast-cost: mean time between process crashes (the nodes survive), e.g. 2h")
    plan.add_argument("--node-mtbf", type=positive_duration, default=None,
                      help="with --fast-cost: mean time between losses of one node (its memory and disk), e.g. 8h")
    plan.add_argument("--more-mtbf", type=positive_duration, default=None,
                      help="with --fast-cost: mean time between failures that only the durable tier survives (two "
                           "adjacent nodes, every node), e.g. 1w")
    plan.add_argument("--fast-replicas", type=int, choices=(0, 1), default=1,
                      help="with --fast-cost: 1 (default) if the fast tier keeps a copy on the next node, so that it "
                           "survives the loss of one node; 0 if not (or on one node)")


def class_rates(args: argparse.Namespace) -> dict[str, float]:
    """``{class: failures per second}`` from ``--crash-mtbf``, ``--node-mtbf``, ``--more-mtbf``; UsageError when
    they do not go with the other options."""
    given = {cls: getattr(args, option) for option, cls in CLASS_OPTIONS.items() if getattr(args, option) is not None}
    if args.fast_cost is None:
        if given:
            raise UsageError("--crash-mtbf, --node-mtbf and --more-mtbf go with --fast-cost (a job with a fast "
                                 "tier). HINT: add --fast-cost, or give the job's --mtbf alone")
        return {}
    if args.mtbf is not None:
        raise UsageError("with --fast-cost, give each failure class's MTBF (--crash-mtbf, --node-mtbf, "
                             "--more-mtbf) instead of --mtbf. HINT: --crash-mtbf 8h --node-mtbf 1d for a job that "
                             "crashes every 8 h and loses a node every day")
    if not given:
        raise UsageError("--fast-cost needs at least one failure class's MTBF: --crash-mtbf, --node-mtbf or "
                             "--more-mtbf. HINT: --crash-mtbf 8h --node-mtbf 1d")
    return {cls: 1 / mtbf for cls, mtbf in given.items()}


def plan(args: argparse.Namespace) -> int:
    """``ft-checkpoint plan --fast-cost ...``: each tier's interval, and the waste against one tier and fixed ones."""
    from ft_checkpoint.policies.adaptive.classes import CRASH, NODE
    from ft_checkpoint.policies.adaptive.multilevel import pattern_waste, plan_tiers
    from ft_checkpoint.policies.adaptive.simulate_tiers import FIXED

    rates = class_rates(args)
    survives = {CRASH, NODE} if args.fast_replicas else {CRASH}
    fast_rate = sum(r for cls, r in rates.items() if cls in survives)
    durable_rate = sum(r for cls, r in rates.items() if cls not in survives)
    figures = {"fast_cost": args.fast_cost, "durable_cost": args.cost, "fast_rate": fast_rate,
               "durable_rate": durable_rate, "restart": args.restart}
    best = plan_tiers(**figures)
    rows = [("multi-level (ours)", best.fast_interval, best.every, best.expected_waste),
            ("durable tier alone", None, 1, best.durable_alone)]
    fast_alone = plan_tiers(**{**figures, "durable_rate": 0.0}) if fast_rate > 0 else None
    if fast_alone is not None:
        rows.append(("fast tier alone", fast_alone.fast_interval, None,
                     pattern_waste(fast_alone.fast_interval, None, **figures)))
    for name, (fast, durable) in FIXED.items():
        every = max(1, round(durable / fast))
        rows.append((f"fixed {name}", fast, every, pattern_waste(fast, every, **figures)))
    result = {"fast_cost_s": args.fast_cost, "durable_cost_s": args.cost, "restart_s": args.restart,
              "rates": rates, "fast_tier_survives": [c for c in rates if c in survives],
              "plans": [_row_json(name, fast, every, waste, best.durable_alone_interval) for name, fast, every, waste
                        in rows]}
    if args.json:
        print(json.dumps(result))
        return 0
    words = {"process crash": "a process crash", "more": "more than one node lost"}
    mtbf = {cls: f"{words.get(cls, cls)} (1 per {human_seconds(1 / r)})" for cls, r in rates.items()}
    print(f"fast tier: save cost {human_seconds(args.fast_cost)}, survives "
          f"{' and '.join(mtbf[c] for c in rates if c in survives) or 'none of the failures given'}")
    rest = ", ".join(mtbf[c] for c in rates if c not in survives)
    print(f"durable tier: save cost {human_seconds(args.cost)}, survives the rest too{': ' + rest if rest else ''}")
    print(f"{'plan':<22}{'fast tier':>11}{'durable tier':>21}{'expected waste':>17}")
    for row in result["plans"]:
        print(f"{row['name']:<22}{_fast_text(row):>11}{_durable_text(row):>21}{100 * row['expected_waste']:>16.2f}%")
    return 0


def _row_json(name: str, fast: float | None, every: int | None, waste: float, alone: float) -> dict[str, Any]:
    durable = alone if fast is None else math.inf if every is None else every * fast
    return {"name": name, "fast_interval_s": fast, "durable_interval_s": durable if math.isfinite(durable) else None,
            "every": every, "expected_waste": waste}


def _fast_text(row: dict[str, Any]) -> str:
    return "-" if row["fast_interval_s"] is None else human_seconds(row["fast_interval_s"])


def _durable_text(row: dict[str, Any]) -> str:
    if row["durable_interval_s"] is None:
        return "never"
    every = f" (1 in {row['every']})" if row["fast_interval_s"] is not None else ""
    return f"{human_seconds(row['durable_interval_s'])}{every}"


def mixes(text: str) -> list[float]:
    """argparse type: failure mixes as process crashes/nodes lost in percent (``75/25``), comma-separated; the share
    of crashes of each.

    Example:
        >>> mixes("100/0,75/25")
        [1.0, 0.75]
    """
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            crash, node = (float(x) for x in part.split("/"))
        except ValueError:
            crash = node = math.nan
        if not (0 <= crash <= 100 and 0 <= node <= 100 and abs(crash + node - 100) < 1e-9):
            raise argparse.ArgumentTypeError(f"{part!r} is not a mix: use process crashes/nodes lost in percent, "
                                             "adding up to 100, e.g. 75/25")
        out.append(crash / 100)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one mix, e.g. 100/0,75/25")
    return out


def add_simulate_arguments(sim: argparse.ArgumentParser, durations: Any) -> None:
    """``simulate``'s options for a job with a fast tier."""
    sim.add_argument("--tiers", action="store_true",
                     help="simulate a job with a fast tier (no peer copies) and a durable tier, under a mix of process "
                          "crashes and nodes lost, and compare the multi-level plan with fixed two-tier schedules "
                          "and either tier alone (default MTBFs 1h,6h,1d; costs 1m,10m)")
    sim.add_argument("--fast-cost", type=durations, default=None, metavar="COSTS",
                     help="with --tiers: what a save to the fast tier costs, comma-separated (default: 1s,10s)")
    sim.add_argument("--mix", type=mixes, default=None, metavar="MIXES",
                     help="with --tiers: failure mixes, process crashes/nodes lost in percent, comma-separated "
                          "(default: 100/0,75/25,50/50,0/100; 75/25 is DLRover's)")


TIER_DEFAULTS = {"mtbf": [3600.0, 21600.0, 86400.0], "cost": [60.0, 600.0], "fast_cost": [1.0, 10.0],
                 "mix": [1.0, 0.75, 0.5, 0.0], "early_seeds": 500, "seeds": 10}


def simulate(args: argparse.Namespace) -> int:
    """``ft-checkpoint simulate --tiers``: one row per MTBF, cost pair and mix, printed as soon as it is computed."""
    from ft_checkpoint.policies.adaptive.simulate_tiers import POLICIES, simulate_tiers

    for name, default in TIER_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if not args.json:
        failures = f"Weibull shape {args.weibull}" if args.weibull else "exponential"
        print(f"wasted compute %, mean of {args.seeds} runs of {args.work:g} MTBFs of work each (before the 5th failure: "
              f"of {args.early_seeds} runs); {failures} failures, a mix of process crashes (the fast tier survives them) "
              f"and nodes lost (the durable tier only); ours learns from no history (prior: {args.world_size} GPUs at "
              "Llama 3's rate, DLRover's shares)")
        head = "".join(f"{p.replace(' alone', ''):>8}" for p in POLICIES)
        print(f"{'MTBF':>8}{'mix':>7}{'c':>7}{'d':>8}{head}{'ours<5f':>9}{'fixed<5f':>9}{'ratio':>7}{'ours>=5f':>9}"
              f"{'oracle>=5f':>11}{'ratio':>7}{'single>=5f':>11}{'ratio':>7}", flush=True)
    rows = []
    for m in args.mtbf:
        for c in args.fast_cost:
            for d in args.cost:
                for crash in args.mix:  # each row printed as soon as it is computed
                    w = simulate_tiers(m, c, d, crash, restart=args.restart, seeds=args.seeds,
                                       early_seeds=args.early_seeds, work_mtbfs=args.work, shape=args.weibull,
                                       world_size=args.world_size)
                    rows.append({"mtbf_s": m, "fast_cost_s": c, "durable_cost_s": d, "crash_share": crash, "waste": w})
                    if not args.json:
                        print(_simulate_row(m, c, d, crash, w, POLICIES), flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


def _simulate_row(m: float, c: float, d: float, crash: float, w: dict[str, Any], policies: Any) -> str:
    fixed = min(w[p]["before"] for p in policies if "+" in p)
    single = min(w["durable alone"]["after"], w["fast alone"]["after"])
    ours, oracle = w["ours"], w["oracle"]
    mix = f"{100 * crash:.0f}/{100 - 100 * crash:.0f}"
    cells = "".join(f"{100 * w[p]['all']:>8.2f}" for p in policies)
    return (f"{human_seconds(m):>8}{mix:>7}{human_seconds(c):>7}{human_seconds(d):>8}{cells}{100 * ours['before']:>9.2f}"
            f"{100 * fixed:>9.2f}{ours['before'] / fixed:>7.3f}{100 * ours['after']:>9.2f}{100 * oracle['after']:>11.2f}"
            f"{ours['after'] / oracle['after']:>7.3f}{100 * single:>11.2f}{ours['after'] / single:>7.3f}")
