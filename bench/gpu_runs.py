"""What the checks of bench.gpu_check are made of: the plan (a GPU's sizes or --dry_run's), a check's verdict,
the server runs (server.py as sweep cells, bounded by a deadline), other tools run to a deadline (pytest), and the
tables of the summary."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_probe import ROOT
from serverbench.launch.session import Session
from serverbench.launch.study import TIMEOUT_STATUS, Cell, CellRefused, Experiment, record_failure, row_of
from serverbench.launch.study import Runner as StudyRunner
from serverbench.records.markdown import table
from serverbench.system.process import one_line

PASS, FAIL, INFO, NOT_RUN, REFUSED = "pass", "FAIL", "info", "not run", "refused"
BUDGET, PARTIAL = "not run (budget)", "partial (budget)"
# A server run's row status when the study runner stopped it at the time left, and when it was never started.
CUT_STATUS, SKIPPED_STATUS = TIMEOUT_STATUS, "not_run_budget"


@dataclass(frozen=True)
class Plan:
    """The sizes and the concurrency of every check: a GPU's, or tiny ones on the CPU for --dry_run."""

    device: str
    model: str  # verify, overlap, door and the reference table
    image_size: int
    batch_size: int  # verify, race, overlap, compile, the example model, instances
    num_iters: int
    ceiling_s: float  # the timed runs' ceiling; the runs that only check correctness run without one
    timed_min_s: float  # the timed runs' least measured phase (--duration_s): NVML's utilisation needs 1 s windows
    race_model: str  # a model slow enough for the planted race to show
    race_image_size: int  # small enough that the frontend keeps the backend's queue full: the race's window
    race_repeats: int
    race_num_iters: int
    compile_model: str
    compare_model: str
    compare_batch_size: int
    compare_num_iters: int
    compare_precision: str  # the fastest configuration's; the reference-like one runs at the default
    bandwidth_mib: int
    example_tokens: int  # the example encoder's sequences and layers
    example_depth: int
    door_batch_sizes: tuple[int, ...]
    door_num_iters: int
    table_batch_sizes: tuple[int, ...]
    table_num_iters: int
    table_experiments: tuple[str, ...]  # of TABLE_EXPERIMENTS
    compile_cases: tuple[str, ...]  # of COMPILE_CASES
    example_cases: tuple[str, ...]  # eager, batching
    verify_every_pair: bool  # every design over both transports; the dry run: each design over one, in turn
    server_slots: int  # server runs at once, all checks together, outside the timed checks
    concurrent_checks: int  # checks that only test correctness, run at once
    timed_alone: bool  # the timed checks (bandwidth, overlap, compare, door, table) run with nothing beside them
    pytest_workers: int  # pytest-xdist's -n for the cuda tests, where it is installed
    time_scale: float  # each check's least time worth starting it with (seconds on a GPU) times this
    stop_grace_s: float  # a server told to stop writes its row within about 7 s
    min_run_s: float  # a server run is not started with less than this left
    end_margin_s: float  # kept at the end of the budget: the summary and the bundle

    def server_flags(self, ceiling: bool) -> list[str]:
        flags = ["--device", self.device, "--model", self.model, "--image_size", str(self.image_size)]
        flags += ["--num_iters", str(self.num_iters)]
        if ceiling and self.timed_min_s > 0:
            flags += ["--duration_s", str(self.timed_min_s)]
        return flags + (["--ceiling_s", str(self.ceiling_s)] if ceiling else ["--no-ceiling"])


@dataclass
class Check:
    name: str
    status: str  # pass, FAIL, info (measured, no verdict on this device), not run, refused, not run (budget), ...
    detail: str  # one line: what was measured, or why it failed or did not run
    where: str = ""  # the rows, logs or files behind it, inside the bundle
    table: str = ""  # markdown numbers for the summary
    seconds: float = 0.0


@dataclass(frozen=True)
class RunSpec:
    """One server.py run of a check: its experiment name, flags (after the plan's, so they win), batch and compile."""

    name: str
    flags: tuple[str, ...]
    batch_size: int
    compile: bool = False
    repeat: int = 0

    def cell(self) -> Cell:
        return Cell(Experiment(self.name, self.flags), self.batch_size, self.compile, self.repeat)


@dataclass
class RunResult:
    spec: RunSpec
    status: str
    row: dict
    cut: bool  # stopped by the budget (or never started): not a failure of the code
    log: Path


@dataclass
class Context:
    """What every check gets: the plan, the probe's facts, the folder of the runs, and the server runner."""

    plan: Plan
    facts: dict
    work: Path
    runner: Runner
    cuda: bool


class Runner:
    """server.py runs as study cells (serverbench/launch/study.py's runner: one row each in <folder>/runs.csv, logs
    beside it), bounded by a deadline: each run's timeout and its server's own limits come from the time left, and a
    run that cannot start in time is not started. Several run at once on the plan's server slots."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.slots = threading.BoundedSemaphore(plan.server_slots)

    def run_all(
        self,
        folder: Path,
        specs: Sequence[RunSpec],
        deadline: float,
        timed: bool,
        ceiling: bool,
        env: dict[str, str] | None = None,
    ) -> list[RunResult]:
        """The runs, in order; a timed check's one at a time, alone (the plan's timed_alone), the others on the
        shared slots."""
        folder.mkdir(parents=True, exist_ok=True)
        flags = self.plan.server_flags(ceiling)
        if timed and self.plan.timed_alone:
            return [self.run(folder, spec, flags, deadline, env) for spec in specs]
        with ThreadPoolExecutor(max_workers=max(1, min(len(specs), self.plan.server_slots))) as pool:
            return list(pool.map(lambda spec: self.run(folder, spec, flags, deadline, env), specs))

    def run(
        self, folder: Path, spec: RunSpec, base_flags: Sequence[str], deadline: float, env: dict[str, str] | None
    ) -> RunResult:
        cell = spec.cell()
        with self.slots:
            left_s = deadline - time.monotonic() - self.plan.stop_grace_s
            if left_s < self.plan.min_run_s:
                return RunResult(spec, SKIPPED_STATUS, {"experiment": spec.name}, True, cell.log_path(folder))
            # The server's own limits below ours, so that it ends itself and writes its row with a reason.
            limit_s = max(1.0, left_s - self.plan.stop_grace_s)
            limits = ("--warmup_timeout_s", f"{limit_s:.0f}", "--timeout_s", f"{min(120.0, limit_s):.0f}")
            runner = StudyRunner(
                "gpu_check", folder, (*base_flags, *limits), left_s, env=env, stop_grace_s=self.plan.stop_grace_s
            )
            try:
                status = runner.run_cell(cell)
            except CellRefused as exc:  # this run's flags or this machine (/dev/shm, memory): its row says why
                status = record_failure(cell, folder, "refused", str(exc))
        print(f"  {cell.label()}: {status}", flush=True)
        row = row_of(cell, folder) or {"experiment": spec.name, "status": status}
        # A server stopped at the time left, or one that ended itself at the limits the budget set it, is cut by
        # the budget, not hung.
        late = status == "timeout" and deadline - time.monotonic() < 3 * self.plan.stop_grace_s
        return RunResult(spec, str(row["status"]), row, status == CUT_STATUS or late, cell.log_path(folder))


def read_rows(path: Path) -> list[dict]:
    """The rows of a runs.csv as dicts (numbers as numbers, empty cells as None); none when there is no file."""
    if not path.exists():
        return []
    import pandas as pd

    try:
        frame = pd.read_csv(path, low_memory=False)
    except (OSError, ValueError):  # a row being appended by a server beside: read again
        time.sleep(0.2)
        frame = pd.read_csv(path, low_memory=False)
    return [{k: (None if v != v else v) for k, v in row.items()} for row in frame.to_dict("records")]


def number(row: dict, column: str) -> float | None:
    try:
        number = float(row.get(column))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if number != number else number


def _problem(result: RunResult) -> str:
    error = str(result.row.get("error") or "")
    return f"{result.spec.name}: {result.status} {one_line(error, limit=160) if error else ''}".strip()


def verdict(name: str, results: Sequence[RunResult], good: Callable[[RunResult], bool], what: str, where: str) -> Check:
    """pass when every run was good; FAIL naming the first bad ones; when the budget stopped some (or all) and none
    failed: partial (budget) or not run (budget)."""
    cut = [r for r in results if r.cut]
    bad = [r for r in results if not r.cut and not good(r)]
    done = len(results) - len(cut)
    detail = f"{done - len(bad)}/{len(results)} {what}"
    if cut:
        detail += f"; {len(cut)} stopped or not started by the budget"
    if bad:
        return Check(name, FAIL, detail + "; " + "; ".join(_problem(r) for r in bad[:3]), where)
    if cut:
        return Check(name, PARTIAL if done else BUDGET, detail, where)
    return Check(name, PASS, detail, where)


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def speed_table(results: Sequence[RunResult], baseline: str | None = None) -> str:
    """Each run's status, throughput, latency, GPU utilisation and efficiency (and its ratio to `baseline`'s)."""
    base = next((r for r in results if r.spec.name == baseline and r.status == "ok"), None)
    base_throughput = number(base.row, "throughput") if base else None
    rows = []
    for r in results:
        throughput = number(r.row, "throughput") if r.status == "ok" else None
        ratio = throughput / base_throughput if throughput and base_throughput else None
        rows.append(
            [
                r.spec.name,
                r.spec.batch_size,
                r.status,
                fmt(throughput, digits=0),
                fmt(number(r.row, "p50_latency_s"), 1e3),
                fmt(number(r.row, "p99_latency_s"), 1e3),
                fmt(number(r.row, "gpu_util")),
                fmt(number(r.row, "efficiency"), digits=3),
                *([fmt(ratio, digits=2)] if baseline else []),
            ]
        )
    header = ["run", "batch", "status", "samples/s", "p50 ms", "p99 ms", "GPU util %", "efficiency"]
    return "\n".join(table([*header, *([f"x {baseline}"] if baseline else [])], rows)) + "\n"


def run_tool(cmd: Sequence[str], log: Path, timeout_s: float, grace_s: float) -> tuple[int | None, bool]:
    """A command (pytest) with its output in `log`, in a session of its own (the one launcher): past timeout_s it
    gets SIGINT (pytest then tears its tests down, which stops the servers they started), then the session is
    killed after grace_s. (exit status, stopped by the timeout)."""
    ended = Session.logged(cmd, log, ROOT).run_to_end(max(1.0, timeout_s), grace_s, timeout_signal=signal.SIGINT)
    return ended.returncode, ended.timed_out
