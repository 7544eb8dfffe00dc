"""What the checks of bench.gpu_check are made of: the plan (a GPU's sizes or --dry_run's), a check's verdict,
the server runs (server.py as sweep cells, bounded by a deadline), other tools run to a deadline (pytest), and the
tables of the summary."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from bench.gpu_probe import ROOT
from serverbench.launch.session import Session
from serverbench.launch.study import (
    TIMEOUT_STATUS,
    Cell,
    CellRefused,
    Experiment,
    next_attempt,
    record_failure,
    row_of,
)
from serverbench.launch.study import Runner as StudyRunner
from serverbench.records.markdown import figure, table
from serverbench.system.process import line_of

PASS, FAIL, INFO, NOT_RUN, REFUSED = "pass", "FAIL", "info", "not run", "refused"
BUDGET, PARTIAL = "not run (budget)", "partial (budget)"
# A server run's row status when the study runner stopped it at the time left, and when it was never started.
CUT_STATUS, SKIPPED_STATUS = TIMEOUT_STATUS, "not_run_budget"


@dataclass(frozen=True)
class Plan:
    """The sizes and the concurrency of every check: a GPU's (the defaults), or tiny ones on the CPU for --dry_run."""

    device: str = "cuda"
    model: str = "resnet18"  # verify, overlap, door and the reference table
    image_size: int = 224
    batch_size: int = 32  # verify, race, overlap, compile, the example model, instances
    num_iters: int = 50
    ceiling_s: float = 0.25  # the timed runs' ceiling; the runs that only check correctness run without one
    # the timed runs' least measured phase (--duration_s): NVML's utilisation needs 1 s windows
    timed_min_s: float = 2.0
    race_model: str = "resnet18"  # a model slow enough for the planted race to show
    # small enough that the frontend keeps the backend's queue full, the race's window (at 224 the frontend fills
    # requests slower than the GPU serves them: no overlap to race)
    race_image_size: int = 64
    race_repeats: int = 2
    race_num_iters: int = 200
    compile_model: str = "resnet18"
    compare_model: str = "resnet18"
    compare_batch_size: int = 256
    compare_num_iters: int = 30
    compare_precision: str = "bf16"  # the fastest configuration's; the reference-like one runs at the default
    bandwidth_mib: int = 256
    example_tokens: int = 64  # the example encoder's sequences and layers
    example_depth: int = 2
    door_batch_sizes: tuple[int, ...] = (1, 32)
    door_num_iters: int = 100
    table_batch_sizes: tuple[int, ...] = (32, 256)
    table_num_iters: int = 60
    table_experiments: tuple[str, ...] = ("serial", "threaded", "pipelined_2w", "pipelined_4w")  # of TABLE_EXPERIMENTS
    compile_cases: tuple[str, ...] = ("pipelined_2w", "serial_reduce_overhead")  # of COMPILE_CASES
    example_cases: tuple[str, ...] = ("eager", "batching")
    verify_every_pair: bool = True  # every design over both transports; the dry run: each design over one, in turn
    server_slots: int = 4  # server runs at once, all checks together, outside the timed checks
    concurrent_checks: int = 3  # checks that only test correctness, run at once
    timed_alone: bool = True  # the timed checks (bandwidth, overlap, compare, door, table) run with nothing beside
    # pytest-xdist's -n for the cuda tests, where it is installed: 14 tests of 20-60 s each, most a server run; 3
    # workers needed more than 150 s on an H200
    pytest_workers: int = 5
    time_scale: float = 1.0  # each check's least time worth starting it with (seconds on a GPU) times this
    stop_grace_s: float = 10.0  # a server told to stop writes its row within about 7 s
    min_run_s: float = 15.0  # a server run is not started with less than this left
    end_margin_s: float = 5.0  # kept at the end of the budget: the summary and the bundle

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
        cell = replace(cell, attempt=next_attempt(cell, folder))  # the attempt run_cell gives it: its row and log
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


def number(row: dict, column: str) -> float | None:
    try:
        number = float(row.get(column))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if number != number else number


def _problem(result: RunResult) -> str:
    error = str(result.row.get("error") or "")
    return f"{result.spec.name}: {result.status} {line_of(error, limit=160) if error else ''}".strip()


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
                figure(throughput, ".0f", missing="-"),
                figure(number(r.row, "p50_latency_s"), ".1f", 1e3, "-"),
                figure(number(r.row, "p99_latency_s"), ".1f", 1e3, "-"),
                figure(number(r.row, "gpu_util"), missing="-"),
                figure(number(r.row, "efficiency"), ".3f", missing="-"),
                *([figure(ratio, ".2f", missing="-")] if baseline else []),
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
