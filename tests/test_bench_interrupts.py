"""Ctrl-C stops every bench tool that runs server.py: the run in flight is stopped, the tool exits 130 without a
traceback, and no server process is left. The tool is started as a script's `&` starts it (SIGINT ignored, which
a Python program does not undo by itself) in its own session, and the interrupt goes to its whole process group,
as a terminal's Ctrl-C or `kill -INT -PGID` sends it. bench.commits also under SIGTERM (a process manager's stop):
its scratch worktrees are unregistered from the repository and its temporary folder is gone.

The cases run at once, each tool in its own session with its own folders: a case spends most of its time waiting
for processes to start and to stop, so the file takes about as long as its slowest case, not the sum of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT, kill_session, live_processes_in_session, processes

from serverbench.launch.procutil import process_status

START_S = 120.0  # until the tool's first server run is in flight: bench.compare imports torch first
STOP_S = 60.0  # after the interrupt: the server stops within about 7 s, a sweep's within its cell's
IDENTITY = ["--device", "cpu", "--model", "identity", "--image_size", "16"]
# tool -> its arguments, with a first server run long enough to be interrupted in flight ({out}: the tool's folder)
TOOLS = {
    # seed 1: its first run is pipelined_2w_eager (seed 0's, inductor's, compiles for seconds before it is in flight)
    "your_model": ["--repeats", "1", "--seed", "1", "--num_iters", "100000", "--batch_size", "1", "--out", "{out}"],
    "loadgen_agreement": ["--out", "{out}", "--capacity_iters", "1000000", "--duration_s", "1"],
    "serving": ["--parts", "overhead", "--repeats", "2", "--out", "{out}"],
    "compare": ["--models", "identity", "--num_iters", "identity=1000000", "--batch_size", "1", "--image_size", "16"]
    + ["--repeats", "1", "--device", "cpu", "--out", "{out}"],
    "stability": ["--suites", "identity", "--repeats", "1", "--out", "{out}", "--", "--image_size", "16"],
    "commits": ["--base", "HEAD", "--repeats", "2", "--out", "{out}", "--", *IDENTITY, "--num_iters", "1000000"],
    "search": ["--objective", "throughput", "--out", "{out}", "--", *IDENTITY, "--num_iters", "1000000"],
    # interrupted in its first calibration run
    "resolution": ["--models", "identity", "--repeats", "2", "--out", "{out}", "--", "--num_iters", "1000000"],
}
POLL_S = 0.05


# /proc/<pid>/task/<tid>/children: a kernel built without CONFIG_PROC_CHILDREN has none (then /proc is scanned).
CHILDREN_LISTED = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


def _children(pid: int) -> list[int]:
    """pid's child processes, from /proc/<pid>/task/*/children where the kernel lists them: a few small reads,
    not a scan of every process, while twelve cases poll as their tools start."""
    if not CHILDREN_LISTED:
        return [entry.pid for entry in processes() if entry.parent_pid == pid]
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(child) for child in (task / "children").read_text().split()]
    except OSError:  # it ended meanwhile
        pass
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _server_sessions(pid: int) -> list[int]:
    """The server.py processes among pid's descendants (each leads its own session)."""
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in _children(parent)]
        found += [child for child in frontier if "server.py" in _cmdline(child)]
    return found


def _signal_masks(pid: int) -> tuple[int, int]:
    """(ignored, caught) signal masks of pid, from /proc/<pid>/status; (0, 0) once it is gone."""
    status = process_status(pid) or {}
    return int(status.get("SigIgn", "0"), 16), int(status.get("SigCgt", "0"), 16)


def _run_in_flight(server: int) -> bool:
    """The server has started its run's processes and takes SIGINT and SIGTERM: it ignores SIGINT while it starts
    them, and before its handlers are set an interrupt ends it with a traceback. The earliest point at which an
    interrupt stops a run with processes of its own, whatever the load (a fixed sleep was either long or racy)."""
    ignored, caught = _signal_masks(server)
    bit = {signum: 1 << (signum - 1) for signum in (signal.SIGINT, signal.SIGTERM)}
    handled = not ignored & bit[signal.SIGINT] and caught & bit[signal.SIGINT] and caught & bit[signal.SIGTERM]
    return bool(handled) and any("multiprocessing.spawn" in _cmdline(child) for child in _children(server))


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worktrees_under(folder: Path) -> list[str]:
    listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(str(folder))]


# (tool, signal, sent to): the tool's process group, or only its server (someone stopped that run: the tool stops too)
CASES = [(tool, signal.SIGINT, "group") for tool in TOOLS] + [("commits", signal.SIGTERM, "group")]
CASES += [(tool, signal.SIGINT, "server") for tool in ("serving", "compare", "commits", "resolution")]
Case = tuple[str, signal.Signals, str]


@dataclass
class Outcome:
    """What one case saw: `failure` says why it stopped short of its checks ("" when it did not)."""

    failure: str = ""
    returncode: int | None = None
    stderr: str = ""
    servers: list[int] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)  # the servers' sessions' processes after the stop
    worktrees: list[str] = field(default_factory=list)  # the repository's worktrees under the tool's TMPDIR
    scratch_left: list[str] = field(default_factory=list)  # bench-commits-* folders left in the tool's TMPDIR


def _start(case: Case, folder: Path) -> subprocess.Popen:
    tool = case[0]
    argv = [arg.replace("{out}", str(folder / "out")) for arg in TOOLS[tool]]
    scratch = folder / "tmp"  # the tool's temporary folder (bench.commits' worktrees)
    scratch.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", f"bench.{tool}", *argv],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(scratch)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_ignore_sigint,
    )


def _interrupt(case: Case, proc: subprocess.Popen, folder: Path) -> Outcome:
    """Waits for the tool's first server run to be in flight, sends the case's signal, and notes what is left."""
    tool, signum, target = case
    outcome = Outcome()
    deadline = time.monotonic() + START_S
    while not (servers := _server_sessions(proc.pid)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    outcome.servers = servers
    server = Path(f"/proc/{outcome.servers[0]}") if outcome.servers else None
    while server is not None and server.exists() and not _run_in_flight(int(server.name)):
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if server is None or not server.exists() or time.monotonic() >= deadline:
        outcome.failure = f"no server run in flight within {START_S:g} s (bench.{tool} exit {proc.poll()})"
        return outcome
    if target == "group":
        os.killpg(proc.pid, signum)
    else:
        os.kill(outcome.servers[0], signum)
    try:
        _, outcome.stderr = proc.communicate(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        outcome.failure = f"bench.{tool} still running {STOP_S:g} s after {signum.name}"
        return outcome
    outcome.returncode = proc.returncode
    outcome.left_running = [line for server in outcome.servers for line in live_processes_in_session(server)]
    outcome.worktrees = _worktrees_under(folder / "tmp")
    outcome.scratch_left = [path.name for path in (folder / "tmp").glob("bench-commits-*")]
    return outcome


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Case, Outcome]]:
    """Every case at once, each to its checks: its tool started, its first server run interrupted in flight, the
    tool's exit and what it left."""
    folders = {case: tmp_path_factory.mktemp(f"{case[0]}-{case[1].name}-{case[2]}") for case in CASES}
    procs: dict[Case, subprocess.Popen] = {}
    outcomes: dict[Case, Outcome] = {}
    try:
        for case in CASES:  # all started before any thread exists: preexec_fn is not safe beside threads
            procs[case] = _start(case, folders[case])
        with ThreadPoolExecutor(len(CASES)) as pool:
            futures = {case: pool.submit(_interrupt, case, procs[case], folders[case]) for case in CASES}
            outcomes = {case: future.result() for case, future in futures.items()}
        yield outcomes
    finally:
        for case, proc in procs.items():  # whatever ended the fixture, nothing of it outlives the file
            servers = set(_server_sessions(proc.pid)) | set(outcomes[case].servers if case in outcomes else [])
            for session in (*servers, proc.pid):
                kill_session(session)
            proc.communicate()
            for folder in _worktrees_under(folders[case] / "tmp"):  # a failing run's worktrees leave the repository
                subprocess.run(["git", "worktree", "remove", "--force", folder], cwd=ROOT, timeout=60)


@pytest.mark.parametrize("tool,signum,target", CASES, ids=[f"{t}-{s.name}-{to}" for t, s, to in CASES])
def test_an_interrupt_stops_the_tool_with_130_and_leaves_no_server(
    interrupted: dict[Case, Outcome], tool: str, signum: signal.Signals, target: str
) -> None:
    outcome = interrupted[(tool, signum, target)]
    assert not outcome.failure, outcome.failure
    assert outcome.returncode == 130, (outcome.returncode, outcome.stderr[-3000:])
    assert "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    assert outcome.left_running == []
    assert outcome.worktrees == [] and outcome.scratch_left == []
