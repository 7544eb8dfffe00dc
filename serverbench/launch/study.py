"""The study runner: a study's cells (an experiment's server flags x batch size x compile x load point x repeat),
each a server.py run in a session of its own (launch/session.py), interleaved by seed so that a drift of the machine
spreads over every configuration, resumed from the rows already in <out>/runs.csv, with a progress line per cell.
sweep.py and every bench study run their server.py runs here; what a study reports is its own."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from serverbench.config.load_kind import SweepAxis
from serverbench.config.loads import SWEEP_LOADS, load_kind
from serverbench.launch import procutil
from serverbench.launch.outcome import EXIT_INTERRUPTED
from serverbench.launch.session import STOP_GRACE_S, Session
from serverbench.records.csv_store import append_row
from serverbench.records.report_input import TRUE_TEXT
from serverbench.schema.ab import shuffled
from serverbench.system.process import last_line, one_line
from serverbench.system.provenance import CHECKOUT, read_provenance

RUNS_CSV = "runs.csv"
TIMEOUT_STATUS = "sweep_timeout"  # a run the runner stopped at its timeout
# How a server that was interrupted ends: 130 as it says, or killed by SIGINT before its handler was set.
INTERRUPTED_EXITS = (EXIT_INTERRUPTED, -signal.SIGINT)


@dataclass(frozen=True)
class Experiment:
    name: str
    flags: tuple[str, ...]
    # A run that is not server.py's (perf_analyzer against a served model): Measure makes it and gives its row
    measure: Measure | None = field(default=None, compare=False, repr=False)


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
    attempt: int = 1  # the runner's run of this cell in its folder (next_attempt): not part of its key

    @property
    def key(self) -> CellKey:
        return (self.experiment.name, self.batch_size, self.compile, self.load_point, self.repeat)

    def server_args(
        self, server_flags: Sequence[str], results_dir: Path | str | None, given_last: bool = False
    ) -> list[str]:
        """server.py's flags for this cell; the load point after the shared flags, so the axis wins over a --load
        given there; `results_dir` last (None: left to whoever runs it). `given_last`: the flags given to every run
        come after the experiment's own, which are then defaults they may override (a study of fixed commands whose
        model the user may shrink)."""
        shared = [*self.experiment.flags, *server_flags] if given_last else [*server_flags, *self.experiment.flags]
        return [
            *shared,
            *(self.load_point.flags() if self.load_point else ()),
            "--batch_size",
            str(self.batch_size),
            "--compile" if self.compile else "--no-compile",
            "--experiment",
            self.experiment.name,
            "--repeat",
            str(self.repeat),
            "--attempt",
            str(self.attempt),
            *(() if results_dir is None else ("--results_dir", str(results_dir))),
        ]

    def log_path(self, out_dir: Path) -> Path:
        """Where run_cell writes this cell's command line and output (a run again: its own, beside the earlier's)."""
        compiled = "c" if self.compile else "nc"
        point = f"_{self.load_point.tag()}" if self.load_point else ""
        again = f"_a{self.attempt}" if self.attempt > 1 else ""
        name = f"{self.experiment.name}_bs{self.batch_size}_{compiled}{point}_r{self.repeat}{again}.log"
        return out_dir / "logs" / name

    def label(self) -> str:
        point = f" {self.load_point.label()}" if self.load_point else ""
        return (
            f"{self.experiment.name} bs={self.batch_size} compile={'on' if self.compile else 'off'}{point} "
            f"repeat={self.repeat}"
        )


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
    """Every cell of the axes, `repeats` rounds interleaved."""
    return interleaved(grid(experiments, batch_sizes, compiles, points, repeat=0), repeats, seed)


def interleaved(round_cells: Sequence[Cell], repeats: int, seed: int) -> list[Cell]:
    """`round_cells` once per round, each round in its own order shuffled by (seed, round): a drift of the machine
    hits every configuration alike, and the same seed gives the same order (so a resumed study runs what is left)."""
    order: list[Cell] = []
    for repeat in range(repeats):
        order += shuffled([replace(cell, repeat=repeat) for cell in round_cells], seed, repeat)
    return order


def read_rows(runs_csv: Path) -> pd.DataFrame | None:
    """A study's rows so far (compile as a bool, a torchrun job once: its rank rows left out), or None before its
    first row."""
    if not runs_csv.exists():
        return None
    runs = read_csv(runs_csv)
    if runs.empty or "repeat" not in runs.columns:
        return None
    if "scope" in runs.columns:
        runs = runs[runs["scope"] != "rank"].reset_index(drop=True)
    runs["compile"] = runs["compile"].astype(str).str.strip().str.lower().isin(TRUE_TEXT)
    return runs


def _row_load_points(runs, load_axis: LoadAxes) -> list[LoadPoint | None]:
    """Each row's point on the sweep's load axes. Without an axis every row's is None, whatever its load: rows of
    a sweep given `-- --load poisson --rate 20` (or written before the axis existed) keep resuming as they did."""
    axes = _axes(load_axis)
    points: list[LoadPoint | None] = [None] * len(runs)
    if "load" not in runs.columns:
        return points
    for load in axes:
        column = LOAD_AXES[load]
        if column not in runs.columns:
            continue
        for index, (row_load, v) in enumerate(zip(runs["load"], runs[column])):
            if row_load == load and v == v:  # v == v: not NaN
                points[index] = LoadPoint(load, _canonical(v))
    return points


# The loads whose points a study's cells carry: one name (poisson, closed), several, or None for no load axis
LoadAxes = str | Sequence[str] | None


def _axes(load_axis: LoadAxes) -> tuple[str, ...]:
    found = (load_axis,) if isinstance(load_axis, str) else tuple(load_axis or ())
    return tuple(load for load in found if load in LOAD_AXES)


def _row_keys(runs, load_axis: LoadAxes) -> list[CellKey]:
    return [
        (str(e), int(b), bool(c), p, int(r))
        for e, b, c, p, r in zip(
            runs["experiment"], runs["batch_size"], runs["compile"], _row_load_points(runs, load_axis), runs["repeat"]
        )
    ]


def completed_keys(runs_csv: Path, retry_failed: bool, load_axis: LoadAxes = None) -> set[CellKey]:
    """Cells that have a row: done, unless it says the cell was interrupted (a Ctrl-C is not the cell's own
    failure: it runs again) or, with retry_failed, that it failed. load_axis: poisson or closed (or both) when the
    cells carry load points (--rates, --concurrency), so that a row counts for its own."""
    runs = read_rows(runs_csv)
    if runs is None:
        return set()
    runs = runs[runs["status"] != "interrupted"]
    if retry_failed:
        runs = runs[runs["status"] == "ok"]
    return set(_row_keys(runs, load_axis))


class CellRefused(Exception):
    """server.py refused a cell's flags (exit 2): every other cell would be refused the same way."""


class CellInterrupted(KeyboardInterrupt):
    """Someone stopped a cell's server (its exit status says interrupted): a study that stops with it raises
    this."""


class FixtureFailed(Exception):
    """What a cell's run needs beside it (a server it runs against) did not start: the cell fails with this line."""


# A cell's fixture: what its run needs beside it, started around it (an echo server it runs against), given the cell
# and the study's folder; it yields the flags it adds to the run (they come last: they replace the placeholders the
# checks before any run saw, a --target's address). Raises FixtureFailed.
Fixture = Callable[[Cell, Path], AbstractContextManager[tuple[str, ...]]]
# A cell's run that is not server.py's (an Experiment's measure): given the cell, its runner (folder, server flags,
# timeout) and the flags its fixture added, it makes the run and returns its row: status, error and its figures
# (p99_latency_s as server.py names them); the runner adds the cell's key and what made the row (the row's own commit
# wins: a run from another checkout's worktree). Anything it raises but CellRefused is the cell's failure.
Measure = Callable[["Cell", "Runner", tuple[str, ...]], dict[str, object]]


@contextmanager
def _failing_as_fixture(fixture: AbstractContextManager[tuple[str, ...]]) -> Iterator[tuple[str, ...]]:
    """A fixture whose start raised anything but FixtureFailed fails as FixtureFailed, in one line."""
    with ExitStack() as stack:
        try:
            added = stack.enter_context(fixture)
        except FixtureFailed:
            raise
        except Exception as exc:  # whatever starting it raised is the cell's failure, in one line
            raise FixtureFailed(one_line(exc)) from exc
        yield added


class HeldFixtures:
    """The fixture around each cell's run; with `key`, cells that share a key share one fixture (a server several
    runs are made against): it is started for the first of them and stays up until a cell with another key comes,
    or the runs end (close). A fixture that did not start fails every cell of its key without starting again."""

    def __init__(self, fixture: Fixture | None, key: Callable[[Cell], Hashable] | None, out_dir: Path) -> None:
        self._fixture, self._key, self._out_dir = fixture, key, out_dir
        self._held: ExitStack | None = None
        self._held_key: Hashable = None
        self._flags: tuple[str, ...] = ()
        self._failed: str | None = None

    def around(self, cell: Cell) -> AbstractContextManager[tuple[str, ...]]:
        """The flags the cell's fixture adds, within it; FixtureFailed when it did not start."""
        if self._fixture is None:
            return nullcontext(())
        if self._key is None:
            return _failing_as_fixture(self._fixture(cell, self._out_dir))
        key = self._key(cell)
        if self._held is None or key != self._held_key:
            self.close()
            self._held_key, self._held, self._failed = key, ExitStack(), None
            try:
                self._flags = self._held.enter_context(_failing_as_fixture(self._fixture(cell, self._out_dir)))
            except FixtureFailed as exc:
                self._failed = str(exc)
        if self._failed is not None:
            raise FixtureFailed(self._failed)
        return nullcontext(self._flags)

    def close(self) -> None:
        """The held fixture stopped (its server told to stop, waited for)."""
        held, self._held = self._held, None
        if held is not None:
            held.close()


@dataclass(frozen=True)
class Runner:
    """Where and how a study's cells run: their rows go to <out_dir>/runs.csv, each cell's command line and output
    to <out_dir>/logs/. `prog` names the tool in what it prints; `keep_open`: file descriptors each server inherits
    (the study's lock, held until the server has exited); `stop_when_interrupted`: a cell whose server someone else
    stopped stops the study (CellInterrupted) instead of counting as a failed cell; `fixture`: started around each
    cell's run (Fixture), one for consecutive cells that share their `fixture_key` when it is given."""

    prog: str
    out_dir: Path
    server_flags: tuple[str, ...] = ()
    timeout_s: float = 3600.0
    python: str = sys.executable
    keep_open: tuple[int, ...] = ()
    stop_when_interrupted: bool = False
    fixture: Fixture | None = None
    fixture_key: Callable[[Cell], Hashable] | None = None
    given_last: bool = False  # the server flags come after each experiment's own (Cell.server_args)
    env: Mapping[str, str] | None = None  # added to each server's environment (the door's carried packages)
    stop_grace_s: float = STOP_GRACE_S

    def run_cell(self, cell: Cell, fixtures: HeldFixtures | None = None) -> str:
        """Runs one cell (inside its fixture, `fixtures`' when given); returns its status. A cell that dies without
        writing its row, or whose fixture did not start, gets one written here. A cell with rows runs as its next
        attempt."""
        fixtures = fixtures or HeldFixtures(self.fixture, None, self.out_dir)
        cell = replace(cell, attempt=next_attempt(cell, self.out_dir))
        try:
            with fixtures.around(cell) as added:
                if cell.experiment.measure is not None:
                    return self._measure(cell, added)
                return self._run_server(cell, added)
        except FixtureFailed as exc:
            return record_failure(cell, self.out_dir, "error", str(exc))

    def _measure(self, cell: Cell, added: tuple[str, ...]) -> str:
        """A run that is not server.py's, its row made by its Measure, with the cell's key and what made it."""
        log_path = cell.log_path(self.out_dir)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            measured = cell.experiment.measure(cell, self, added)
        except CellRefused:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the run raised is its recorded failure, not the study's
            measured = {"status": "error", "error": one_line(exc)}
        row = {name: value.item() if isinstance(value, np.generic) else value for name, value in measured.items()}
        # The key last: a row that names another batch or experiment would never count for its cell on resume
        append_row(self.out_dir / RUNS_CSV, {**_made_by(), **row, **_key_columns(cell)})
        return str(row["status"])

    def release(self) -> None:
        """Closes what the servers inherited (the study's lock on its folder): its runs are done, and a later
        study, in this process or another, may take the folder."""
        for fd in self.keep_open:
            os.close(fd)

    def cell_flags(self, cell: Cell, added: tuple[str, ...] = ()) -> list[str]:
        """server.py's flags for a cell's run here, but where its row goes (a measure's run decides that): the
        runner's and the cell's, then what its fixture added."""
        return [*cell.server_args(self.server_flags, None, self.given_last), *added]

    def server(
        self, cell: Cell, flags: Sequence[str], output_file: str = RUNS_CSV, checkout: Path = CHECKOUT
    ) -> ServerExit:
        """One server.py run of a cell, from `checkout` (a commit's worktree): `flags`, its row to
        <out_dir>/<output_file>, its command line and output in the cell's log. Past the timeout it is stopped as an
        interrupt would (its partial row written); Ctrl-C here stops it and is raised again. Exit 2 raises
        CellRefused (every other run with these flags would be refused alike); with stop_when_interrupted, a server
        someone else interrupted raises CellInterrupted."""
        cmd = [self.python, str(checkout / "server.py"), *flags]
        cmd += ["--results_dir", str(self.out_dir), "--output_file", output_file]
        log_path = cell.log_path(self.out_dir)
        proc = Session.logged(cmd, log_path, checkout, self.env, self.keep_open).proc  # the one launcher
        try:
            returncode = proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.stop(proc, signal.SIGTERM)
            return ServerExit(proc.poll(), True, _said(log_path))
        except KeyboardInterrupt:
            self.stop(proc, signal.SIGINT)
            raise
        if returncode == 2:
            raise CellRefused(f"server.py refused its flags: {_said(log_path) or 'exit 2, nothing said'}")
        if returncode in INTERRUPTED_EXITS and self.stop_when_interrupted:
            raise CellInterrupted(cell.label())
        return ServerExit(returncode, False, _said(log_path))

    def server_row(
        self, cell: Cell, flags: Sequence[str], output_file: str, row_file: str = "", checkout: Path = CHECKOUT
    ) -> tuple[ServerExit, dict[str, object] | None]:
        """A measure's own server.py run (`server`), and the row it appended to <out_dir>/<row_file> (its
        output_file unless named: a peak search writes its result to peak.csv), None when it appended none."""
        path = self.out_dir / (row_file or output_file)
        before = _readable(path)
        ended = self.server(cell, flags, output_file, checkout)
        return ended, _appended(before, _readable(path))

    def _run_server(self, cell: Cell, added: tuple[str, ...]) -> str:
        ended = self.server(cell, [*self.cell_flags(cell, added), "--save_requests"])
        log_path = cell.log_path(self.out_dir)
        if ended.timed_out:
            why = f"no result within {self.timeout_s:g} s (see {log_path})"
            return record_failure(cell, self.out_dir, TIMEOUT_STATUS, why)
        row = row_of(cell, self.out_dir)
        if row is None:  # it died before writing its row (an earlier attempt's row is not this run's)
            why = f"server.py exit status {ended.returncode} (see {log_path})"
            return record_failure(cell, self.out_dir, "crashed", why)
        return str(row["status"])

    def stop(self, proc: subprocess.Popen, signum: int) -> None:
        """Stops a cell's server as an interrupt would (procutil.stop_session): its partial row is written and its
        resource tracker cleans up; one that does not stop within the grace is killed with its session, and what
        its processes had mapped in /dev/shm is unlinked here."""
        removed = procutil.stop_session(proc, signum, self.stop_grace_s)
        if removed is not None:
            said = f"the cell's server did not stop within {self.stop_grace_s:g} s: killed; unlinked {len(removed)}"
            print(f"{self.prog}: {said} shared-memory entries it left", file=sys.stderr, flush=True)

    def run(
        self, cells: Sequence[Cell], retry_failed: bool = False, load_axis: LoadAxes = None, what: str = ""
    ) -> list[tuple[Cell, str]]:
        """The cells that have no row yet (an interrupted one runs again; a failed one with retry_failed), one
        progress line each, after a line saying how many and `what` they are; the cells that did not complete.
        load_axis: the load whose points the cells carry (poisson, closed), so that a row counts for its own."""
        done = completed_keys(self.out_dir / RUNS_CSV, retry_failed, load_axis)
        todo = [cell for cell in cells if cell.key not in done]
        said = f"{len(cells)} runs{f' ({what})' if what else ''} into {self.out_dir}"
        print(f"{self.prog}: {said}; {len(cells) - len(todo)} already done", flush=True)
        fixtures = HeldFixtures(self.fixture, self.fixture_key, self.out_dir)
        try:
            return run_cells(todo, len(cells), lambda cell: self.run_cell(cell, fixtures))
        finally:
            fixtures.close()


@dataclass(frozen=True)
class ServerExit:
    """How a server.py run ended: its exit status (None: its session was killed), whether the runner's timeout
    stopped it, and the last line of its output (its refusal or failure)."""

    returncode: int | None
    timed_out: bool
    said: str


def _said(log_path: Path) -> str:
    """A run's last line of output, after its command line."""
    return last_line("\n".join(log_path.read_text(errors="replace").splitlines()[1:]))


def read_csv(path: Path) -> pd.DataFrame:
    """A CSV runs append to (empty when it is missing). A last line without its newline, cut by a crash or being
    appended by a server running beside (the GPU plan's), is left out, as the CSV store's next append sets it aside:
    a resume runs that cell again rather than failing on a row cut before its key, or counting it done."""
    if not path.exists():
        return pd.DataFrame()
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    return pd.read_csv(io.BytesIO(whole), low_memory=False) if whole.strip() else pd.DataFrame()


def _readable(path: Path) -> pd.DataFrame:
    """A measure's own CSV, or none where it cannot be read at all (read_csv already leaves out a line cut by a
    crash): the run goes ahead rather than failing on a file it only compares before and after."""
    try:
        return read_csv(path)
    except (OSError, ValueError):
        return pd.DataFrame()


def _appended(before: pd.DataFrame, after: pd.DataFrame) -> dict[str, object] | None:
    """The row a run appended: the last whose run_id was not there before (a line cut by an earlier crash, set
    aside by this run's append, leaves the count as it was); by the count where the rows have no run_id."""
    if "run_id" in after and len(after):
        new = after[~after["run_id"].isin(before["run_id"] if "run_id" in before else [])]
        return _record(new.iloc[-1]) if len(new) else None
    return _record(after.iloc[-1]) if len(after) > len(before) else None


def _record(row: pd.Series) -> dict[str, object]:
    """A row as a dict, its empty cells None."""
    return {name: None if pd.isna(value) else value for name, value in row.items()}


def csv_records(path: Path) -> list[dict[str, object]]:
    """The rows of a CSV runs append to (a runs.csv, a peak search's peak.csv) as dicts, empty cells None."""
    return [_record(row) for _, row in read_csv(path).iterrows()]


def _cell_attempts(cell: Cell, out_dir: Path) -> tuple[pd.DataFrame | None, dict[int, int]]:
    """The rows of <out_dir>/runs.csv and, for each of the cell's, its index and attempt (none written: 1)."""
    runs = read_rows(out_dir / RUNS_CSV)
    if runs is None:
        return None, {}
    attempts = pd.to_numeric(runs.get("attempt", pd.Series(1, index=runs.index)), errors="coerce").fillna(1)
    keys = _row_keys(runs, cell.load_point and cell.load_point.load)
    return runs, {i: int(attempts.iloc[i]) for i, key in enumerate(keys) if key == cell.key}


def next_attempt(cell: Cell, out_dir: Path) -> int:
    """The cell's next run: one more than its latest attempt there (a timed-out run has two rows of one)."""
    return 1 + max(_cell_attempts(cell, out_dir)[1].values(), default=0)


def row_of(cell: Cell, out_dir: Path) -> dict[str, object] | None:
    """The latest row of the cell's attempt in <out_dir>/runs.csv (empty cells as None), or None when it has none:
    a run beside it in the folder (the GPU plan's) writes another cell's, an earlier attempt's is not this run's."""
    runs, attempts = _cell_attempts(cell, out_dir)
    mine = [i for i, attempt in attempts.items() if attempt == cell.attempt]
    return _record(runs.iloc[mine[-1]]) if mine else None


def _key_columns(cell: Cell) -> dict[str, object]:
    """The columns a row is found by on resume (completed_keys), and which run of its cell it is."""
    return {
        "experiment": cell.experiment.name,
        "batch_size": cell.batch_size,
        "compile": cell.compile,
        "repeat": cell.repeat,
        "attempt": cell.attempt,
        **(cell.load_point.row_columns() if cell.load_point else {}),
    }


def _made_by() -> dict[str, object]:
    """What made a row the runner writes itself, as server.py's rows say it."""
    made = read_provenance()
    return {"commit": made.commit, "code_dirty": made.code_dirty, "cpu_model": made.cpu_model}


def record_failure(cell: Cell, out_dir: Path, status: str, error: str) -> str:
    append_row(out_dir / RUNS_CSV, {**_key_columns(cell), **_made_by(), "status": status, "error": error})
    return status


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


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
        took = f"{status} in {time.monotonic() - cell_start:.1f} s"
        print(f"{took} | elapsed {_duration(elapsed)}, left ~{_duration(eta)}", flush=True)
    return failed


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interruptible(prog: str, work: Callable[[], int], kept: str = "") -> int:
    """A tool's `work` (a study's, the search's, a sweep's: its checks, runs and report) with Ctrl-C and SIGTERM
    raised as KeyboardInterrupt, even when the tool started with SIGINT ignored (`&` in a script): the server in
    flight is stopped as an interrupt (the runner), and the tool says so in one line (`kept`: what stays, e.g. the
    rows so far) and exits 130, as server.py does. A server someone else interrupted stops it the same way; a run
    whose flags server.py refused (which the checks before the first run could not see) ends it with one line and
    exit 1."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return work()
    except CellRefused as exc:  # a run's flags that the checks before the first run could not see
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        for signum in previous:  # a second Ctrl-C now would only cut this line short
            signal.signal(signum, signal.SIG_IGN)
        print(f"{prog}: interrupted{kept}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, handler)
