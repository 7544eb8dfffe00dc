"""server.py as the bench tools run it: from a checkout (this one, or a commit's worktree), with their flags, its row
appended to <results_dir>/<output_file>, in a session of its own that is stopped whole at a timeout or an interrupt.
A server up for several runs is started the same way (start_served, stop_served). How a
tool stops on Ctrl-C or SIGTERM (interruptible), its server flags checked as server.py checks them, before any run
(check_server_flags)."""

from __future__ import annotations

import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from serverbench.config.build import build_config
from serverbench.config.flags import ConfigError, RaisingParser
from serverbench.config.options import add_cli_args
from serverbench.launch.outcome import EXIT_INTERRUPTED
from serverbench.launch.session import Session, last_line
from serverbench.launch.study import CellRefused
from serverbench.launch.study_checks import check_tool_run

ROOT = Path(__file__).resolve().parent.parent
# A backstop, not a measurement limit: server.py ends a stuck run itself (--timeout_s); the longest runs the tools
# make (a --find_peak search, an --aoti compile of a large model) take minutes.
SERVER_TIMEOUT_S = 7200.0
STOP_GRACE_S = 30.0  # a server told to stop ends its children within about 7 s and writes its row (sweep.py's too)
# The flags of a tool's runs against a server are checked (as server.py checks them, nothing contacted) before any
# server has its port: this address stands in for it.
FLAG_CHECK_ADDRESS = "127.0.0.1:1"


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

    @property
    def said(self) -> str:
        """The last line it wrote on stderr (its one-line refusal or failure), when captured."""
        return last_line(self.stderr) or "no output"


def _rows(path: Path) -> pd.DataFrame:
    """A CSV a run appends to (empty when it is missing, or cut by a crash mid-row)."""
    try:
        return pd.read_csv(path) if path.exists() else pd.DataFrame()
    except (OSError, ValueError):
        return pd.DataFrame()


def rows_in(path: Path) -> int:
    """How many rows a CSV a run appends to holds."""
    return len(_rows(path))


def row_added(path: Path, before: int) -> dict[str, object] | None:
    """The row a run appended to `path` when it held `before` rows; None when it appended none."""
    rows = _rows(path)
    return rows.iloc[-1].to_dict() if len(rows) > before else None


def run_logged(
    flags: Sequence[str], out: Path, output_file: str, log_path: Path, timeout_s: float, checkout: Path = ROOT
) -> ServerRun:
    """A study's own server.py run (run_server, its output captured) with its command line and output in log_path;
    CellRefused on exit 2: every other run with these flags would be refused alike."""
    ran = run_server(flags, out, output_file, checkout=checkout, timeout_s=timeout_s, capture_output=True)
    log_path.write_text(f"$ {shlex.join(ran.command)}\n{ran.stdout}{ran.stderr}")
    if ran.returncode == 2:
        raise CellRefused(f"server.py refused its flags: {ran.said}")
    return ran


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
    STOP_GRACE_S; Ctrl-C is then raised again here. A server that was interrupted otherwise (exit 130) raises
    Interrupted: whoever stopped it meant the tool too."""
    command = server_command(flags, results_dir, output_file, checkout)
    if echo:
        print(f"$ {shlex.join(command)}", flush=True)
    ended = Session.piped(command, checkout, capture=capture_output).run_to_end(timeout_s, STOP_GRACE_S)
    if ended.returncode in INTERRUPTED_EXITS and not ended.timed_out:
        raise Interrupted(f"server.py exit {ended.returncode}")
    return ServerRun(command, ended.returncode, ended.timed_out, ended.stdout or "", ended.stderr or "")


def run_target(
    flags: Sequence[str], out: Path, output_file: str, log_path: Path, timeout_s: float
) -> dict[str, object]:
    """One server.py run of our generator against someone's server (`flags` hold its --target), its output in
    log_path and its row appended to <out>/<output_file>: ok, error, p50, p99, requests/s (achieved), requests,
    wall time and run_id as a line of a bench tool's runs.csv."""
    before = rows_in(out / output_file)
    start_s = time.monotonic()
    ran = run_server(flags, out, output_file, timeout_s=timeout_s, capture_output=True, echo=True)
    wall_s = time.monotonic() - start_s
    log_path.write_text(ran.stdout + ran.stderr, encoding="utf-8")
    row = row_added(out / output_file, before)
    if row is None:
        why = "timed out" if ran.timed_out else f"exit {ran.returncode}"
        return {"ok": False, "error": f"server.py --target {why}, no row: {ran.said}", "wall_s": wall_s}
    ok = ran.returncode == 0 and row["status"] == "ok"
    why = row.get("error")
    error = "" if ok else f"{row['status']}: {'' if pd.isna(why) else why} (exit {ran.returncode})"
    found = {name: row.get(name) for name in ("p50_latency_s", "p99_latency_s")}
    found |= {"throughput_rps": row.get("achieved_rate_rps"), "requests": row.get("responses_received")}
    return {"ok": ok, "error": error, **found, "wall_s": wall_s, "detail": str(row.get("run_id", ""))}


def start_served(
    command: Sequence[str], log_path: Path, ready: Callable[[Session], bool], what: str, timeout_s: float
) -> tuple[Session, str]:
    """A server up for several runs (ours with --serve_only, a peer, the echo): `command` in a session of its own
    (Ctrl-C reaches the tool only; a tool killed outright takes it along), its output in log_path, once
    ready(session) holds within timeout_s. The session, and "" or the one line saying why it does not serve (it is
    stopped then: it ended first, or the deadline passed). An interrupt while it starts stops it too."""
    print(f"$ {shlex.join(command)}", flush=True)
    session = Session.logged(command, log_path, ROOT)
    try:
        problem = session.wait_ready(lambda: ready(session), timeout_s, what)
    except BaseException:
        session.stop(signal.SIGTERM, STOP_GRACE_S)
        raise
    if problem:
        stop_served(session, what)  # what it started (tritonserver, stubs, our backend) goes with it
    return session, problem


def stop_served(session: Session, what: str, grace_s: float = STOP_GRACE_S) -> str:
    """SIGTERM to the server alone (ours, PyTriton, KServe and the echo each answer what is in flight, end their own
    children and exit 0; ours writes its row), its session killed when it has not ended within grace_s; "" or the
    one line saying what went wrong."""
    if session.stop(signal.SIGTERM, grace_s) is not None:
        return f"{what} did not stop within {grace_s:g} s of SIGTERM: killed"
    if (code := session.poll()) != 0:
        return f"{what} exit {code}: {last_line(session.log_text())}"
    return f"{what} left processes running after it ended: killed" if session.left_behind else ""


# How a server that was interrupted ends: 130 as it says, or killed by SIGINT before its handler was set.
INTERRUPTED_EXITS = (EXIT_INTERRUPTED, -signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """A server run the tool ran was interrupted (someone stopped it): the tool stops as at its own Ctrl-C."""


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interruptible(prog: str, work: Callable[[], int], kept: str = "") -> int:
    """A bench tool's `work` with Ctrl-C and SIGTERM raised as KeyboardInterrupt, even when the tool started with
    SIGINT ignored (`&` in a script): the server in flight is stopped as an interrupt (run_server, the study
    runner), and the tool says so in one line (`kept`: what stays, e.g. the rows so far) and exits 130, as
    server.py and sweep.py do. An interrupted server stops it the same way; a run whose flags
    server.py refused (which the checks before the first run could not see) ends it with one line and exit 1."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return work()
    except CellRefused as exc:  # a run's flags that the checks before the first run could not see
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        for signum in previous:  # a second Ctrl-C now would only cut this line short
            signal.signal(signum, signal.SIG_IGN)
        print(f"{prog}: interrupted{kept}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, handler)


def check_server_flags(
    commands: Iterable[Sequence[str]], what: str = "the server flags after --", serves: bool = False
) -> None:
    """Each server.py command line a tool will run (its flags; the tool adds where the row goes) as server.py's own
    parser and build_config take it, before any run; ConfigError naming the first refusal and `what` gave it."""
    parser = RaisingParser(prog="server.py")
    add_cli_args(parser)  # server.py's parser (server.build_parser) is this, with a one-line error that exits
    for flags in commands:
        try:
            check_tool_run(build_config(parser.parse_args(list(flags))), serves)
        except ConfigError as exc:
            raise ConfigError(f"{what}: server.py would refuse them: {exc}") from None
