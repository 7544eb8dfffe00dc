"""server.py as the bench tools run it: from a checkout (this one, or a commit's worktree), with their flags, its row
appended to <results_dir>/<output_file>, in a session of its own that is stopped whole at a timeout or an interrupt."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from serverbench.launch import procutil
from serverbench.system.process import end_with_parent

ROOT = Path(__file__).resolve().parent.parent
# A backstop, not a measurement limit: server.py ends a stuck run itself (--timeout_s); the longest runs the tools
# make (a --find_peak search, an --aoti compile of a large model) take minutes.
SERVER_TIMEOUT_S = 7200.0
STOP_GRACE_S = 30.0  # a server told to stop ends its children within about 7 s and writes its row (sweep.py's too)


def server_command(
    flags: Sequence[str],
    results_dir: Path,
    output_file: str,
    checkout: Path = ROOT,
    python: str = sys.executable,
) -> list[str]:
    """The command line of one server.py run: `flags`, then where its row goes."""
    return [
        python,
        str(checkout / "server.py"),
        *flags,
        "--results_dir",
        str(results_dir),
        "--output_file",
        output_file,
    ]


@dataclass(frozen=True)
class ServerRun:
    command: list[str]
    returncode: int | None  # None: it could not be stopped (its session was killed and is still going)
    timed_out: bool  # stopped after the timeout; its row, if it wrote one, is partial
    stdout: str  # "" unless captured
    stderr: str  # "" unless captured
    output_path: Path

    def rows(self) -> pd.DataFrame:
        """Every row of the output file after this run, earlier runs' too (server.py appends); none when there is
        no file."""
        return pd.read_csv(self.output_path) if self.output_path.exists() else pd.DataFrame()


def run_server(
    flags: Sequence[str],
    results_dir: Path,
    output_file: str,
    *,
    checkout: Path = ROOT,
    timeout_s: float = SERVER_TIMEOUT_S,
    capture_output: bool = False,
    echo: bool = False,
) -> ServerRun:
    """One server.py run from `checkout` (its current folder too, where a factory is imported from). Its output is
    captured with `capture_output`; otherwise its stdout (the summary; the row holds it all) is dropped and its
    stderr (log lines, errors) goes to the terminal. `echo`: the command line is printed first. Past `timeout_s`,
    or on Ctrl-C (which reaches only this process: the server leads its own session), the server is told to stop
    as an interrupt would, so that it writes its row, and is killed with its session when it does not within
    STOP_GRACE_S; Ctrl-C is then raised again here."""
    command = server_command(flags, results_dir, output_file, checkout)
    if echo:
        print(f"$ {shlex.join(command)}", flush=True)
    proc = subprocess.Popen(
        command,
        cwd=checkout,
        stdout=subprocess.PIPE if capture_output else subprocess.DEVNULL,
        stderr=subprocess.PIPE if capture_output else None,
        text=True,
        errors="replace",
        start_new_session=True,  # a timeout stops the server's whole session: its children too
        preexec_fn=end_with_parent(signal.SIGTERM),  # and a tool killed outright takes its server with it
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        procutil.stop_session(proc, signal.SIGTERM, STOP_GRACE_S)
        stdout, stderr = _rest_of_output(proc)
    except KeyboardInterrupt:
        procutil.stop_session(proc, signal.SIGINT, STOP_GRACE_S)
        raise
    return ServerRun(command, proc.poll(), timed_out, stdout or "", stderr or "", Path(results_dir) / output_file)


def _rest_of_output(proc: subprocess.Popen) -> tuple[str | None, str | None]:
    """What a stopped server wrote that was not read yet; nothing when a process outside its session still holds
    the pipes open past the grace."""
    try:
        return proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        return None, None
