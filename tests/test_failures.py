"""A failure anywhere ends the run within seconds, with a recorded status, a non-zero exit and nothing left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    TINY,
    child_pids,
    kill_session,
    live_processes_in_session,
    new_shm_entries,
    read_log_until,
    read_rows,
    run_server,
    shm_entries,
    start_server,
)

# Every step in the pipelined design, where each runs on a thread of its own; in serial and threaded the three steps
# run in one loop or one task, so a fault in any of them takes the same way out as the forward's. The start-up
# and the frontend are the same for all designs.
CASES = [("serial", "predict"), ("threaded", "predict")]
CASES += [("pipelined", stage) for stage in ("h2d", "predict", "d2h", "backend_start", "frontend")]


@pytest.mark.parametrize("design,stage", CASES, ids=[f"{d}-{s}" for d, s in CASES])
def test_an_exception_in_any_step_ends_the_run(tmp_path: Path, design: str, stage: str) -> None:
    """The fault fires on the first measured request, right after the warm-up line (backend_start: as the backend
    starts). 1000 requests of 20 ms would take 10 s or more to serve (20 s on one forward thread, 10 s on
    pipelined's two): the run must stop at the fault, with at most the requests already inside the backend
    answered, well before serving the rest could end."""
    shm_before = shm_entries()
    args = [*TINY, "--model", "identity", "--num_iters", "1000", "--inject_delay_ms", "20", "--design", design]
    run = run_server([*args, "--inject_fault", stage], tmp_path)
    assert run.returncode == 1
    row = run.row
    assert row["status"] == "error"
    assert "injected fault" in row["error"]
    # At most what the backend holds at once (--max_inflight, 8 by default) answered, of the 1000.
    assert int(row["responses_received"]) <= 8, (row["requests_sent"], row["responses_received"])
    if stage == "backend_start":  # from the processes' start: the children still import (seconds on a slow VM)
        assert _seconds_since_log_line(run.stderr, "frontend pid=") < 30
    else:  # from the fault: the stop and the teardown (under a second here), not the 10 s of serving the rest
        assert _seconds_since_log_line(run.stderr, "warm-up response") < 5
    # stderr says it in one line; the child's traceback is kept in the file the row names
    assert "Traceback" not in run.stderr and f"(traceback: {tmp_path / row['traceback_file']})" in run.stderr
    kept = (tmp_path / row["traceback_file"]).read_text()
    assert kept.startswith("Traceback (most recent call last):") and "injected fault" in kept
    assert live_processes_in_session(run.session_id) == []
    assert new_shm_entries(shm_before) == set()


def _seconds_since_log_line(stderr: str, marker: str) -> float:
    """Seconds from the last log line that holds `marker` until now (the run has just ended)."""
    import datetime

    line = [text for text in stderr.splitlines() if marker in text][-1]
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return (datetime.datetime.now() - stamp).total_seconds()


@pytest.mark.parametrize("design", ["serial", "pipelined"])
def test_a_stuck_backend_is_declared_hung_after_timeout_s(tmp_path: Path, design: str) -> None:
    start = time.monotonic()
    run = run_server(
        [*TINY, "--model", "identity", "--design", design, "--inject_fault", "hang", "--timeout_s", "2"], tmp_path
    )
    elapsed_s = time.monotonic() - start
    assert run.returncode == 1
    assert run.row["status"] == "timeout"
    assert "no progress" in run.row["error"]
    assert int(run.row["responses_missing"]) >= 1
    # Start-up + 2 s without progress + the stop and reap graces (5 s each), then the kill: about 15 s here, far
    # below what waiting for the default --timeout_s (120 s) would take.
    assert elapsed_s < 60
    # Every thread's stack, the stuck one included (faulthandler heads a stack "Thread 0x..." or, for the thread it
    # runs on, "Current thread 0x...": the serial backend has that one thread only).
    assert "(most recent call first)" in run.stderr and "in predict" in run.stderr
    if design == "pipelined":  # the main thread only reads the queue there, so its signal handler runs;
        assert "progress of each step" in run.stderr  # in serial, it is the stuck thread itself
    assert live_processes_in_session(run.session_id) == []


@pytest.mark.parametrize("fault", ["oom", "oom_build"])
def test_out_of_memory_is_its_own_status(tmp_path: Path, fault: str) -> None:
    shm_before = shm_entries()
    run = run_server([*TINY, "--model", "identity", "--inject_fault", fault], tmp_path)
    # Before the model exists, or just after: the children's start-up and no --timeout_s (120 s).
    assert _seconds_since_log_line(run.stderr, "frontend pid=") < 30
    assert new_shm_entries(shm_before) == set()
    assert run.returncode == 1
    assert run.row["status"] == "oom"  # a sweep can tell "too big" from "broken" and go on
    assert "OutOfMemoryError" in run.row["error"]
    assert live_processes_in_session(run.session_id) == []


def _start_long_run(tmp_path: Path) -> tuple:
    """A run long enough to be interrupted, past its warm-up; returns the process and the child pids."""
    proc = start_server([*TINY, "--model", "resnet18", "--image_size", "64", "--num_iters", "100000"], tmp_path)
    log = read_log_until(proc, lambda text: "warm-up response" in text, limit_s=120)
    pids = child_pids(log)
    if pids is None or "warm-up response" not in log or proc.poll() is not None:
        kill_session(proc.pid)
        pytest.fail("server did not reach its measured phase:\n" + log)
    time.sleep(1.0)  # well inside the measured phase
    return proc, pids


def _wait_for_exit(proc, limit_s: float) -> tuple[int, float, str]:
    start = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        _, stderr = proc.communicate(timeout=30)
        pytest.fail(f"server still running {limit_s} s after the kill; its log:\n{stderr[-6000:]}")
    return proc.returncode, time.monotonic() - start, stderr


@pytest.mark.parametrize("role", ["backend", "frontend"])
def test_killing_either_process_ends_the_run_within_10_s(tmp_path: Path, role: str) -> None:
    shm_before = shm_entries()
    proc, pids = _start_long_run(tmp_path)
    os.kill(pids[role], signal.SIGKILL)
    returncode, elapsed_s, stderr = _wait_for_exit(proc, limit_s=10)
    assert returncode == 1
    assert elapsed_s < 10
    [row] = read_rows(tmp_path / "out.csv")
    assert row["status"] == f"{role}_died"
    assert "SIGKILL" in row["error"]
    if role == "frontend":  # its counts died with it: unknown, not 0 (12 may have been sent)
        assert row["requests_sent"] == row["responses_received"] == row["responses_missing"] == ""
    if role == "backend":  # the frontend's records survive: the partial run is still reported
        assert int(row["responses_received"]) > 0 and int(row["responses_missing"]) >= 0
    assert live_processes_in_session(proc.pid) == []
    assert new_shm_entries(shm_before) == set()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_server_stops_everything_and_keeps_the_partial_row(tmp_path: Path, signum) -> None:
    shm_before = shm_entries()
    proc, _ = _start_long_run(tmp_path)
    if signum == signal.SIGINT:  # Ctrl-C hits the group, and people press it twice
        os.killpg(proc.pid, signum)
        time.sleep(0.3)
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)
    returncode, elapsed_s, stderr = _wait_for_exit(proc, limit_s=10)
    assert returncode == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    [row] = read_rows(tmp_path / "out.csv")
    assert row["status"] == "interrupted"
    assert int(row["responses_received"]) > 0
    assert float(row["throughput"]) > 0
    assert live_processes_in_session(proc.pid) == []
    assert new_shm_entries(shm_before) == set()


def test_ctrl_c_while_the_children_start_ends_with_one_line_and_the_row(tmp_path: Path) -> None:
    proc = start_server([*TINY, "--model", "resnet18"], tmp_path)
    assert "frontend pid=" in read_log_until(proc, lambda text: "frontend pid=" in text, limit_s=60)
    for _ in range(4):  # Ctrl-C, pressed again, while the children are still importing torch (about 2 s)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.4)
    returncode, _, stderr = _wait_for_exit(proc, limit_s=15)
    assert returncode == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    [row] = read_rows(tmp_path / "out.csv")
    assert row["status"] == "interrupted"
    assert live_processes_in_session(proc.pid) == []


def _start_and_freeze(tmp_path: Path, extra: list[str], which: str) -> subprocess.Popen:
    """A slow Poisson run at --timeout_s 3 past its warm-up, with every backend instance ready (one that is frozen
    before it is would hold the measured phase back, by design), then SIGSTOP of one child: `frontend`, or a backend
    instance's index (its pid from the log line)."""
    args = [*TINY, "--num_iters", "50", "--load", "poisson", "--rate", "8", "--timeout_s", "3", "--design", "serial"]
    instances = int(extra[extra.index("--instances") + 1]) if "--instances" in extra else 1
    proc = start_server([*args, *extra], tmp_path)
    text = read_log_until(
        proc, lambda text: "warm-up response" in text and text.count(" ready on ") >= instances, limit_s=120
    )
    pids = child_pids(text)
    assert pids is not None and proc.poll() is None, text
    if which == "frontend":
        os.kill(pids["frontend"], signal.SIGSTOP)
    else:
        backends = text.split("backend pid=")[1].split()[0].split(",")
        os.kill(int(backends[int(which)]), signal.SIGSTOP)
    return proc


def test_a_frozen_frontend_is_a_timeout_within_its_deadline(tmp_path: Path) -> None:
    """SIGSTOP the frontend mid-run: it cannot time out by itself, so the server's deadline on its heartbeat does:
    status timeout, exit 1, within --timeout_s plus 10 s, nothing left behind."""
    shm_before = shm_entries()
    proc = _start_and_freeze(tmp_path, [], "frontend")
    returncode, elapsed_s, stderr = _wait_for_exit(proc, limit_s=3 + 10)
    assert returncode == 1 and elapsed_s < 3 + 10
    [row] = read_rows(tmp_path / "out.csv")
    assert row["status"] == "timeout" and "the frontend stopped running" in row["error"]
    assert live_processes_in_session(proc.pid) == []
    assert new_shm_entries(shm_before) == set()


def test_a_frozen_instance_stops_no_other_and_is_a_timeout(tmp_path: Path) -> None:
    """SIGSTOP one of two backend instances mid-run: it holds no lock while it waits for a request, so the other
    keeps serving; its heartbeat falls silent, so the run ends as a timeout within --timeout_s plus 10 s."""
    shm_before = shm_entries()
    proc = _start_and_freeze(tmp_path, ["--instances", "2"], "1")
    returncode, elapsed_s, stderr = _wait_for_exit(proc, limit_s=3 + 10)
    assert returncode == 1 and elapsed_s < 3 + 10
    [row] = read_rows(tmp_path / "out.csv")
    assert row["status"] == "timeout" and "the backend instance 1 stopped running" in row["error"]
    served_by_0 = int(row["requests_per_instance"].split(";")[0])
    assert served_by_0 >= 10  # the 3 s before the deadline at 8 req/s, and more: it kept serving
    assert live_processes_in_session(proc.pid) == []
    assert new_shm_entries(shm_before) == set()


def test_the_frontends_deadline_is_the_warm_up_one_until_it_first_beats() -> None:
    from serverbench.transport.channels import frozen_frontend

    assert frozen_frontend(2.9, beaten=True, timeout_s=3, warmup_timeout_s=1800) is None
    assert "--timeout_s 3 s" in frozen_frontend(3.1, beaten=True, timeout_s=3, warmup_timeout_s=1800)
    assert frozen_frontend(60, beaten=False, timeout_s=3, warmup_timeout_s=1800) is None  # still importing torch
    assert "--warmup_timeout_s 1800 s" in frozen_frontend(1801, beaten=False, timeout_s=3, warmup_timeout_s=1800)
