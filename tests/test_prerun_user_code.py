"""The user's code before the run (a factory's import and build, the probe's first forward) cannot take the server
down, hang it or keep it from an interrupt: whatever that code does (exit, crash, hang) is one line and exit 2 before
any process of the run starts, an interrupt meanwhile is exit 130 at once, and nothing is written or left running.
The stack-dump signals the server sends a stuck child do not kill one still starting up: that run is a timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import (
    kill_session,
    live_processes_in_session,
    new_shm_entries,
    read_rows,
    run_server,
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


@pytest.fixture
def user_code(tmp_path: Path) -> Path:
    """A folder to run the server from, holding the user's modules (a factory is imported from the current folder)."""
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_CODE))
    (tmp_path / "exits_at_import.py").write_text(EXITS_AT_IMPORT)
    (tmp_path / "slow_import.py").write_text(textwrap.dedent(SLOW_IMPORT))
    (tmp_path / "slow_the_second_time.py").write_text(textwrap.dedent(SLOW_THE_SECOND_TIME))
    return tmp_path


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


@pytest.mark.parametrize(
    "argv,fragment",
    [
        pytest.param(["--model", "sys:exit"], "SystemExit", id="--model sys:exit"),
        pytest.param(["--model", "builtins:exit"], "SystemExit", id="--model builtins:exit"),
        pytest.param(["--model", "user:factory_exits"], "SystemExit: 5", id="factory calls sys.exit(5)"),
        pytest.param(["--model", "exits_at_import:make"], "SystemExit: 7", id="module calls sys.exit(7) at import"),
        pytest.param(["--model", "user:factory_interrupted"], "KeyboardInterrupt", id="factory raises Ctrl-C"),
        pytest.param(["--model", "user:forward_exits", *VECTOR], "SystemExit: 3", id="forward calls sys.exit(3)"),
        pytest.param(["--model", "user:forward_os_exit", *VECTOR], "(exit 9)", id="forward calls os._exit(9)"),
        pytest.param(["--model", "user:forward_aborts", *VECTOR], "(signal 6)", id="forward calls os.abort()"),
    ],
)
def test_user_code_that_ends_its_process_before_the_run_is_one_line_and_exit_2(
    argv: list[str], fragment: str, user_code: Path
) -> None:
    results = user_code / "results"
    run = run_server([*QUICK, *argv], results, timeout_s=120, cwd=user_code)
    assert run.returncode == 2, run.stderr[-3000:]
    lines = _messages(run.stderr)
    assert len(lines) == 1 and lines[0].startswith("server.py: error: --model "), lines
    assert fragment in lines[0], lines[0]
    assert run.stdout == "" and not results.exists()  # nothing run, nothing written
    pid = _probe_pid(user_code)
    if pid is not None:  # the forward's process: not the server's
        assert pid != run.session_id
    assert live_processes_in_session(run.session_id, grace_s=5) == []


def test_a_first_forward_that_hangs_is_refused_within_the_warm_up_limit(user_code: Path) -> None:
    results = user_code / "results"
    argv = [*QUICK, "--model", "user:forward_hangs", *VECTOR, "--timeout_s", "3", "--warmup_timeout_s", "5"]
    started = time.monotonic()
    run = run_server(argv, results, timeout_s=40, cwd=user_code)
    took_s = time.monotonic() - started
    assert run.returncode == 2, run.stderr[-3000:]
    lines = _messages(run.stderr)
    assert len(lines) == 1 and "--warmup_timeout_s 5" in lines[0] and "forward" in lines[0], lines
    assert took_s < 5 + 10, took_s  # the limit, and the server's own start and the child's stop
    assert not results.exists()
    pid = _probe_pid(user_code)
    assert pid is not None and pid != run.session_id and _gone(pid), "the hung forward's process is still running"
    assert live_processes_in_session(run.session_id, grace_s=5) == []


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """What a script's `server.py &` does: the server starts with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    "signum,to_group,ignored_at_start",
    [
        pytest.param(signal.SIGINT, True, False, id="Ctrl-C"),
        pytest.param(signal.SIGINT, True, True, id="Ctrl-C to a server started with SIGINT ignored"),
        pytest.param(signal.SIGTERM, False, False, id="SIGTERM"),
    ],
)
def test_an_interrupt_during_a_slow_import_ends_the_checks_at_once_with_130(
    signum: signal.Signals, to_group: bool, ignored_at_start: bool, user_code: Path
) -> None:
    results = user_code / "results"
    if ignored_at_start:
        with _sigint_ignored():
            proc = start_server([*QUICK, "--model", "slow_import:make"], results, cwd=user_code)
    else:
        proc = start_server([*QUICK, "--model", "slow_import:make"], results, cwd=user_code)
    try:
        deadline = time.monotonic() + 60
        while _probe_pid(user_code) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # until the checks are inside the user's import
        assert _probe_pid(user_code) is not None, proc.communicate(timeout=5)[1][-3000:]
        (os.killpg if to_group else os.kill)(proc.pid, signum)
        sent = time.monotonic()
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{signum.name} did not end the checks within 20 s (the import sleeps 60 s)")
        took_s = time.monotonic() - sent
    finally:
        kill_session(proc.pid)
    assert proc.returncode == 130, stderr[-3000:]
    assert took_s < 5, took_s
    lines = _messages(stderr)
    assert len(lines) == 1 and "interrupted" in lines[0] and signum.name in lines[0], lines
    assert stdout == "" and not results.exists()  # a run that never started: nothing written
    pid = _probe_pid(user_code)
    assert pid is not None and _gone(pid), "the import's process is still running"
    assert live_processes_in_session(proc.pid, grace_s=5) == []


def test_a_backend_still_importing_the_model_at_the_warm_up_limit_is_a_timeout_not_killed_by_the_stack_dump(
    user_code: Path,
) -> None:
    """The server dumps the stuck children's stacks (SIGUSR1, and SIGUSR2 for the backend's progress) before it stops
    them: a backend still importing the model has no handler for either yet, and must not die of it."""
    results = user_code / "results"
    before = shm_entries()
    argv = [*QUICK, "--model", "slow_the_second_time:make", "--timeout_s", "3", "--warmup_timeout_s", "5"]
    run = run_server(argv, results, timeout_s=90, cwd=user_code)
    assert (user_code / "imported_once").exists()  # the checks imported it quickly: the backend is the slow one
    assert run.returncode == 1, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "timeout", (row["status"], row["error"])
    assert "SIGUSR" not in row["error"] and "SIGUSR" not in run.stderr, row["error"]
    assert new_shm_entries(before) == set()
    assert live_processes_in_session(run.session_id) == []
    assert read_rows(results / "out.csv") == run.rows
