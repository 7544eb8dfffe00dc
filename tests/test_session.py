"""The one launcher (serverbench/launch/session.py): its command first in its log, ready or the one line saying why
not, a deadline that stops the command and every process it started, an interrupt that stops it and is raised
again, and piped output kept."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from serverbench.launch.session import Session

# A command that starts a grandchild in its session, writes both pids, says it is ready, then waits.
PARENT = """
import os, signal, subprocess, sys, time
# Interruptible even when started from a background job, where SIGINT starts ignored (as server.py and the tools do).
signal.signal(signal.SIGINT, signal.default_int_handler)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("pids", os.getpid(), child.pid, flush=True)
print("ready", flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended


def _pids(session: Session) -> list[int]:
    line = next(line for line in session.log_text().splitlines() if line.startswith("pids "))
    return [int(pid) for pid in line.split()[1:]]


def test_a_logged_command_is_ready_then_a_deadline_stops_it_and_all_it_started(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "parent.log"
    session = Session.logged([sys.executable, "-c", PARENT], log, tmp_path)
    assert session.wait_ready(lambda: "ready" in session.log_text().splitlines()[1:], 30, "parent") == ""
    assert log.read_text().splitlines()[0].startswith(sys.executable)  # the command first, to run it again
    pids = _pids(session)
    started = time.monotonic()
    ended = session.run_to_end(timeout_s=0.5, grace_s=1.0)  # SIGTERM kills the parent; its child goes with the session
    assert ended.timed_out and ended.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids) and time.monotonic() - started < 5


def test_a_command_that_ends_before_it_is_ready_says_its_status_and_last_line(tmp_path: Path) -> None:
    quits = "print('no model here'); raise SystemExit(3)"
    session = Session.logged([sys.executable, "-c", quits], tmp_path / "quits.log", tmp_path)
    assert session.wait_ready(lambda: False, 30, "the peer") == "the peer exited (3) before serving: no model here"
    slow = Session.logged([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "slow.log", tmp_path)
    try:
        assert session.wait_ready(lambda: False, 0.3, "the echo").startswith("the echo exited (3)")
        problem = slow.wait_ready(lambda: False, 0.3, "the slow one")
        assert problem == f"the slow one did not serve within 0.3 s (log: {tmp_path / 'slow.log'})"
    finally:
        assert slow.stop(signal.SIGTERM, 2.0) is None  # it ended on the signal: nothing was killed


def test_piped_output_is_kept_and_an_interrupt_stops_the_command_and_is_raised_again(tmp_path: Path) -> None:
    said = Session.piped([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"])
    ended = said.run_to_end(timeout_s=30, grace_s=1.0)
    assert (ended.returncode, ended.timed_out, ended.stdout, ended.stderr) == (0, False, "out\n", "err\n")
    merged = Session.piped([sys.executable, "-c", "import sys; print('err', file=sys.stderr)"], merge_stderr=True)
    assert merged.run_to_end(timeout_s=30, grace_s=1.0).stdout == "err\n"

    session = Session.logged([sys.executable, "-c", PARENT], tmp_path / "interrupted.log", tmp_path)
    assert session.wait_ready(lambda: "ready" in session.log_text().splitlines()[1:], 30, "parent") == ""
    pids = _pids(session)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.setitimer(signal.ITIMER_REAL, 0.3)  # Ctrl-C, in effect, while the caller waits
    try:
        with pytest.raises(KeyboardInterrupt):
            session.run_to_end(timeout_s=30, grace_s=1.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert session.poll() == -signal.SIGINT  # told to stop as an interrupt (Python's default: KeyboardInterrupt)
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)
