"""The same server command at two commits, interleaved: did a change cost the server anything?

    python -m bench.commits --base 803a616 --repeats 7 --out results/commits/noise -- \\
        --device cpu --model identity --image_size 16 --batch_size 1 --num_iters 2000 --load burst --no-ceiling

A study on the harness (bench/study.py): each commit is checked out once into a scratch git worktree (the runner's
fixture, kept for all the runs and removed after, however they end) and run with this environment's python; each
round runs both, in an order shuffled by the seed and the round, so that whatever the machine does meanwhile falls
on both; the same command resumes. Prints, and writes to <out>/commits.md, each repeat's figure for both, then the
A/B verdict (serverbench/schema/ab.py, as report.py --baseline and bench.compare print it): repeat i of base and of
head form a pair, and the verdict says "head is x % slower" only when the ratio's 95 % interval is all on one side
of 1; otherwise how many repeats would resolve the difference seen. Run nothing else on the machine meanwhile. The
commits, --out, --column and the server flags (as this checkout's server.py takes them) are checked before anything
runs; Ctrl-C or SIGTERM stops the run in flight, removes the scratch worktrees and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from bench.study import ROOT, Study
from serverbench.config.build import parse_server_flags
from serverbench.config.flags import ConfigError
from serverbench.config.limits import AB_DEFAULT_REPEATS
from serverbench.launch.study import (
    RUNS_CSV,
    Cell,
    CellRefused,
    Experiment,
    FixtureFailed,
    Runner,
    interleaved,
    read_rows,
)
from serverbench.launch.study_checks import check_server_flags, resume_problem, study_args
from serverbench.records.comparison import better_when_higher, compare_rows
from serverbench.records.markdown import table_head, table_row
from serverbench.schema.columns import COLUMNS
from serverbench.system.process import one_line

GIT_TIMEOUT_S = 300.0  # a worktree of this repository is checked out in seconds; a slow disk gets minutes
NOT_FIGURES = {"text", "bool", "path", "JSON", "CPU ids", "UTC ISO time"}  # units of columns that hold no number
SIDES = ("base", "head")


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM held until the block is done, then delivered: git must not be stopped half-way through
    adding or removing a worktree of the user's repository, nor the clean-up half-way."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def git(*args: str) -> subprocess.CompletedProcess:
    """git in this checkout's repository, its output captured, within GIT_TIMEOUT_S."""
    with signals_held():  # the child inherits the held signals: a Ctrl-C to the process group waits for it too
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)


def resolve_commit(flag: str, given: str) -> str:
    """The full hash of the commit `given` names in this checkout's repository; ConfigError when it names none."""
    try:
        found = git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{given}^{{commit}}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{flag} {given}: git could not be asked ({one_line(exc)})") from None
    if found.returncode != 0:
        raise ConfigError(f"{flag} {given}: no such commit in the repository of {ROOT}")
    return found.stdout.strip()


def check_column(name: str) -> None:
    """--column: a column of server.py's row that holds a figure; ConfigError otherwise."""
    column = next((c for c in COLUMNS if c.name == name), None)
    if column is None:
        raise ConfigError(
            f"--column {name}: not a column of server.py's row; e.g. achieved_rate_rps, throughput, p99_latency_s "
            "(docs/columns.md)"
        )
    if column.unit in NOT_FIGURES:
        raise ConfigError(f"--column {name}: {column.unit}, not a figure to compare")
    if better_when_higher(name) is None:
        raise ConfigError(
            f"--column {name}: {column.unit}, neither a rate nor a time, so neither commit is slower; "
            "e.g. achieved_rate_rps, throughput, p99_latency_s"
        )


def experiment_names(args: argparse.Namespace) -> dict[str, str]:
    """Each side's experiment: its name and its commit (rows of other commits in the folder are not these)."""
    commits = {"base": resolve_commit("--base", args.base), "head": resolve_commit("--head", args.head)}
    return {side: f"{side}-{commit}" for side, commit in commits.items()}


def measured_names(args: argparse.Namespace, rows: pd.DataFrame) -> dict[str, str]:
    """Each side's experiment as its rows name it (the commit it was when measured: a --report_only after HEAD has
    moved reports the commits that ran, not the ones the names resolve to now); resolved now for a side with none."""
    found = {side_commit(name)[0]: name for name in rows["experiment"].dropna().astype(str).unique()}
    if set(SIDES) <= set(found):
        return {side: found[side] for side in SIDES}
    resolved = experiment_names(args)
    return {side: found.get(side, resolved[side]) for side in SIDES}


def side_commit(name: str) -> tuple[str, str]:
    """(side, commit) of an experiment's name, base-<sha> or head-<sha>."""
    side, _, commit = name.partition("-")
    return side, commit


def preflight(args: argparse.Namespace) -> str | None:
    """Every argument before any worktree, folder or run: why one is refused, else None."""
    try:
        check_column(args.column)
        if args.report_only:  # of the commits its rows name, which need not be those the names give now
            return None
        names = experiment_names(args)
        if not args.server_flags:
            raise ConfigError(
                "give the server.py flags after --, e.g. -- --device cpu --model identity --num_iters 2000"
            )
        check_server_flags([args.server_flags])
    except ConfigError as exc:
        return str(exc)
    if (problem := resume_problem(args.out.resolve(), args.server_flags)) is not None:  # before its rows are read
        return problem
    rows = read_rows(args.out / RUNS_CSV)
    if rows is not None and (other := sorted(set(rows["experiment"]) - set(names.values()))):
        return f"{args.out} holds runs of other commits ({', '.join(other)}); choose another --out"
    return None


def cells(args: argparse.Namespace, rows: pd.DataFrame | None) -> list[Cell]:
    """Both commits once per round; the batch and compile the server flags give (a row counts for its cell)."""
    cfg = parse_server_flags(args.server_flags)
    one_round = [
        Cell(Experiment(name, (), measure), cfg.batch_size, cfg.compile, 0) for name in experiment_names(args).values()
    ]
    return interleaved(one_round, args.repeats, args.seed)


@contextlib.contextmanager
def worktrees(cell: Cell, out: Path) -> Iterator[tuple[str, ...]]:
    """The runner's fixture, one for every run: a scratch worktree of each commit, in a temporary folder, yielded
    to the runs; all removed, and unregistered from the repository, when the runs end, however they end."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-commits-"))
    folders: list[Path] = []
    try:
        for name in experiment_names(study_args(out)).values():
            folders.append(scratch / name)  # before git makes it: a failed add is cleaned up too
            try:
                made = git("worktree", "add", "--detach", str(folders[-1]), side_commit(name)[1])
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise FixtureFailed(f"git worktree add: {one_line(exc)}") from None
            if made.returncode != 0:
                raise FixtureFailed(f"git worktree add {name}: {one_line(made.stderr) or made.returncode}")
        yield ("--worktrees", str(scratch))
    finally:
        with signals_held():
            for folder in folders:
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    git("worktree", "remove", "--force", str(folder))
            shutil.rmtree(scratch, ignore_errors=True)


def measure(cell: Cell, runner: Runner, added: tuple[str, ...]) -> dict[str, object]:
    """One server.py run from the cell's commit's worktree; its row (server.py's own, from <side>.csv). A run that
    refuses the flags ends the study (every other run of that commit would be refused the same way)."""
    name, out = cell.experiment.name, runner.out_dir
    side_csv = out / f"{side_commit(name)[0]}.csv"
    flags = [*runner.server_flags, "--experiment", name, "--repeat", str(cell.repeat)]
    checkout = Path(added[added.index("--worktrees") + 1]) / name
    try:
        ran, row = runner.server_row(cell, flags, side_csv.name, checkout=checkout)
    except CellRefused as exc:  # say which commit's server.py refused them
        raise CellRefused(f"{exc} (at {name[:17]})") from None
    row = row or {}
    code = f"exit {ran.returncode}" + (f", timed out after {runner.timeout_s:g} s" if ran.timed_out else "")
    if not row or ran.returncode != 0 or ran.timed_out:
        status = row.get("status") if row and row.get("status") != "ok" else "crashed"
        commit = side_commit(name)[1]  # what ran, though it wrote no row saying so
        return {"commit": commit, **row, "status": status, "error": f"{code}: {row.get('error') or ran.said}"}
    return row


def report(args: argparse.Namespace, rows: pd.DataFrame, out: Path) -> list[str]:
    """Each repeat's figures (a run without its figure: failed), the A/B verdict over the repeats both ran (pairs
    by repeat: serverbench/schema/ab.py), and the runs that failed."""
    names = measured_names(args, rows)
    labels = {side: f"{getattr(args, side)} ({side_commit(names[side])[1][:12]})" for side in SIDES}
    figures = {side: figured(rows[rows["experiment"] == names[side]], args.column) for side in SIDES}

    def shown(side: str, repeat: int) -> str:
        value = figures[side].get(repeat)
        return "failed" if value is None else f"{value:,.4g}"

    repeats = sorted(set(rows["repeat"].astype(int)))
    kept = {side: rows[(rows["experiment"] == names[side]) & rows["repeat"].isin(figures[side])] for side in SIDES}
    found = compare_rows(kept["base"], kept["head"], args.column, labels["base"], labels["head"])
    failed = [f"repeat {r} {side}" for r in repeats for side in SIDES if figures[side].get(r) is None]
    return [
        f"# {args.column}: {labels['head']} against {labels['base']}, {len(repeats)} interleaved repeats",
        "",
        *table_head(["repeat", "base", "head"]),
        *(table_row([r, shown("base", r), shown("head", r)]) for r in repeats),
        "",
        found.text if found is not None else "no verdict: fewer than 2 repeats where both runs gave their figure",
        *([f"failed: {', '.join(failed)}"] if failed else []),
    ]


def figured(rows: pd.DataFrame, column: str) -> dict[int, float]:
    """Each repeat's figure, from its ok row (a failed run, or one without the figure, has none)."""
    ok = rows[rows["status"] == "ok"]
    values = pd.to_numeric(ok[column], errors="coerce") if column in ok else pd.Series(dtype=float)
    return {int(r): float(v) for r, v in zip(ok["repeat"], values) if pd.notna(v)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, help="the commit before the change")
    parser.add_argument("--head", default="HEAD", help="the commit with the change (default HEAD)")
    parser.add_argument(
        "--column",
        default="throughput",
        help="the row's figure to compare (default throughput: on the CPU divided by each run's machine-speed probe, "
        "the figure the A/B method was calibrated on; achieved_rate_rps stays raw)",
    )


STUDY = Study(
    "commits",
    __doc__,
    (cells,),
    report,
    add_arguments,
    repeats=AB_DEFAULT_REPEATS,
    fixture=worktrees,
    fixture_key=lambda cell: "worktrees",
    checked_cells=lambda args, rows: [],  # the server flags are the user's whole command: preflight checks them
    preflight=preflight,
    free_flags=("column",),  # the report's own
)


main = STUDY.main


if __name__ == "__main__":
    sys.exit(main())
