"""A sweep: every (experiment, batch size, compile, load) cell, repeated, each a run of server.py, then the report.

    python sweep.py --out results/sweep_cpu --repeats 3 -- --image_size 64 --num_iters 20
    python sweep.py --rates 5 10 20 40 --out results/curve -- --slo_ms 200 --duration_s 30

--rates (open loop, --load poisson) or --concurrency (closed loop) adds an axis of offered loads: the report then
draws latency against achieved throughput and names each experiment's highest rate within --slo_ms.

Cells run interleaved and shuffled (seeded): each repeat round visits every cell once in its own random order,
so a drift of the machine spreads over all experiments. A failed cell (oom, crash, timeout) leaves a row with
its status and the sweep goes on; the failures are listed at the end. Re-running the same command resumes:
cells that already have a row in <out>/runs.csv are skipped (--retry_failed runs the failed ones again).
`sweep.sh` is the same with its axes also settable by environment variables.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from serverbench.config import paths
from serverbench.config.design_kinds import DESIGNS, design_kind
from serverbench.config.flags import ConfigError
from serverbench.config.limits import AB_DEFAULT_REPEATS, MAX_REPEATS
from serverbench.config.loads import load_kind
from serverbench.launch.study import RUNS_CSV, Cell, Experiment, Runner, grid, interruptible, load_points, plan
from serverbench.launch.study_checks import (
    StudyLocked,
    args_problem,
    check_cells,
    given_tool_flags,
    lock_out_dir,
    record_args,
    record_flags,
    resume_problem,
)

ROOT = Path(__file__).resolve().parent


def experiments_from(designs: Sequence[str], workers: Sequence[int], custom: Sequence[str]) -> list[Experiment]:
    """serial and threaded once each; pipelined once per worker count; plus NAME=FLAGS experiments."""
    found: list[Experiment] = []
    for design in map(design_kind, designs):
        if design.many_workers:
            found += [Experiment(design.label(w), ("--design", design.name, "--num_workers", str(w))) for w in workers]
        else:
            found.append(Experiment(design.name, ("--design", design.name)))
    for spec in custom:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"--experiment {spec!r}: expected NAME=FLAGS, e.g. 'big_queue=--max_inflight 32'")
        found.append(Experiment(name, tuple(shlex.split(flags))))
    names = [e.name for e in found]
    if not found:
        raise ValueError("nothing to sweep: no --designs and no --experiment")
    if len(set(names)) != len(names):
        raise ValueError(f"experiment names repeat: {names}")
    return found


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "on", "1", "yes"):
        return True
    if lowered in ("false", "off", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    from serverbench.config.flags import OneLineErrorParser

    parser = OneLineErrorParser(
        prog="sweep.py",
        description=__doc__.split("\n\n")[0],
        epilog="Flags after -- go to every server.py run, e.g. -- --image_size 64.",
    )
    axes = parser.add_argument_group("axes (defaults: the reference's runner.sh)")
    axes.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 32, 64, 128, 256])
    axes.add_argument(
        "--compile",
        type=parse_bool,
        nargs="+",
        default=[True, False],
        dest="compiles",
        help="compile values to sweep (default: true false)",
    )
    axes.add_argument(
        "--designs",
        nargs="*",
        default=list(DESIGNS),
        choices=DESIGNS,
        help="the designs swept as they are (default: all three); none: only the --experiment ones",
    )
    axes.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2, 4], help="pipelined's worker counts (default 1 2 4)"
    )
    axes.add_argument(
        "--experiment",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="an extra experiment: a name and its server flags, e.g. 'deep=--max_inflight 32'",
    )
    axes.add_argument("--repeats", type=int, default=AB_DEFAULT_REPEATS, help="runs of each cell (default %(default)s)")
    axes.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[],
        metavar="R",
        dest="rates_rps",
        help="offered rates (requests/s): every cell runs open loop at each, --load poisson --rate R; "
        "not with --concurrency (default: none, the server flags decide the load)",
    )
    axes.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[],
        metavar="C",
        dest="concurrencies",
        help="closed-loop concurrencies: every cell runs at each, --load closed --concurrency C; "
        "not with --rates (default: none)",
    )
    run = parser.add_argument_group("the sweep")
    run.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder of this sweep (default results/sweep_<date>); re-running resumes it",
    )
    run.add_argument("--seed", type=int, default=0, help="seed of the cell order (default 0)")
    run.add_argument(
        "--cell_timeout_s",
        type=float,
        default=3600.0,
        help="a cell that has not finished after this long is killed and recorded (default 3600)",
    )
    run.add_argument("--retry_failed", action="store_true", help="on resume, run failed cells again")
    run.add_argument("--baseline", default=None, help="experiment the report compares the others with (default serial)")
    run.add_argument("--plots_dir", type=Path, default=None, help="default: plots/<name of --out>")
    run.add_argument("--python", default=sys.executable, help="interpreter for server.py (default: this one)")
    return parser


def split_server_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The script's own flags, and those after `--`, which go to every server.py run."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


@dataclass(frozen=True)
class SweepArgs:
    """The sweep's arguments once checked: where it writes, which interpreter runs the cells, what it runs."""

    out_dir: Path
    python: str
    experiments: list[Experiment]
    points: list


def check_sweep_args(args: argparse.Namespace, server_flags: list[str]) -> SweepArgs:
    """Every check before any work (the folders can be made and written, the interpreter is there, every cell's
    flags parse); raises ConfigError with the line to print."""
    if args.repeats < 1 or any(b < 1 for b in args.batch_sizes) or any(w < 1 for w in args.workers):
        raise ConfigError("repeats, batch sizes and worker counts must be at least 1")
    if args.repeats > MAX_REPEATS:
        raise ConfigError(f"--repeats {args.repeats}: at most {MAX_REPEATS} runs of each cell")
    out_dir = paths.check_output_folder("--out", args.out or ROOT / "results" / f"sweep_{time.strftime('%Y%m%d')}")
    if args.plots_dir is not None:
        paths.check_output_folder("--plots_dir", args.plots_dir)
    python = paths.check_executable("--python", args.python)
    if not 0 < args.cell_timeout_s < float("inf"):
        raise ConfigError(f"--cell_timeout_s {args.cell_timeout_s:g}: must be a positive number of seconds")
    try:
        experiments = experiments_from(args.designs, args.workers, args.experiment)
        points = load_points(args.rates_rps, args.concurrencies)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.baseline is not None and args.baseline not in (names := [e.name for e in experiments]):
        raise ConfigError(f"--baseline {args.baseline}: not an experiment of this sweep ({', '.join(names)})")
    problem = check_cells(grid(experiments, args.batch_sizes, args.compiles, points, repeat=0), server_flags)
    if problem is not None:
        raise ConfigError(problem)
    return SweepArgs(out_dir.resolve(), python, experiments, points)


def report_sweep(out_dir: Path, failed: list[tuple[Cell, str]], plots_dir: Path | None, baseline: str | None) -> int:
    """The cells that did not complete, then the sweep's report; the sweep's exit status."""
    if failed:
        print(f"sweep: {len(failed)} cell(s) did not complete:")
        for cell, status in failed:
            print(f"  {cell.label()}: {status}")
    import report

    plots_dir = plots_dir or report.default_plots_dir(out_dir / RUNS_CSV)
    try:
        written = report.write_report(out_dir / RUNS_CSV, out_dir, plots_dir, baseline)
    except report.ReportError as exc:  # the rows are kept; the report is what failed
        print(f"sweep.py: no report: {exc}", file=sys.stderr)
        return 1
    print(f"sweep: report in {out_dir / 'summary.md'}, {sum(p.suffix == '.png' for p in written)} plots in {plots_dir}")
    return 1 if failed else 0


# Axes a resume may widen or narrow (each row is keyed by its experiment, batch size and compile value), what only
# the report reads, and the interpreter (each row names its torch). An --experiment's flags and the load axis are not
# among them: rows made with another definition under the same name, or at offered rates under a sweep that offers
# none, would count as done.
FREE_FLAGS = ("batch_sizes", "compiles", "designs", "workers", "baseline", "plots_dir", "python")


def main(argv: Sequence[str] | None = None) -> int:
    argv, server_flags = split_server_flags(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    given = given_tool_flags(parser, argv, args)
    # A value given twice is one cell, not two runs of it under one key
    args.batch_sizes, args.compiles = list(dict.fromkeys(args.batch_sizes)), list(dict.fromkeys(args.compiles))
    args.workers, args.server_flags = list(dict.fromkeys(args.workers)), list(server_flags)
    # Ctrl-C stops the sweep even when started with & from a script (SIGINT then starts ignored), and SIGTERM stops
    # it the same way: in the checks (a model's forward tried in a child), in a cell (the running one is interrupted
    # and keeps its partial row) or in the report.
    return interruptible("sweep.py", lambda: sweep(parser, args, given), "; re-run the same command to resume")


def sweep(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> int:
    """The checks, the cells that have no row yet, the report; the exit status."""
    try:
        checked = check_sweep_args(args, args.server_flags)
    except ConfigError as exc:
        print(f"sweep.py: error: {exc}", file=sys.stderr)
        return 2
    out_dir, points = checked.out_dir, checked.points
    args.out = out_dir
    problem = resume_problem(out_dir, args.server_flags) or args_problem(parser, FREE_FLAGS, args, given)
    if problem is not None:
        print(f"sweep.py: error: {problem}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock_fd = lock_out_dir(out_dir)
    except StudyLocked as exc:
        print(f"sweep.py: error: {exc}", file=sys.stderr)
        return 2
    cells = plan(checked.experiments, args.batch_sizes, args.compiles, args.repeats, args.seed, points)
    load_axis = points[0].load if points[0] else None
    axis = f"{len(points)} {load_kind(load_axis).sweep_axis.plural} x " if load_axis else ""
    what = (
        f"{len(checked.experiments)} experiments x {len(args.batch_sizes)} batch sizes x {len(args.compiles)} "
        f"compile values x {axis}{args.repeats} repeats"
    )
    record_flags(out_dir, args.server_flags)
    record_args(out_dir, args)
    runner = Runner("sweep", out_dir, tuple(args.server_flags), args.cell_timeout_s, checked.python, (lock_fd,))
    failed = runner.run(cells, args.retry_failed, load_axis, what)
    return report_sweep(out_dir, failed, args.plots_dir, args.baseline)


if __name__ == "__main__":
    sys.exit(main())
