"""--find_peak: the highest Poisson rate whose p99 latency stays within --slo_ms, by bisection between 0 and the
'offline' rate that a burst run reaches. Each step is a whole run made by the caller (server.run_once), taken as an
argument."""

from __future__ import annotations

import datetime
import sys
from dataclasses import replace
from pathlib import Path

from serverbench.config.loads import DEFAULT_LOAD, PEAK_SEARCH_LOAD
from serverbench.config.options import BenchConfig
from serverbench.launch.outcome import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, Interrupted, RunOnce
from serverbench.records.csv_store import append_row
from serverbench.records.row import make_run_id


def bisect_peak(
    measure, offline_rps: float, slo_s: float, steps: int
) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """Bisection on the rate in (0, offline_rps]: `measure(step, rate)` returns the p99 latency in seconds, or
    None when the run failed (which counts as over the target). Returns (rate, p99) of the highest rate that met
    slo_s and of the lowest that did not; either may be None. The offline rate is tried first: a server that
    keeps its p99 at its own maximum needs no search."""
    passing: tuple[float, float] | None = None
    failing: tuple[float, float] | None = None
    low, high = 0.0, offline_rps
    for step in range(steps):
        rate = high if step == 0 else (low + high) / 2
        p99_s = measure(step, rate)
        if p99_s is not None and p99_s <= slo_s:
            passing, low = (rate, p99_s), rate
            if step == 0:
                break
        else:
            failing, high = (rate, float("nan") if p99_s is None else p99_s), rate
    return passing, failing


def find_peak(cfg: BenchConfig, run_once: RunOnce) -> int:
    """The 'server' figure, each step a `run_once(cfg, extra_columns)`. Every run is a row; the result goes to
    peak.csv. Returns the server's exit status."""
    # The search's own id, unlike any step's: a tool finds the line this search appended by it
    search_id = f"{make_run_id(cfg)}_peak"
    result, row = run_once(
        replace(cfg, load=DEFAULT_LOAD.name, rate_rps=None, find_peak=False), {"peak_search_step": "offline"}
    )
    if result.status != "ok" or not row.get("achieved_rate_rps"):
        print(f"server.py: peak search stopped: the burst run failed ({result.status})", file=sys.stderr)
        return EXIT_INTERRUPTED if result.status == "interrupted" else EXIT_FAILED
    offline_rps = float(row["achieved_rate_rps"])

    def measure(step: int, rate: float) -> float | None:
        result, row = run_once(
            replace(cfg, load=PEAK_SEARCH_LOAD.name, rate_rps=rate, find_peak=False), {"peak_search_step": step}
        )
        if result.status == "interrupted":
            raise Interrupted("SIGINT")
        p99_s = row.get("p99_latency_s") if result.status == "ok" else None
        print(f"peak search step {step}: {rate:.2f} req/s -> p99 {'n/a' if p99_s is None else f'{p99_s * 1e3:.1f} ms'}")
        return p99_s

    try:
        passing, failing = bisect_peak(measure, offline_rps, cfg.slo_ms / 1e3, cfg.peak_steps)
    except Interrupted:
        return EXIT_INTERRUPTED
    high = failing[0] if failing else offline_rps
    peak = {
        "experiment": cfg.experiment,
        "repeat": cfg.repeat,
        "attempt": cfg.attempt,
        "batch_size": cfg.batch_size,
        "compile": cfg.compile,
        "design": cfg.design,
        "num_workers": cfg.num_workers,
        "max_batch_size": cfg.max_batch_size,
        "intra_op_threads": row.get("intra_op_threads"),
        "model": cfg.model,
        "device": cfg.device,
        "slo_ms": cfg.slo_ms,
        "burstiness": cfg.burstiness,
        "offline_rate_rps": offline_rps,
        "offline_throughput": offline_rps * cfg.batch_size,
        "peak_rate_rps": passing[0] if passing else None,
        "peak_throughput": passing[0] * cfg.batch_size if passing else None,
        "peak_p99_latency_s": passing[1] if passing else None,
        "over_slo_rate_rps": failing[0] if failing else None,
        "over_slo_p99_latency_s": failing[1] if failing else None,
        "steps": cfg.peak_steps,
        "status": "ok" if passing else "slo_not_met",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "run_id": search_id,
    }
    append_row(Path(cfg.results_dir) / "peak.csv", peak)
    if passing:
        print(
            f"peak: {passing[0]:.2f} req/s ({passing[0] * cfg.batch_size:.1f} samples/s) with p99 "
            f"{passing[1] * 1e3:.1f} ms <= {cfg.slo_ms:g} ms; offline maximum {offline_rps:.2f} req/s"
            + (f"; {failing[0]:.2f} req/s gave p99 {failing[1] * 1e3:.1f} ms" if failing else "")
        )
    else:
        print(f"peak: no rate tried kept p99 within {cfg.slo_ms:g} ms (lowest tried {high:.2f} req/s)")
    print(f"  result appended to {Path(cfg.results_dir) / 'peak.csv'}")
    return EXIT_OK
