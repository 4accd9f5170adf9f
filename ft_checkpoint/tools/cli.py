"""The ``ft-checkpoint`` command line.

    ft-checkpoint plan --mtbf 6h --cost 5m [--restart 2m] [--json] [--plot waste.png]
    ft-checkpoint plan --cost 10m --fast-cost 1s --crash-mtbf 8h [--node-mtbf 1d] [--more-mtbf 1w] [--fast-replicas 0]
    ft-checkpoint simulate [--mtbf 15m,1h,6h,1d,1w] [--cost 1s,10s,1m,10m] [--weibull 0.7] [--json]
    ft-checkpoint simulate --tiers [--mtbf 1h,6h,1d] [--fast-cost 1s,10s] [--cost 1m,10m] [--mix 100/0,75/25]
    ft-checkpoint ls DIR [--fast FAST_DIRPATH] [--json] [--key-file PATH] [--run-name NAME]
    ft-checkpoint verify DIR [--step N | --all] [--json] [--key-file PATH] [--run-name NAME]
    ft-checkpoint inspect DIR [--step N] [--json] [--key-file PATH] [--run-name NAME]
    ft-checkpoint gc DIR --keep N [--keep-every M|0] [--dry-run] [--json] [--key-file PATH] [--run-name NAME]
    ft-checkpoint report DIR [--plot timeline.png] [--json]

Durations are read as the commands print them: ``90`` (seconds), ``30s``, ``15 min``, ``56.7 min``, ``1h30m``,
``2d``. ``DIR`` is a local path or an
fsspec URL (``gs://bucket/run``); storage options (credentials, endpoint) come from
``FT_CHECKPOINT_STORAGE_OPTIONS`` (a JSON object) or the file named by ``FT_CHECKPOINT_CONFIG``, like the
training's; without ``DIR``, ``FT_CHECKPOINT_DIRPATH``. A signing key (``--key-file``, or the training's:
``FT_CHECKPOINT_SIGNING_KEY``, ``FT_CHECKPOINT_SIGNING_KEY_FILE``, the config file) makes ``ls``, ``verify``,
``inspect`` and ``gc`` check signatures as a resume does. The logic lives in ``ft_checkpoint.tools.catalog`` and
``ft_checkpoint.tools.goodput``; this module parses arguments and prints. Exit codes: 0 ok; 1 ``verify``
found a problem; 2 a usage, configuration or storage error, or a file that cannot be read: always one
line ``ft-checkpoint COMMAND: error: ...`` on stderr, never a traceback (``FT_CHECKPOINT_DEBUG=1``
shows the traceback of an unexpected error). Warnings (such as journal files skipped as unreadable)
go to stderr as ``ft-checkpoint: warning: ...``.

Example:
    >>> main(["plan", "--mtbf", "6h", "--cost", "5m", "--json"])  # doctest: +ELLIPSIS
    {"cost_s": 300.0, ...}
    0
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ft_checkpoint._version import __version__
from ft_checkpoint.errors import FTCheckpointError, UsageError
from ft_checkpoint.progress import Progress
from ft_checkpoint.units import DURATION_EXAMPLES, human_bytes, human_seconds, parse_duration, plural, printable, short

if TYPE_CHECKING:
    from ft_checkpoint.config import CheckpointConfig
    from ft_checkpoint.format.layout import StepCheck
    from ft_checkpoint.format.signing import Signer
    from ft_checkpoint.store.storage import Storage

log = logging.getLogger("ft_checkpoint.tools.cli")  # not __name__: "__main__" under python -m


MAX_SECONDS = 100 * 365.25 * 86400
"""The longest duration the commands take (100 years): longer is a typo, and overflows the arithmetic."""


def duration(text: str) -> float:
    """argparse type: a duration as the commands print them (``90``, ``15 min``, ``1h30m``, ...; a bare number is
    seconds), finite and at most 100 years.

    Example:
        >>> duration("15 min"), duration("1h30m"), duration("56.7 min")
        (900.0, 5400.0, 3402.0)
    """
    text = text.strip()
    try:
        seconds = parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{short(text)} is not a duration: use e.g. {DURATION_EXAMPLES} (a number "
                                         "without a unit is seconds)") from None
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{short(text)}: use a duration of at most 100 years")
    return seconds


def positive_duration(text: str) -> float:
    """argparse type: a duration > 0."""
    seconds = duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{short(text)}: must be longer than 0")
    return seconds


def durations(text: str) -> list[float]:
    """argparse type: comma-separated durations, each > 0 (at least one)."""
    out = [positive_duration(t) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"{short(text)}: give at least one duration, e.g. 1h,6h")
    return out


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{short(text)}: use a finite number > 0")
    return value


MAX_WORK = 1000.0
"""The most work ``simulate`` gives a run, in MTBFs (20 times the default; a ``--tiers`` run of it takes seconds)."""
MAX_RUNS = 10_000
"""The most simulated runs per row of ``simulate`` (``--seeds``); ``--early-seeds`` runs, which stop at the 5th
failure, up to ``MAX_EARLY_RUNS``. Each run takes time: more would make a row take hours."""
MAX_EARLY_RUNS = 100_000


def work_mtbfs(text: str) -> float:
    """argparse type: the useful work of a simulated run, in MTBFs: a number > 0, at most ``MAX_WORK``."""
    value = positive_number(text)
    if value > MAX_WORK:
        raise argparse.ArgumentTypeError(f"{short(text)}: use a number > 0 and at most {MAX_WORK:g} (MTBFs of work "
                                         "per run: a run takes longer the more work it has)")
    return value


def simulated_runs(text: str) -> int:
    """argparse type: a number of simulated runs per row, from 1 to ``MAX_RUNS``."""
    return positive(text, maximum=MAX_RUNS)


def early_runs(text: str) -> int:
    """argparse type: a number of simulated runs per row that stop at the 5th failure, from 1 to ``MAX_EARLY_RUNS``."""
    return positive(text, maximum=MAX_EARLY_RUNS)


def cmd_plan(args: argparse.Namespace) -> int:
    with _arithmetic("plan"):
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    from ft_checkpoint.policies.adaptive.interval import daly_interval, expected_waste, young_interval
    from ft_checkpoint.tools import tier_commands

    rates = tier_commands.class_rates(args)
    if rates:
        warn_nonsense([1 / r for r in rates.values()], [args.cost, args.fast_cost], args.restart)
        return tier_commands.plan(args)
    if args.mtbf is None:
        raise UsageError("--mtbf is required (or --fast-cost with each failure class's MTBF, for a job with a fast "
                         "tier). HINT: --mtbf 6h --cost 5m")

    d, m, r = args.cost, args.mtbf, args.restart
    rows = [("young", young_interval(d, m)), ("daly", daly_interval(d, m))]
    rows += [(f"every {human_seconds(t)}", t) for t in (900.0, 3600.0, 10800.0)]
    result = {"cost_s": d, "mtbf_s": m, "restart_s": r,
              "intervals": [{"name": n, "interval_s": t, "expected_waste": expected_waste(t, d, m, r)} for n, t in rows]}
    warn_nonsense([m], [d], r)  # once the figures could be computed
    if args.json:
        print(json.dumps(result))
    else:
        print(f"checkpoint cost {human_seconds(d)}, MTBF {human_seconds(m)}, restart {human_seconds(r)}")
        print(f"{'interval':<14}{'length':>12}{'expected waste':>17}")
        for row in result["intervals"]:
            print(f"{row['name']:<14}{human_seconds(row['interval_s']):>12}{100 * row['expected_waste']:>16.2f}%")
    if args.plot:
        _plot(args.plot, d, m, r, daly_interval(d, m))
    return 0


def _plot(path: str, d: float, m: float, r: float, best: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UsageError(f"--plot needs matplotlib ({e}). HINT: pip install 'ft-checkpoint[plot]'") from None
    from ft_checkpoint.policies.adaptive.interval import expected_waste

    xs = [best * 10 ** (i / 50 - 1.2) for i in range(121)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([x / 60 for x in xs], [100 * expected_waste(x, d, m, r) for x in xs])
    ax.axvline(best / 60, linestyle="--", color="k")
    ax.annotate(f"Daly optimum {human_seconds(best)}", (best / 60, 100 * expected_waste(best, d, m, r)))
    ax.set(xscale="log", xlabel="checkpoint interval (min)", ylabel="expected waste (%)",
           title=f"cost {human_seconds(d)}, MTBF {human_seconds(m)}")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


SHORT_MTBF = 60.0
"""An MTBF below this (seconds) is not a training job's: most likely a number given without its unit."""


def nonsense(mtbfs: list[float], costs: list[float], restart: float) -> list[str]:
    """What makes no sense in these inputs (each a sentence with a HINT), or nothing.

    Example:
        >>> nonsense([6.0], [300.0], 0.0)[0][:58]
        'an MTBF of 6 s: a failure every few seconds (a number with'
        >>> nonsense([6 * 3600.0], [7 * 3600.0], 0.0)[0][:63]
        'a checkpoint that costs 7 h against an MTBF of 6 h: most failur'
        >>> nonsense([6 * 3600.0], [300.0], 120.0)
        []
    """
    out = [f"an MTBF of {human_seconds(m)}: a failure every few seconds (a number without a unit is seconds). "
           f"HINT: give the unit, e.g. --mtbf {m:g}h" for m in sorted(set(mtbfs)) if m < SHORT_MTBF]
    worst = min(mtbfs)
    out += [f"a checkpoint that costs {human_seconds(d)} against an MTBF of {human_seconds(worst)}: most failures come "
            "before a checkpoint completes, so no interval helps and the figures mean little. HINT: --cost is what one "
            "save costs the training, --mtbf the mean time between failures of the whole job"
            for d in sorted(set(costs)) if d >= worst]
    if restart >= worst:
        out.append(f"a restart of {human_seconds(restart)} against an MTBF of {human_seconds(worst)}: the job fails "
                   "again before it has restarted. HINT: --restart is the time from a failure to training again")
    return out


def warn_nonsense(mtbfs: list[float], costs: list[float], restart: float) -> None:
    """Warn (stderr) about each input that makes no sense; the command still prints its figures."""
    for text in nonsense(mtbfs, costs, restart):
        log.warning("%s", text)


def cmd_simulate(args: argparse.Namespace) -> int:
    with _arithmetic("simulate"):
        return _simulate(args)


class _arithmetic:
    """Turns an overflow (or a math domain error) of numbers the arguments allow into a UsageError."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, e: BaseException | None, tb: Any) -> None:
        if isinstance(e, ArithmeticError) or (isinstance(e, ValueError) and not isinstance(e, FTCheckpointError)):
            raise UsageError(f"cannot compute with these numbers ({type(e).__name__}: {e}). HINT: give durations of "
                             f"the same order as a real job's ('ft-checkpoint {self.command} --help')") from e


def _simulate(args: argparse.Namespace) -> int:
    from ft_checkpoint.policies.adaptive.simulate import POLICIES, simulate_scenario
    from ft_checkpoint.tools import tier_commands

    if args.tiers:
        tiers = {**tier_commands.TIER_DEFAULTS, **{k: v for k, v in vars(args).items() if v is not None}}
        warn_nonsense(tiers["mtbf"], tiers["cost"] + tiers["fast_cost"], args.restart)
        return tier_commands.simulate(args)
    if args.fast_cost is not None or args.mix is not None:
        raise UsageError("--fast-cost and --mix go with --tiers. HINT: ft-checkpoint simulate --tiers --mix 75/25")
    args.mtbf, args.cost = args.mtbf or SIMULATE_MTBFS, args.cost or SIMULATE_COSTS
    args.seeds, args.early_seeds = args.seeds or 20, args.early_seeds or 3000
    warn_nonsense(args.mtbf, args.cost, args.restart)
    if not args.json:
        failures = f"Weibull shape {args.weibull}" if args.weibull else "exponential"
        print(f"wasted compute %, mean of {args.seeds} runs of {args.work:g} MTBFs of work each (before the 5th "
              f"failure: of {args.early_seeds} runs); {failures} failures; ours learns from no history (prior: "
              f"{args.world_size} GPUs at Llama 3's rate)")
        head = "".join(f"{p:>11}" for p in POLICIES)
        print(f"{'MTBF':>8}{'cost':>8}{head}{'ours<5f':>10}{'best fixed<5f':>15}{'ratio':>7}"
              f"{'ours>=5f':>10}{'oracle>=5f':>12}{'ratio':>7}", flush=True)
    rows = []
    for m in args.mtbf:
        for d in args.cost:  # each row printed as soon as it is computed
            r = simulate_scenario(m, d, restart=args.restart, seeds=args.seeds, early_seeds=args.early_seeds,
                                  work_mtbfs=args.work, shape=args.weibull, world_size=args.world_size)
            rows.append({"mtbf_s": m, "cost_s": d, "waste": r})
            if not args.json:
                print(_simulate_row(m, d, r, POLICIES), flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


def _simulate_row(m: float, d: float, w: dict[str, Any], policies: Any) -> str:
    best_fixed = min(w[p]["before"] for p in policies if p.startswith("fixed"))
    cells = "".join(f"{100 * w[p]['all']:>11.2f}" for p in policies)
    ours, oracle = w["ours"], w["oracle"]
    return (f"{human_seconds(m):>8}{human_seconds(d):>8}{cells}{100 * ours['before']:>10.2f}"
            f"{100 * best_fixed:>15.2f}{ours['before'] / best_fixed:>7.3f}{100 * ours['after']:>10.2f}"
            f"{100 * oracle['after']:>12.2f}{ours['after'] / oracle['after']:>7.3f}")


# -- checkpoint directories ----------------------------------------------------------------------
def utc(t: float | None) -> str:
    """An epoch time as ``2026-11-29 12:00:01Z`` (``-`` for None); a number no calendar holds says so.

    Example:
        >>> utc(1795910400), utc(1e300)
        ('2026-11-29 00:00:00Z', '1e+300 (not a date)')
    """
    if t is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))
    except (OverflowError, OSError, ValueError):  # a manifest's time is any finite number
        return f"{t:g} (not a date)"


def training_config(args: argparse.Namespace) -> CheckpointConfig:
    """The training's configuration (``FT_CHECKPOINT_*`` and its config file), read once per command."""
    from ft_checkpoint.errors import ConfigError

    if getattr(args, "training_config", None) is None:
        try:
            args.training_config = _read_training_config(args)
        except ConfigError as e:
            raise ConfigError(f"in the training's configuration (FT_CHECKPOINT_* environment variables, the file "
                              f"FT_CHECKPOINT_CONFIG names), which 'ft-checkpoint {args.command}' reads too: {e}") \
                from None
    config: CheckpointConfig = args.training_config
    return config


def _read_training_config(args: argparse.Namespace) -> CheckpointConfig:
    """``CheckpointConfig.from_env()``; with DIR given, a bad training ``dirpath`` (not used then) is let pass."""
    from ft_checkpoint.config import CheckpointConfig
    from ft_checkpoint.errors import ConfigError

    try:
        return CheckpointConfig.from_env()
    except ConfigError as e:
        if not (getattr(args, "dir", None) and str(e).startswith("dirpath=")):
            raise
        return CheckpointConfig.from_env(dirpath=os.sep)  # DIR is checked by open_storage


def open_storage(args: argparse.Namespace) -> Storage:
    """The checkpoint directory ``args.dir`` (or the training's ``dirpath``), with the training's storage options."""
    from ft_checkpoint.config import refuse_careless_text
    from ft_checkpoint.errors import ConfigError
    from ft_checkpoint.store.storage import Storage
    from ft_checkpoint.tools.catalog import require_directory

    if args.dir:  # as a dirpath is checked: an end space, quotes or a variable nobody expanded name another directory
        refuse_careless_text("DIR", args.dir)
    config = training_config(args)
    url = args.dir or config.dirpath
    if not url:
        raise ConfigError("no checkpoint directory given: pass DIR (a local path or a URL such as "
                          "gs://bucket/run) or set FT_CHECKPOINT_DIRPATH")
    if url.lower().startswith("memory:"):
        raise UsageError(f"{url} is in the memory of the process that wrote it: no other process, this command neither, "
                         "can see it. HINT: give the training a local path or an object store's URL")
    storage = Storage(url, config.storage_options, retries=config.retries)
    require_directory(storage)
    return storage


def open_signer(args: argparse.Namespace, storage: Storage) -> Signer | None:
    """The signer of ``--key-file`` (else the training's key: env or config file) and ``--run-name`` (else the
    training's, else the directory's URL); None without a key."""
    from ft_checkpoint.format.signing import Signer

    config = training_config(args)
    if args.key_file is not None:  # the option wins over a key in the environment
        config = config.replace(signing_key=None, signing_key_file=args.key_file)
    if args.run_name is not None:
        config = config.replace(run_name=args.run_name)
    return Signer.from_config(config, storage.url)


def table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """Aligned columns, two spaces apart; ``align`` has one ``<`` or ``>`` per column.

    Example:
        >>> table(["step", "status"], [["10", "committed"]], "><")
        ['step  status', '  10  committed']
    """
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths, strict=True)).rstrip()
            for row in [header, *rows]]


def emit(args: argparse.Namespace, data: Any, lines: list[str]) -> None:
    """Print ``data`` as JSON with ``--json``, else the human ``lines`` (control characters escaped: names and
    versions come from files anyone who can write the directory may have forged)."""
    try:
        print(json.dumps(data) if args.json else "\n".join(printable(line) for line in lines), flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:  # stdout on a full disk, say: not "a file in the directory may be damaged"
        deleted = args.command == "gc" and not args.dry_run
        done = " (gc: its deletions are done; 'ft-checkpoint ls' shows what is left)" if deleted else ""
        raise UsageError(f"cannot write the output to stdout ({type(e).__name__}: {e}); the command itself ran to its "
                         f"end{done}. HINT: check where the output goes (a full disk?)") from None


def cmd_ls(args: argparse.Namespace) -> int:
    from ft_checkpoint.tools.catalog import UNVERIFIED, fast_tier_steps, list_checkpoints

    storage = open_storage(args)
    if args.fast and not os.path.isdir(args.fast):
        raise UsageError(f"--fast {args.fast}: {'not a directory' if os.path.exists(args.fast) else 'no such directory'}. "
                         "HINT: pass the job's fast_dirpath on this node (such as /dev/shm/ft)")
    signer = open_signer(args, storage)
    listing = list_checkpoints(storage, signer=signer)
    fast = fast_tier_steps(listing.url, args.fast) if args.fast else {}
    newest = listing.resume_step
    signed = " with a signature that verifies" if signer is not None else ""
    pick = f"newest committed{signed}: step {newest} (a resume tries it first)" if newest is not None else \
        "no committed step: a resume would start fresh"
    refused = listing.resume_step is None and any(i.status == UNVERIFIED for i in listing.steps)
    if refused:  # so does the resume, whatever the fast tier holds
        pick = "no step verifies with the key: a resume would stop with an error (the key or run name may be wrong)"
    newer_fast = [s for s, held in fast.items() if held["committed"] and (newest is None or s > newest)]
    if newer_fast and not refused:  # the resume's first choice: the footer says on what condition
        pick = (f"newest committed{signed} here: {'none' if newest is None else f'step {newest}'}; a resume tries the "
                f"fast tier's step {max(newer_fast)} first (below)")
    lines = [f"{listing.url}: {plural(len(listing.steps), 'step directory', 'step directories')}; {pick}"]
    if not listing.steps and not fast:
        from ft_checkpoint.format.layout import checkpoint_dirs_below

        lines += [f"HINT: checkpoints are in {url}: 'ft-checkpoint ls {url}'" for url in checkpoint_dirs_below(storage)]
    rows = {i.step: [str(i.step), i.status, utc(i.time), human_bytes(i.bytes), str(i.files),
                     "-" if i.world_size is None else str(i.world_size), "durable",
                     "<- newest committed" if i.step == newest else i.reason or ""] for i in listing.steps}
    for step, held in fast.items():
        what = f"fast ({plural(len(held['ranks']), 'rank')} here{'' if held['committed'] else ', not committed'})"
        if step in rows and rows[step][1] == "committed":
            rows[step][6] = f"durable, {what}"
        else:
            rows[step] = [str(step), "committed" if held["committed"] else "partial", "-", human_bytes(held["bytes"]),
                          "-", "-", what, ""]
    if rows:
        header = ["step", "status", "saved (UTC)", "size", "files", "world", "tiers", ""]
        table_rows = [rows[s] if args.fast else rows[s][:6] + rows[s][7:] for s in sorted(rows)]
        lines += table(header if args.fast else header[:6] + header[7:], table_rows, "><<>>><<" if args.fast else "><<>>><")
    if fast:
        top = max(fast)
        lines.append(f"this node's fast tier ({args.fast}) holds step {top}, which a resume takes if every rank's "
                     f"part is on some node: 'ft-checkpoint inspect {fast[top]['folders'][0]} --step {top}' shows one")
    if newest is not None:
        checked = "sizes and signatures" if signer is not None else "sizes"
        lines.append(f"({checked} checked, not checksums: a resume loads step {newest} only if its checksums match, "
                     f"else it falls back to the previous step; 'ft-checkpoint verify {args.dir or listing.url}' checks them)")
    emit(args, {**listing.to_dict(), "fast": {str(k): v for k, v in fast.items()}}, lines)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import ft_checkpoint.state  # noqa: F401 - torch, for the rank files: imported before the listing and the progress
    from ft_checkpoint.tools.catalog import PARTIAL, check_step, list_checkpoints, select_steps

    storage = open_storage(args)
    signer = open_signer(args, storage)
    listing = list_checkpoints(storage, signer=signer)
    steps = select_steps(listing, step=args.step, all_steps=args.all)
    require_step(args, listing)
    if not steps:
        emit(args, {"url": storage.url, "ok": False, "steps": []},
             [f"{storage.url}: no committed step to verify (a resume would start fresh)"])
        return 1
    sizes = {i.step: i.bytes for i in listing.steps}
    listed = {i.step for i in listing.steps if i.manifest}
    status = {i.step: i.status for i in listing.steps}
    with Progress("verifying", sum(sizes.get(s, 0) for s in steps)) as progress:
        checks = [check_step(storage, s, on_bytes=progress.update, signer=signer, listed=s in listed) for s in steps]
        for _ in range(3):  # the newest step, deleted as it was checked by a running job's retention: its successor
            newest = [] if args.all or args.step is not None or not checks[-1].gone else \
                select_steps(list_checkpoints(storage, signer=signer))
            if not newest or newest[-1] <= checks[-1].step:
                break
            checks.append(check_step(storage, newest[-1], on_bytes=progress.update, signer=signer, listed=True))
    gone = [c for c in checks if c.gone]
    checks = [c for c in checks if not c.gone]
    ok = bool(checks) and all(c.ok for c in checks)
    lines = [f"step {c.step}: deleted while it was checked (a running job's retention, or gc)" for c in gone]
    for c in checks:
        lines.append(f"step {c.step}: {_verdict(c, partial=status.get(c.step) == PARTIAL)}")
        lines += [f"  {p}" for p in c.problems]
    if not checks:
        emit(args, {"url": storage.url, "ok": False, "steps": [c.to_dict() for c in gone]},
             lines + ["nothing verified: every step was deleted as it was checked. HINT: run it again"])
        return 1
    bad = [c.step for c in checks if not c.ok]
    skipped = [c.step for c in checks if not c.resume_loads]
    loaded = sorted(set(bad) - set(skipped))
    lines.append(f"intact: {plural(len(checks), 'step')} checked" if ok else
                 f"NOT INTACT: {len(bad)} of {plural(len(checks), 'checked step')} ({', '.join(map(str, bad))}); "
                 + "; ".join((["a resume skips a corrupt, partial or unverified step and takes the one before"]
                              if skipped else [])
                             + ([f"a resume still loads {'step' if len(loaded) == 1 else 'steps'} "
                                 f"{', '.join(map(str, loaded))} (every tensor's bytes match their checksums; bytes "
                                 "outside them changed: check the storage)"] if loaded else []))
                 + ("" if args.all else ". HINT: 'ft-checkpoint verify --all' checks the others"))
    emit(args, {"url": storage.url, "ok": ok, "steps": [c.to_dict() for c in gone + checks]}, lines)
    return 0 if ok else 1


def _verdict(c: StepCheck, *, partial: bool) -> str:
    """What ``verify`` says of a step checked: ``partial``, the listing found no ``manifest.json`` (as ``ls`` says)."""
    from ft_checkpoint.format.layout import REFUSED

    if c.ok:
        return f"ok ({c.files} files, {human_bytes(c.bytes)}: {_checked(c.signature)})"
    if c.signature == REFUSED:
        return "UNVERIFIED"
    if c.resume_loads:
        return "CORRUPT outside its tensors (a resume loads it)"
    if partial:
        return "PARTIAL: never committed (an interrupted save, or one being written)"
    return "UNREADABLE by this user (not checked)" if c.unreadable else "CORRUPT"


def _checked(signature: str | None) -> str:
    """What ``verify`` checked in a step that is ok, by its ``StepCheck.signature``."""
    return {"verified": "sizes, checksums and signature",
            "not checked": "sizes and checksums; signed, signature not checked: no key given"}.get(
        signature or "", "sizes and checksums")


def require_step(args: argparse.Namespace, listing: Any) -> None:
    """UsageError unless ``--step`` (if given) names a step directory of the ``listing``."""
    if args.step is not None and args.step not in {i.step for i in listing.steps}:
        raise UsageError(f"{listing.url} has no step {args.step}; 'ft-checkpoint ls {args.dir or listing.url}' "
                         "lists the steps")


def cmd_inspect(args: argparse.Namespace) -> int:
    from ft_checkpoint.tools.catalog import UNVERIFIED, inspect_step, list_checkpoints

    storage = open_storage(args)
    signer = open_signer(args, storage)
    listing = list_checkpoints(storage, signer=signer)
    step = args.step if args.step is not None else listing.resume_step
    require_step(args, listing)
    if step is None:
        refused = [i.step for i in listing.steps if i.status == UNVERIFIED]
        why = (f" that verifies with the key given ({plural(len(refused), 'step')} refused: the key or run name may be "
               "wrong); " if refused else ": ")
        raise UsageError(f"{storage.url} has no committed step{why}pass --step N ('ft-checkpoint ls' lists them)")
    info = inspect_step(storage, step, signer=signer)
    emit(args, info, _inspect_lines(info))
    return 0


def _inspect_lines(info: dict[str, Any]) -> list[str]:
    m, tensors = info["manifest"], info["tensors"]
    width = max([len(t["name"]) for t in tensors] + [4]) + 2
    lines = [f"step {info['step']} of {info['url']}: saved {utc(m['time'])}, world size {m['world_size']}, "
             f"epoch {m['epoch']}, format {m['format_version']}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in sorted(m["versions"].items())), _signature_line(info)]
    from ft_checkpoint.format.layout import FAST_TIER

    fast = m["metadata"].get(FAST_TIER) if isinstance(m["metadata"], dict) else None
    if isinstance(fast, dict):
        lines.append(f"fast tier: rank {fast.get('rank')}'s part of a step of {fast.get('world_size')} ranks, on node "
                     f"{fast.get('node')} (its local state only: what this rank loads at a resume)")
    if m["metadata"]:
        lines.append(f"metadata: {json.dumps(m['metadata'])}")
    lines += _deepspeed_lines(m["metadata"])
    lines.append(f"files ({len(m['files'])}, {human_bytes(sum(f['size'] for f in m['files'].values()))}):")
    names = max([len(name) for name in m["files"]] + [22]) + 2
    lines += [f"  {name:<{names}}{human_bytes(f['size']):>10}  {f['checksum'][:23]}..."
              for name, f in sorted(m["files"].items())]
    lines.append(f"tensors ({len(tensors)}, {human_bytes(sum(t['bytes'] for t in tensors))}; "
                 "from the tensor metadata, no data read):")
    lines.append(f"  {'name':<{width}}{'dtype':<10}{'shape':<20}{'size':>9}")
    lines += [f"  {t['name']:<{width}}{t['dtype']:<10}{str(t['shape']):<20}{human_bytes(t['bytes']):>9}"
              for t in tensors]
    return lines


def _signature_line(info: dict[str, Any]) -> str:
    if info["signature"] == "verified":
        return f"signature: verified with the key (run {short(info['manifest']['signature']['run'])})"
    if info["signature"] == "not checked":
        return "signature: present, not checked (no key given: --key-file PATH, or FT_CHECKPOINT_SIGNING_KEY)"
    return "signature: none"


def _deepspeed_lines(metadata: Any) -> list[str]:
    """One line per DeepSpeed engine the step holds (see ``ft_checkpoint.integrations.deepspeed``): ZeRO stage, parallel sizes."""
    if not isinstance(metadata, dict):
        return []
    engines = {k: v for k, v in metadata.items() if isinstance(v, dict) and v.get("kind") == "deepspeed"}
    return [f"deepspeed engine {key!r}: ZeRO stage {d.get('zero_stage')}, data-parallel {d.get('dp_world_size')}, "
            f"model-parallel {d.get('mp_world_size')}, pipeline-parallel {d.get('pp_world_size')} "
            f"(deepspeed {d.get('deepspeed')}; its files are DeepSpeed's, under their own names)"
            for key, d in sorted(engines.items())]


def cmd_gc(args: argparse.Namespace) -> int:
    # torch (for the rank files) imported before the listing, as verify does: else a running job's retention deletes
    # every step listed while torch is imported, and none is protected
    import ft_checkpoint.state  # noqa: F401
    from ft_checkpoint.tools.catalog import apply_gc, list_checkpoints, plan_gc

    storage = open_storage(args)
    signer = open_signer(args, storage)
    keep_every, source = milestones_to_keep(args)
    sizes = {i.step: i.bytes for i in list_checkpoints(storage, signer=signer).steps}
    with Progress("gc: verifying the newest step", 0) as progress:  # its total: the bytes of each step verified
        plan = plan_gc(storage, keep_last=args.keep, keep_every_n_steps=keep_every, on_bytes=progress.update,
                       signer=signer, on_step=growing_total(progress, sizes))
    deleted, left = plan.delete, []
    gone: list[int] = []  # steps another gc or the job's retention deleted first
    if not args.dry_run:
        with Progress("gc: deleting", len(plan.delete), unit="step") as progress:
            done = apply_gc(storage, plan, on_deleted=progress.update, gone=gone)  # a link swapped in: left alone
        deleted, left = list(done), [url for urls in done.values() for url in urls]
    kept = sorted(set(plan.keep) | (set(plan.delete) - set(deleted) - set(gone)))
    verb = "would delete" if args.dry_run else "deleted"
    milestones = f" and every multiple of {keep_every}{source}" if keep_every else ""
    protected = f"; never deletes step {plan.protected}, the newest that verifies" if plan.protected is not None \
        else "; no step verifies"
    lines = [f"{plan.url}: keep the newest {plural(args.keep, 'committed step')}{milestones}{protected}",
             f"{verb}: {', '.join(f'step {s}' for s in deleted) or 'nothing'}",
             *([f"already gone (another gc or the job's retention deleted them): {', '.join(f'step {s}' for s in gone)}"]
               if gone else []),
             f"{'keeps' if args.dry_run else 'kept'}: {', '.join(f'step {s}' for s in kept) or 'nothing'}"]
    if left:
        lines.append(f"left in place in deleted steps' directories (folders ft-checkpoint never writes; gc deletes "
                     f"only files): {', '.join(left)}")
    if plan.unverified:
        lines.append(f"not counted, left as they are (their signature does not verify; a resume with the key sets "
                     f"them aside): {', '.join(f'step {s}' for s in plan.unverified)}")
    emit(args, {**plan.to_dict(), "delete": deleted, "keep": kept, "already_gone": gone, "left_in_place": left,
               "dry_run": args.dry_run}, lines)
    return 0


def growing_total(progress: Progress, sizes: dict[int, int]) -> Callable[[int], None]:
    """What gc calls before it verifies each step (the newest, then older ones while none verifies): the step's
    bytes (``sizes``, from the listing) added to the total of ``progress``, so that the bytes done never run past
    the total shown. A step the listing did not hold (saved since) makes the total unknown, not wrong.

    Example:
        >>> p = Progress("verifying", 0, terminal=False)
        >>> on_step = growing_total(p, {30: 6, 20: 5})
        >>> on_step(30); p.total, on_step(20), p.total, on_step(40), p.total
        (6, None, 11, None, 0)
    """
    known = True

    def on_step(step: int) -> None:
        nonlocal known
        known = known and step in sizes
        progress.set_total(progress.total + sizes[step] if known else 0)

    return on_step


def milestones_to_keep(args: argparse.Namespace) -> tuple[int | None, str]:
    """The ``keep_every_n_steps`` that gc keeps: ``--keep-every`` (0: none), else the training's (env or config
    file: a milestone the training keeps is never gc's to delete unasked), and where it came from, in words.

    Example:
        >>> milestones_to_keep(argparse.Namespace(keep_every=0)), milestones_to_keep(argparse.Namespace(keep_every=9))
        ((None, ''), (9, ''))
    """
    if args.keep_every is not None:
        return args.keep_every or None, ""
    configured = training_config(args).keep_every_n_steps
    return configured, " (the training's keep_every_n_steps; --keep-every 0 keeps none)"


def cmd_report(args: argparse.Namespace) -> int:
    from ft_checkpoint.tools.goodput import goodput_report, plot_timeline

    report = goodput_report(open_storage(args))
    if args.plot:
        try:
            plot_timeline(report, args.plot)
        except ImportError as e:
            raise UsageError(str(e)) from e
    emit(args, report.to_dict(), _report_lines(report) + ([f"wrote {args.plot}"] if args.plot else []))
    return 0


def _report_lines(report: Any) -> list[str]:
    skipped = [f"(skipped {plural(len(report.skipped), 'unreadable journal file')}: see the warnings above)"] \
        if report.skipped else []
    if not report.attempts:
        return [f"{report.url}: no journal (nothing was recorded by ft-checkpoint in this directory)", *skipped]
    lines = [f"goodput of {report.url}: {plural(len(report.attempts), 'attempt')}, "
             f"{plural(report.failures, 'failure')}, {plural(report.preemptions, 'preemption')}"]
    rows = []
    for n, a in enumerate(report.attempts, 1):
        at_least = "" if a.recomputed_exact else ">="
        redo = "-" if a.recomputed_steps is None and not a.recomputed_s else \
            f"{'?' if a.recomputed_steps is None else at_least + str(a.recomputed_steps)} steps, {human_seconds(a.recomputed_s)}"
        rows.append([str(n), utc(a.start), human_seconds(a.duration_s), a.outcome,
                     f"{a.resumed_from or 0}->" + ("(none noted)" if a.last_step is None else str(a.last_step)),
                     human_seconds(a.stall_s),
                     human_seconds(a.load_s), redo, "-" if a.gap_after_s is None else human_seconds(a.gap_after_s)])
    lines += table(["#", "started (UTC)", "ran", "outcome", "steps", "stall", "loading", "recomputed", "gap after"],
                   rows, "><><>>>>>")
    t = report.totals()
    lines += [f"wall time {human_seconds(t['wall_s'])}: useful training {human_seconds(t['useful_s'])}, checkpoint stall "
              f"{human_seconds(t['stall_s'])}, loading {human_seconds(t['load_s'])}, recomputed "
              f"{'' if t['recomputed_exact'] else 'at least '}{t['recomputed_steps']} steps "
              f"({human_seconds(t['recomputed_s'])}), restart gaps {human_seconds(t['gap_s'])}",
              "goodput " + ("n/a" if t["goodput"] is None else f"{100 * t['goodput']:.1f}%") + " (useful / wall)"]
    if not t["recomputed_exact"]:
        miss = "some" if t["may_miss_s"] is None else f"up to {human_seconds(t['may_miss_s'])} of"
        lines.append(f"(recomputed steps are a lower bound: a failed attempt may have run {miss} training past its last "
                     "progress note; on an object store a note comes every progress_interval, on a filesystem every step)")
    return lines + skipped


class _Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (``ft-checkpoint plan: error: ...``) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}. HINT: '{self.prog} --help' lists the arguments\n")


SIMULATE_MTBFS = [900.0, 3600.0, 21600.0, 86400.0, 604800.0]
SIMULATE_COSTS = [1.0, 10.0, 60.0, 600.0]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    from ft_checkpoint.tools import tier_commands

    parser = _Parser(
        prog="ft-checkpoint",
        description="Plan checkpoint intervals and inspect checkpoint directories (local paths or fsspec URLs).")
    parser.add_argument("--version", action="version", version=f"ft-checkpoint {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    plan = sub.add_parser(
        "plan", help="Young's and Daly's optimal intervals and the expected waste",
        description="How often to checkpoint: Young's and Daly's optimal intervals for a checkpoint that costs "
                    "COST and failures every MTBF on average, and the expected share of wall time wasted (on saves, "
                    "recomputed work and restarts) at those and at fixed intervals. " + _DURATIONS_HELP)
    plan.add_argument("--mtbf", type=positive_duration, default=None,
                      help="mean time between failures of the whole job, e.g. 6h (the job fails, not one GPU); "
                           "required unless --fast-cost")
    plan.add_argument("--cost", type=positive_duration, required=True,
                      help="what one checkpoint costs the training (its stall, not the background write), e.g. 5m")
    plan.add_argument("--restart", type=duration, default=0.0,
                      help="time from a failure to training again (rescheduling, start-up, loading), e.g. 2m; default 0")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--plot", metavar="PNG", help="draw expected waste against interval (needs matplotlib)")
    tier_commands.add_plan_arguments(plan, duration, positive_duration)
    plan.set_defaults(func=cmd_plan)

    sim = sub.add_parser(
        "simulate", help="compare interval policies on a simulated job with failures",
        description="Simulate jobs with random failures and compare the wasted compute of fixed intervals, Young's, "
                    "Daly's, ours (the adaptive policy, learning the failure rate as it goes) and an oracle that knows "
                    "the true MTBF; one row per MTBF and cost, printed as soon as it is computed. "
                    + _DURATIONS_HELP)
    sim.add_argument("--mtbf", type=durations, default=None, metavar="MTBFS",
                     help="true mean times between failures, comma-separated (default: 15m,1h,6h,1d,1w)")
    sim.add_argument("--cost", type=durations, default=None, metavar="COSTS",
                     help="what one checkpoint costs the training (with --tiers: a durable save), comma-separated "
                          "(default: 1s,10s,1m,10m)")
    sim.add_argument("--restart", type=duration, default=60.0, help="time from a failure to training again (default 60 s)")
    sim.add_argument("--weibull", type=positive_number, default=None, metavar="SHAPE",
                     help="Weibull failures of this shape (e.g. 0.7: failures come in bursts); default: exponential")
    sim.add_argument("--seeds", type=simulated_runs, default=None,
                     help=f"simulated runs per row (default 20; --tiers: 10; at most {MAX_RUNS})")
    sim.add_argument("--early-seeds", type=early_runs, default=None,
                     help="simulated runs per row for the columns before the 5th failure (default 3000; --tiers: 500; "
                          f"at most {MAX_EARLY_RUNS})")
    sim.add_argument("--work", type=work_mtbfs, default=50.0,
                     help=f"useful work per simulated run, in MTBFs (default 50, at most {MAX_WORK:g})")
    sim.add_argument("--world-size", type=positive, default=1024,
                     help="GPUs of the simulated job, for the prior failure rate ours starts from (default 1024)")
    sim.add_argument("--json", action="store_true", help="machine-readable output (printed at the end)")
    tier_commands.add_simulate_arguments(sim, durations)
    sim.set_defaults(func=cmd_simulate)
    _add_directory_commands(sub)
    return parser


MAX_STEP = 10**12 - 1
"""The largest step a checkpoint directory can hold (step directories have 12 digits)."""


def step_number(text: str) -> int:
    """argparse type: a step number (an integer from 0 to 10**12 - 1)."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise argparse.ArgumentTypeError(f"{short(text)} is not a step number: use an integer from 0 to {MAX_STEP}, "
                                         "as 'ls' shows")
    return int(text)


def positive(text: str, maximum: int = MAX_STEP) -> int:
    """argparse type: an integer from 1 to ``maximum`` (default 10**12 - 1)."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 12 or not 1 <= int(text) <= maximum:
        raise argparse.ArgumentTypeError(f"{short(text)}: use an integer from 1 to {maximum}")
    return int(text)


def positive_or_zero(text: str) -> int:
    """argparse type: 0, or an integer from 1 to 10**12 - 1 (see :func:`positive`)."""
    return 0 if text.strip() == "0" else positive(text)


def _add_directory_commands(sub: Any) -> None:
    """``ls``, ``verify``, ``inspect``, ``gc`` and ``report``: each takes DIR and ``--json``."""

    def add(name: str, func: Any, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help + ". " + _DIR_HELP)
        p.add_argument("dir", metavar="DIR", nargs="?",
                       help="local path or fsspec URL (default: FT_CHECKPOINT_DIRPATH)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        return p

    def add_signing(p: argparse.ArgumentParser) -> None:
        p.add_argument("--key-file", metavar="PATH", help="check signatures with the key in this file (default: "
                       "FT_CHECKPOINT_SIGNING_KEY or FT_CHECKPOINT_SIGNING_KEY_FILE, as the training)")
        p.add_argument("--run-name", metavar="NAME", help="the run identity signatures bind (default: "
                       "FT_CHECKPOINT_RUN_NAME, else the directory's URL)")

    ls = add("ls", cmd_ls, "list the steps: status, time, size, files, world size, and the step a resume would pick")
    add_signing(ls)
    ls.add_argument("--fast", metavar="FAST_DIRPATH",
                    help="also list what this node's fast tier (the run's fast_dirpath) holds, and which tiers hold each step")
    verify = add("verify", cmd_verify, "check sizes and checksums; exit code 0 only if everything checked is intact")
    add_signing(verify)
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_number,
                       help="check this step (default: the newest with a manifest, which a resume tries first)")
    which.add_argument("--all", action="store_true", help="check every step that has a manifest")
    inspect = add("inspect", cmd_inspect, "show a step's manifest and its tensors' names, shapes, dtypes and sizes")
    inspect.add_argument("--step", type=step_number, help="the step (default: the newest committed one)")
    add_signing(inspect)
    gc = add("gc", cmd_gc, "delete old steps by the retention rules; never the newest step that verifies")
    gc.add_argument("--keep", type=positive, required=True, help="how many of the newest committed steps to keep")
    gc.add_argument("--keep-every", type=positive_or_zero, metavar="N",
                    help="also keep every step that is a multiple of N (default: the training's keep_every_n_steps, "
                         "from FT_CHECKPOINT_KEEP_EVERY_N_STEPS or the config file; 0: none)")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    add_signing(gc)
    report = add("report", cmd_report, "goodput of the job from its journal: where the time went, per attempt")
    report.add_argument("--plot", metavar="PNG", help="draw the attempts on a time axis (needs matplotlib)")


_DURATIONS_HELP = (f"Durations as the commands print them: {DURATION_EXAMPLES}; a number without a unit is seconds.")
_DIR_HELP = ("Storage options (credentials, endpoint_url) come from FT_CHECKPOINT_STORAGE_OPTIONS (JSON) "
             "or the YAML file named by FT_CHECKPOINT_CONFIG.")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    _log_warnings_to_stderr()
    try:
        result: Any = args.func(args)
    except (FTCheckpointError, UsageError) as e:
        return _error(args.command, str(e))
    except BrokenPipeError:  # e.g. piped into head: not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the flush at exit
        return 0
    except KeyboardInterrupt:
        return _error(args.command, "interrupted", code=130)
    except Exception as e:  # a file or argument nothing above foresaw: one line, not a traceback
        if os.environ.get("FT_CHECKPOINT_DEBUG"):
            raise
        return _error(args.command, f"unexpected {type(e).__name__}: {e}. HINT: a file in the directory may be "
                                    "damaged; FT_CHECKPOINT_DEBUG=1 shows the traceback (please report it)")
    return int(result or 0)


def _error(command: str, message: str, code: int = 2) -> int:
    """Print ``ft-checkpoint COMMAND: error: MESSAGE`` as one line on stderr; return ``code``."""
    print(f"ft-checkpoint {command}: error: {printable(' '.join(message.split()))}", file=sys.stderr)
    return code


class _StderrWarnings(logging.Handler):
    """``ft-checkpoint: warning: ...`` on stderr (as it is at the time), for the package's warnings."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"ft-checkpoint: {record.levelname.lower()}: {printable(record.getMessage())}", file=sys.stderr)
        except Exception:
            self.handleError(record)


def _log_warnings_to_stderr() -> None:
    logger = logging.getLogger("ft_checkpoint")
    if not any(isinstance(h, _StderrWarnings) for h in logger.handlers):
        logger.addHandler(_StderrWarnings(logging.WARNING))


if __name__ == "__main__":
    sys.exit(main())
