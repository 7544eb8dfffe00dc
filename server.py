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
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as wait_for
from pathlib import Path

from serverbench.config.build import build_config, config_warnings
from serverbench.config.flags import ConfigError, OneLineErrorParser
from serverbench.config.options import BenchConfig, add_cli_args
from serverbench.launch import job as torchrun_job
from serverbench.launch import peak as peak_search
from serverbench.launch import procutil
from serverbench.launch.children import Children, make_children
from serverbench.launch.frontends import combine_frontend_reports, surviving_generators
from serverbench.launch.instances import combine_backend_reports, mps_in_use, role_kind
from serverbench.launch.outcome import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Interrupted,
    RunResult,
    StartBarrier,
    crash_if_asked,
)
from serverbench.launch.preflight import preflight
from serverbench.launch.ranks import rank_from_env
from serverbench.records.benchmark_db import save_records
from serverbench.records.console import format_summary
from serverbench.records.csv_store import append_row
from serverbench.records.row import build_row, in_row_order, make_run_id, write_detail_files
from serverbench.schema.messages import (
    ENDED_AS_ASKED,
    BackendReport,
    ChildReport,
    DoorReport,
    FrontendReport,
    first_failure,
    served_as_frontend,
)
from serverbench.system import process
from serverbench.system.net import host_port
from serverbench.system.process import one_line
from serverbench.system.provenance import read_provenance
from serverbench.system.scratch import children_temp_folder
from serverbench.transport.channels import (
    Heartbeat,
    StartGate,
    frozen_frontend,
    make_request_channel,
)
from serverbench.transport.responses import ResponseChannel

log = logging.getLogger("server")

STOP_GRACE_S = 5.0  # how long a child may take to leave once told to stop, before it is killed
REPORTED_EXIT_S = 1.0  # after an interrupt's grace: a child that sent its report is only flushing and exiting
STACK_DUMP_WAIT_S = 1.0  # how long a hung run's child may take to begin its stack dump before the next one is asked
STACK_WRITE_S = 0.1  # once begun: the dump is a few kB written from the signal handler


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


def _handle_run_stoppers(handler) -> dict[int, object]:
    """`handler` for each signal that stops a run (process.RUN_STOPPERS): SIGINT, SIGTERM, and SIGHUP (a closed
    terminal) unless it is ignored (nohup: the run goes on); the handlers they had."""
    stoppers = [s for s in process.RUN_STOPPERS if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN]
    return {signum: signal.signal(signum, handler) for signum in stoppers}


def _restore_handlers(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, SIGTERM and SIGHUP Interrupted, in the main thread while inside; the
    previous handlers come back afterwards, unless the run was interrupted: then further interrupts are only noted
    until the process exits (see defer_further_interrupts). Python leaves SIGINT ignored when it was ignored at start
    (a job started with `&` by a script): Ctrl-C and the group's SIGINT must still stop the run, so that handler is
    installed too."""
    previous = _handle_run_stoppers(_raise_interrupted)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is not _note_repeated_interrupt:
            _restore_handlers(previous)


def _note_repeated_interrupt(signum: int, frame) -> None:
    log.warning("%s again: already stopping; the partial row is being written", signal.Signals(signum).name)


def defer_further_interrupts() -> None:
    """After the first interrupt the run is stopping and its partial row is still to be written: a second Ctrl-C
    (people press it twice) must not lose what the first one saved."""
    _handle_run_stoppers(_note_repeated_interrupt)


@contextlib.contextmanager
def interrupts_noted() -> Iterator[list[str]]:
    """While a run's row is built and written: the signals that stop a run are noted, not raised, so that one that
    comes once the run has ended cannot lose its row to a traceback; the caller stops after the row. Inside an
    interrupted run's stop (defer_further_interrupts) nothing changes: interrupts are noted there already."""
    noted: list[str] = []
    if signal.getsignal(signal.SIGINT) is _note_repeated_interrupt:
        yield noted
        return

    def note(signum: int, frame) -> None:
        noted.append(signal.Signals(signum).name)

    previous = _handle_run_stoppers(note)
    try:
        yield noted
    finally:
        _restore_handlers(previous)


@contextlib.contextmanager
def children_start_ignoring() -> Iterator[None]:
    """Processes started inside inherit process.IGNORED_AT_START ignored from their first instruction: Ctrl-C while
    one of them is still importing torch would otherwise end it with a KeyboardInterrupt traceback, and the stack
    dump of a hung start-up would kill the child it was meant to look into, and a stop's SIGTERM to the group would
    end it mid-run. Only the server decides what an interrupt does (a Ctrl-C or SIGTERM in these few milliseconds is
    not seen by it either)."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in process.IGNORED_AT_START}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_benchmark(cfg: BenchConfig, start_barrier: StartBarrier | None = None) -> RunResult:
    """Starts the frontend and the backend (--instances of it), waits for their reports, and always leaves no
    process behind, nor any temporary file of theirs (children_temp_folder).

    Under torchrun, `start_barrier(ok, error)` is called exactly once: when the frontend has warmed up (ok), or
    when the run ended before that (not ok). It returns None once every rank is ready, else why to stop."""
    with children_temp_folder() as environment:
        return _run_children(cfg, start_barrier, environment)


def _run_children(cfg: BenchConfig, start_barrier: StartBarrier | None, environment: dict[str, str]) -> RunResult:
    """run_benchmark's run, its children given `environment`; every one of them reaped on the way out."""
    if cfg.profile and not cfg.is_cuda and not cfg.verbose:
        # The profiler's kineto probes for a GPU on a CPU machine and prints "gpuGetDeviceCount failed" and its
        # start/stop marks to the children's stderr, below Python; they inherit this environment.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    ctx = mp.get_context("spawn")  # CUDA cannot be forked; spawn also proves no state leaks through globals
    # multiprocessing's resource tracker, started first and with the run's stoppers ignored, keeps them so: a closed
    # terminal's SIGHUP to the whole group would end it, and what it tracks (the ring's shared memory) could leak.
    with children_start_ignoring():
        resource_tracker.ensure_running()
    requests = make_request_channel(ctx, cfg)  # shm: the ring is made here, once, before either process starts
    responses = ResponseChannel(ctx, lock_timeout_s=cfg.timeout_s, writers=cfg.instances)
    stop_event = ctx.Event()
    # Shut until the server opens it under torchrun, and with several generators (once every one has warmed up).
    gate = StartGate(ctx, open_now=start_barrier is None and cfg.generators == 1, parties=cfg.generators)
    children = make_children(ctx, cfg, requests, responses, stop_event, gate, environment)
    reports: dict[str, ChildReport] = {}
    reap_grace_s = STOP_GRACE_S
    result = RunResult(status="ok", mps=mps_in_use() if cfg.is_cuda else None, provenance=read_provenance())
    barrier_pending = start_barrier is not None
    with interrupts_raise():
        try:
            _start(children, responses, result)
            if cfg.serve_only:
                _serve_until_told(cfg, children, reports, result, requests, stop_event, gate)
            else:
                barrier_pending = _supervise(cfg, children, reports, result, requests, stop_event, gate, start_barrier)
            if any(role not in reports for role in children.processes):
                # Supervision ends with a report missing only once the stop's grace has passed: a frozen child
                # had it already, and a second one only delayed the run's end (a frozen door: 10 s, not 5).
                reap_grace_s = REPORTED_EXIT_S
        except (Interrupted, KeyboardInterrupt) as exc:
            defer_further_interrupts()
            _mark_interrupted(result, exc)
            stop_event.set()
            _collect_reports(children.conns, reports, time.monotonic() + STOP_GRACE_S)
            # Those that reported are leaving; those that did not had the grace already: not a second one each.
            reap_grace_s = REPORTED_EXIT_S
        finally:
            stop_event.set()
            _reap(children.processes, reap_grace_s)
            if requests is not None:
                requests.close()  # the shm ring's segment: every process that mapped it is gone

        combined = combine_backend_reports(reports, children.roles)
        backend = combined.get("backend") if children.roles else BackendReport(status="ok")  # --target: none of ours
        door = reports.get("door") or (backend.door if backend is not None else None)
        if door is None and "door" in children.processes:  # it never reported: not ok, whatever else says so
            door = DoorReport(status="missing", error="no report from the door", counted=False)
        frontend = combine_frontend_reports(combined, children.frontends) or (
            served_as_frontend(door) if cfg.serve_only else None
        )
        _merge_reports(result, frontend, backend, door, bool(surviving_generators(combined, children.frontends)))
        if barrier_pending and result.status != "interrupted":
            # The run ended before its warm-up did: the other ranks learn why at the barrier, and stop.
            try:
                start_barrier(result.status == "ok", f"{result.status}: {result.error}")
            except (Interrupted, KeyboardInterrupt) as exc:
                _mark_interrupted(result, exc)
    return result


def _serve_until_told(
    cfg: BenchConfig,
    children: Children,
    reports: dict[str, ChildReport],
    result: RunResult,
    requests,
    stop_event,
    gate: StartGate,
) -> None:
    """--serve_only: the door and backend serve until SIGINT or SIGTERM; then the door takes no more requests, lets
    the answers in flight out and ends the backend, and the run ends as asked (a second signal interrupts it). A
    child that fails once the finish was asked (a backend still building its model, whose door has left) failed of
    it, when nothing had been served yet: the run was interrupted, which its status says, not the broken pipe that
    followed."""
    # The door's own "listening on" line says when the port accepts
    log.info("serving on %s://%s until SIGINT or SIGTERM", cfg.transport, host_port(cfg.host, cfg.port))
    try:
        _supervise(cfg, children, reports, result, requests, stop_event, gate, None)
        return  # a child ended first: a failure, which the reports say
    except (Interrupted, KeyboardInterrupt) as exc:
        log.info("%s: finishing (no more requests; the answers in flight go out)", str(exc) or "SIGINT")
        asked = exc
    children.finish_event.set()
    _supervise(cfg, children, reports, result, requests, stop_event, gate, None)
    doors = [report if isinstance(report, DoorReport) else getattr(report, "door", None) for report in reports.values()]
    served = any(door is not None and door.answered for door in doors)
    if not served and any(report.status not in ENDED_AS_ASKED for report in reports.values()):
        _mark_interrupted(result, asked)  # a door that had served and then failed keeps its own failure


def _start(children: Children, responses: ResponseChannel, result: RunResult) -> None:
    """Starts every child, then lets go of the ends of their pipes that only they use."""
    with children_start_ignoring():
        for proc in children.processes.values():
            proc.start()
    for child_end in children.child_ends:
        child_end.close()
    responses.close()  # the children hold their own ends: a write to a frontend that is gone then fails
    if children.control is not None:
        children.control.close()
    result.pids = {role: proc.pid for role, proc in children.processes.items()}
    backends = ",".join(str(result.pids[role]) for role in children.roles)
    frontends = ",".join(str(result.pids[role]) for role in children.frontends)
    shown = [f"frontend pid={frontends}"] if frontends else []
    shown += [f"backend pid={backends}"] if backends else []
    shown += [f"door pid={result.pids['door']}"] if "door" in result.pids else []
    log.info("%s", " ".join(shown))


def _supervise(
    cfg: BenchConfig,
    children: Children,
    reports: dict[str, ChildReport],
    result: RunResult,
    requests,
    stop_event,
    gate: StartGate,
    start_barrier: StartBarrier | None,
) -> bool:
    """Collects each child's report as it comes. Once one fails, is frozen, or the ranks abort at the start
    barrier, the others are told to stop and given STOP_GRACE_S to report. Whether the start barrier (under
    torchrun) is still to be passed."""
    processes, conns = children.processes, children.conns
    barrier_pending = start_barrier is not None
    gate_pending = not gate.is_open()
    stop_deadline: float | None = None
    started_ns = time.monotonic_ns()
    while len(reports) < len(processes):
        waitables = [conns[r] for r in conns if r not in reports]
        waitables += [processes[r].sentinel for r in processes if r not in reports]
        for ready in wait_for(waitables, timeout=0.05 if gate_pending else 0.5):
            role = next((r for r, c in conns.items() if c is ready), None) or next(
                r for r, p in processes.items() if p.sentinel is ready
            )
            if role not in reports:
                reports[role] = _read_report(role, conns[role], processes[role])
        if children.frontends and all(r in reports for r in children.frontends) and children.finish_event is not None:
            children.finish_event.set()  # the door takes no more requests and ends the backend
        failed = [r for r in reports.values() if r.status not in ENDED_AS_ASKED]
        if gate_pending and not failed and stop_deadline is None and gate.is_reached():
            # Every frontend has warmed up: under torchrun the ranks meet first; then the measured phase starts.
            gate_pending = barrier_pending = False
            problem = start_barrier(True, "") if start_barrier is not None else None
            if problem is None:
                gate.open()
            else:
                result.status, result.error = "aborted", problem
        frozen = None if stop_deadline is not None else _frozen_child(children.heartbeats, reports, cfg, started_ns)
        if frozen is not None:
            log.error("%s: stopping it", frozen[1])
            result.status, result.error = "timeout", frozen[1]
            processes[frozen[0]].kill()  # its report cannot come: waiting for it would only add the grace
        if (failed or result.status in ("aborted", "timeout")) and stop_deadline is None:
            if result.status == "timeout" or any(r.status == "timeout" for r in failed):
                _dump_stacks(processes, requests)
            stop_event.set()  # one side failed: stop the other now
            stop_deadline = time.monotonic() + STOP_GRACE_S
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            break
    return barrier_pending


def _frozen_child(
    heartbeats: dict[str, Heartbeat], reports: dict, cfg: BenchConfig, started_ns: int
) -> tuple[str, str] | None:
    """(role, why) of the first child that has not reported and has not beaten within its deadline, else None."""
    now_ns = time.monotonic_ns()
    for role, heartbeat in heartbeats.items():
        if role in reports:
            continue
        silent_s = heartbeat.silent_for_s(now_ns, started_ns)
        why = frozen_frontend(silent_s, heartbeat.beaten, cfg.timeout_s, cfg.warmup_timeout_s, role)
        if why is not None:
            return role, why
    return None


def _collect_reports(conns: dict, reports: dict[str, ChildReport], deadline: float) -> None:
    """The reports the children send once told to stop, all waited for at once until the deadline."""
    gone: set[str] = set()  # exited without one: not waited for again
    while (waiting := {conn: role for role, conn in conns.items() if role not in reports and role not in gone}) and (
        left_s := deadline - time.monotonic()
    ) > 0:
        for conn in wait_for(list(waiting), timeout=left_s):
            try:
                reports[waiting[conn]] = conn.recv()
            except (EOFError, OSError):
                gone.add(waiting[conn])


def _mark_interrupted(result: RunResult, exc: BaseException) -> None:
    result.status, result.error = "interrupted", f"interrupted by {str(exc) or 'SIGINT'}"


def _dump_stacks(processes: dict, requests) -> None:
    """A run declared hung: every thread's stack of each live child goes to the log (faulthandler), with the
    request queue's depth, so the stuck place can be found afterwards. One child at a time, each under a line that
    names it: faulthandler writes a stack in many small pieces, and two children's at once interleave them."""
    log.error(
        "no progress: dumping every thread's stack; request queue depth %s",
        requests.depth() if requests is not None else None,
    )
    for role, proc in processes.items():
        if not proc.is_alive():
            continue
        log.error("%s (pid %d): every thread's stack", role, proc.pid)
        with contextlib.suppress(ProcessLookupError):  # it may exit meanwhile
            os.kill(proc.pid, process.STACK_DUMP_SIGNAL)
        if procutil.signal_taken(proc.pid, process.STACK_DUMP_SIGNAL, STACK_DUMP_WAIT_S):
            time.sleep(STACK_WRITE_S)
        else:
            log.error(
                "%s (pid %d) did not take the signal within %g s (stopped?): no stack",
                role,
                proc.pid,
                STACK_DUMP_WAIT_S,
            )
    for role, proc in processes.items():  # each backend instance logs its steps' progress: one line each
        if role_kind(role) != "frontend" and proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, process.PROGRESS_SIGNAL)
    time.sleep(0.5)  # let them write before the children are stopped


def _read_report(role: str, conn, proc) -> ChildReport:
    """The child's report; or, when its pipe is closed with nothing in it or it exited without
    sending one, a report that says it died and how."""
    try:
        if conn.poll(0.2):
            return conn.recv()
    except (EOFError, OSError):
        pass
    proc.join(timeout=1.0)  # a closed pipe means it is exiting: get its exit code
    status, error = f"{role_kind(role)}_died", f"the {role} process died ({_describe_exit(proc.exitcode)})"
    if role_kind(role) == "frontend":
        return FrontendReport(status=status, error=error)
    return (
        DoorReport(status=status, error=error, counted=False)
        if role == "door"
        else BackendReport(role=role, status=status, error=error)
    )


def _reap(processes: dict, grace_s: float) -> None:
    """Every child gone: one grace period for all of them, then the rest killed together."""
    killed = procutil.stop_processes(list(processes.values()), grace_s)
    if killed:
        shown = ", ".join(killed) if len(killed) <= 4 else f"{len(killed)} processes ({', '.join(killed[:3])}, ...)"
        log.warning("%s did not stop within %.0f s: killed", shown, grace_s)


def _merge_reports(
    result: RunResult,
    frontend: FrontendReport | None,
    backend: BackendReport | None,
    door: DoorReport | None,
    survivors: bool = False,
) -> None:
    """One status for the run, by first_failure: a death, then the door's failure, the backend's, the frontend's; a
    run that ended with a report missing and nothing else wrong is an error, never ok. `survivors`: of several load
    generators, some reported although another died; the row keeps their records and counters (the run still
    fails with the death's status)."""
    died = frontend is not None and frontend.status.endswith("_died")
    # A dead frontend's stand-in carries no records: with nothing else, what was sent is unknown, not 0.
    result.frontend = None if died and not survivors else frontend
    result.backend = backend or BackendReport(status="missing", error="no backend report")
    result.door = door
    if result.status != "ok":
        return
    # The door before the backend: a door that failed leaves the backend writing to a pipe nobody reads.
    cause = first_failure([report for report in (door, backend, frontend) if report is not None])
    if cause is None and frontend is not None and frontend.status != "ok":
        cause = frontend  # stopped, with nothing failed: the run did not finish, and says so
    if cause is not None:
        result.status, result.error = cause.status, cause.error
        result.traceback = cause.traceback
        return
    missing = [role for role, report in (("frontend", frontend), ("backend", backend)) if report is None]
    if missing:
        result.status, result.error = "error", f"no report from {', '.join(missing)}"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="server.py",
        description="Benchmark a Python inference server design: a frontend process streams fake image batches "
        "to a backend process; one CSV row per run.",
    )
    add_cli_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # --target grpc:// asks the server's metadata over grpc in this process, which then starts its children (fork,
    # then exec): grpc's fork handlers may abort such a child before its exec; grpc's switch for this case, read
    # when grpc starts (it is imported later, by preflight)
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    rank = rank_from_env()  # set when torchrun started this process
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s server{'' if rank is None else f' rank {rank.rank}'}[%(process)d] "
        "%(levelname)s %(message)s",
    )
    args = build_parser().parse_args(argv)
    process.raise_open_files_limit()  # before the checks count them; the children inherit it
    try:
        with interrupts_raise():  # the checks may take long (a model's import and first forward): Ctrl-C ends them
            cfg = preflight(build_config(args, rank))  # the flags alone first, then this machine
        for warning in config_warnings(args):
            print(f"server.py: warning: {warning}", file=sys.stderr)
    except ConfigError as exc:
        print(f"server.py: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (Interrupted, KeyboardInterrupt) as exc:
        # Before the run: no process of it started and nothing written (the results folder is made last), so no row.
        why = str(exc) or "SIGINT"
        print(f"server.py: interrupted by {why} during the checks before the run; nothing was run", file=sys.stderr)
        return EXIT_INTERRUPTED

    if cfg.rank is not None:
        return run_job(cfg)
    if cfg.find_peak:
        return find_peak(cfg)
    result, _ = run_once(cfg)
    if result.status == "ok":
        return EXIT_OK if result.row_saved else EXIT_FAILED
    return EXIT_INTERRUPTED if result.status == "interrupted" else EXIT_FAILED


def run_once(cfg: BenchConfig, extra_columns: dict | None = None) -> tuple[RunResult, dict[str, object]]:
    """One run: both processes, the row (appended), the detail files and the terminal summary."""
    run_id = make_run_id(cfg)
    crash_if_asked(cfg)
    result = run_benchmark(cfg)
    with interrupts_noted() as late:
        row = build_row(cfg, result)
        try:
            details = write_detail_files(cfg, result, run_id)
        except OSError as exc:  # the folder went away or filled up during the run: the row still gets out
            print(f"server.py: could not write the detail files: {one_line(exc)}", file=sys.stderr)
            details = {}
        # In the declared order: the door's columns, declared last, were built with the rest of the row.
        row = in_row_order({**row, "run_id": run_id, **details, **(extra_columns or {})})
        written, problem = save_row(cfg.output_path, row, run_id)
    print(format_summary(cfg, row))
    if problem is None:
        print(f"  row appended to {written}")
    else:
        result.row_saved = False
        kept = f"kept it in {written}" if written else "it is lost"
        print(f"server.py: could not write the row to {cfg.output_path} ({problem}); {kept}", file=sys.stderr)
    if cfg.save_pytorch_benchmark:
        save_records(cfg.output_path, [row])
    if result.status != "ok":
        kept = details.get("traceback_file")
        where = f" (traceback: {Path(cfg.results_dir) / kept})" if kept else ""
        print(f"server.py: run failed ({result.status}): {result.error}{where}", file=sys.stderr)
        if result.traceback and not kept:  # its file could not be written: shown rather than lost
            print(result.traceback.rstrip(), file=sys.stderr)
    elif late:  # the run was measured whole; what comes after it (a peak search's next step, this process's exit
        # status) stops as after an interrupted run
        print(f"server.py: {late[0]} after the run ended: its row is kept; stopping", file=sys.stderr)
        result.status = "interrupted"
    return result, row


def save_row(path: Path, row: dict[str, object], run_id: str) -> tuple[Path | None, str | None]:
    """Appends the row; (the file it went to, None). When the results file cannot be written after all (it was
    checked before the run: a disk that filled up, a folder removed meanwhile), the row goes to a side file in the
    temporary folder: (that file or None, why)."""
    try:
        return append_row(path, row), None
    except (OSError, TimeoutError) as exc:
        side = Path(tempfile.gettempdir()) / f"{path.stem}.unwritten-{run_id}.csv"
        try:
            return append_row(side, row), one_line(exc)
        except OSError:
            return None, one_line(exc)


def run_job(cfg: BenchConfig) -> int:
    """One rank of a torchrun job (serverbench.launch.job), its run this server's run_benchmark; SIGINT and SIGTERM
    raise meanwhile, so that an interrupt stops the job's collectives too."""
    with interrupts_raise():
        return torchrun_job.run_job(cfg, run_benchmark)


def find_peak(cfg: BenchConfig) -> int:
    """--find_peak (serverbench.launch.peak), each step a run_once."""
    return peak_search.find_peak(cfg, run_once)


def quiet_exit(code: int) -> int:
    """An interrupted run leaves with 130 even when the second Ctrl-C of a pair lands while the interpreter shuts
    down: Python then puts the default handler back, and that signal would end the process as killed by SIGINT."""
    if code == EXIT_INTERRUPTED:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # SIG_IGN survives the interpreter's own clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    if "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun: an exception that escapes is written to torchrun's error file, so the launcher's
        # summary names the rank and shows its traceback.
        from torch.distributed.elastic.multiprocessing.errors import record

        sys.exit(quiet_exit(record(main)()))
    sys.exit(quiet_exit(main()))
