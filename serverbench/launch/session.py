"""The one launcher of a command that serves or drives servers (server.py, a peer server, perf_analyzer, a sweep,
pytest) from a tool: in a session of its own, so that a deadline or an interrupt stops it whole with its children;
ended with its parent, even one killed outright; its output in a log file (its command as the first line, to run it
again) or in pipes; ready when a condition holds within a deadline; stopped by a signal to it alone (it then stops
its own children and writes what it has), its session killed when it has not ended within a grace."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from serverbench.launch.procutil import stop_session
from serverbench.system.process import end_with_parent, last_line

READY_POLL_S = 0.2
STOP_GRACE_S = 30.0  # a server told to stop ends its children within about 7 s and writes its row


@dataclass
class Ended:
    """How a command run to its end ended: its exit status (None: still running after the kill, which does not
    happen with a session of its own), whether the deadline stopped it, and what it wrote where piped."""

    returncode: int | None
    timed_out: bool
    stdout: str | None = None
    stderr: str | None = None


class Session:
    """A command started in a session of its own (`logged` or `piped`)."""

    def __init__(self, proc: subprocess.Popen, log_path: Path | None) -> None:
        self.proc = proc
        self.log_path = log_path
        self.left_behind = False  # stop() found processes of its session still running after it ended

    @classmethod
    def logged(
        cls,
        cmd: Sequence[str],
        log_path: Path,
        cwd: Path,
        env: Mapping[str, str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> Session:
        """Its stdout and stderr into `log_path` after its command line; `env` is added to this process's and
        `pass_fds` are inherited. No pipe to drain: it may run as long as it likes."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w", encoding="utf-8") as log:
            log.write(shlex.join(map(str, cmd)) + "\n")
            log.flush()
            proc = subprocess.Popen(
                list(map(str, cmd)),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else {**os.environ, **env},
                start_new_session=True,  # a deadline stops its whole session: its children too
                preexec_fn=end_with_parent(signal.SIGTERM),  # and a caller killed outright takes it along
                pass_fds=tuple(pass_fds),
            )
        return cls(proc, log_path)

    @classmethod
    def piped(
        cls,
        cmd: Sequence[str],
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        merge_stderr: bool = False,
    ) -> Session:
        """Its output in pipes (stderr into stdout with merge_stderr). `env` replaces this process's."""
        proc = subprocess.Popen(
            list(map(str, cmd)),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            env=None if env is None else dict(env),
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=end_with_parent(signal.SIGTERM),
        )
        return cls(proc, None)

    def poll(self) -> int | None:
        return self.proc.poll()

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path else ""

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float, what: str) -> str:
        """Waits until `ready()`: "" then, else the one line saying why not (it ended first: its exit status and its
        log's last line; or the deadline passed). It is left running either way: the caller stops it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return ""
            if self.proc.poll() is not None:
                return f"{what} exited ({self.proc.returncode}) before serving: {last_line(self.log_text())}"
            time.sleep(READY_POLL_S)
        where = f" (log: {self.log_path})" if self.log_path else ""
        return f"{what} did not serve within {timeout_s:g} s{where}"

    @classmethod
    def serving(
        cls,
        cmd: Sequence[str],
        log_path: Path,
        cwd: Path,
        ready: Callable[[Session], bool],
        what: str,
        timeout_s: float,
    ) -> tuple[Session, str]:
        """A server up for several runs (ours with --serve_only, a peer, the echo), logged, once ready(session)
        holds within timeout_s: the session, and "" or the one line saying why it does not serve (it is stopped
        then: it ended first, or the deadline passed). An interrupt while it starts stops it too."""
        session = cls.logged(cmd, log_path, cwd)
        try:
            problem = session.wait_ready(lambda: ready(session), timeout_s, what)
        except BaseException:
            session.stop(signal.SIGTERM, STOP_GRACE_S)
            raise
        if problem:
            session.stop_served(what)  # what it started (tritonserver, stubs, our backend) goes with it
        return session, problem

    def stop_served(self, what: str, grace_s: float = STOP_GRACE_S) -> str:
        """SIGTERM to a server started by `serving` (it answers what is in flight, ends its own children and exits
        0; ours writes its row), its session killed when it has not ended within grace_s; "" or the one line
        saying what went wrong."""
        if self.stop(signal.SIGTERM, grace_s) is not None:
            return f"{what} did not stop within {grace_s:g} s of SIGTERM: killed"
        if (code := self.poll()) != 0:
            return f"{what} exit {code}: {last_line(self.log_text())}"
        return f"{what} left processes running after it ended: killed" if self.left_behind else ""

    def stop(self, signum: int, grace_s: float) -> list[str] | None:
        """`signum` to it alone, up to grace_s to end; else its session killed (procutil.stop_session): None when
        it ended, else the shared-memory names unlinked after it. Either way nothing of its session is left: what
        it started and left running after it ended is killed after another grace_s (`left_behind` says so)."""
        killed = None if self.proc.poll() is not None else stop_session(self.proc, signum, grace_s)
        self.left_behind = self._end_session(grace_s)
        return killed

    def _end_session(self, grace_s: float) -> bool:
        """Whether processes of its session were still there grace_s after it ended; they are killed then."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return False
            time.sleep(0.05)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def run_to_end(self, timeout_s: float, grace_s: float, timeout_signal: int = signal.SIGTERM) -> Ended:
        """Waits for its end. Past timeout_s it gets `timeout_signal` (then its session is killed after grace_s);
        an interrupt here (Ctrl-C, or SIGTERM raised as one) stops it with SIGINT and is raised again."""
        piped = self.proc.stdout is not None
        try:
            if piped:
                stdout, stderr = self.proc.communicate(timeout=timeout_s)
                return Ended(self.proc.returncode, False, stdout, stderr)
            return Ended(self.proc.wait(timeout=timeout_s), False)
        except subprocess.TimeoutExpired:
            self.stop(timeout_signal, grace_s)
            stdout, stderr = self._rest(grace_s) if piped else (None, None)
            return Ended(self.proc.poll(), True, stdout, stderr)
        except KeyboardInterrupt:
            self.stop(signal.SIGINT, grace_s)
            raise

    def _rest(self, grace_s: float) -> tuple[str | None, str | None]:
        """What a stopped command wrote that was not read yet; nothing when a process outside its session still
        holds the pipes open past the grace."""
        try:
            return self.proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return None, None
