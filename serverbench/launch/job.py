"""One rank of a torchrun job in the server process: its own run, between the collectives every rank makes
(serverbench.launch.ranks); rank 0 writes every rank's row and the job's row. The run itself is the caller's
(server.run_benchmark), taken as an argument: a torchrun rank and a plain run are two ways of making one call."""

from __future__ import annotations

import sys
from dataclasses import replace

from serverbench.config.loads import load_kind
from serverbench.config.options import BenchConfig
from serverbench.launch.frontends import merged_report
from serverbench.launch.outcome import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Interrupted,
    RunBenchmark,
    RunResult,
    crash_if_asked,
)
from serverbench.launch.ranks import (
    Job,
    JobError,
    RankOutcome,
    clock_domain,
    clock_offsets_ns,
    job_status,
    slowest_rank,
    tell_torchrun,
)
from serverbench.load.noise import NOISE_COLUMNS
from serverbench.records.benchmark_db import save_records
from serverbench.records.console import format_rank_line, format_summary
from serverbench.records.csv_store import append_row
from serverbench.records.row import (
    JOB_COLUMNS,
    build_row,
    in_row_order,
    make_run_id,
    write_detail_files,
)


def run_job(cfg: BenchConfig, run_benchmark: RunBenchmark) -> int:
    """This rank's run (`run_benchmark(cfg, start_barrier)`) between the job's collectives; rank 0 writes the rows.
    Each rank exits with its own run's status. The caller has SIGINT and SIGTERM raise (Interrupted) meanwhile."""
    rank = cfg.rank
    try:
        job = Job(rank, cfg.dist_timeout_s)
    except (Interrupted, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    except JobError as exc:
        print(f"server.py: {exc}", file=sys.stderr)
        tell_torchrun(str(exc))
        return EXIT_FAILED
    crash_if_asked(cfg)
    result = run_benchmark(cfg, job.start_barrier)
    if result.status == "interrupted":
        print(f"server.py: rank {rank.rank}: {result.error}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.status not in ("ok", "aborted"):
        # This rank's own failure, told before any other rank may exit: torchrun's summary then names it.
        tell_torchrun(f"rank {rank.rank} ({result.status}): {result.error}")
    report = result.frontend
    if report is not None and report.backend_ready is not None:  # the --verify answers stay here
        report = replace(report, backend_ready=replace(report.backend_ready, reference_outputs=None))
    mine = RankOutcome(rank, build_row(cfg, result), replace(result, frontend=report), clock_domain(), job.barrier_ns)
    written = False
    try:
        outcomes = job.gather(mine)
        if rank.rank == 0:
            write_job_rows(cfg, outcomes)
            written = True
        job.finish()
    except JobError as exc:
        print(f"server.py: {exc}", file=sys.stderr)
        tell_torchrun(str(exc))
        if rank.rank == 0 and not written:  # what it knows still becomes rows, the failure as the job's status
            write_job_rows(cfg, [mine], collective_error=str(exc))
        return EXIT_FAILED
    except (Interrupted, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    job.close()
    if rank.rank != 0:
        print(
            f"rank {rank.rank} ({cfg.device}): {result.status}, throughput {mine.row.get('throughput')} samples/s; "
            "rank 0 wrote the rows"
        )
    return EXIT_OK if result.status == "ok" else EXIT_FAILED


def write_rank_rows(cfg: BenchConfig, outcomes: list, base_id: str) -> list[dict[str, object]]:
    """Rank 0: one row per rank, with its detail files; the rows as appended."""
    written = []
    for outcome in outcomes:
        run_id = f"{base_id}_rank{outcome.rank.rank}"
        row = dict(outcome.row, run_id=run_id, **write_detail_files(cfg, outcome.result, run_id))
        row.update(
            dict.fromkeys(JOB_COLUMNS),
            scope="rank",
            rank=outcome.rank.rank,
            local_rank=outcome.rank.local_rank,
            world_size=cfg.rank.world_size,
        )
        row = in_row_order(row)  # the door's columns, declared after the job's, were built with the rest
        append_row(cfg.output_path, row)
        written.append(row)
    return written


def pooled_rank_figures(rows: list[dict[str, object]]) -> dict[str, object]:
    """The job row's figures taken from its rank rows: the slowest rank's build, compile and warm-up (the job
    waited for it), the sum of the ceilings, the devices and hosts, and no noise or in-flight figure (each rank
    measured its own machine and sender, and in flight per rank against the job's rate is no Little's law)."""

    def unique(column: str) -> str:
        return ",".join(dict.fromkeys(str(r.get(column)) for r in rows if r.get(column) is not None))

    def largest(column: str) -> float | None:
        values = [r.get(column) for r in rows if r.get(column) is not None]
        return max(values) if values else None

    ceilings = [r.get("ceiling_throughput") for r in rows]
    return {
        "warmup_latency": largest("warmup_latency"),
        "torch_load_time": largest("torch_load_time"),
        "m_compile_time": largest("m_compile_time"),
        "model_build_s": largest("model_build_s"),
        "ceiling_throughput": sum(ceilings) if ceilings and None not in ceilings else None,
        "ceiling_batch_ms": None,
        "littles_law_ratio": None,
        "utilisation": None,  # "some GPU busy" is not a utilisation: each rank row has its own
        **{column: None for column in NOISE_COLUMNS if column not in ("noise_warning", "noise_note")},
        "noise_warning": "",
        "noise_note": "per rank: see the rank rows",
        "device_name": unique("device_name"),
        "host": unique("host"),
        "device": unique("device"),
    }


def write_job_rows(cfg: BenchConfig, outcomes: list, collective_error: str | None = None) -> None:
    """Rank 0: one row per rank (with its detail files), then the job's row: throughput over the common window,
    latency percentiles over every rank's requests, the slowest rank named."""
    base_id = make_run_id(cfg)
    written = write_rank_rows(cfg, outcomes, base_id)  # every row appended, for the benchmark records
    status, error = job_status(outcomes)
    if collective_error is not None:
        status, error = "error", collective_error
    offsets_ns = clock_offsets_ns(outcomes)
    merged = RunResult(
        status=status,
        error=error,
        frontend=merged_report([o.result.frontend for o in outcomes], offsets_ns),
        provenance=outcomes[0].result.provenance,  # one checkout and machine's: torchrun starts every rank there
    )
    pooled = pooled_rank_figures([o.row for o in outcomes])
    job_cfg = replace(cfg, seed=cfg.seed - cfg.rank.rank, device=pooled.pop("device"))
    row = build_row(job_cfg, merged)
    ceiling = pooled["ceiling_throughput"]
    slowest, slowest_throughput = slowest_rank(outcomes)
    clocks = {o.clock for o in outcomes}
    row.update(
        run_id=f"{base_id}_job",
        **pooled,
        efficiency=row["throughput"] / ceiling
        if row.get("throughput") is not None and ceiling and load_kind(cfg.load).saturating
        else None,
        scope="job",
        rank=None,
        local_rank=None,
        world_size=cfg.rank.world_size,
        ranks_reported=len(outcomes),
        ranks_ok=sum(o.result.status == "ok" for o in outcomes),
        nodes=len(clocks),
        clock_alignment="shared clock" if len(clocks) == 1 else "start barrier",
        slowest_rank=slowest,
        slowest_rank_throughput=slowest_throughput,
    )
    row = in_row_order(row)
    append_row(cfg.output_path, row)
    written.append(row)

    print(format_summary(job_cfg, row))
    for outcome in outcomes:
        print(format_rank_line(outcome.rank.rank, outcome.row))
    if slowest is not None:
        print(f"  slowest rank  {slowest} ({slowest_throughput:.1f} samples/s)")
    print(f"  {len(outcomes)} rank rows and the job row appended to {cfg.output_path}")
    if cfg.save_pytorch_benchmark:
        save_records(cfg.output_path, written)
    if status != "ok":
        print(f"server.py: job failed ({status}): {error}", file=sys.stderr)
