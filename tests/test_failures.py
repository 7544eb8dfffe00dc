"""A failure anywhere ends the run within seconds, with a recorded status, a non-zero exit and nothing left."""

from __future__ import annotations

import datetime
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    TINY,
    ServerRun,
    child_pids,
    kill_session,
    live_processes_in_session,
    new_shm_entries,
    read_rows,
    run_server,
    shm_entries,
    start_server,
)

import server
from serverbench.launch.procutil import signal_taken

# Every step in the pipelined design, where each runs on a thread of its own; in serial and threaded the three steps
# run in one loop or one task, so a fault in any of them takes the same way out as the forward's. The start-up
# and the frontend are the same for all designs.
CASES = [("serial", "predict"), ("threaded", "predict")]
CASES += [("pipelined", stage) for stage in ("h2d", "predict", "d2h", "backend_start", "frontend")]


@dataclass
class Faulted:
    run: ServerRun
    results: Path
    ended_at: datetime.datetime  # when the run ended, in the log lines' clock


@dataclass
class FaultRuns:
    runs: dict[str, Faulted]  # by the --inject_fault stage, "design-stage" for the steps
    shm_left: set[str]  # /dev/shm entries left by any of the runs, once every one had ended


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory) -> FaultRuns:
    """Each injected fault's run, two at a time: a run is one process at work at a time (its children start, then
    its 20 ms forwards), and each is timed by its own log lines and end, not against the others."""
    folder = tmp_path_factory.mktemp("faults")
    steps = [*TINY, "--model", "identity", "--num_iters", "1000", "--inject_delay_ms", "20"]
    argv = {f"{d}-{s}": [*steps, "--design", d, "--inject_fault", s] for d, s in CASES}
    argv |= {fault: [*TINY, "--model", "identity", "--inject_fault", fault] for fault in ("oom", "oom_build")}

    def serve(name: str) -> Faulted:
        run = run_server(argv[name], folder / name)
        return Faulted(run, folder / name, datetime.datetime.now())

    shm_before = shm_entries()
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(argv, pool.map(serve, argv)))
    return FaultRuns(runs, new_shm_entries(shm_before))


@pytest.mark.parametrize("design,stage", CASES, ids=[f"{d}-{s}" for d, s in CASES])
def test_an_exception_in_any_step_ends_the_run(fault_runs: FaultRuns, design: str, stage: str) -> None:
    """The fault fires on the first measured request, right after the warm-up line (backend_start: as the backend
    starts). 1000 requests of 20 ms would take 10 s or more to serve (20 s on one forward thread, 10 s on
    pipelined's two): the run must stop at the fault, with at most the requests already inside the backend
    answered, well before serving the rest could end."""
    faulted = fault_runs.runs[f"{design}-{stage}"]
    run = faulted.run
    assert run.returncode == 1
    row = run.row
    assert row["status"] == "error"
    assert "injected fault" in row["error"]
    # At most what the backend holds at once (--max_inflight, 8 by default) answered, of the 1000.
    assert int(row["responses_received"]) <= 8, (row["requests_sent"], row["responses_received"])
    if stage == "backend_start":  # from the processes' start: the children still import (seconds on a slow VM)
        assert _seconds_from_log_line(run.stderr, "frontend pid=", faulted.ended_at) < 30
    else:  # from the fault: the stop and the teardown (under a second here), not the 10 s of serving the rest
        assert _seconds_from_log_line(run.stderr, "warm-up response", faulted.ended_at) < 5
    # stderr says it in one line; the child's traceback is kept in the file the row names
    traceback_file = faulted.results / row["traceback_file"]
    assert "Traceback" not in run.stderr and f"(traceback: {traceback_file})" in run.stderr
    kept = traceback_file.read_text()
    assert kept.startswith("Traceback (most recent call last):") and "injected fault" in kept
    assert live_processes_in_session(run.session_id) == []
    assert fault_runs.shm_left == set()


def _seconds_from_log_line(stderr: str, marker: str, ended_at: datetime.datetime) -> float:
    """Seconds from the last log line that holds `marker` until the run ended."""
    line = [text for text in stderr.splitlines() if marker in text][-1]
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return (ended_at - stamp).total_seconds()


@pytest.mark.parametrize("fault", ["oom", "oom_build"])
def test_out_of_memory_is_its_own_status(fault_runs: FaultRuns, fault: str) -> None:
    faulted = fault_runs.runs[fault]
    run = faulted.run
    # Before the model exists, or just after: the children's start-up and no --timeout_s (120 s).
    assert _seconds_from_log_line(run.stderr, "frontend pid=", faulted.ended_at) < 30
    assert fault_runs.shm_left == set()
    assert run.returncode == 1
    assert run.row["status"] == "oom"  # a sweep can tell "too big" from "broken" and go on
    assert "OutOfMemoryError" in run.row["error"]
    assert live_processes_in_session(run.session_id) == []


# The runs below are slow by what they wait for (a deadline, a grace period, a run reaching its measured phase), not
# by their work: each group starts at once, so that their waits overlap. Each run is timed by its own clock (its
# start, the signal that ends it, its exit); the signals that start a timed bound wait until every run of the group
# that gets one is past its own start, so that the others' start (torch's import) does not share the CPU with it.


@dataclass
class Scenario:
    """One server run of a group: its flags, and `act` (in a thread of its own, once `ready(log so far)` holds, and
    when `together`, once it holds for every such run of the group), which does to the run what the test is about and
    returns time.monotonic() after its last signal."""

    args: list[str]
    ready: Callable[[str], bool] | None = None
    act: Callable[[subprocess.Popen, str], float] | None = None
    together: bool = True


@dataclass
class Outcome:
    """How a run of a group went: `problem` is why it was not acted on or did not end within the group's bound."""

    run: ServerRun
    started_s: float
    ended_s: float
    acted_s: float | None
    problem: str
    shm_left: set[str]  # /dev/shm entries left by any run of the group, once every one had ended


def _run_at_once(scenarios: dict[str, Scenario], folder: Path, limit_s: float) -> dict[str, Outcome]:
    """Every scenario's server started at once, each acted on when its log says it is ready (those acted on together
    once all of them are), all waited for (each within limit_s of the group's start, then its session killed)."""
    shm_before = shm_entries()
    started_s = time.monotonic()
    procs = {name: start_server(s.args, folder / name) for name, s in scenarios.items()}
    logs = {name: b"" for name in procs}
    acted: dict[str, float] = {}
    problems: dict[str, str] = {}
    ended: dict[str, tuple[float, str, str]] = {}

    def act(name: str, text: str) -> None:
        try:
            acted[name] = scenarios[name].act(procs[name], text)
        except Exception as exc:  # noqa: BLE001 - the test of that run says it, the others go on
            problems[name] = f"could not act on it: {exc!r}"

    def wait(name: str) -> None:
        try:
            stdout, stderr = procs[name].communicate(timeout=max(started_s + limit_s - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            kill_session(procs[name].pid)
            stdout, stderr = procs[name].communicate(timeout=30)
            problems.setdefault(name, f"still running {limit_s} s after the group started")
        ended[name] = (time.monotonic(), stdout, stderr)

    threads: list[threading.Thread] = []

    def begin(target: Callable, *args) -> None:
        threads.append(threading.Thread(target=target, args=args))
        threads[-1].start()

    for name in (n for n, s in scenarios.items() if s.act is None):
        begin(wait, name)  # from the start: its output is read as it comes
    reading = {procs[n].stderr.fileno(): n for n, s in scenarios.items() if s.act is not None}
    held: dict[str, str] = {}  # ready, its act waiting for the others': the log so far
    while reading and time.monotonic() < started_s + limit_s:
        for fd in select.select(list(reading), [], [], 0.1)[0]:
            name = reading[fd]
            chunk = os.read(fd, 65536)
            logs[name] += chunk
            text = logs[name].decode(errors="replace")
            if chunk and not scenarios[name].ready(text):
                continue
            del reading[fd]
            if not chunk or procs[name].poll() is not None:
                problems[name] = "it ended before it was ready to be acted on"
            elif scenarios[name].together:
                held[name] = text
            else:
                begin(act, name, text)
            begin(wait, name)  # the rest of its output is read as it comes
        if held and not any(scenarios[name].together for name in reading.values()):
            for name, text in held.items():
                begin(act, name, text)
            held.clear()
    for name in held:
        problems[name] = f"not acted on: the others were not ready within {limit_s} s"
    for name in reading.values():
        problems[name] = f"not ready to be acted on within {limit_s} s"
        begin(wait, name)
    for thread in threads:
        thread.join()
    shm_left = new_shm_entries(shm_before)
    outcomes = {}
    for name, proc in procs.items():
        ended_s, stdout, stderr = ended[name]
        stderr = logs[name].decode(errors="replace") + stderr
        run = ServerRun(proc.returncode, stdout, stderr, read_rows(folder / name / "out.csv"), proc.pid)
        outcome = Outcome(run, started_s, ended_s, acted.get(name), problems.get(name, ""), shm_left)
        outcomes[name] = outcome
    return outcomes


def _checked(outcome: Outcome) -> Outcome:
    """The outcome, once its run was acted on as planned and ended within the group's bound."""
    assert not outcome.problem, f"{outcome.problem}; its log:\n{outcome.run.stderr[-6000:]}"
    return outcome


def _warm(instances: int = 1) -> Callable[[str], bool]:
    """Past its warm-up, with every backend instance ready (one frozen before it is would hold the measured phase
    back, by design)."""
    return lambda text: "warm-up response" in text and text.count(" ready on ") >= instances


def _signal_child(which: str, signum: int, after_s: float = 0.0) -> Callable[[subprocess.Popen, str], float]:
    """`signum` to one child after after_s: `frontend`, `backend`, or a backend instance's index (its pid from the
    log line)."""

    def act(proc: subprocess.Popen, text: str) -> float:
        time.sleep(after_s)
        pids = child_pids(text)
        assert pids is not None, "no child pids in the log"
        if which in ("frontend", "backend"):
            os.kill(pids[which], signum)
        else:
            backends = text.split("backend pid=")[1].split()[0].split(",")
            os.kill(int(backends[int(which)]), signum)
        return time.monotonic()

    return act


def _interrupt_server(
    signum: int, presses: int, apart_s: float, after_s: float = 0.0, group: bool | None = None
) -> Callable[[subprocess.Popen, str], float]:
    """`presses` times `signum`, apart_s apart, after after_s: to the server's whole group for SIGINT (Ctrl-C hits the
    group) or when `group` says so (a process manager's stop, `timeout`), to the server alone otherwise."""
    to_group = signum == signal.SIGINT if group is None else group

    def act(proc: subprocess.Popen, text: str) -> float:
        time.sleep(after_s)
        for press in range(presses):
            if press:
                time.sleep(apart_s)
            (os.killpg if to_group else os.kill)(proc.pid, signum)
        return time.monotonic()

    return act


# Long enough to be interrupted past its warm-up (100000 requests of 20 ms forwards), idle enough not to slow the
# others' start: the identity model.
LONG_RUN = [*TINY, "--model", "identity", "--num_iters", "100000", "--inject_delay_ms", "20"]
INTERRUPTED = {
    # SIGKILL of one child well inside the measured phase.
    "kill-backend": Scenario(LONG_RUN, _warm(), _signal_child("backend", signal.SIGKILL, after_s=1.0)),
    "kill-frontend": Scenario(LONG_RUN, _warm(), _signal_child("frontend", signal.SIGKILL, after_s=1.0)),
    # Ctrl-C hits the group, and people press it twice.
    "SIGINT": Scenario(LONG_RUN, _warm(), _interrupt_server(signal.SIGINT, 2, 0.3, after_s=1.0)),
    "SIGTERM": Scenario(LONG_RUN, _warm(), _interrupt_server(signal.SIGTERM, 1, 0.0, after_s=1.0)),
    # A stop's SIGTERM to the whole group (systemd, a container's stop, `timeout`): the children ignore it.
    "SIGTERM-group": Scenario(LONG_RUN, _warm(), _interrupt_server(signal.SIGTERM, 1, 0.0, after_s=1.0, group=True)),
    # The terminal closed (an ssh session lost): the kernel's SIGHUP to its whole foreground group.
    "SIGHUP-group": Scenario(LONG_RUN, _warm(), _interrupt_server(signal.SIGHUP, 1, 0.0, after_s=1.0, group=True)),
    # Ctrl-C, pressed again, while the children are still importing torch (seconds): at once, whatever the others do.
    "Ctrl-C at start": Scenario(
        [*TINY, "--model", "identity"],
        lambda text: "frontend pid=" in text,
        _interrupt_server(signal.SIGINT, 4, 0.4),
        together=False,
    ),
}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict[str, Outcome]:
    """One group of runs, each ended from outside: SIGKILL of the backend and of the frontend, SIGINT (twice) and
    SIGTERM of the server, SIGTERM and SIGHUP of its whole group, all in the measured phase; and Ctrl-C four times
    while the children start."""
    return _run_at_once(INTERRUPTED, tmp_path_factory.mktemp("interrupted"), limit_s=150)


@pytest.mark.parametrize("role", ["backend", "frontend"])
def test_killing_either_process_ends_the_run_within_10_s(interrupted: dict[str, Outcome], role: str) -> None:
    outcome = _checked(interrupted[f"kill-{role}"])
    assert outcome.run.returncode == 1
    assert outcome.ended_s - outcome.acted_s < 10
    [row] = outcome.run.rows
    assert row["status"] == f"{role}_died"
    assert "SIGKILL" in row["error"]
    if role == "frontend":  # its counts died with it: unknown, not 0 (12 may have been sent)
        assert row["requests_sent"] == row["responses_received"] == row["responses_missing"] == ""
        assert "requests      ?/? answered, ? missing" in outcome.run.stdout  # and said so, not "None"
    assert "None" not in outcome.run.stdout, outcome.run.stdout
    if role == "backend":  # the frontend's records survive: the partial run is still reported
        assert int(row["responses_received"]) > 0 and int(row["responses_missing"]) >= 0
    assert live_processes_in_session(outcome.run.session_id) == []
    assert outcome.shm_left == set()


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGTERM-group", "SIGHUP-group"])
def test_interrupting_the_server_stops_everything_and_keeps_the_partial_row(
    interrupted: dict[str, Outcome], how: str
) -> None:
    outcome = _checked(interrupted[how])
    assert outcome.run.returncode == 130
    assert outcome.ended_s - outcome.acted_s < 10
    assert "Traceback" not in outcome.run.stderr and "KeyboardInterrupt" not in outcome.run.stderr
    [row] = outcome.run.rows
    assert row["status"] == "interrupted"
    assert int(row["responses_received"]) > 0
    assert float(row["throughput"]) > 0
    assert live_processes_in_session(outcome.run.session_id) == []
    assert outcome.shm_left == set()


def test_ctrl_c_while_the_children_start_ends_with_one_line_and_the_row(interrupted: dict[str, Outcome]) -> None:
    outcome = _checked(interrupted["Ctrl-C at start"])
    assert outcome.ended_s - outcome.acted_s < 15
    assert outcome.run.returncode == 130
    stderr = outcome.run.stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    [row] = outcome.run.rows
    assert row["status"] == "interrupted"
    assert live_processes_in_session(outcome.run.session_id) == []


# A slow Poisson run at --timeout_s 3 (long enough to be frozen once the other runs are warm too), SIGSTOP of one
# child past its warm-up.
FROZEN = [*TINY, "--num_iters", "400", "--load", "poisson", "--rate", "8", "--timeout_s", "3", "--design", "serial"]
WAITING = {
    # The predictor stuck on the first measured request; --timeout_s 2.
    f"hung-{design}": Scenario(
        [*TINY, "--model", "identity", "--design", design, "--inject_fault", "hang", "--timeout_s", "2"]
    )
    for design in ("serial", "pipelined")
}
WAITING["frozen-frontend"] = Scenario(FROZEN, _warm(), _signal_child("frontend", signal.SIGSTOP))
# A forward slower than --timeout_s that does end: the frontend gives up first, then the backend's answer meets a
# closed pipe. The cause must win over its consequence.
WAITING["slow-serial"] = Scenario(
    [*TINY, "--model", "identity", "--design", "serial", "--planted_delay_us", "3000000", "--timeout_s", "2"]
)
WAITING["frozen-instance"] = Scenario([*FROZEN, "--instances", "2"], _warm(2), _signal_child("1", signal.SIGSTOP))


@pytest.fixture(scope="module")
def waiting(tmp_path_factory) -> dict[str, Outcome]:
    """One group of runs that each wait out a deadline: a stuck backend in serial and in pipelined, a frozen
    (SIGSTOP) frontend, and a frozen backend instance of two."""
    return _run_at_once(WAITING, tmp_path_factory.mktemp("waiting"), limit_s=150)


@pytest.mark.parametrize("design", ["serial", "pipelined"])
def test_a_stuck_backend_is_declared_hung_after_timeout_s(waiting: dict[str, Outcome], design: str) -> None:
    outcome = _checked(waiting[f"hung-{design}"])
    run = outcome.run
    assert run.returncode == 1
    assert run.row["status"] == "timeout"
    assert "no progress" in run.row["error"]
    assert int(run.row["responses_missing"]) >= 1
    # Start-up + 2 s without progress + the stop and reap graces (5 s each), then the kill: about 15 s here, far
    # below what waiting for the default --timeout_s (120 s) would take.
    assert outcome.ended_s - outcome.started_s < 60
    # Every thread's stack of the backend, the stuck one included, under the line that names it, whole: the server
    # asks one child at a time (two dumps at once interleaved their pieces, and "in predict" was cut apart).
    stacks = _stack_dump(run.stderr, "backend")
    assert "(most recent call first)" in stacks and "in predict" in stacks
    if design == "pipelined":  # the main thread only reads the queue there, so its signal handler runs;
        assert "progress of each step" in run.stderr  # in serial, it is the stuck thread itself
    assert live_processes_in_session(run.session_id) == []


def _stack_dump(stderr: str, role: str) -> str:
    """What faulthandler wrote under the server's line naming `role`, up to the next log line; each of its lines as
    faulthandler writes them (a thread's head, a frame, a blank line), so none is cut by another process's."""
    head = re.search(rf"ERROR {role} \(pid \d+\): every thread's stack\n", stderr)
    assert head is not None, stderr[-3000:]
    rest = stderr[head.end() :]
    dump = rest[: next_log.start()] if (next_log := re.search(r"^\d{4}-\d\d-\d\d ", rest, re.M)) else rest
    frame = r'  File ".*", line \d+ in \S+|(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):|'
    assert all(re.fullmatch(frame, line) for line in dump.splitlines()), dump
    return dump


def test_the_stack_dump_waits_for_each_child_to_take_its_signal_but_never_for_a_stopped_one() -> None:
    """The server asks one child at a time and waits, up to a bound, for each to begin its dump; a frozen child
    (SIGSTOP) cannot take the signal until continued, so the next one is asked at once."""
    code = (
        "import signal, sys, time\n"
        "if sys.argv[1] == 'blocked': signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
        "else: signal.signal(signal.SIGUSR1, lambda *_: None)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    kinds = ("handled", "blocked", "stopped")
    children = {kind: subprocess.Popen([sys.executable, "-c", code, kind], stdout=subprocess.PIPE) for kind in kinds}
    try:
        for child in children.values():
            assert child.stdout.readline() == b"ready\n"
        children["stopped"].send_signal(signal.SIGSTOP)
        took_s: dict[str, tuple[bool, float]] = {}
        for kind, child in children.items():
            child.send_signal(signal.SIGUSR1)
            started_s = time.monotonic()
            taken = signal_taken(child.pid, signal.SIGUSR1, timeout_s=0.5)
            took_s[kind] = (taken, time.monotonic() - started_s)
    finally:
        for child in children.values():
            child.kill()
            child.wait(timeout=10)
    assert took_s["handled"][0] and took_s["handled"][1] < 0.5, took_s
    assert not took_s["blocked"][0] and took_s["blocked"][1] >= 0.5, took_s  # still pending: the bound, not a hang
    assert not took_s["stopped"][0] and took_s["stopped"][1] < 0.2, took_s


def test_a_forward_slower_than_timeout_s_is_a_timeout_not_the_broken_pipe_it_leaves(
    waiting: dict[str, Outcome],
) -> None:
    run = _checked(waiting["slow-serial"]).run
    assert run.returncode == 1
    assert run.row["status"] == "timeout" and "no progress" in run.row["error"], run.row["error"]
    assert "BrokenPipeError" not in run.row["error"]


def test_a_frozen_frontend_is_a_timeout_within_its_deadline(waiting: dict[str, Outcome]) -> None:
    """SIGSTOP the frontend mid-run: it cannot time out by itself, so the server's deadline on its heartbeat does:
    status timeout, exit 1, within --timeout_s plus 10 s, nothing left behind."""
    outcome = _checked(waiting["frozen-frontend"])
    assert outcome.run.returncode == 1 and outcome.ended_s - outcome.acted_s < 3 + 10
    [row] = outcome.run.rows
    assert row["status"] == "timeout" and "the frontend stopped running" in row["error"]
    assert live_processes_in_session(outcome.run.session_id) == []
    assert outcome.shm_left == set()


def test_a_frozen_instance_stops_no_other_and_is_a_timeout(waiting: dict[str, Outcome]) -> None:
    """SIGSTOP one of two backend instances mid-run: it holds no lock while it waits for a request, so the other
    keeps serving; its heartbeat falls silent, so the run ends as a timeout within --timeout_s plus 10 s."""
    outcome = _checked(waiting["frozen-instance"])
    assert outcome.run.returncode == 1 and outcome.ended_s - outcome.acted_s < 3 + 10
    [row] = outcome.run.rows
    assert row["status"] == "timeout" and "the backend instance 1 stopped running" in row["error"]
    served_by_0 = int(row["requests_per_instance"].split(";")[0])
    assert served_by_0 >= 10  # the 3 s before the deadline at 8 req/s, and more: it kept serving
    assert live_processes_in_session(outcome.run.session_id) == []
    assert outcome.shm_left == set()


def test_the_frontends_deadline_is_the_warm_up_one_until_it_first_beats() -> None:
    from serverbench.transport.channels import frozen_frontend

    assert frozen_frontend(2.9, beaten=True, timeout_s=3, warmup_timeout_s=1800) is None
    assert "--timeout_s 3 s" in frozen_frontend(3.1, beaten=True, timeout_s=3, warmup_timeout_s=1800)
    assert frozen_frontend(60, beaten=False, timeout_s=3, warmup_timeout_s=1800) is None  # still importing torch
    assert "--warmup_timeout_s 1800 s" in frozen_frontend(1801, beaten=False, timeout_s=3, warmup_timeout_s=1800)
    # A --timeout_s near the beats' 0.1 s period: a silence is judged over 1 s at least, or a running one is frozen
    assert frozen_frontend(0.6, beaten=True, timeout_s=0.05, warmup_timeout_s=1800) is None
    assert "--timeout_s 0.05 s, at least 1 s" in frozen_frontend(
        1.1, beaten=True, timeout_s=0.05, warmup_timeout_s=1800
    )


# server.py whose build_row is first sent the signal: the interrupt lands once the run has ended, as the row is made
LATE_INTERRUPT = """import os, signal, sys
import server
real = server.build_row
def build_row(cfg, result):
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real(cfg, result)
if __name__ == "__main__":  # spawn's children run this file again
    server.build_row = build_row
    sys.exit(server.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupt_after_the_run_ended_keeps_its_row_and_exits_130(tmp_path: Path, signame: str) -> None:
    """It printed a KeyboardInterrupt traceback (SIGTERM: nothing) and lost the row of a run measured whole."""
    script = tmp_path / "late.py"
    script.write_text(LATE_INTERRUPT)
    args = [*TINY, "--results_dir", str(tmp_path / "out"), "--output_file", "out.csv"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's server.py, beside the script
    cmd = [sys.executable, str(script), signame, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 130, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "Traceback" in line or line.startswith("server.py:")]
    assert lines == [f"server.py: {signame} after the run ended: its row is kept; stopping"], proc.stderr[-3000:]
    (row,) = read_rows(tmp_path / "out" / "out.csv")
    assert row["status"] == "ok" and int(row["responses_received"]) == 6


def test_a_closed_terminal_stops_the_run_unless_sighup_is_ignored() -> None:
    """SIGHUP raises as SIGTERM does while a run is supervised; under nohup (SIGHUP ignored) the run goes on."""
    previous = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with server.interrupts_raise():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with server.interrupts_raise():
            assert signal.getsignal(signal.SIGHUP) is server._raise_interrupted
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
