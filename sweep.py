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
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from serverbench.config import paths
from serverbench.config.design_kinds import DESIGNS, design_kind
from serverbench.config.flags import ConfigError
from serverbench.config.limits import AB_DEFAULT_REPEATS, MAX_REPEATS
from serverbench.config.load_kind import SweepAxis
from serverbench.config.loads import SWEEP_LOADS, load_kind
from serverbench.launch import procutil
from serverbench.launch.session import Session
from serverbench.schema.ab import shuffled

ROOT = Path(__file__).resolve().parent
RUNS_CSV = "runs.csv"


@dataclass(frozen=True)
class Experiment:
    name: str
    flags: tuple[str, ...]


LOAD_AXES = {kind.name: kind.sweep_axis.column for kind in SWEEP_LOADS}  # the load axis and the row column naming it


def _canonical(value: float) -> float:
    """A load value as a key: the same whether it came from the command line or back from the CSV."""
    return float(f"{float(value):.12g}")


@dataclass(frozen=True)
class LoadPoint:
    """One offered load of the sweep's load axis (a rate, a concurrency), as its load's SweepAxis declares it."""

    load: str  # the name of a load with a sweep axis
    value: float  # requests/s for poisson, requests outstanding for closed

    @property
    def axis(self) -> SweepAxis:
        return load_kind(self.load).sweep_axis

    def flags(self) -> tuple[str, ...]:
        return ("--load", self.load, self.axis.server_flag, load_kind(self.load).value_text(self.value))

    def tag(self) -> str:  # for file names: rate20, conc4
        return f"{self.axis.tag}{self.value:.12g}"

    def label(self) -> str:
        return f"{self.axis.name}={load_kind(self.load).value_text(self.value)}{self.axis.label_unit}"

    def row_columns(self) -> dict[str, object]:  # as server.py's row has them (for rows the sweep writes)
        return {"load": self.load, self.axis.column: self.value}


def load_points(rates_rps: Sequence[float], concurrencies: Sequence[int]) -> list[LoadPoint | None]:
    """The load axis, ascending and without repeats; [None] (no axis: the server flags decide) when neither is given."""
    given = {"--rates": rates_rps, "--concurrency": concurrencies}  # this script's flags, one per load's axis
    axes = [(kind, given[kind.sweep_axis.sweep_flag]) for kind in SWEEP_LOADS if given[kind.sweep_axis.sweep_flag]]
    if len(axes) > 1:
        raise ValueError("--rates (open loop) and --concurrency (closed loop) are two load axes; a sweep takes one")
    if axes:
        kind, values = axes[0]
        return [LoadPoint(kind.name, v) for v in sorted({_canonical(value) for value in values})]
    return [None]


CellKey = tuple[str, int, bool, LoadPoint | None, int]


@dataclass(frozen=True)
class Cell:
    experiment: Experiment
    batch_size: int
    compile: bool
    repeat: int
    load_point: LoadPoint | None = None

    @property
    def key(self) -> CellKey:
        return (self.experiment.name, self.batch_size, self.compile, self.load_point, self.repeat)

    def server_args(self, server_flags: Sequence[str], results_dir: Path | str) -> list[str]:
        """server.py's flags for this cell; the load point after the shared flags, so the axis wins over a --load
        given there."""
        return [
            *server_flags,
            *self.experiment.flags,
            *(self.load_point.flags() if self.load_point else ()),
            "--batch_size",
            str(self.batch_size),
            "--compile" if self.compile else "--no-compile",
            "--experiment",
            self.experiment.name,
            "--repeat",
            str(self.repeat),
            "--results_dir",
            str(results_dir),
        ]

    def log_path(self, out_dir: Path) -> Path:
        """Where run_cell writes this cell's command line and server output."""
        compiled = "c" if self.compile else "nc"
        point = f"_{self.load_point.tag()}" if self.load_point else ""
        return out_dir / "logs" / f"{self.experiment.name}_bs{self.batch_size}_{compiled}{point}_r{self.repeat}.log"

    def label(self) -> str:
        point = f" {self.load_point.label()}" if self.load_point else ""
        return (
            f"{self.experiment.name} bs={self.batch_size} compile={'on' if self.compile else 'off'}{point} "
            f"repeat={self.repeat}"
        )


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


def grid(
    experiments: Sequence[Experiment],
    batch_sizes: Sequence[int],
    compiles: Sequence[bool],
    points: Sequence[LoadPoint | None],
    repeat: int,
) -> list[Cell]:
    """One repeat round's cells, in the order of the axes."""
    return [Cell(e, b, c, repeat, p) for e in experiments for b in batch_sizes for c in compiles for p in points]


def plan(
    experiments: Sequence[Experiment],
    batch_sizes: Sequence[int],
    compiles: Sequence[bool],
    repeats: int,
    seed: int,
    points: Sequence[LoadPoint | None] = (None,),
) -> list[Cell]:
    order: list[Cell] = []
    for repeat in range(repeats):
        order += shuffled(grid(experiments, batch_sizes, compiles, points, repeat), seed, repeat)
    return order


def _runs(runs_csv: Path):
    """The sweep's rows so far, compile as a bool (report.load_runs), or None before the first row."""
    import report

    if not runs_csv.exists():
        return None
    runs = report.load_runs(runs_csv)
    return None if runs.empty or "repeat" not in runs.columns else runs


def _row_load_points(runs, load_axis: str | None) -> list[LoadPoint | None]:
    """Each row's point on the sweep's load axis. Without an axis every row's is None, whatever its load: rows of
    a sweep given `-- --load poisson --rate 20` (or written before the axis existed) keep resuming as they did."""
    column = LOAD_AXES.get(load_axis) if load_axis else None
    if column is None or column not in runs.columns or "load" not in runs.columns:
        return [None] * len(runs)
    return [
        LoadPoint(load_axis, _canonical(v)) if load == load_axis and v == v else None  # v == v: not NaN
        for load, v in zip(runs["load"], runs[column])
    ]


def _row_keys(runs, load_axis: str | None) -> list[CellKey]:
    return [
        (str(e), int(b), bool(c), p, int(r))
        for e, b, c, p, r in zip(
            runs["experiment"], runs["batch_size"], runs["compile"], _row_load_points(runs, load_axis), runs["repeat"]
        )
    ]


def completed_keys(runs_csv: Path, retry_failed: bool, load_axis: str | None = None) -> set[CellKey]:
    """Cells that have a row: done, unless it says the cell was interrupted (a Ctrl-C is not the cell's own
    failure: it runs again) or, with retry_failed, that it failed. load_axis: poisson or closed when the sweep
    has one (--rates, --concurrency), so that a row counts for its own load point."""
    runs = _runs(runs_csv)
    if runs is None:
        return set()
    runs = runs[runs["status"] != "interrupted"]
    if retry_failed:
        runs = runs[runs["status"] == "ok"]
    return set(_row_keys(runs, load_axis))


def run_cell(
    cell: Cell, out_dir: Path, server_flags: Sequence[str], timeout_s: float, python: str, keep_open: Sequence[int] = ()
) -> str:
    """Runs one cell; returns its status. A cell that dies without writing its row gets one written here.
    `keep_open`: file descriptors the server inherits (the sweep's lock, held until the server has exited)."""
    cmd = [
        python,
        str(ROOT / "server.py"),
        *cell.server_args(server_flags, out_dir),
        "--output_file",
        RUNS_CSV,
        "--save_requests",
    ]
    log_path = cell.log_path(out_dir)
    proc = Session.logged(cmd, log_path, ROOT, pass_fds=keep_open).proc  # the one launcher
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_cell(proc, signal.SIGTERM, CELL_STOP_GRACE_S)
        return _record_failure(cell, out_dir, "sweep_timeout", f"no result within {timeout_s:g} s (see {log_path})")
    except KeyboardInterrupt:
        stop_cell(proc, signal.SIGINT, CELL_STOP_GRACE_S)
        raise
    if returncode == 2:  # invalid flags: every other cell would fail the same way
        lines = log_path.read_text().strip().splitlines()
        raise SystemExit(f"sweep.py: error: server.py refused its flags: {lines[-1] if lines else '?'}")
    status = _status_of(cell, out_dir)
    if status is None:  # it died before writing its row
        return _record_failure(cell, out_dir, "crashed", f"server.py exit status {returncode} (see {log_path})")
    return status


CELL_STOP_GRACE_S = 30.0  # a server told to stop ends its children within about 7 s and writes its row


def stop_cell(proc: subprocess.Popen, signum: int, grace_s: float) -> None:
    """Stops a cell's server as an interrupt would (procutil.stop_session): its partial row is written and its
    resource tracker cleans up; one that does not stop within grace_s is killed with its session, and what its
    processes had mapped in /dev/shm is unlinked here."""
    removed = procutil.stop_session(proc, signum, grace_s)
    if removed is not None:
        print(
            f"sweep.py: the cell's server did not stop within {grace_s:g} s: killed; unlinked {len(removed)} "
            "shared-memory entries it left",
            file=sys.stderr,
            flush=True,
        )


def _status_of(cell: Cell, out_dir: Path) -> str | None:
    runs = _runs(out_dir / RUNS_CSV)
    if runs is None:
        return None
    statuses = [
        s
        for key, s in zip(_row_keys(runs, cell.load_point and cell.load_point.load), runs["status"])
        if key == cell.key
    ]
    return str(statuses[-1]) if statuses else None


def _record_failure(cell: Cell, out_dir: Path, status: str, error: str) -> str:
    from serverbench.records.csv_store import append_row

    append_row(
        out_dir / RUNS_CSV,
        {
            "batch_size": cell.batch_size,
            "compile": cell.compile,
            "status": status,
            "error": error,
            "experiment": cell.experiment.name,
            "repeat": cell.repeat,
            **(cell.load_point.row_columns() if cell.load_point else {}),
        },
    )
    return status


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


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


class SweepLocked(Exception):
    """Another sweep is running on the same output folder."""


def lock_out_dir(out_dir: Path) -> int:
    """An exclusive lock on the output folder, held while this sweep runs (and, passed to each server, until that
    server has exited); the file descriptor, or SweepLocked naming the sweep that holds it."""
    import fcntl

    path = out_dir / ".sweep.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SweepLocked(
            f"another sweep (pid {holder}) is running on {out_dir}; wait for it, or choose another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_cells(
    experiments: Sequence[Experiment],
    batch_sizes: Sequence[int],
    compiles: Sequence[bool],
    server_flags: Sequence[str],
    points: Sequence[LoadPoint | None] = (None,),
) -> str | None:
    """Every cell's server flags validated as server.py would, before anything runs or is created: why the
    first that server.py would refuse is refused, else None."""
    import tempfile

    from serverbench.config.build import build_config
    from serverbench.config.flags import ConfigError, RaisingParser
    from serverbench.config.options import add_cli_args
    from serverbench.launch.preflight import preflight

    parser = RaisingParser(prog="server.py")
    add_cli_args(parser)
    # Preflight too, as server.py: a model, checkpoint, device or size this machine refuses stops the sweep now.
    with tempfile.TemporaryDirectory() as scratch:  # preflight makes the results folder: not the sweep's yet
        for cell in grid(experiments, batch_sizes, compiles, points, repeat=0):
            try:
                preflight(build_config(parser.parse_args(cell.server_args(server_flags, scratch))))
            except ConfigError as exc:
                where = f"batch {cell.batch_size}" + (f", {cell.load_point.label()}" if cell.load_point else "")
                return f"experiment {cell.experiment.name} ({where}): server.py would refuse: {exc}"
    return None


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
    problem = check_cells(experiments, args.batch_sizes, args.compiles, server_flags, points)
    if problem is not None:
        raise ConfigError(problem)
    return SweepArgs(out_dir.resolve(), python, experiments, points)


def run_cells(todo: list[Cell], total: int, run: Callable[[Cell], str]) -> list[tuple[Cell, str]]:
    """Runs the cells left to do, a line each with the time left; the cells that did not complete (Ctrl-C raises)."""
    failed: list[tuple[Cell, str]] = []
    started = time.monotonic()
    for index, cell in enumerate(todo, start=1):
        cell_start = time.monotonic()
        print(f"[{total - len(todo) + index}/{total}] {cell.label()} ...", end=" ", flush=True)
        status = run(cell)
        if status != "ok":
            failed.append((cell, status))
        elapsed = time.monotonic() - started
        eta = elapsed / index * (len(todo) - index)
        print(
            f"{status} in {time.monotonic() - cell_start:.1f} s | elapsed {_duration(elapsed)}, left ~{_duration(eta)}",
            flush=True,
        )
    return failed


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


def main(argv: Sequence[str] | None = None) -> int:
    argv, server_flags = split_server_flags(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        checked = check_sweep_args(args, server_flags)
    except ConfigError as exc:
        print(f"sweep.py: error: {exc}", file=sys.stderr)
        return 2
    out_dir, points = checked.out_dir, checked.points
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock_fd = lock_out_dir(out_dir)
    except SweepLocked as exc:
        print(f"sweep.py: error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C stops the sweep even when started with & from a script (SIGINT then starts ignored), and SIGTERM
    # stops it the same way: the running cell is interrupted and keeps its partial row.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    cells = plan(checked.experiments, args.batch_sizes, args.compiles, args.repeats, args.seed, points)
    load_axis = points[0].load if points[0] else None
    done = completed_keys(out_dir / RUNS_CSV, args.retry_failed, load_axis)
    todo = [c for c in cells if c.key not in done]
    axis = f"{len(points)} {load_kind(load_axis).sweep_axis.plural} x " if load_axis else ""
    print(
        f"sweep: {len(cells)} cells ({len(checked.experiments)} experiments x {len(args.batch_sizes)} batch sizes x "
        f"{len(args.compiles)} compile values x {axis}{args.repeats} repeats) into {out_dir}; "
        f"{len(cells) - len(todo)} already done",
        flush=True,
    )

    def run(cell: Cell) -> str:
        return run_cell(cell, out_dir, server_flags, args.cell_timeout_s, checked.python, keep_open=(lock_fd,))

    try:
        failed = run_cells(todo, len(cells), run)
    except KeyboardInterrupt:
        print("interrupted; re-run the same command to resume", flush=True)
        return 130
    return report_sweep(out_dir, failed, args.plots_dir, args.baseline)


if __name__ == "__main__":
    sys.exit(main())
