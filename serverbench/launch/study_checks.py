"""What a study's runs must pass before the first starts, and the folder it runs into: every cell's flags as
server.py would take them (check_cells, check_tool_run), a folder that holds runs of other server flags or a CSV
the runner could not resume from (resume_problem, record_flags), and one study at a time in a folder
(lock_out_dir)."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from serverbench.config.build import parse_server_flags, server_parser
from serverbench.config.flags import ConfigError
from serverbench.config.options import BenchConfig
from serverbench.launch.preflight import preflight
from serverbench.launch.study import RUNS_CSV, Cell, Experiment
from serverbench.records.report_input import ReportError, read_run_csv

FLAGS_FILE = "server_flags.json"  # the server flags a study's runs were made with, for its resume


def resume_problem(out_dir: Path, server_flags: Sequence[str]) -> str | None:
    """Why a study cannot run into out_dir, else None: a runs.csv the runner could not append to and read back (a
    server would write its row beside it, and every run would count as crashed and run again on each resume), or
    rows made with other server flags (they would count as done, under a report naming these)."""
    runs = out_dir / RUNS_CSV
    if runs.exists():
        try:
            read_run_csv(runs)
        except ReportError as exc:
            return f"{exc}; remove it or choose another --out"
    recorded = out_dir / FLAGS_FILE
    if not recorded.exists():
        return None
    try:
        before = json.loads(recorded.read_text())
    except (OSError, ValueError):
        before = None
    if before != list(server_flags):
        made = shlex.join(before) if isinstance(before, list) and all(isinstance(f, str) for f in before) else "?"
        return (
            f"{out_dir} holds runs made with the server flags `{made}`, not these: give the same flags to resume, or "
            "another --out"
        )
    return None


def record_flags(out_dir: Path, server_flags: Sequence[str]) -> None:
    (out_dir / FLAGS_FILE).write_text(json.dumps(list(server_flags)) + "\n")


class StudyLocked(Exception):
    """Another study or sweep is running on the same output folder."""


def lock_out_dir(out_dir: Path, what: str = "sweep") -> int:
    """An exclusive lock on the output folder, held while this study runs (and, passed to each server, until that
    server has exited); the file descriptor, or StudyLocked naming the process that holds it."""
    path = out_dir / ".sweep.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StudyLocked(
            f"another {what} (pid {holder}) is running on {out_dir}; wait for it, or choose another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _flag_names(args: Sequence[str]) -> set[str]:
    """The flags named in a command line, each by its positive form (--no-compile is --compile)."""
    names = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    return {"--" + name[5:] if name.startswith("--no-") else name for name in names}


# A tool writes its runs' command lines into logs, reports and server_flags.json: a token goes by the environment.
SECRET_FLAG = (
    "--auth_token: a tool writes its runs' command lines into logs and reports; give the token as "
    "$SERVERBENCH_AUTH_TOKEN (read for a door beyond loopback and for --target)"
)


def check_tool_run(cfg: BenchConfig) -> None:
    """What a run a tool makes may not hold (ConfigError): a token, which its logged command line would show; and
    --serve_only: such a run serves until it is stopped, so it would last its whole timeout and be reported as timed
    out (a door a tool stops itself is started as a served peer, not as a run)."""
    if cfg.auth_token is not None:
        raise ConfigError(SECRET_FLAG)
    if cfg.serve_only:
        raise ConfigError("--serve_only serves until it is stopped: a tool's run must end on its own; leave it out")


def _spelled_out(name: str, parser: argparse.ArgumentParser) -> str:
    """A flag as argparse reads it: an abbreviation that names one flag is that flag (argparse keeps its parsers'
    option strings in _actions, the one place they are listed)."""
    options = {option for action in parser._actions for option in action.option_strings}
    matches = [option for option in options if option.startswith(name)]
    return name if name in options or len(matches) != 1 else matches[0]


def given_flags(server_flags: Sequence[str]) -> set[str]:
    """The server.py flags a command line names, each spelled out as server.py reads it (--batch is --batch_size,
    --no-compile is --compile)."""
    parser = server_parser()
    return {_spelled_out(name, parser) for name in _flag_names(server_flags)}


def _set_by_runs(cell: Cell) -> set[str]:
    """The flags each run of `cell` sets itself: its axes (with its experiment's flags), where its row goes."""
    return _flag_names(cell.server_args((), "_")) | {"--output_file"}


def check_cells(cells: Sequence[Cell], server_flags: Sequence[str], given_last: bool = False) -> str | None:
    """Each cell's server flags validated as server.py would, before anything runs or is created: why the first
    that server.py would refuse is refused, else None. Cells that differ only in their repeat are checked once. A
    flag of `server_flags` that a cell sets itself (its axis, its configuration; with `given_last` its axis only)
    is refused, and so is an experiment's own flag that the grid's axes set: the cell's would win, and the run
    would not be what was asked."""
    given = given_flags(server_flags)
    if "--auth_token" in given:
        return SECRET_FLAG
    named = {flags: given_flags(flags) for flags in {cell.experiment.flags for cell in cells}}  # a parser each
    for cell in cells:
        axes = replace(cell, experiment=Experiment(cell.experiment.name, ()))
        if taken := sorted(named[cell.experiment.flags] & _set_by_runs(axes)):
            return (
                f"experiment {cell.experiment.name} gives {', '.join(taken)}, which the grid sets in each of its runs "
                "(the batch size, compile, the load point, the run's name and folder), so its value would be "
                "overridden; give it as an axis of the grid, or leave it out"
            )
        own = axes if given_last else cell
        if taken := sorted(given & _set_by_runs(own)):
            return (
                f"{', '.join(taken)}: every run of experiment {cell.experiment.name} sets it itself (its axes and "
                "configuration do), so the value given would be overridden; leave it out"
            )
    # Preflight too, as server.py: a model, checkpoint, device or size this machine refuses stops the study now.
    forwards_tried: set[tuple] = set()  # a user model's forward is tried once, not once per design
    with tempfile.TemporaryDirectory() as scratch:  # preflight makes the results folder: not the study's yet
        for cell in {replace(cell, repeat=0): None for cell in cells}:
            try:
                cfg = parse_server_flags(cell.server_args(server_flags, scratch, given_last))
                check_tool_run(cfg)
                preflight(cfg, forwards_tried)
            except ConfigError as exc:
                where = f"batch {cell.batch_size}" + (f", {cell.load_point.label()}" if cell.load_point else "")
                return f"experiment {cell.experiment.name} ({where}): server.py would refuse: {exc}"
    return None


def check_server_flags(commands: Iterable[Sequence[str]]) -> None:
    """Each server.py command line a tool will run (its flags; the tool adds where the row goes) as server.py's own
    parser and build_config take it, before any run; ConfigError naming the first refusal."""
    for flags in commands:
        try:
            check_tool_run(parse_server_flags(flags))
        except ConfigError as exc:
            raise ConfigError(f"the server flags after --: server.py would refuse them: {exc}") from None


# ----------------------------------------------------------------- the study flags the folder's runs were made with

ARGS_JSON = "study_args.json"  # a tool's own flags: what a fixture or a run that is not server.py's reads (study_args)


def record_args(out_dir: Path, args: argparse.Namespace) -> None:
    """The tool's flags (with args.server_flags) as the runs into out_dir are made with them, for a resume's and a
    --report_only's check (args_problem) and for what reads them back (study_args)."""
    kept = {name: value for name, value in vars(args).items() if name != "out"}
    (out_dir / ARGS_JSON).write_text(json.dumps(kept, default=str, indent=1) + "\n")


def study_args(out: Path) -> argparse.Namespace:
    """The study flags of the last command that ran runs into the folder."""
    return argparse.Namespace(**json.loads((out / ARGS_JSON).read_text()))


def measured_args(
    args: argparse.Namespace, out: Path, given: set[str], free_flags: Iterable[str]
) -> argparse.Namespace:
    """A --report_only's arguments as the measuring command gave them (study_args.json): its report is of those
    runs (a comparison at batch 256 is not judged against batch 64's ceiling), but for the free flags `given` now
    (the report's own: its SLO, its column); the command's own where none were recorded."""
    if not args.report_only or not (out / ARGS_JSON).exists():
        return args
    kept = given & set(free_flags)
    measured = {name: value for name, value in vars(study_args(out)).items() if name not in kept}
    return argparse.Namespace(**{**vars(args), **measured, "out": args.out, "report_only": True})


# Flags of how the runs are run, not of what they measure: a resume may change them (more rounds, a longer time
# limit, failed runs again); the server flags have their own check (resume_problem)
RUN_CONTROL = frozenset({"out", "seed", "cell_timeout_s", "report_only", "repeats", "retry_failed", "server_flags"})


def given_tool_flags(parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace) -> set[str]:
    """The dest names of the flags the command line gives, not left at their defaults: argparse sets a default only
    where the namespace has no such attribute, so in a namespace of Nones only a given flag has a value (an append
    flag's list starts from None as from no default)."""
    parsed = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args))))
    return {name for name, value in vars(parsed).items() if value is not None}


def _shown(flag: str, value: object) -> str:
    """A tool's flag as a command line gives it."""
    if isinstance(value, bool) or value in ([], None):
        return flag if value else f"no {flag}"
    return " ".join([flag, *map(str, value if isinstance(value, list) else [value])])


def args_problem(
    parser: argparse.ArgumentParser, free_flags: Iterable[str], args: argparse.Namespace, given: set[str]
) -> str | None:
    """Why these study flags cannot go with the runs already in the folder (study_args.json), else None: a resume
    with another value of a flag the runs depend on (the rows made with the old value would count as done under a
    report naming the new one), or a --report_only given such a flag (its report is of the runs as made).
    `free_flags`: those a resume may change and a --report_only takes as given (the report's own, more rounds)."""
    path = args.out / ARGS_JSON
    if not path.exists():
        return None
    try:
        made = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{path}: cannot be read ({type(exc).__name__}); remove it or choose another --out"
    if not isinstance(made, dict):
        return f"{path}: not the study flags a run records; remove it or choose another --out"
    now = json.loads(json.dumps(vars(args), default=str))  # as study_args.json holds them: paths as text, lists
    fixed = (set(now) & set(made)) - RUN_CONTROL - set(free_flags)  # a flag newer than the runs: unknown
    report_only = getattr(args, "report_only", False)  # a sweep has none
    changed = sorted(n for n in fixed if made[n] != now[n] and (not report_only or n in given))
    if not changed:
        return None
    # Each by its flag (--rates, not its dest rates_rps): argparse lists its parsers' flags in _actions only
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    was, asked = (", ".join(_shown(flags.get(n, f"--{n}"), values[n]) for n in changed) for values in (made, now))
    if report_only:
        return f"{asked}: the runs in {args.out} were made with {was}; --report_only reports them as made: leave it out"
    return (
        f"{args.out} holds runs made with {was}; this command gives {asked}: give the same to resume, or another --out"
    )
