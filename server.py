"""Command line and orchestration: starts the frontend (client.py) and the backend (worker.py) processes,
supervises them, and appends one CSV row per run to results/<output_file>.

    python server.py --batch_size 256 --num_workers 2 --compile
    python server.py --design serial --batch_size 32 --output_file serial.csv

Exit status: 0 when every request was answered; 2 for an invalid flag (before any process starts);
1 when the run failed (the row says how); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import platform
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from serverbench.config.options import BenchConfig, ConfigError, OneLineErrorParser, add_cli_args, build_config
from serverbench.launch.instances import (Instance, backend_roles, combine_backend_reports, instance_columns, mps_in_use, role_kind,
                       warmup_busy_ns)
from serverbench.launch.procutil import one_line, run_role
from serverbench.load.windows import STABLE_WINDOWS

log = logging.getLogger("server")

StartBarrier = Callable[[bool, str], Optional[str]]  # (this rank ok, its error) -> None, or why to stop

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
STOP_GRACE_S = 5.0  # how long a child may take to leave once told to stop, before it is killed
SATURATING_LOADS = ("burst", "closed")  # loads that keep the server busy: efficiency against the ceiling applies
LITTLES_LAW_LOADS = ("closed", "poisson")  # loads whose in-flight count the load sampler sees whole
LITTLES_LAW_TOLERANCE = 0.10  # further off than this, the records or the sampler miss something


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the server."""


@dataclass
class RunResult:
    status: str  # ok, error, oom, timeout, backend_died, frontend_died, interrupted
    error: str = ""
    traceback: str = ""
    frontend: Optional[object] = None  # transport.FrontendReport
    backend: dict = field(default_factory=dict)
    pids: dict = field(default_factory=dict)
    mps: Optional[bool] = None  # CUDA: whether the NVIDIA MPS control daemon took the backends' contexts
    row_saved: bool = True  # False when the row could not be written to the results file


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _describe_exit(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGTERM and SIGINT raise Interrupted / KeyboardInterrupt in the main thread while inside; the previous
    handlers come back afterwards, unless the run was interrupted: then further interrupts are only noted until
    the process exits (see defer_further_interrupts). Python leaves SIGINT ignored when it was ignored at start (a
    job started with `&` by a script): Ctrl-C and the group's SIGINT must still stop the run, so that handler is
    installed too."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is not _note_repeated_interrupt:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)


def _note_repeated_interrupt(signum: int, frame) -> None:
    log.warning("%s again: already stopping; the partial row is being written", signal.Signals(signum).name)


def defer_further_interrupts() -> None:
    """After the first interrupt the run is stopping and its partial row is still to be written: a second Ctrl-C
    (people press it twice) must not lose what the first one saved."""
    signal.signal(signal.SIGINT, _note_repeated_interrupt)
    signal.signal(signal.SIGTERM, _note_repeated_interrupt)


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started inside inherit SIGINT ignored from their first instruction: Ctrl-C while one of them is
    still importing torch would otherwise end it with a KeyboardInterrupt traceback. Only the server decides what
    an interrupt does (a Ctrl-C in these few milliseconds is not seen by it either)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_benchmark(cfg: BenchConfig, start_barrier: Optional[StartBarrier] = None) -> RunResult:
    """Starts the frontend and the backend (--instances of it), waits for their reports, and always leaves no
    process behind.

    Under torchrun, `start_barrier(ok, error)` is called exactly once: when the frontend has warmed up (ok), or
    when the run ended before that (not ok). It returns None once every rank is ready, else why to stop."""
    from serverbench.transport.channels import ResponseChannel, StartGate, make_request_channel

    if cfg.profile and not cfg.is_cuda and not cfg.verbose:
        # The profiler's kineto probes for a GPU on a CPU machine and prints "gpuGetDeviceCount failed" and its
        # start/stop marks to the children's stderr, below Python; they inherit this environment.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    ctx = mp.get_context("spawn")  # CUDA cannot be forked; spawn also proves no state leaks through globals
    requests = make_request_channel(ctx, cfg)  # shm: the ring is made here, once, before either process starts
    responses = ResponseChannel(ctx, lock_timeout_s=cfg.timeout_s)
    stop_event = ctx.Event()
    gate = StartGate(ctx, open_now=start_barrier is None)
    # --instances: every instance passes this before each ceiling loop, so that they time it together.
    barrier = ctx.Barrier(cfg.instances) if cfg.instances > 1 else None
    roles = backend_roles(cfg.instances)
    processes, conns, child_ends = {}, {}, []
    for index, role in enumerate(roles):
        conns[role], backend_report = ctx.Pipe(duplex=False)
        child_ends.append(backend_report)
        processes[role] = ctx.Process(target=run_role, name=role,
                                      args=("worker", "backend_main", cfg, requests, responses, backend_report,
                                            stop_event, Instance(index, cfg.instances, barrier)))
    conns["frontend"], frontend_report = ctx.Pipe(duplex=False)
    child_ends.append(frontend_report)
    processes["frontend"] = ctx.Process(target=run_role, name="frontend",
                                        args=("client", "frontend_main", cfg, requests, responses, frontend_report,
                                              stop_event, gate))
    reports: dict[str, dict] = {}
    result = RunResult(status="ok", mps=mps_in_use() if cfg.is_cuda else None)
    barrier_pending = start_barrier is not None
    with interrupts_raise():
        try:
            with children_ignore_sigint():
                for proc in processes.values():
                    proc.start()
            for child_end in child_ends:
                child_end.close()
            responses.close()  # the children hold their own ends: a write to a frontend that is gone then fails
            result.pids = {role: proc.pid for role, proc in processes.items()}
            log.info("frontend pid=%d backend pid=%s", result.pids["frontend"],
                     ",".join(str(result.pids[role]) for role in roles))
            stop_deadline: Optional[float] = None
            while len(reports) < len(processes):
                waitables = [conns[r] for r in conns if r not in reports]
                waitables += [processes[r].sentinel for r in processes if r not in reports]
                for ready in wait_for(waitables, timeout=0.05 if barrier_pending else 0.5):
                    role = next((r for r, c in conns.items() if c is ready), None) or \
                        next(r for r, p in processes.items() if p.sentinel is ready)
                    if role not in reports:
                        reports[role] = _read_report(role, conns[role], processes[role])
                failed = [r for r in reports.values() if r["status"] not in ("ok", "stopped")]
                if barrier_pending and not failed and stop_deadline is None and gate.is_reached():
                    barrier_pending = False
                    problem = start_barrier(True, "")
                    if problem is None:
                        gate.open()
                    else:
                        result.status, result.error = "aborted", problem
                if (failed or result.status == "aborted") and stop_deadline is None:
                    if any(r["status"] == "timeout" for r in failed):
                        _dump_stacks(processes, requests)
                    stop_event.set()  # one side failed: stop the other now
                    stop_deadline = time.monotonic() + STOP_GRACE_S
                if stop_deadline is not None and time.monotonic() > stop_deadline:
                    break
        except (Interrupted, KeyboardInterrupt) as exc:
            defer_further_interrupts()
            _mark_interrupted(result, exc)
            stop_event.set()
            deadline = time.monotonic() + STOP_GRACE_S
            for role in ("frontend", *roles):
                if role not in reports and conns[role].poll(max(0.0, deadline - time.monotonic())):
                    try:
                        reports[role] = conns[role].recv()
                    except (EOFError, OSError):
                        pass
        finally:
            stop_event.set()
            _reap(processes)
            requests.close()  # the shm ring's segment: every process that mapped it is gone

        _merge_reports(result, combine_backend_reports(reports, roles))
        if barrier_pending and result.status != "interrupted":
            # The run ended before its warm-up did: the other ranks learn why at the barrier, and stop.
            try:
                start_barrier(result.status == "ok", f"{result.status}: {result.error}")
            except (Interrupted, KeyboardInterrupt) as exc:
                _mark_interrupted(result, exc)
    return result


def _mark_interrupted(result: RunResult, exc: BaseException) -> None:
    result.status, result.error = "interrupted", f"interrupted by {str(exc) or 'SIGINT'}"


def _dump_stacks(processes: dict, requests) -> None:
    """A run declared hung: every thread's stack of each live child goes to the log (faulthandler), with the
    request queue's depth, so the stuck place can be found afterwards."""
    from serverbench.launch import procutil

    log.error("no progress: dumping every thread's stack; request queue depth %s", requests.depth())
    for role, proc in processes.items():
        if proc.is_alive():
            os.kill(proc.pid, procutil.STACK_DUMP_SIGNAL)
            if role != "frontend":  # every backend instance
                os.kill(proc.pid, procutil.PROGRESS_SIGNAL)
    time.sleep(0.5)  # let faulthandler write before the children are stopped


def _read_report(role: str, conn, proc) -> dict:
    """The child's report; or, when its pipe is closed with nothing in it or it exited without
    sending one, a report that says it died and how."""
    try:
        if conn.poll(0.2):
            return conn.recv()
    except (EOFError, OSError):
        pass
    proc.join(timeout=1.0)  # a closed pipe means it is exiting: get its exit code
    return {"role": role, "status": f"{role_kind(role)}_died",
            "error": f"the {role} process died ({_describe_exit(proc.exitcode)})"}


def _reap(processes: dict) -> None:
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in processes.values():
        if proc.pid is not None:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in processes.values():
        if proc.pid is not None and proc.is_alive():
            log.warning("%s did not stop within %.0f s: killing it", proc.name, STOP_GRACE_S)
            proc.kill()
            proc.join(timeout=STOP_GRACE_S)


def _merge_reports(result: RunResult, reports: dict[str, dict]) -> None:
    """One status for the run: the first cause wins (a death, then the backend's error, then the frontend's)."""
    frontend = reports.get("frontend", {})
    backend = reports.get("backend", {})
    result.frontend = frontend.get("frontend")
    result.backend = backend
    if result.status != "ok":
        return
    for role in ("backend", "frontend"):
        if reports.get(role, {}).get("status", "").endswith("_died"):
            result.status, result.error = reports[role]["status"], reports[role]["error"]
            return
    if backend.get("status") not in (None, "ok", "stopped"):
        result.status, result.error, result.traceback = backend["status"], backend.get("error", ""), \
            backend.get("traceback", "")
        return
    if frontend.get("status") not in ("ok", None):
        report = result.frontend
        result.status = frontend["status"]
        result.error = report.error if report is not None else frontend.get("error", "")
        result.traceback = report.traceback if report is not None else ""
        return
    missing = [r for r in ("frontend", "backend") if r not in reports]
    if missing:
        result.status, result.error = "error", f"no report from {', '.join(missing)}"


def environment_columns(result: RunResult) -> dict[str, object]:
    ready = getattr(result.frontend, "backend_ready", None)
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
    }


def package_version(name: str) -> Optional[str]:
    """An installed package's version from its metadata: importing torchvision only to read it costs the server
    about a second (it pulls in torch._dynamo) after every run."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def build_row(cfg: BenchConfig, result: RunResult) -> dict[str, object]:
    """The CSV row: the reference's columns first, in its order and units, then ours."""
    from metrics import summarize, summary_columns
    from serverbench.load.windows import reported_span_ns, window_columns

    report = result.frontend
    ready = getattr(report, "backend_ready", None)
    windows = report.windows if report else []
    records = report.records if report else []
    summary = summarize(records, report.requests_sent if report else 0,
                        report.responses_duplicated if report else 0, report.gpu_samples if report else [],
                        cfg.slo_ms, report.load_samples if report else [], span_ns=reported_span_ns(windows),
                        backend_busy_ns=warmup_busy_ns(result.backend, records))
    columns = summary_columns(summary)
    if cfg.load not in LITTLES_LAW_LOADS:
        columns["littles_law_ratio"] = None
    row: dict[str, object] = {
        "batch_size": cfg.batch_size,
        "compile": cfg.compile,
        "torch_load_time": ready.torch_load_time_s if ready else None,
        "m_compile_time": ready.compile_time_s if ready else None,
    }
    row.update(columns)  # warmup_latency ... gpu_util follow in the reference's order, then ours
    row.update(ceiling_columns(cfg, result.backend, columns.get("throughput")))
    row.update(window_columns(windows, report.stable if report else None))
    row.update(
        status=result.status,
        error=result.error,
        experiment=cfg.experiment,
        repeat=cfg.repeat,
        load=cfg.load,
        concurrency=cfg.concurrency,
        offered_rate_rps=cfg.rate_rps if cfg.load == "poisson" else None,
        burstiness=cfg.burstiness if cfg.load == "poisson" else None,
        min_duration_s=cfg.duration_s if cfg.stability_pct is None else None,  # windows decide instead
        warmup_iters=cfg.warmup_iters,
        slo_ms=cfg.slo_ms,
        design=cfg.design,
        transport=cfg.transport,
        ring_slots=cfg.ring_slots if cfg.transport == "shm" else None,
        wire_dtype=cfg.wire_dtype,
        precision=cfg.precision,
        cudnn_allow_tf32=ready.cudnn_allow_tf32 if ready else None,
        matmul_precision=ready.matmul_precision if ready else None,
        channels_last=cfg.channels_last,
        compile_mode=cfg.compile_mode if cfg.compile else None,
        compile_decode=cfg.compile_decode,
        device=cfg.device,
        model=cfg.model,
        image_size=cfg.image_size,
        num_workers=cfg.num_workers,
        num_iters=cfg.num_iters if cfg.stability_pct is None else None,
        stability_pct=cfg.stability_pct,
        responses_unexpected=report.responses_unexpected if report else 0,
        verify=cfg.verify,
        wrong_outputs=report.wrong_outputs if report and cfg.verify else None,
        max_abs_error=report.max_abs_error if report and cfg.verify else None,
        verify_tolerance=cfg.verify_tolerance if cfg.verify else None,
        checkpoint=cfg.checkpoint or "",
        seed=cfg.seed,
        max_inflight=cfg.max_inflight,
        max_batch_size=cfg.max_batch_size,
        max_queue_delay_ms=cfg.max_queue_delay_ms if cfg.batching else None,
        spin_wait=cfg.spin_wait,
        cpu_split=cfg.cpu_split if not cfg.is_cuda else None,
        backend_cpus=result.backend.get("backend_cpus"),
        intra_op_threads=result.backend.get("intra_op_threads"),
        malloc_tuned=result.backend.get("malloc_tuned"),
        backend_cpu_cores=result.backend.get("backend_cpu_cores"),
        gpu_util_note=report.gpu_util_note if report else "",
        profile_trace=result.backend.get("profile_trace", ""),
    )
    row.update(environment_columns(result))
    row.update(instance_columns(cfg.instances, records, result.mps, report.instances_ready if report else []))
    return row


def ceiling_columns(cfg: BenchConfig, backend: dict, throughput: Optional[float]) -> dict[str, object]:
    """The model alone at the design's concurrency (timed by the backend before and after serving), and the
    efficiency of the run against it: for loads that saturate the server only (burst, closed loop). Under an
    open-loop rate the server idles between requests by design; `utilisation` says how busy it was instead."""
    from metrics import ceiling_stats

    stats = ceiling_stats(backend.get("ceiling_before") or {}, backend.get("ceiling_after") or {})
    if stats is None:
        return dict.fromkeys(("ceiling_throughput", "ceiling_batch_ms", "ceiling_concurrency", "ceiling_spread_pct",
                              "ceiling_before_throughput", "ceiling_after_throughput", "efficiency"))
    return {
        "ceiling_throughput": stats.throughput,
        # Per forward at the ceiling's rate: a request's batch, or a full formed batch with dynamic batching.
        "ceiling_batch_ms": cfg.formed_rows / stats.throughput * 1e3,
        "ceiling_concurrency": stats.concurrency,
        "ceiling_spread_pct": stats.spread_pct,
        "ceiling_before_throughput": stats.before,
        "ceiling_after_throughput": stats.after,
        "efficiency": throughput / stats.throughput if throughput is not None and cfg.load in SATURATING_LOADS
        else None,
    }


def write_detail_files(cfg: BenchConfig, result: RunResult, run_id: str) -> dict[str, str]:
    """Per-request lines, GPU samples and the timeline, when asked for; paths relative to the results folder."""
    from metrics import GpuSample, LoadSample, write_formed_batches, write_request_records, write_samples
    from serverbench.records.timeline import write_timeline

    report = result.frontend
    records = report.records if report else []
    samples = report.gpu_samples if report else []
    written = {"requests_file": "", "gpu_samples_file": "", "load_samples_file": "", "batches_file": "",
               "timeline_trace": ""}
    root = Path(cfg.results_dir)
    if cfg.save_requests:
        write_request_records(root / "requests" / f"{run_id}.csv", records)
        write_samples(root / "gpu" / f"{run_id}.csv", samples, GpuSample)
        write_samples(root / "load" / f"{run_id}.csv", report.load_samples if report else [], LoadSample)
        written.update(requests_file=f"requests/{run_id}.csv", gpu_samples_file=f"gpu/{run_id}.csv",
                       load_samples_file=f"load/{run_id}.csv")
        if cfg.batching:
            write_formed_batches(root / "batches" / f"{run_id}.csv", records)
            written["batches_file"] = f"batches/{run_id}.csv"
    if cfg.trace:
        write_timeline(root / "traces" / f"{run_id}_timeline.json", records, samples)
        written["timeline_trace"] = f"traces/{run_id}_timeline.json"
    return written


def _fmt(value: object, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(float(value) * scale, fmt)


def format_summary(cfg: BenchConfig, row: dict[str, object]) -> str:
    def num(key: str, scale: float = 1.0, fmt: str = ".3f") -> str:
        return _fmt(row.get(key), fmt, scale)

    lines = [
        f"{cfg.experiment} | {cfg.model} {cfg.image_size}x{cfg.image_size} | batch {cfg.batch_size} | "
        f"{cfg.num_workers} worker(s) | compile {'on' if cfg.compile else 'off'} | {cfg.transport} "
        f"{cfg.wire_dtype} {cfg.precision}{' channels_last' if cfg.channels_last else ''} | "
        f"{cfg.device} ({row.get('device_name') or '?'})",
        f"  status        {row['status']}" + (f": {row['error']}" if row.get("error") else ""),
        f"  requests      {row['responses_received']}/{row['requests_sent']} answered, "
        f"{row['responses_missing']} missing, {row['responses_duplicated']} duplicated",
        f"  warm-up       {num('warmup_latency')} s   (model build {num('model_build_s', fmt='.2f')} s"
        + (f", compile {num('m_compile_time', fmt='.2f')} s)" if row.get("m_compile_time") is not None else ")"),
        f"  latency       mean {num('average_latency', 1e3, '.1f')} ms  p50 {num('p50_latency_s', 1e3, '.1f')}  "
        f"p99 {num('p99_latency_s', 1e3, '.1f')}  max {num('max_latency', 1e3, '.1f')} ms",
        f"  stages (ms)   queue {num('mean_request_queue_ms', fmt='.1f')}  "
        + (f"batch {num('mean_batch_wait_ms', fmt='.1f')}  " if cfg.batching else "")
        + f"h2d {num('mean_h2d_ms', fmt='.1f')}  "
        f"predict {num('mean_predict_ms', fmt='.1f')}  d2h {num('mean_d2h_ms', fmt='.1f')}  "
        f"return {num('mean_response_queue_ms', fmt='.1f')}",
        f"  throughput    {num('throughput', fmt='.1f')} samples/s"
        + (f"   GPU util {num('gpu_util', fmt='.1f')} %" if row.get("gpu_util") is not None else ""),
    ]
    if cfg.batching:
        lines.append(f"  batching      up to {cfg.max_batch_size} images, delay {cfg.max_queue_delay_ms:g} ms: formed "
                     f"{num('mean_formed_batch', fmt='.1f')} images on average (p50 {num('p50_formed_batch', fmt='g')})"
                     f", padding {num('padding_pct', fmt='.1f')} %, wait in the batcher "
                     f"{num('mean_batch_wait_ms', fmt='.2f')} ms")
    if cfg.instances > 1:
        mps = {True: ", MPS on", False: ", MPS off: the instances time-slice the GPU", None: ""}[row.get("mps")]
        lines.append(f"  instances     {cfg.instances} processes; measured requests each served: "
                     f"{row.get('requests_per_instance')}{mps}")
    if row.get("stable") is not None:
        verdict = "stable" if row["stable"] else f"NOT stable within {cfg.stability_pct:g} % (--max_windows)"
        lines.append(f"  windows       {row['windows']}, {verdict}; the last {STABLE_WINDOWS} reported "
                     f"({row['reported_requests']} requests): throughput spread (CV) "
                     f"{num('window_throughput_cv_pct', fmt='.1f')} %")
    if row.get("ceiling_throughput") is not None:
        fit = (f"efficiency {num('efficiency', fmt='.3f')}" if row.get("efficiency") is not None
               else f"utilisation {num('utilisation', fmt='.3f')}")
        if row.get("ceiling_concurrency") is None:  # a torchrun job: the sum of its ranks' ceilings
            lines.append(f"  ceiling       {num('ceiling_throughput', fmt='.1f')} samples/s (the ranks' models "
                         f"alone, summed)   {fit}")
        elif cfg.instances > 1:  # timed by every instance at once, summed
            lines.append(f"  ceiling       {num('ceiling_throughput', fmt='.1f')} samples/s +- "
                         f"{num('ceiling_spread_pct', fmt='.1f')} % (the {cfg.instances} instances' models alone, "
                         f"timed at once and summed, {row['ceiling_concurrency']} at once in each; before "
                         f"{num('ceiling_before_throughput', fmt='.1f')}, after "
                         f"{num('ceiling_after_throughput', fmt='.1f')})   {fit}")
        else:
            lines.append(f"  ceiling       {num('ceiling_throughput', fmt='.1f')} samples/s +- "
                         f"{num('ceiling_spread_pct', fmt='.1f')} % (the model alone, {row['ceiling_concurrency']} "
                         f"at once; before {num('ceiling_before_throughput', fmt='.1f')}, after "
                         f"{num('ceiling_after_throughput', fmt='.1f')})   {fit}")
    if cfg.load != "burst":
        offered = f"offered {cfg.rate_rps:.6g}, " if cfg.rate_rps else f"concurrency {cfg.concurrency}, "
        inflight = f", in flight max {row['inflight_max']}" if row.get("inflight_max") is not None else ""
        lines.append(f"  load          {cfg.load}: {offered}achieved {num('achieved_rate_rps', fmt='.2f')} req/s"
                     f"{inflight}")
    ratio = row.get("littles_law_ratio")
    if ratio is not None:
        sound = abs(ratio - 1) <= LITTLES_LAW_TOLERANCE
        lines.append(f"  Little's law  in flight / (rate x latency) = {ratio:.3f}" + (
            "" if sound else f"   WARNING: off by more than {LITTLES_LAW_TOLERANCE:.0%}: the records miss part of "
                             "some requests' lives (or the load sampler missed requests)"))
    if row.get("timestamp_order_violations"):
        lines.append(f"  WARNING       {row['timestamp_order_violations']} request(s) have stamps out of order "
                     "(sent <= taken <= h2d <= forward <= d2h <= received): the stage times of this run are suspect")
    if cfg.slo_ms is not None:
        lines.append(f"  SLO {cfg.slo_ms:g} ms   {num('slo_attainment', 100, '.1f')} % within, goodput "
                     f"{num('goodput_samples_per_s', fmt='.1f')} samples/s, p99 met: {row.get('slo_p99_met')}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="server.py",
        description="Benchmark a Python inference server design: a frontend process streams fake image batches "
                    "to a backend process; one CSV row per run.",
    )
    add_cli_args(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from serverbench.launch.ranks import rank_from_env

    rank = rank_from_env()  # set when torchrun started this process
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s server{'' if rank is None else f' rank {rank.rank}'}[%(process)d] "
                               "%(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        cfg = build_config(args, rank)
    except ConfigError as exc:
        print(f"server.py: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    if cfg.rank is not None:
        return run_job(cfg)
    if cfg.find_peak:
        return find_peak(cfg)
    result, _ = run_once(cfg)
    if result.status == "ok":
        return EXIT_OK if result.row_saved else EXIT_FAILED
    return EXIT_INTERRUPTED if result.status == "interrupted" else EXIT_FAILED


def run_once(cfg: BenchConfig, extra_columns: Optional[dict] = None) -> tuple[RunResult, dict[str, object]]:
    """One run: both processes, the row (appended), the detail files and the terminal summary."""
    run_id = _run_id(cfg)
    crash_if_asked(cfg)
    result = run_benchmark(cfg)
    row = build_row(cfg, result)
    try:
        details = write_detail_files(cfg, result, run_id)
    except OSError as exc:  # the folder went away or filled up during the run: the row still gets out
        print(f"server.py: could not write the detail files: {one_line(exc)}", file=sys.stderr)
        details = {}
    row.update(run_id=run_id, **details, **(extra_columns or {}))
    written, problem = save_row(cfg.output_path, row, run_id)
    print(format_summary(cfg, row))
    if problem is None:
        print(f"  row appended to {written}")
    else:
        result.row_saved = False
        kept = f"kept it in {written}" if written else "it is lost"
        print(f"server.py: could not write the row to {cfg.output_path} ({problem}); {kept}", file=sys.stderr)
    if result.status != "ok":
        print(f"server.py: run failed ({result.status}): {result.error}", file=sys.stderr)
        if result.traceback:
            print(result.traceback.rstrip(), file=sys.stderr)
    return result, row


def save_row(path: Path, row: dict[str, object], run_id: str) -> tuple[Optional[Path], Optional[str]]:
    """Appends the row; (the file it went to, None). When the results file cannot be written after all (it was
    checked before the run: a disk that filled up, a folder removed meanwhile), the row goes to a side file in the
    temporary folder: (that file or None, why)."""
    import tempfile

    from metrics import append_row

    try:
        return append_row(path, row), None
    except (OSError, TimeoutError) as exc:
        side = Path(tempfile.gettempdir()) / f"{path.stem}.unwritten-{run_id}.csv"
        try:
            return append_row(side, row), one_line(exc)
        except OSError:
            return None, one_line(exc)


def _run_id(cfg: BenchConfig) -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}_{cfg.experiment}_bs{cfg.batch_size}_r{cfg.repeat}_{os.getpid()}"


def crash_if_asked(cfg: BenchConfig) -> None:
    """Test-only (--inject_fault server): the server process itself raises, as a crashing rank would."""
    if cfg.inject_fault == "server":
        raise RuntimeError("injected fault in the server process")


# ---------------------------------------------------------------------------------------------- torchrun


def run_job(cfg: BenchConfig) -> int:
    """One rank of a torchrun job: its own run, between the collectives every rank makes (ranks.py);
    rank 0 writes every rank's row and the job's row. Each rank exits with its own run's status."""
    from dataclasses import replace

    from serverbench.launch.ranks import Job, JobError, RankOutcome, clock_domain, tell_torchrun

    rank = cfg.rank
    with interrupts_raise():
        try:
            job = Job(rank, cfg.dist_timeout_s)
        except (Interrupted, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        except JobError as exc:
            print(f"server.py: {exc}", file=sys.stderr)
            tell_torchrun(str(exc))
            return EXIT_FAILED
        crash_if_asked(cfg)
        result = run_benchmark(cfg, start_barrier=job.start_barrier)
        if result.status == "interrupted":
            print(f"server.py: rank {rank.rank}: {result.error}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if result.status not in ("ok", "aborted"):
            # This rank's own failure, told before any other rank may exit: torchrun's summary then names it.
            tell_torchrun(f"rank {rank.rank} ({result.status}): {result.error}")
        report = result.frontend
        if report is not None and report.backend_ready is not None:  # the --verify answers stay here
            report = replace(report, backend_ready=replace(report.backend_ready, reference_outputs=None))
        mine = RankOutcome(rank, build_row(cfg, result), replace(result, frontend=report), clock_domain(),
                           job.barrier_ns)
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
        print(f"rank {rank.rank} ({cfg.device}): {result.status}, throughput {mine.row.get('throughput')} samples/s; "
              "rank 0 wrote the rows")
    return EXIT_OK if result.status == "ok" else EXIT_FAILED


# Columns of torchrun rows only: scope is "rank" (one rank's run) or "job" (all ranks together).
JOB_COLUMNS = ("scope", "rank", "local_rank", "world_size", "ranks_reported", "ranks_ok", "nodes", "clock_alignment",
               "slowest_rank", "slowest_rank_throughput")


def write_job_rows(cfg: BenchConfig, outcomes: list, collective_error: Optional[str] = None) -> None:
    """Rank 0: one row per rank (with its detail files), then the job's row: throughput over the common window,
    latency percentiles over every rank's requests, the slowest rank named."""
    from dataclasses import replace

    from serverbench.launch.ranks import clock_offsets_ns, job_status, merged_report, slowest_rank
    from metrics import append_row

    base_id = _run_id(cfg)
    world_size = cfg.rank.world_size
    for outcome in outcomes:
        run_id = f"{base_id}_rank{outcome.rank.rank}"
        row = dict(outcome.row, run_id=run_id, **write_detail_files(cfg, outcome.result, run_id))
        row.update(dict.fromkeys(JOB_COLUMNS), scope="rank", rank=outcome.rank.rank,
                   local_rank=outcome.rank.local_rank, world_size=world_size)
        append_row(cfg.output_path, row)

    status, error = job_status(outcomes)
    if collective_error is not None:
        status, error = "error", collective_error
    offsets_ns = clock_offsets_ns(outcomes)
    merged = RunResult(status=status, error=error,
                       frontend=merged_report([o.result.frontend for o in outcomes], offsets_ns))
    rows = [o.row for o in outcomes]

    def unique(column: str) -> str:
        return ",".join(dict.fromkeys(str(r.get(column)) for r in rows if r.get(column) is not None))

    def largest(column: str) -> Optional[float]:
        values = [r.get(column) for r in rows if r.get(column) is not None]
        return max(values) if values else None

    job_cfg = replace(cfg, seed=cfg.seed - cfg.rank.rank, device=unique("device"))
    row = build_row(job_cfg, merged)
    ceilings = [r.get("ceiling_throughput") for r in rows]
    ceiling = sum(ceilings) if ceilings and None not in ceilings else None  # the job's model-alone figure
    slowest, slowest_throughput = slowest_rank(outcomes)
    clocks = {o.clock for o in outcomes}
    row.update(
        run_id=f"{base_id}_job",
        # The job waited for its slowest rank's build, compile and warm-up.
        warmup_latency=largest("warmup_latency"), torch_load_time=largest("torch_load_time"),
        m_compile_time=largest("m_compile_time"), model_build_s=largest("model_build_s"),
        ceiling_throughput=ceiling, ceiling_batch_ms=None,
        # Pooled over ranks, the in-flight count is per rank but the rate the job's, and "some GPU busy" is not
        # a utilisation: each rank row has its own.
        littles_law_ratio=None, utilisation=None,
        efficiency=row["throughput"] / ceiling if row.get("throughput") is not None and ceiling
        and cfg.load in SATURATING_LOADS else None,
        device_name=unique("device_name"), host=unique("host"),
        scope="job", rank=None, local_rank=None, world_size=world_size, ranks_reported=len(outcomes),
        ranks_ok=sum(o.result.status == "ok" for o in outcomes), nodes=len(clocks),
        clock_alignment="shared clock" if len(clocks) == 1 else "start barrier",
        slowest_rank=slowest, slowest_rank_throughput=slowest_throughput,
    )
    append_row(cfg.output_path, row)

    print(format_summary(job_cfg, row))
    for outcome in outcomes:
        r = outcome.row
        print(f"  rank {outcome.rank.rank:<4}  {r.get('device')} ({r.get('device_name')}) on {r.get('host')}: "
              f"{r.get('status')}, throughput {_fmt(r.get('throughput'), '.1f')} samples/s, "
              f"p50 {_fmt(r.get('p50_latency_s'), '.1f', 1e3)} ms, p99 {_fmt(r.get('p99_latency_s'), '.1f', 1e3)} ms")
    if slowest is not None:
        print(f"  slowest rank  {slowest} ({slowest_throughput:.1f} samples/s)")
    print(f"  {len(outcomes)} rank rows and the job row appended to {cfg.output_path}")
    if status != "ok":
        print(f"server.py: job failed ({status}): {error}", file=sys.stderr)


def bisect_peak(measure, offline_rps: float, slo_s: float, steps: int
                ) -> tuple[Optional[tuple[float, float]], Optional[tuple[float, float]]]:
    """Bisection on the rate in (0, offline_rps]: `measure(step, rate)` returns the p99 latency in seconds, or
    None when the run failed (which counts as over the target). Returns (rate, p99) of the highest rate that met
    slo_s and of the lowest that did not; either may be None. The offline rate is tried first: a server that
    keeps its p99 at its own maximum needs no search."""
    passing: Optional[tuple[float, float]] = None
    failing: Optional[tuple[float, float]] = None
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


def find_peak(cfg: BenchConfig) -> int:
    """The 'server' figure: the highest Poisson rate whose p99 latency stays within --slo_ms, by bisection
    between 0 and the 'offline' rate that a burst run reaches. Every run is a row; the result goes to peak.csv."""
    from dataclasses import replace

    from metrics import append_row

    result, row = run_once(replace(cfg, load="burst", rate_rps=None, find_peak=False),
                           {"peak_search_step": "offline"})
    if result.status != "ok" or not row.get("achieved_rate_rps"):
        print(f"server.py: peak search stopped: the burst run failed ({result.status})", file=sys.stderr)
        return EXIT_INTERRUPTED if result.status == "interrupted" else EXIT_FAILED
    offline_rps = float(row["achieved_rate_rps"])

    def measure(step: int, rate: float) -> Optional[float]:
        result, row = run_once(replace(cfg, load="poisson", rate_rps=rate, find_peak=False),
                               {"peak_search_step": step})
        if result.status == "interrupted":
            raise Interrupted("SIGINT")
        p99_s = row.get("p99_latency_s") if result.status == "ok" else None
        print(f"peak search step {step}: {rate:.2f} req/s -> p99 "
              f"{'n/a' if p99_s is None else f'{p99_s * 1e3:.1f} ms'}")
        return p99_s

    try:
        passing, failing = bisect_peak(measure, offline_rps, cfg.slo_ms / 1e3, cfg.peak_steps)
    except Interrupted:
        return EXIT_INTERRUPTED
    high = failing[0] if failing else offline_rps
    peak = {
        "experiment": cfg.experiment, "repeat": cfg.repeat, "batch_size": cfg.batch_size, "compile": cfg.compile,
        "design": cfg.design, "num_workers": cfg.num_workers, "max_batch_size": cfg.max_batch_size,
        "intra_op_threads": row.get("intra_op_threads"), "model": cfg.model, "device": cfg.device,
        "slo_ms": cfg.slo_ms, "burstiness": cfg.burstiness,
        "offline_rate_rps": offline_rps, "offline_throughput": offline_rps * cfg.batch_size,
        "peak_rate_rps": passing[0] if passing else None,
        "peak_throughput": passing[0] * cfg.batch_size if passing else None,
        "peak_p99_latency_s": passing[1] if passing else None,
        "over_slo_rate_rps": failing[0] if failing else None,
        "over_slo_p99_latency_s": failing[1] if failing else None,
        "steps": cfg.peak_steps, "status": "ok" if passing else "slo_not_met",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    append_row(Path(cfg.results_dir) / "peak.csv", peak)
    if passing:
        print(f"peak: {passing[0]:.2f} req/s ({passing[0] * cfg.batch_size:.1f} samples/s) with p99 "
              f"{passing[1] * 1e3:.1f} ms <= {cfg.slo_ms:g} ms; offline maximum {offline_rps:.2f} req/s"
              + (f"; {failing[0]:.2f} req/s gave p99 {failing[1] * 1e3:.1f} ms" if failing else ""))
    else:
        print(f"peak: no rate tried kept p99 within {cfg.slo_ms:g} ms (lowest tried {high:.2f} req/s)")
    print(f"  result appended to {Path(cfg.results_dir) / 'peak.csv'}")
    return EXIT_OK


if __name__ == "__main__":
    if "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun: an exception that escapes is written to torchrun's error file, so the launcher's
        # summary names the rank and shows its traceback.
        from torch.distributed.elastic.multiprocessing.errors import record

        sys.exit(record(main)())
    sys.exit(main())
