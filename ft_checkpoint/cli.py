"""The ``ft-checkpoint`` command line.

    ft-checkpoint plan --mtbf 6h --cost 5m [--restart 2m] [--json] [--plot waste.png]
    ft-checkpoint simulate [--mtbf 15m,1h,6h,1d,1w] [--cost 1s,10s,1m,10m] [--weibull 0.7] [--json]

Durations accept seconds or ``30s``, ``5m``, ``6h``, ``2d``, ``1w``.

Example:
    >>> main(["plan", "--mtbf", "6h", "--cost", "5m", "--json"])  # doctest: +ELLIPSIS
    {"cost_s": 300.0, ...}
    0
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ft_checkpoint import __version__
from ft_checkpoint.config import parse_duration


def duration(text: str) -> float:
    """argparse type: a duration in seconds (``1w`` allowed too)."""
    text = text.strip()
    if text.endswith("w") and text[:-1].replace(".", "", 1).isdigit():
        return float(text[:-1]) * 7 * 86400
    try:
        return parse_duration(float(text) if text.replace(".", "", 1).isdigit() else text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def durations(text: str) -> list[float]:
    """argparse type: comma-separated durations."""
    return [duration(t) for t in text.split(",") if t.strip()]


def human(seconds: float) -> str:
    """``5400`` -> ``'1.5 h'``; the unit that reads best."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def cmd_plan(args: argparse.Namespace) -> int:
    from ft_checkpoint.interval import daly_interval, expected_waste, young_interval

    d, m, r = args.cost, args.mtbf, args.restart
    rows = [("young", young_interval(d, m)), ("daly", daly_interval(d, m))]
    rows += [(f"every {human(t)}", t) for t in (900.0, 3600.0, 10800.0)]
    result = {"cost_s": d, "mtbf_s": m, "restart_s": r,
              "intervals": [{"name": n, "interval_s": t, "expected_waste": expected_waste(t, d, m, r)} for n, t in rows]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"checkpoint cost {human(d)}, MTBF {human(m)}, restart {human(r)}")
        print(f"{'interval':<14}{'length':>12}{'expected waste':>17}")
        for row in result["intervals"]:
            print(f"{row['name']:<14}{human(row['interval_s']):>12}{100 * row['expected_waste']:>16.2f}%")
    if args.plot:
        _plot(args.plot, d, m, r, daly_interval(d, m))
    return 0


def _plot(path: str, d: float, m: float, r: float, best: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'ft-checkpoint[plot]'") from None
    from ft_checkpoint.interval import expected_waste

    xs = [best * 10 ** (i / 50 - 1.2) for i in range(121)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([x / 60 for x in xs], [100 * expected_waste(x, d, m, r) for x in xs])
    ax.axvline(best / 60, linestyle="--", color="k")
    ax.annotate(f"Daly optimum {human(best)}", (best / 60, 100 * expected_waste(best, d, m, r)))
    ax.set(xscale="log", xlabel="checkpoint interval (min)", ylabel="expected waste (%)",
           title=f"cost {human(d)}, MTBF {human(m)}")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def cmd_simulate(args: argparse.Namespace) -> int:
    from ft_checkpoint.simulate import POLICIES, simulate_scenario

    rows = []
    for m in args.mtbf:
        for d in args.cost:
            r = simulate_scenario(m, d, restart=args.restart, seeds=args.seeds, work_mtbfs=args.work,
                                  shape=args.weibull, world_size=args.world_size)
            rows.append({"mtbf_s": m, "cost_s": d, "waste": r})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"wasted compute %, mean of {args.seeds} runs of {args.work:g} MTBFs of work each; "
          f"{'Weibull shape ' + str(args.weibull) if args.weibull else 'exponential'} failures; "
          f"ours learns from no history (prior: {args.world_size} GPUs at Llama 3's rate)")
    head = "".join(f"{p:>11}" for p in POLICIES)
    print(f"{'MTBF':>8}{'cost':>8}{head}{'ours<5f':>10}{'best fixed<5f':>15}{'ours>=5f':>10}{'oracle>=5f':>12}")
    for row in rows:
        w = row["waste"]
        best_fixed = min(w[p]["before"] for p in POLICIES if p.startswith("fixed"))
        cells = "".join(f"{100 * w[p]['all']:>11.2f}" for p in POLICIES)
        print(f"{human(row['mtbf_s']):>8}{human(row['cost_s']):>8}{cells}{100 * w['ours']['before']:>10.2f}"
              f"{100 * best_fixed:>15.2f}{100 * w['ours']['after']:>10.2f}{100 * w['oracle']['after']:>12.2f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="ft-checkpoint",
        description="Plan checkpoint intervals and inspect checkpoint directories (local paths or fsspec URLs).")
    parser.add_argument("--version", action="version", version=f"ft-checkpoint {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    plan = sub.add_parser("plan", help="Young's and Daly's optimal intervals and the expected waste")
    plan.add_argument("--mtbf", type=duration, required=True, help="mean time between failures, e.g. 6h")
    plan.add_argument("--cost", type=duration, required=True, help="what one checkpoint costs the training, e.g. 5m")
    plan.add_argument("--restart", type=duration, default=0.0, help="time to restart after a failure")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--plot", metavar="PNG", help="draw expected waste against interval (needs matplotlib)")
    plan.set_defaults(func=cmd_plan)

    sim = sub.add_parser("simulate", help="compare interval policies on a simulated job with failures")
    sim.add_argument("--mtbf", type=durations, default=durations("15m,1h,6h,1d,1w"))
    sim.add_argument("--cost", type=durations, default=durations("1s,10s,1m,10m"))
    sim.add_argument("--restart", type=duration, default=60.0)
    sim.add_argument("--weibull", type=float, default=None, metavar="SHAPE", help="Weibull failures (e.g. 0.7)")
    sim.add_argument("--seeds", type=int, default=3)
    sim.add_argument("--work", type=float, default=50.0, help="useful work per run, in MTBFs")
    sim.add_argument("--world-size", type=int, default=1024, help="GPUs, for ours' prior failure rate")
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    result: Any = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
