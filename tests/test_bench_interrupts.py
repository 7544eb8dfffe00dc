"""Ctrl-C stops every bench tool that runs server.py: the run in flight is stopped, the tool exits 130 without a
traceback, and no server process is left. The tool is started as a script's `&` starts it (SIGINT ignored, which
a Python program does not undo by itself) in its own session, and the interrupt goes to its whole process group,
as a terminal's Ctrl-C or `kill -INT -PGID` sends it. bench.commits also under SIGTERM (a process manager's stop):
its scratch worktrees are unregistered from the repository and its temporary folder is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, kill_session, live_processes_in_session, processes, register_session

START_S = 120.0  # until the tool's first server run has started: bench.compare imports torch first
STOP_S = 60.0  # after the interrupt: the server stops within about 7 s, a sweep's within its cell's
IDENTITY = ["--device", "cpu", "--model", "identity", "--image_size", "16"]
# tool -> its arguments, with a first server run long enough to be interrupted in flight ({out}: the tool's folder)
TOOLS = {
    "your_model": ["--repeats", "1", "--num_iters", "100000", "--batch_size", "1", "--out", "{out}"],
    "loadgen_agreement": ["--out", "{out}", "--capacity_iters", "1000000", "--duration_s", "1"],
    "serving": ["--parts", "overhead", "--repeats", "2", "--out", "{out}"],
    "compare": ["--models", "identity", "--num_iters", "identity=1000000", "--batch_size", "1", "--image_size", "16"]
    + ["--repeats", "1", "--device", "cpu", "--out", "{out}"],
    "stability": ["--suites", "identity", "--repeats", "1", "--out", "{out}", "--", "--image_size", "16"],
    "commits": ["--base", "HEAD", "--repeats", "2", "--out", "{out}", "--", *IDENTITY, "--num_iters", "1000000"],
    # interrupted in its first calibration run
    "resolution": ["--models", "identity", "--rounds", "2", "--out", "{out}", "--", "--num_iters", "1000000"],
}


def _server_sessions(pid: int) -> list[int]:
    """The server.py processes among pid's descendants (each leads its own session)."""
    parents = {entry.pid: entry for entry in processes()}
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, entry in parents.items() if entry.parent_pid in frontier}
        found += [child for child in frontier if "server.py" in parents[child].cmdline]
    return found


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worktrees_under(folder: Path) -> list[str]:
    listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(str(folder))]


# (tool, signal, sent to): the tool's process group, or only its server (someone stopped that run: the tool stops too)
CASES = [(tool, signal.SIGINT, "group") for tool in TOOLS] + [("commits", signal.SIGTERM, "group")]
CASES += [(tool, signal.SIGINT, "server") for tool in ("serving", "compare", "commits", "resolution")]


@pytest.mark.parametrize("tool,signum,target", CASES, ids=[f"{t}-{s.name}-{to}" for t, s, to in CASES])
def test_an_interrupt_stops_the_tool_with_130_and_leaves_no_server(
    tmp_path: Path, tool: str, signum: signal.Signals, target: str
) -> None:
    argv = [arg.replace("{out}", str(tmp_path / "out")) for arg in TOOLS[tool]]
    scratch = tmp_path / "tmp"  # the tool's temporary folder (bench.commits' worktrees)
    scratch.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", f"bench.{tool}", *argv],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(scratch)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_ignore_sigint,
    )
    register_session(proc.pid)  # killed at the test's end whatever ends it, pytest's own timeout included
    servers: list[int] = []
    try:
        deadline = time.monotonic() + START_S
        while not (servers := _server_sessions(proc.pid)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers, f"no server run started within {START_S:g} s"
        for server in servers:
            register_session(server)
        time.sleep(1.0)  # the server is running
        if target == "group":
            os.killpg(proc.pid, signum)
        else:
            os.kill(servers[0], signum)
        try:
            _, stderr = proc.communicate(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"bench.{tool} still running {STOP_S:g} s after {signum.name}")
        assert proc.returncode == 130, (proc.returncode, stderr[-3000:])
        assert "Traceback" not in stderr, stderr[-3000:]
        assert all(live_processes_in_session(server) == [] for server in servers)
        assert _worktrees_under(scratch) == [] and list(scratch.glob("bench-commits-*")) == []
    finally:
        for session in (proc.pid, *servers):
            kill_session(session)
        proc.communicate()
        for folder in _worktrees_under(scratch):  # a failing run's worktrees are not left in the repository
            subprocess.run(["git", "worktree", "remove", "--force", folder], cwd=ROOT, timeout=60)
