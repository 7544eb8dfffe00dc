"""The CSV row of a run, built from the run's result and its config, and the detail files it names. Its columns
and their order are declared in serverbench/schema/columns.py (ROW_COLUMNS)."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import time
from pathlib import Path

from serverbench.config.door_options import NETWORK_TRANSPORTS
from serverbench.config.inputs import is_image_input
from serverbench.config.loads import LOAD_ROW_COLUMNS, load_kind
from serverbench.config.options import BenchConfig
from serverbench.config.transport_kinds import Hop, request_hop
from serverbench.load.loadgen import keep_logs, loadgen_columns
from serverbench.load.noise import noise_columns, sender_lateness
from serverbench.load.windows import reported_span_ns, window_columns
from serverbench.records.csv_store import write_formed_batches, write_request_records, write_samples
from serverbench.records.instances import instance_columns, warmup_busy_ns
from serverbench.records.summary import (
    ceiling_stats,
    efficiency_interval,
    efficiency_verdict,
    summarize,
    summary_columns,
)
from serverbench.records.timeline import write_timeline
from serverbench.schema.columns import CEILING_COLUMNS, DETAIL_FILE_COLUMNS, ROW_COLUMNS
from serverbench.schema.columns import JOB_COLUMNS as JOB_COLUMNS  # re-exported: launch/job.py reads it here
from serverbench.schema.messages import BackendReport, RunResult
from serverbench.schema.records import GpuSample, LoadSample, RecordTotals


def make_run_id(cfg: BenchConfig) -> str:
    """The row's run_id, which names its detail files too."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}_{cfg.experiment}_bs{cfg.batch_size}_r{cfg.repeat}_{os.getpid()}"


def environment_columns(result: RunResult) -> dict[str, object]:
    ready = getattr(result.frontend, "backend_ready", None)
    provenance = result.provenance
    return {
        "device_name": ready.device_name if ready else None,
        "timing_source": ready.timing_source if ready else None,
        "model_build_s": ready.model_build_s if ready else None,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python_version": platform.python_version(),
        # As the backend's torch says (torch.__version__ has the build's local label, the package metadata not).
        "torch_version": ready.torch_version if ready else package_version("torch"),
        "torchvision_version": package_version("torchvision"),
        "cuda_version": ready.cuda_version if ready else None,
        "commit": provenance.commit if provenance else None,
        "code_dirty": provenance.code_dirty if provenance else None,
        "cpu_model": provenance.cpu_model if provenance else None,
    }


def package_version(name: str) -> str | None:
    """An installed package's version from its metadata: importing torchvision only to read it costs the server
    about a second (it pulls in torch._dynamo) after every run."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def build_row(cfg: BenchConfig, result: RunResult) -> dict[str, object]:
    """The CSV row: every producer's columns, in ROW_COLUMNS' order (the reference's columns first)."""
    report = result.frontend
    windows = report.windows if report else []
    records = report.records if report else []
    summary = summarize(
        records,
        report.requests_sent if report else 0,
        report.responses_duplicated if report else 0,
        report.gpu_samples if report else [],
        cfg.slo_ms,
        report.load_samples if report else [],
        span_ns=reported_span_ns(windows),
        backend_busy_ns=warmup_busy_ns(result.backend, records),
        totals=report.totals if report else None,
    )
    columns = summary_columns(summary)
    if report is None:  # the frontend sent no report (it died): what it sent and received is unknown, not 0
        columns.update(
            dict.fromkeys(("requests_sent", "responses_received", "responses_missing", "responses_duplicated"))
        )
    if not load_kind(cfg.load).littles_law or result.status != "ok":
        columns["littles_law_ratio"] = None  # an interrupted or failed phase's in-flight count is cut short
    row = run_columns(cfg, result)
    row.update(columns)
    row.update(ceiling_columns(cfg, result.backend, columns.get("throughput")))
    row.update(door_columns(cfg, result))
    row.update(window_columns(windows, report.stable if report else None, cfg.stability_pct))
    row.update(
        noise_columns(
            report.noise if report else None,
            sender_lateness(records),
            columns.get("p50_latency_s"),
            columns.get("p99_latency_s"),
        )
    )
    row.update(environment_columns(result))
    # After run_columns and environment_columns: with several instances it replaces their build figures.
    row.update(instance_columns(cfg.instances, records, result.mps, report.instances_ready if report else []))
    row.update(loadgen_columns(report.loadgen if report else None, columns.get("p99_latency_s"), result.status))
    if cfg.serve_only:
        row.update(serve_only_columns(report.totals if report else None))
    return in_row_order(row)


def serve_only_columns(totals: RecordTotals | None) -> dict[str, object]:
    """A --serve_only door's row: whoever came sent the load, so the columns of our load generator say nothing
    (a 65,401-request row said load burst, num_iters 100, efficiency 0.005 against a ceiling it never saturated,
    and "the measured phase did not start"). Past the door's sample, the note says what the figures are of."""
    note = "--serve_only: no load generator of ours ran, so what the machine did was not measured"
    if totals is not None:
        note += (
            f"; latency, stage and per-instance figures from a uniform sample of {totals.kept:,} of the "
            f"{totals.count:,} requests (counts and throughput from all; no busy fraction)"
        )
    return {
        **dict.fromkeys(("load", "num_iters", "min_duration_s", "concurrency", *LOAD_ROW_COLUMNS)),
        **dict.fromkeys(("efficiency", "efficiency_low", "efficiency_high", "efficiency_note")),
        "noise_note": note,
    }


def in_row_order(row: dict[str, object]) -> dict[str, object]:
    """The row's columns in ROW_COLUMNS' order, which a new results file's header follows; a column that is not
    declared (a bug the tests catch) goes last rather than being lost."""
    declared = set(ROW_COLUMNS)
    ordered = {name: row[name] for name in ROW_COLUMNS if name in row}
    ordered.update((name, value) for name, value in row.items() if name not in declared)
    return ordered


def run_columns(cfg: BenchConfig, result: RunResult) -> dict[str, object]:
    """The run's flags and outcome, and what the backend reported of its setup."""
    report = result.frontend
    ready = getattr(report, "backend_ready", None)
    return {
        "batch_size": cfg.batch_size,
        "compile": cfg.compile,
        "torch_load_time": ready.torch_load_time_s if ready else None,
        "m_compile_time": ready.compile_time_s if ready else None,
        "status": result.status,
        "error": result.error,
        "experiment": cfg.experiment,
        "repeat": cfg.repeat,
        "attempt": cfg.attempt,
        "load": cfg.load,
        "concurrency": cfg.concurrency,
        **dict.fromkeys(LOAD_ROW_COLUMNS),
        **load_kind(cfg.load).row_facts(cfg),  # what this load offered
        "min_duration_s": cfg.duration_s if cfg.stability_pct is None else None,  # windows decide instead
        "warmup_iters": cfg.warmup_iters,
        "slo_ms": cfg.slo_ms,
        "design": cfg.design,
        "transport": cfg.transport,
        "ring_slots": cfg.ring_slots if uses_ring(cfg) else None,
        "wire_dtype": cfg.wire_dtype,
        "precision": cfg.precision,
        "cudnn_allow_tf32": ready.cudnn_allow_tf32 if ready else None,
        "matmul_precision": ready.matmul_precision if ready else None,
        "channels_last": cfg.channels_last,
        "compile_mode": cfg.compile_mode if cfg.compile else None,
        "compile_decode": cfg.compile_decode,
        "compile_path": ready.compile_path if ready else None,
        "aoti_runners": ready.aoti_runners if ready else None,
        "aoti_compiled_now": ready.aoti_compiled_now if ready else None,
        "compile_graph_breaks": ready.compile_graph_breaks if ready else None,
        "device": cfg.device,
        "model": cfg.model,
        "model_kwargs": cfg.model_kwargs or "",
        # The image that ran: --target's comes from the server's metadata, whatever --image_size said
        "image_size": next(
            (spec.shape[1] for spec in cfg.model_inputs if is_image_input(spec) and spec.shape[1] == spec.shape[2]),
            None,
        ),
        "inputs": " ".join(spec.describe() for spec in cfg.model_inputs),
        "request_bytes": cfg.request_bytes,
        "response_bytes": report.response_bytes if report else None,
        "num_workers": cfg.num_workers,
        "num_iters": cfg.num_iters if cfg.stability_pct is None else None,
        "stability_pct": cfg.stability_pct,
        "responses_unexpected": report.responses_unexpected if report else None,
        "verify": cfg.verify,
        "wrong_outputs": report.wrong_outputs if report and cfg.verify else None,
        "max_abs_error": report.max_abs_error if report and cfg.verify else None,
        "verify_tolerance": cfg.verify_tolerance if cfg.verify else None,
        "checkpoint": cfg.checkpoint or "",
        "seed": cfg.seed,
        "max_inflight": cfg.max_inflight,
        "max_batch_size": cfg.max_batch_size,
        "max_queue_delay_ms": cfg.max_queue_delay_ms if cfg.batching else None,
        "spin_wait": cfg.spin_wait,
        "cpu_split": cfg.cpu_split if not cfg.is_cuda else None,
        "backend_cpus": result.backend.backend_cpus,
        "intra_op_threads": result.backend.intra_op_threads,
        "machine_speed_before": result.backend.machine_speed_before,
        "machine_speed_after": result.backend.machine_speed_after,
        "planted_delay_us": cfg.planted_delay_us or None,
        "malloc_tuned": result.backend.malloc_tuned,
        "backend_cpu_cores": result.backend.backend_cpu_cores,
        "gpu_util_note": report.gpu_util_note if report else "",
        "profile_trace": result.backend.profile_trace,
    }


def uses_ring(cfg: BenchConfig) -> bool:
    """Whether requests reached the backend over the shm ring: shm, or a door in its own process."""
    return request_hop(cfg) is Hop.RING


def door_columns(cfg: BenchConfig, result: RunResult) -> dict[str, object]:
    """The network front door's figures (--transport http|grpc), and the --target driven."""
    door = result.door
    network = cfg.transport in NETWORK_TRANSPORTS
    # A door that never reported (killed, frozen) took its counts with it: empty, as an inline door's that died
    counted = door if door is not None and door.counted else None
    errors = counted.errors if counted is not None else {}
    return {
        "door": cfg.door if network and cfg.target is None else None,
        "door_address": door.address if door is not None else None,
        "target": cfg.target,
        "door_answered": counted.answered if counted is not None else None,
        "door_errors": sum(errors.values()) if counted is not None else None,
        "door_error_statuses": ";".join(f"{status}:{count}" for status, count in sorted(errors.items())),
        "door_disconnects": counted.disconnects if counted is not None else None,
        "generators": None if cfg.serve_only else cfg.generators,
    }


def ceiling_columns(cfg: BenchConfig, backend: BackendReport, throughput: float | None) -> dict[str, object]:
    """The model alone at the design's concurrency (timed by the backend before and after serving), and the
    efficiency of the run against it: for loads that saturate the server only (burst, closed loop). Under an
    open-loop rate the server idles between requests by design; `utilisation` says how busy it was instead."""
    stats = ceiling_stats(backend.ceiling_before or {}, backend.ceiling_after or {})
    if stats is None:
        return dict.fromkeys(CEILING_COLUMNS)
    saturating = throughput is not None and load_kind(cfg.load).saturating
    # The efficiency's interval: throughput over the ceiling interval's ends (metrics.ceiling_interval).
    low, high = (efficiency_interval(throughput, stats) if saturating else None) or (None, None)
    return {
        "ceiling_throughput": stats.throughput,
        # Per forward at the ceiling's rate: a request's batch, or a full formed batch with dynamic batching.
        "ceiling_batch_ms": cfg.formed_rows / stats.throughput * 1e3,
        "ceiling_concurrency": stats.concurrency,
        "ceiling_spread_pct": stats.spread_pct,
        "ceiling_before_throughput": stats.before,
        "ceiling_after_throughput": stats.after,
        "efficiency": throughput / stats.throughput if saturating else None,
        "efficiency_low": low,
        "efficiency_high": high,
        "efficiency_note": efficiency_verdict(low, high),
    }


# The folders write_detail_files makes under --results_dir (an --output_file of one of these names cannot be written)
DETAIL_FOLDERS = ("requests", "gpu", "load", "batches", "traces", "tracebacks")


def write_detail_files(cfg: BenchConfig, result: RunResult, run_id: str) -> dict[str, str]:
    """Per-request lines, GPU samples and the timeline, when asked for, and a failed run's traceback; paths relative
    to the results folder."""
    report = result.frontend
    records = report.records if report else []
    samples = report.gpu_samples if report else []
    written = dict.fromkeys(DETAIL_FILE_COLUMNS, "")
    root = Path(cfg.results_dir)
    if cfg.save_requests:
        write_request_records(root / "requests" / f"{run_id}.csv", records)
        write_samples(root / "gpu" / f"{run_id}.csv", samples, GpuSample)
        write_samples(root / "load" / f"{run_id}.csv", report.load_samples if report else [], LoadSample)
        written.update(
            requests_file=f"requests/{run_id}.csv",
            gpu_samples_file=f"gpu/{run_id}.csv",
            load_samples_file=f"load/{run_id}.csv",
        )
        if cfg.batching:
            write_formed_batches(root / "batches" / f"{run_id}.csv", records)
            written["batches_file"] = f"batches/{run_id}.csv"
    if report is not None and report.loadgen is not None:
        written["loadgen_log_dir"] = keep_logs(report.loadgen.log_dir, root, run_id)
    if cfg.trace:
        write_timeline(root / "traces" / f"{run_id}_timeline.json", records, samples)
        written["timeline_trace"] = f"traces/{run_id}_timeline.json"
    if result.traceback:  # kept here, not printed: stderr says the failure in one line and names this file
        (root / "tracebacks").mkdir(parents=True, exist_ok=True)
        (root / "tracebacks" / f"{run_id}.txt").write_text(result.traceback)
        written["traceback_file"] = f"tracebacks/{run_id}.txt"
    return written
