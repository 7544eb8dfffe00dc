"""The user's code before the run (a factory's import and build, the probe's first forward) cannot take the server
down, hang it or keep it from an interrupt: whatever that code does (exit, crash, hang) is one line and exit 2 before
any process of the run starts, an interrupt meanwhile is exit 130 at once, and nothing is written or left running.
The stack-dump signals the server sends a stuck child do not kill one still starting up: that run is a timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    ServerRun,
    kill_session,
    live_processes_in_session,
    new_shm_entries,
    read_rows,
    shm_entries,
    start_server,
)

QUICK = ["--device", "cpu", "--image_size", "8", "--batch_size", "2", "--num_iters", "4", "--warmup_iters", "1"]
QUICK += ["--no-ceiling"]
VECTOR = ["--input", "x:float32:4"]

# The user's code: each factory or module misbehaves in one way, in the process that runs it. A process that runs
# it writes its pid into pid.txt first, so that a test can tell whether it is still running afterwards.
USER_CODE = """
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn


def _note_pid():
    Path("pid.txt").write_text(str(os.getpid()))


class Forward(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        _note_pid()
        if self.how == "sys_exit":
            sys.exit(3)
        if self.how == "os_exit":
            os._exit(9)
        if self.how == "abort":
            os.abort()
        if self.how == "hang":
            time.sleep(3600)
        return x * 2


def factory_exits():
    sys.exit(5)


def factory_interrupted():
    raise KeyboardInterrupt


def forward_exits():
    return Forward("sys_exit")


def forward_os_exit():
    return Forward("os_exit")


def forward_aborts():
    return Forward("abort")


def forward_hangs():
    return Forward("hang")
"""

EXITS_AT_IMPORT = "import sys\nsys.exit(7)\n"

# Slow at import: as a module sleeping on a network share or building a cache, for a minute.
SLOW_IMPORT = """
import os
import time
from pathlib import Path

Path("pid.txt").write_text(str(os.getpid()))
time.sleep(60)


def make():
    raise AssertionError("never reached")
"""

# Quick to import the first time (the pre-run checks), then a minute more in every later import (the backend's):
# the backend is still starting up when the warm-up's time limit ends the run.
SLOW_THE_SECOND_TIME = """
import time
from pathlib import Path

from torch import nn

_MARK = Path(__file__).with_name("imported_once")
if _MARK.exists():
    time.sleep(60)
_MARK.touch()


def make():
    return nn.Identity()
"""


def _user_code(folder: Path) -> Path:
    """A folder to run the server from, holding the user's modules (a factory is imported from the current folder)."""
    folder.mkdir(parents=True)
    (folder / "user.py").write_text(textwrap.dedent(USER_CODE))
    (folder / "exits_at_import.py").write_text(EXITS_AT_IMPORT)
    (folder / "slow_import.py").write_text(textwrap.dedent(SLOW_IMPORT))
    (folder / "slow_the_second_time.py").write_text(textwrap.dedent(SLOW_THE_SECOND_TIME))
    return folder


def _messages(stderr: str) -> list[str]:
    """stderr's lines other than the server's log lines."""
    return [line for line in stderr.splitlines() if line.strip() and "server[" not in line]


def _gone(pid: int, grace_s: float = 5.0) -> bool:
    """Whether process `pid` has ended (or is a zombie) within grace_s."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _probe_pid(folder: Path) -> int | None:
    path = folder / "pid.txt"
    return int(path.read_text()) if path.exists() and path.read_text() else None


@dataclass
class Timed:
    """A server run of the module's runs, from `folder` (the user's code, pid.txt), its results in folder/results;
    its start, end and (when it was sent one) the signal's time.monotonic()."""

    run: ServerRun
    folder: Path
    started_s: float
    ended_s: float
    signalled_s: float | None = None
    problem: str = ""  # why it was not signalled as planned


class Runs:
    """Server runs that overlap, each from a folder of its own, each waited for in a thread of its own (so that its
    end is timed when it comes)."""

    def __init__(self, parent: Path, limit_s: float) -> None:
        self.parent, self.limit_s = parent, limit_s
        self.started: dict[str, float] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.ended: dict[str, tuple[float, str, str]] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, argv: list[str], sigint_ignored: bool = False) -> Path:
        folder = _user_code(self.parent / name)
        self.started[name] = time.monotonic()
        with _sigint_ignored() if sigint_ignored else contextlib.nullcontext():
            self.procs[name] = start_server(argv, folder / "results", cwd=folder)
        self.threads.append(threading.Thread(target=self._wait, args=(name,)))
        self.threads[-1].start()
        return folder

    def _wait(self, name: str) -> None:
        proc = self.procs[name]
        try:
            stdout, stderr = proc.communicate(timeout=self.limit_s)
        except subprocess.TimeoutExpired:  # its test fails on its end's time, with the output's tail
            kill_session(proc.pid)
            stdout, stderr = proc.communicate(timeout=30)
        self.ended[name] = (time.monotonic(), stdout, stderr)

    def until(self, done: Callable[[], bool], name: str, limit_s: float = 60) -> None:
        """Until `done()` holds, run `name` ends, or limit_s passes (its test then says what it did not reach)."""
        deadline = time.monotonic() + limit_s
        while not done() and name not in self.ended and time.monotonic() < deadline:
            time.sleep(0.05)

    def finish(self) -> dict[str, Timed]:
        for thread in self.threads:
            thread.join()
        timed = {}
        for name, proc in self.procs.items():
            ended_s, stdout, stderr = self.ended[name]
            folder = self.parent / name
            run = ServerRun(proc.returncode, stdout, stderr, read_rows(folder / "results" / "out.csv"), proc.pid)
            timed[name] = Timed(run, folder, self.started[name], ended_s)
        return timed


EXITS = [
    # (id, --model and more, what the one line names)
    ("--model sys:exit", ["--model", "sys:exit"], "SystemExit"),
    ("--model builtins:exit", ["--model", "builtins:exit"], "SystemExit"),
    ("factory calls sys.exit(5)", ["--model", "user:factory_exits"], "SystemExit: 5"),
    ("module calls sys.exit(7) at import", ["--model", "exits_at_import:make"], "SystemExit: 7"),
    ("factory raises Ctrl-C", ["--model", "user:factory_interrupted"], "KeyboardInterrupt"),
    ("forward calls sys.exit(3)", ["--model", "user:forward_exits", *VECTOR], "SystemExit: 3"),
    ("forward calls os._exit(9)", ["--model", "user:forward_os_exit", *VECTOR], "(exit 9)"),
    ("forward calls os.abort()", ["--model", "user:forward_aborts", *VECTOR], "(signal 6)"),
]
INTERRUPTS = [
    # (id, the signal, to the server's group (Ctrl-C) or to the server alone, SIGINT ignored when it started)
    ("Ctrl-C", signal.SIGINT, True, False),
    ("Ctrl-C to a server started with SIGINT ignored", signal.SIGINT, True, True),
    ("SIGTERM", signal.SIGTERM, False, False),
]
LIMITS = ["--timeout_s", "3", "--warmup_timeout_s", "5"]


@dataclass
class ModuleRuns:
    timed: dict[str, Timed]
    shm_left: set[str]  # /dev/shm entries left by any of the runs, once every one had ended


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> ModuleRuns:
    """Every run of the module, overlapped where one waits: the runs are slow by their start (torch imported by the
    server, then by the process that checks the model, on one core) and by what they wait for, not by their work.

    First a first forward that hangs in the checks (--warmup_timeout_s 5, which covers the checks' own import of
    torch: nothing else starts until that import is done); once it hangs, a backend that will still be importing
    the model (slow the second time only) at its warm-up limit, whose checks import torch meanwhile; once they have
    imported the model, each user code of EXITS run to its refusal and each of INTERRUPTS, sent to a server whose
    checks are inside a slow import (a minute long) once that import has written its pid and the EXITS' runs have
    ended (the signal's time bound then has the CPU)."""
    before = shm_entries()
    runs = Runs(tmp_path_factory.mktemp("runs"), limit_s=120)
    hung = runs.start("hung forward", [*QUICK, "--model", "user:forward_hangs", *VECTOR, *LIMITS])
    runs.until(lambda: _probe_pid(hung) is not None, "hung forward")
    slow = runs.start("slow backend", [*QUICK, "--model", "slow_the_second_time:make", *LIMITS])
    runs.until((slow / "imported_once").exists, "slow backend")
    for name, argv, _ in EXITS:
        runs.start(name, [*QUICK, *argv])
    interrupted = {}
    for name, _, _, ignored_at_start in INTERRUPTS:
        interrupted[name] = runs.start(name, [*QUICK, "--model", "slow_import:make"], sigint_ignored=ignored_at_start)
    signalled, problems = {}, {}
    deadline = time.monotonic() + 90
    while len(signalled) + len(problems) < len(INTERRUPTS) and time.monotonic() < deadline:
        exits_ended = all(name in runs.ended for name, *_ in EXITS)  # their start no longer shares the CPU
        for name, signum, to_group, _ in INTERRUPTS:
            proc = runs.procs[name]
            if name in signalled or name in problems:
                continue
            if exits_ended and _probe_pid(interrupted[name]) is not None:  # the checks are inside the user's import
                (os.killpg if to_group else os.kill)(proc.pid, signum)
                signalled[name] = time.monotonic()
            elif name in runs.ended:
                problems[name] = "the server ended before the checks were inside the import"
        time.sleep(0.05)
    timed = runs.finish()
    for name, *_ in INTERRUPTS:
        timed[name].signalled_s = signalled.get(name)
        timed[name].problem = problems.get(name, "" if name in signalled else "the import never began within 90 s")
    return ModuleRuns(timed, new_shm_entries(before))


@pytest.mark.parametrize("name,fragment", [(c[0], c[2]) for c in EXITS], ids=[c[0] for c in EXITS])
def test_user_code_that_ends_its_process_before_the_run_is_one_line_and_exit_2(
    runs: ModuleRuns, name: str, fragment: str
) -> None:
    timed = runs.timed[name]
    run, results = timed.run, timed.folder / "results"
    assert run.returncode == 2, run.stderr[-3000:]
    lines = _messages(run.stderr)
    assert len(lines) == 1 and lines[0].startswith("server.py: error: --model "), lines
    assert fragment in lines[0], lines[0]
    assert run.stdout == "" and not results.exists()  # nothing run, nothing written
    pid = _probe_pid(timed.folder)
    if pid is not None:  # the forward's process: not the server's
        assert pid != run.session_id
    assert live_processes_in_session(run.session_id, grace_s=5) == []


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """What a script's `server.py &` does: the server starts with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("name,signum", [c[:2] for c in INTERRUPTS], ids=[c[0] for c in INTERRUPTS])
def test_an_interrupt_during_a_slow_import_ends_the_checks_at_once_with_130(
    runs: ModuleRuns, name: str, signum: signal.Signals
) -> None:
    timed = runs.timed[name]
    run = timed.run
    assert not timed.problem, f"{timed.problem}\n{run.stderr[-3000:]}"
    took_s = timed.ended_s - timed.signalled_s
    assert took_s < 20, f"{signum.name} did not end the checks within 20 s (the import sleeps 60 s)"
    assert run.returncode == 130, run.stderr[-3000:]
    assert took_s < 5, took_s
    lines = _messages(run.stderr)
    assert len(lines) == 1 and "interrupted" in lines[0] and signum.name in lines[0], lines
    assert run.stdout == "" and not (timed.folder / "results").exists()  # a run that never started: nothing written
    pid = _probe_pid(timed.folder)
    assert pid is not None and _gone(pid), "the import's process is still running"
    assert live_processes_in_session(run.session_id, grace_s=5) == []


def test_a_first_forward_that_hangs_is_refused_within_the_warm_up_limit(runs: ModuleRuns) -> None:
    timed = runs.timed["hung forward"]
    run, took_s = timed.run, timed.ended_s - timed.started_s
    assert run.returncode == 2, run.stderr[-3000:]
    lines = _messages(run.stderr)
    assert len(lines) == 1 and "--warmup_timeout_s 5" in lines[0] and "forward" in lines[0], lines
    assert took_s < 5 + 10, took_s  # the limit, and the server's own start and the child's stop
    assert not (timed.folder / "results").exists()
    pid = _probe_pid(timed.folder)
    assert pid is not None and pid != run.session_id and _gone(pid), "the hung forward's process is still running"
    assert live_processes_in_session(run.session_id, grace_s=5) == []


def test_a_backend_still_importing_the_model_at_the_warm_up_limit_is_a_timeout_not_killed_by_the_stack_dump(
    runs: ModuleRuns,
) -> None:
    """The server dumps the stuck children's stacks (SIGUSR1, and SIGUSR2 for the backend's progress) before it stops
    them: a backend still importing the model has no handler for either yet, and must not die of it."""
    timed = runs.timed["slow backend"]
    run = timed.run
    assert (timed.folder / "imported_once").exists()  # the checks imported it quickly: the backend is the slow one
    assert run.returncode == 1, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "timeout", (row["status"], row["error"])
    assert "SIGUSR" not in row["error"] and "SIGUSR" not in run.stderr, row["error"]
    assert runs.shm_left == set()
    assert live_processes_in_session(run.session_id) == []
    assert read_rows(timed.folder / "results" / "out.csv") == run.rows


def test_the_server_checks_a_factory_in_its_child_without_importing_torch(tmp_path: Path) -> None:
    """The factory is built and its forward tried in the child that preflight starts; the server itself, which
    only reads the child's words, imports no torch (it did, through the child's module: seconds of every
    such run's start)."""
    flags = ["--device", "cpu", "--image_size", "8", "--model", "user:forward_exits", *VECTOR]
    flags += ["--results_dir", str(tmp_path / "results")]
    script = textwrap.dedent(
        f"""
        import sys
        sys.argv = ["server.py"]
        import server
        from serverbench.config.build import build_config
        from serverbench.config.flags import ConfigError, OneLineErrorParser
        from serverbench.config.options import add_cli_args
        from serverbench.launch.preflight import preflight
        parser = OneLineErrorParser()
        add_cli_args(parser)
        try:
            preflight(build_config(parser.parse_args({flags!r})))
        except ConfigError as exc:
            print(exc)
        print("torch" in sys.modules)
        """
    )
    folder = _user_code(tmp_path / "user")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    said = run.stdout.splitlines()
    assert run.returncode == 0 and len(said) == 2, run.stdout + run.stderr[-3000:]
    assert "SystemExit: 3" in said[0]  # the child built the model and ran its forward, which exits
    assert said[1] == "False"
