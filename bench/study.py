"""A study in one file: what it runs (its phases of cells, on the study runner) and what it reports. `run_study` is
the rest every study shares: its command line (the study's own flags, then --out, --repeats, --seed,
--cell_timeout_s, --retry_failed, --report_only, and server flags after --), every cell's flags checked as server.py
checks them before any run, the runs interleaved and resumable, Ctrl-C as every bench tool takes it, and the report
written to <out>/<name>.md (printed) under a header that says which command, commit and machine made the rows.

How to add one: docs/studies.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from serverbench.config.flags import OneLineErrorParser, bounded
from serverbench.config.limits import MAX_REPEATS, MAX_SECONDS
from serverbench.config.paths import parse_bench_args
from serverbench.launch.study import RUNS_CSV, Cell, Fixture, LoadAxes, Runner, interruptible, read_rows
from serverbench.launch.study_checks import (
    StudyLocked,
    args_problem,
    check_cells,
    given_tool_flags,
    lock_out_dir,
    measured_args,
    record_args,
    record_flags,
    resume_problem,
)
from serverbench.records.markdown import figure
from serverbench.records.report_input import (
    CELL_KEY_COLUMNS,
    TRUE_TEXT,
    ReportError,
    drop_superseded,
    read_run_csv,
)
from serverbench.schema.stats import cv_pct
from sweep import split_server_flags

ROOT = Path(__file__).resolve().parent.parent

# A phase: the study's cells given its arguments and the rows so far (None before the first), e.g. a Poisson
# phase at a fraction of the rate a burst phase measured. Called again on a resume: the same rows, the same cells.
Phase = Callable[[argparse.Namespace, "pd.DataFrame | None"], list[Cell]]
# The report: markdown lines from the study's arguments, its rows and its folder (where it may draw its plots); the
# first is its title, which the header of provenance follows.
Report = Callable[[argparse.Namespace, pd.DataFrame, Path], list[str]]


@dataclass(frozen=True)
class Study:
    name: str  # python -m bench.<name>; its report <out>/<name>.md
    description: str  # its --help
    phases: tuple[Phase, ...]
    report: Report
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    repeats: int = 2  # interleaved rounds by default
    load_axis: LoadAxes = None  # the loads whose points its cells carry (poisson, closed, or both), if any
    server_flags: tuple[str, ...] = ()  # flags every run gets before those after --
    fixture: Fixture | None = None  # what each run needs beside it, started around it (an echo it runs against)
    # Consecutive cells with the same key share one fixture, kept up across their runs (a peer's server)
    fixture_key: Callable[[Cell], Hashable] | None = None
    # Whether the study's target is met (None: not measured): exit 1 unless it is. None: no target.
    target_met: Callable[[argparse.Namespace, pd.DataFrame], bool | None] | None = None
    # The cells the checks before any run see, when the later phases' flags need checking too (their rates at
    # placeholders): by default the first phase's.
    checked_cells: Phase | None = None
    # The flags after -- come after each experiment's own and may override them (its model's size, its request
    # count), instead of being refused where an experiment sets the same flag
    given_last: bool = False
    # The study's own checks before any run or report (a tool or environment the machine lacks, a commit that does
    # not exist): why it cannot go on, else None; it sees --report_only and the server flags (args.server_flags)
    preflight: Callable[[argparse.Namespace], str | None] | None = None
    # What the runs need made or brought before the first (perf_analyzer's binary): after every check, so that a
    # refused flag writes nothing; why it cannot be, else None
    prepare: Callable[[argparse.Namespace], str | None] | None = None
    # Study flags (their dest names) that the runs' rows do not depend on: the report's own (its SLO, the column it
    # compares) or more rounds. A resume may change them and --report_only takes them as given; any other study
    # flag must be the one the folder's runs were made with (study_args.json).
    free_flags: tuple[str, ...] = ()

    def main(self, argv: Sequence[str] | None = None) -> int:
        """The study's command line (its module's `main = STUDY.main`)."""
        return run_study(self, argv)


@dataclass(frozen=True)
class Verdict:
    """A target of a study's report: its words (the figure and the rule) and whether it was met; None: measured and
    shown, with no target."""

    text: str
    met: bool | None = None

    def line(self) -> str:
        return f"- {VERDICT_MARKS[self.met]}: {self.text}"


VERDICT_MARKS = {True: "met", False: "NOT met", None: "shown"}


def build_parser(study: Study) -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog=f"python -m bench.{study.name}",
        description=study.description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Flags after -- go to every server.py run.",
    )
    study.add_arguments(parser)
    runs = add_run_arguments(parser, study.name)
    runs.add_argument(
        "--repeats",
        type=bounded(int, 1, MAX_REPEATS),
        default=study.repeats,
        help=f"interleaved rounds, 1 to {MAX_REPEATS} (default {study.repeats})",
    )
    runs.add_argument("--retry_failed", action="store_true", help="on resume, run failed runs again")
    return parser


def add_run_arguments(parser: argparse.ArgumentParser, name: str, timeout_s: float = 3600.0) -> argparse._ArgumentGroup:
    """The flags of a study's runs, defined once for every study and the search: its folder, the seed of the run
    order, a run's time limit and --report_only; the group, for the caller's own."""
    runs = parser.add_argument_group("the runs")
    runs.add_argument("--out", type=Path, default=ROOT / "results" / name, help="its folder; re-running resumes")
    runs.add_argument("--seed", type=int, default=0, help="seed of the run order (default 0)")
    runs.add_argument(
        "--cell_timeout_s",
        type=bounded(float, 1.0, MAX_SECONDS),
        default=timeout_s,
        help=f"seconds a run may take before it is stopped and recorded (default {timeout_s:g})",
    )
    runs.add_argument("--report_only", action="store_true", help=f"rewrite the report from <out>/{RUNS_CSV}")
    return runs


def run_study(study: Study, argv: Sequence[str] | None = None) -> int:
    """The study's command line run: checks, its phases' runs, its report; the exit status."""
    argv, server_flags = split_server_flags(sys.argv[1:] if argv is None else argv)
    parser = build_parser(study)
    args = parse_bench_args(parser, argv, f"bench.{study.name}", RUNS_CSV)  # --out checked before any run
    given = given_tool_flags(parser, argv, args)
    flags = (*study.server_flags, *server_flags)
    args.server_flags = list(flags)  # what every run is given: a study's phases, preflight and report may read it
    if study.preflight is not None and (problem := study.preflight(args)) is not None:
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    kept = f"; the rows so far are in {args.out / RUNS_CSV}: the same command resumes"
    command = tool_command(study.name, argv, server_flags)

    def work() -> int:  # the checks (a model's forward tried in a child), what the runs need, the runs: a Ctrl-C
        # in any is one line
        checked = (study.checked_cells or study.phases[0])(args, None)
        if not args.report_only and (problem := runs_problem(args.out, checked, flags, study.given_last)) is not None:
            parser.error(problem)
        if args.report_only and (problem := rows_problem(args.out / RUNS_CSV)) is not None:
            parser.error(problem)
        if (problem := args_problem(parser, study.free_flags, args, given)) is not None:
            parser.error(problem)
        # A folder written for nothing would then be refused to the corrected command, as holding other flags' runs
        if not args.report_only and not any(phase(args, None) for phase in study.phases):
            parser.error(
                "these flags give no run to make (e.g. peers that only our generator drives, with "
                "--clients perf_analyzer): nothing would be measured"
            )
        if study.prepare is not None and not args.report_only and (problem := study.prepare(args)) is not None:
            print(f"{parser.prog}: error: {problem}", file=sys.stderr)
            return 2
        return run_and_report(study, args, flags, command, given)

    return interruptible(parser.prog, work, kept)


def runs_problem(out: Path, cells: Sequence[Cell], flags: Sequence[str], given_last: bool = False) -> str | None:
    """Why the runs cannot start, before the first: a cell's flags that server.py would refuse, or a folder that
    holds runs of other server flags; else None."""
    if (problem := check_cells(cells, flags, given_last)) is not None:
        return f"server.py would refuse a run: {problem}"
    return resume_problem(out.resolve(), flags)


def tool_command(name: str, argv: Sequence[str], server_flags: Sequence[str]) -> str:
    """The command line that ran bench.<name>, as its report names it."""
    return shlex.join(["python", "-m", f"bench.{name}", *argv, *(["--", *server_flags] if server_flags else [])])


def rows_problem(runs_csv: Path) -> str | None:
    """Why --report_only has nothing to report from (a runs.csv that is not one, or one without rows), else None."""
    try:
        read_run_csv(runs_csv)
    except ReportError as exc:
        return str(exc)
    return f"{runs_csv} holds no rows; measure first" if read_rows(runs_csv) is None else None


def run_and_report(
    study: Study, args: argparse.Namespace, flags: tuple[str, ...], command: str, given: set[str] = frozenset()
) -> int:
    """Each phase's cells that have no row yet, then the report; exit 1 when a run failed or a target was missed."""
    out: Path = args.out.resolve()
    if not args.report_only:
        options = {"fixture": study.fixture, "fixture_key": study.fixture_key, "given_last": study.given_last}
        runner = study_runner(f"bench.{study.name}", out, flags, args.cell_timeout_s, command, **options)
        if runner is None:
            return 2
        record_args(out, args)
        try:
            for number, phase in enumerate(study.phases, start=1):
                cells = phase(args, read_rows(out / RUNS_CSV))
                what = f"phase {number} of {len(study.phases)}, {args.repeats} interleaved rounds"
                runner.run(cells, args.retry_failed, study.load_axis, what)
        finally:
            runner.release()
    rows = read_rows(out / RUNS_CSV)
    if rows is None:
        print(f"bench.{study.name}: error: {out / RUNS_CSV} holds no rows", file=sys.stderr)
        return 1
    kept = drop_superseded(rows)  # a run that a resume or --retry_failed ran again counts once, as its later row
    args = measured_args(args, out, given, study.free_flags)
    title, *body = study.report(args, kept, out)
    text = "\n".join([title, "", *provenance(command, kept, measured_by(out), len(rows) - len(kept)), *body, ""])
    (out / f"{study.name}.md").write_text(text)
    print(text)
    # Each cell by its latest row: a run that --retry_failed ran again and that passed then is no failure
    key = [column for column in CELL_KEY_COLUMNS if column in kept.columns]
    latest = kept.groupby(key, dropna=False, sort=False).tail(1)
    missed = study.target_met is not None and study.target_met(args, kept) is not True
    return 1 if (latest["status"] != "ok").any() or missed else 0


def study_runner(
    prog: str, out: Path, flags: tuple[str, ...], timeout_s: float, command: str, **options: object
) -> Runner | None:
    """The study's folder made and locked (one study at a time in it), its server flags recorded for a resume and
    its command for the report, and the runner of its cells (`options`: the Runner's fixture, fixture_key,
    given_last); None, after one line on stderr, when another study holds the folder."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        lock_fd = lock_out_dir(out, "study")
    except StudyLocked as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return None
    record_flags(out, flags)
    (out / MEASURED_BY).write_text(command + "\n")
    return Runner(prog, out, flags, timeout_s, keep_open=(lock_fd,), stop_when_interrupted=True, **options)


MEASURED_BY = "command.txt"  # the last command that ran runs into the folder: a re-rendered report names it


def repeat_cells(values: Sequence[float], fmt: str) -> list[str]:
    """A figure over the repeats as a table's three cells: each repeat's, their mean and their CV."""
    mean = sum(values) / len(values) if len(values) else None
    return [", ".join(format(v, fmt) for v in values), figure(mean, fmt), figure(cv_pct(values), unit=" %")]


def with_columns(rows: pd.DataFrame, *names: str) -> pd.DataFrame:
    """The rows with every named column, empty where none had it: a folder whose runs all died before writing
    their figures holds only the runner's rows (key, status, error), and a report must still say so."""
    return rows.assign(**{name: float("nan") for name in names if name not in rows})


def part_rows(rows: pd.DataFrame, part: str, *columns: str) -> pd.DataFrame:
    """The rows of a part of a study whose cells are named `<part>.<name>`, named `<name>`, with every column named
    (with_columns)."""
    names = rows["experiment"].astype(str)  # an empty or all-NaN column is no string column
    inside = names.str.startswith(f"{part}.")
    own = names[inside].str.split(".", n=1).str[1].to_numpy()
    return with_columns(rows[inside].assign(experiment=own), *columns)


def measured_by(out: Path) -> str | None:
    """The last command that ran runs into the folder; None for rows made before it was recorded."""
    path = out / MEASURED_BY
    return path.read_text().strip() or None if path.exists() else None


def provenance(command: str, rows: pd.DataFrame, measured: str | None = None, replaced: int = 0) -> list[str]:
    """What made the rows: the command that ran them (`measured`, when the report is rendered by another, e.g. a
    --report_only), the commits and machines the rows name, the rows' count (and `replaced`: how many earlier
    failed or interrupted rows a run again replaced), the report's date."""

    def named(*columns: str) -> str:
        values = {str(value) for column in columns if column in rows for value in rows[column].dropna()}
        return ", ".join(sorted(values)) or "not recorded"

    dirty_rows = rows["code_dirty"].astype(str).str.strip().str.lower().isin(TRUE_TEXT) if "code_dirty" in rows else []
    dirty = " (a tree with uncommitted changes)" if any(dirty_rows) else ""
    commands = [f"- command: `{command}`"]
    if measured is not None and measured != command:
        commands = [f"- command: `{measured}`", f"- this report: `{command}`"]
    return [
        *commands,
        f"- commit: {named('commit')}{dirty}; machine: {named('cpu_model', 'device_name')}",
        f"- rows: {len(rows)} ({int((rows['status'] == 'ok').sum())} ok)"
        f"{f', {replaced} more that a later run of the same cell replaced' if replaced else ''}; report written "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
    ]
