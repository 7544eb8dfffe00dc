"""Shared helpers: run server.py as a user would (a subprocess in its own session), read its CSV, find leftovers."""

from __future__ import annotations

import csv
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from serverbench.config.build import build_config
from serverbench.config.flags import OneLineErrorParser
from serverbench.config.options import BenchConfig, RankInfo, add_cli_args
from serverbench.launch.preflight import preflight
from serverbench.launch.session import Session

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ("suite_budget",)  # each test file held to its share of the suite's time (tests/suite_budget.py)
# This process uses grpc (the door's tests) and then forks children that exec at once (subprocess, a tool's
# preexec_fn): grpc's fork handlers, run in such a child before its exec, aborted one now and then (SIGABRT, no
# message). grpc's documented switch for a process that always execs after fork; read when grpc starts, which is
# after this (the test modules import it).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# Small and fast on a 2-core CPU: the threads and hand-offs are the same at any size and with any model. The identity
# model unless a test names one: its server starts without importing torch (seconds per run); the tests that need a
# real network's forward (--verify's races, checkpoints, compile) ask for resnet18.
TINY = [
    "--device",
    "cpu",
    "--image_size",
    "32",
    "--batch_size",
    "2",
    "--num_iters",
    "6",
    "--ceiling_s",
    "0.05",
    "--model",
    "identity",
]
CUDA_VERDICT = pytest.StashKey[tuple]()  # (run | skip | fail, reason) for the cuda-marked tests, once per session


def cuda_tests_verdict() -> tuple[str, str]:
    """What the `cuda`-marked tests do on this machine: run (torch can use a GPU), skip (there is none, or
    CUDA_VISIBLE_DEVICES hides them) or fail (a GPU is visible but torch cannot use it: a green suite would hide
    that every run falls back to the CPU)."""
    from serverbench.device.layer import unusable_gpu_reason

    if torch.cuda.is_available():
        return "run", ""
    reason = unusable_gpu_reason()
    if reason is not None:
        return "fail", reason
    return "skip", "needs a CUDA GPU"


def pytest_collection_modifyitems(config, items) -> None:
    verdict, reason = cuda_tests_verdict()
    config.stash[CUDA_VERDICT] = (verdict, reason)
    if verdict != "skip":
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_runtest_setup(item) -> None:
    verdict, reason = item.config.stash.get(CUDA_VERDICT, ("run", ""))
    if verdict == "fail" and item.get_closest_marker("cuda") is not None:
        pytest.fail(reason, pytrace=False)


@dataclass
class ServerRun:
    returncode: int
    stdout: str
    stderr: str
    rows: list[dict[str, str]]
    session_id: int

    @property
    def row(self) -> dict[str, str]:
        assert len(self.rows) == 1, f"expected one row, got {len(self.rows)}\n{self.stderr}"
        return self.rows[0]


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def make_config(argv: Sequence[str], rank: RankInfo | None = None) -> BenchConfig:
    """The config server.py would run with these flags: parsed, built from the flags, then checked against this
    machine (device resolved, results folder made)."""
    parser = OneLineErrorParser(prog="server.py")
    add_cli_args(parser)
    return preflight(build_config(parser.parse_args(list(argv)), rank))


def torchrun(nproc_per_node: int) -> list[str]:
    """The launcher arguments that run server.py under torchrun on this machine."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}"]


# The sessions the running test started (server.py, the bench tools, sweeps): each is killed, with every process in
# it, when the test ends however it ends: an assertion, a subprocess bound, or pytest's own timeout (which raises in
# the test, so the teardown still runs) cannot leave a server running into the next test.
_STARTED_SESSIONS: list[int] = []


def register_session(session_id: int) -> None:
    """Kill this session (a process started with start_new_session) at the end of the running test."""
    _STARTED_SESSIONS.append(session_id)


def outlive_the_test(session_id: int) -> None:
    """A session a module-scoped fixture started: that fixture kills it when the module ends, not the first test."""
    _STARTED_SESSIONS.remove(session_id)


@pytest.fixture(autouse=True)
def _kill_sessions_started_by_the_test():
    yield
    while _STARTED_SESSIONS:
        session_id = _STARTED_SESSIONS.pop()
        if _live_in_session(session_id):  # only a session still there: its id cannot be another's yet
            kill_session(session_id)


def start_session(cmd: Sequence[str], cwd: Path, env: Mapping[str, str] | None) -> subprocess.Popen:
    """A command started by the project's launcher (a session of its own, ended with the thread that started it),
    its output captured, registered so that the test's teardown kills the session however the test ends."""
    proc = Session.piped(cmd, cwd, env=None if env is None else {**os.environ, **env}).proc
    register_session(proc.pid)
    return proc


def start_server(
    args: list[str],
    results_dir: Path,
    output_file: str = "out.csv",
    launcher: Sequence[str] = (),
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """server.py (under `launcher`, e.g. torchrun(2), when given) in a new session, so every process it starts
    can be found afterwards by session id, and is killed at the end of the test; from `cwd` (where a factory
    --model is imported from); `env` adds to the environment."""
    cmd = [
        sys.executable,
        *launcher,
        str(ROOT / "server.py"),
        "--results_dir",
        str(results_dir),
        "--output_file",
        output_file,
        *args,
    ]
    return start_session(cmd, cwd, env)


def communicate_or_fail(proc: subprocess.Popen, timeout_s: float, what: str) -> tuple[str, str]:
    """The process's output once it ends; past timeout_s its session is killed and the test fails with the tail."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"{what} did not finish within {timeout_s} s\n{stdout[-2000:]}\n{stderr[-3000:]}")


def run_server(
    args: list[str],
    results_dir: Path,
    timeout_s: float = 240,
    output_file: str = "out.csv",
    launcher: Sequence[str] = (),
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
) -> ServerRun:
    """server.py to its end, within timeout_s (below pytest's 300 s, so that this bound is the one that fires)."""
    proc = start_server(args, results_dir, output_file, launcher, cwd, env)
    stdout, stderr = communicate_or_fail(proc, timeout_s, "server.py")
    return ServerRun(proc.returncode, stdout, stderr, read_rows(results_dir / output_file), proc.pid)


def run_command(
    cmd: Sequence[str], timeout_s: float, cwd: Path = ROOT, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """A command (a bench tool, a sweep) to its end in a session of its own, its output captured; past timeout_s
    (keep it below pytest's 300 s) the session is killed and the test fails with the output's tail."""
    proc = start_session(cmd, cwd, env)
    stdout, stderr = communicate_or_fail(proc, timeout_s, " ".join(cmd)[:200])
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def read_log_until(proc: subprocess.Popen, done: Callable[[str], bool], limit_s: float) -> str:
    """Reads the server's stderr as it comes until `done(what was read)` holds, the server ends, or limit_s
    passes, and returns what was read (proc.communicate() later returns the rest). Never blocks past limit_s: it
    reads the pipe only when select says there is something."""
    fd = proc.stderr.fileno()
    read = b""
    deadline = time.monotonic() + limit_s
    while (left_s := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], min(left_s, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # the server closed its stderr: it has ended
            break
        read += chunk
        if done(read.decode(errors="replace")):
            break
    return read.decode(errors="replace")


def live_processes_in_session(session_id: int, grace_s: float = 15.0) -> list[str]:
    """Processes of that session still running after grace_s (zombies are dead already and are ignored;
    the grace lets a process that is already exiting, such as multiprocessing's resource tracker, finish)."""
    deadline = time.monotonic() + grace_s
    while (alive := _live_in_session(session_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@dataclass(frozen=True)
class ProcessEntry:
    pid: int
    state: str  # R, S, D, T, Z...
    parent_pid: int
    session_id: int
    cmdline: str


def processes() -> list[ProcessEntry]:
    """Every process in /proc, read from its stat and cmdline (one that ends while being read is left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # Fields after the command (which is in parentheses and may hold spaces): state, ppid, pgrp, sid, ...
        fields = stat.rsplit(")", 1)[1].split()
        found.append(ProcessEntry(int(entry.name), fields[0], int(fields[1]), int(fields[3]), cmdline.strip()))
    return found


def _live_in_session(session_id: int) -> list[str]:
    return [
        f"{p.pid} {p.state} {p.cmdline[:200]}" for p in processes() if p.session_id == session_id and p.state != "Z"
    ]


def pids_running(*parts: str) -> list[int]:
    """The live processes whose command line holds every one of `parts`."""
    return [p.pid for p in processes() if p.state != "Z" and all(part in p.cmdline for part in parts)]


def shm_entries() -> set[str]:
    """Names in /dev/shm: shared-memory segments and named semaphores."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def new_shm_entries(before: set[str], grace_s: float = 15.0) -> set[str]:
    """Entries created since `before` that are still there after grace_s (the resource tracker may still be
    unlinking what a finished run registered)."""
    deadline = time.monotonic() + grace_s
    while (left := shm_entries() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_session(session_id: int) -> None:
    try:
        os.killpg(session_id, 9)
    except ProcessLookupError:
        pass


def child_pids(stderr_text: str) -> dict[str, int] | None:
    match = re.search(r"frontend pid=(\d+) backend pid=(\d+)", stderr_text)
    return None if match is None else {"frontend": int(match.group(1)), "backend": int(match.group(2))}


class ServedMeanwhile:
    """server.py started by a module-scoped fixture and left to run while the module's other tests do (its run
    asserts on no time, and most of it is processes importing torch and building or compiling the model); a thread
    reads its output as it comes. run() waits for its end; the fixture calls stop() when the module ends."""

    def __init__(self, args: list[str], results: Path, cwd: Path = ROOT) -> None:
        self.results = results
        self._proc = start_server(args, results, cwd=cwd)
        outlive_the_test(self._proc.pid)  # the module's fixture ends it, not the test that started it
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="served-meanwhile")
        self._output = self._reader.submit(self._proc.communicate)

    def run(self, timeout_s: float = 240) -> ServerRun:
        try:
            stdout, stderr = self._output.result(timeout=timeout_s)
        except FutureTimeout:
            kill_session(self._proc.pid)
            stdout, stderr = self._output.result(timeout=30)
            pytest.fail(f"server.py did not finish within {timeout_s} s\n{stdout[-2000:]}\n{stderr[-3000:]}")
        return ServerRun(self._proc.returncode, stdout, stderr, read_rows(self.results / "out.csv"), self._proc.pid)

    def stop(self) -> None:
        if self._proc.poll() is None:
            kill_session(self._proc.pid)
        self._reader.shutdown(wait=True)
