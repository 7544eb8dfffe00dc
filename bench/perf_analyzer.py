"""Triton's C++ load generator perf_analyzer (from tritonclient 2.40.0) for the benchmark scripts: bring it, build its
command line, run it and read its CSV in seconds.

    binary = ensure_perf_analyzer()  # runs tools/perf_analyzer.sh once; PerfAnalyzerMissing when it cannot
    result = run_perf_analyzer(PerfAnalyzerRun(model="echo", url="127.0.0.1:8000", csv_file=..., ...))

The binary lives in .tools/perf_analyzer/bin with its two libraries in .tools/perf_analyzer/lib (libb64.so.0d and
libcudart.so.12; it runs without a GPU), so it needs perf_analyzer_env()'s LD_LIBRARY_PATH. A failed run is data
(ok False, error: one line); only a perf_analyzer that cannot be brought raises.

What it asks of a server over HTTP (seen on a fake one, tests/test_perf_analyzer_tool.py): GET /v2/models/{m}
(metadata: the "name" there is the one it puts in the URLs below), GET /v2/models/{m}/config (max_batch_size), GET
/v2 (server metadata: "statistics" in "extensions" turns the server-side columns on), GET /v2/models/{m}/stats
(before the first measurement window and after each, only with that extension) and POST /v2/models/{m}/infer.
A single failed request ends the run.
"""

from __future__ import annotations

import csv
import functools
import os
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from serverbench.config.transport_kinds import HTTP, NETWORK_TRANSPORTS
from serverbench.launch.session import Session
from serverbench.system.process import last_line

ROOT = Path(__file__).resolve().parent.parent
PERF_ANALYZER_DIR = ROOT / ".tools" / "perf_analyzer"
SETUP_SCRIPT = ROOT / "tools" / "perf_analyzer.sh"
LIBRARIES = ("libb64.so.0d", "libcudart.so.12")
SETUP_TIMEOUT_S = 300.0  # two wheels (13 MB) and a 10 kB .deb; seconds on a good link
KILL_GRACE_S = 3.0  # after SIGINT at a timeout, before SIGKILL: perf_analyzer may still print what it measured
US_PER_S = 1e6

# perf_analyzer's -f CSV: every latency column is an integer number of microseconds (truncated), Inferences/Second
# is inferences (requests x batch size) per second. The server columns exist only when the server lists the
# "statistics" extension in GET /v2; "Network+Server Send/Recv" is the client's wait minus the server's queue and
# compute, so it holds the server's own overhead too.
LATENCY_COLUMNS_US = {
    "p50_latency_s": "p50 latency",
    "p90_latency_s": "p90 latency",
    "p95_latency_s": "p95 latency",
    "p99_latency_s": "p99 latency",
    "client_send_s": "Client Send",
    "client_recv_s": "Client Recv",
    "network_server_s": "Network+Server Send/Recv",
    "server_queue_s": "Server Queue",
    "server_compute_input_s": "Server Compute Input",
    "server_compute_infer_s": "Server Compute Infer",
    "server_compute_output_s": "Server Compute Output",
}
THROUGHPUT_COLUMN = "Inferences/Second"
# What perf_analyzer prints when something went wrong: "error: ...", "Thread [0] had error: ...", "Failed to obtain
# stable measurement ...", "Pass [2] cb::Error: ...", "terminate called after throwing ...". Its one warning ("Server
# average accounted time was larger than client average wait time ...") matches none of them.
FAILURE_LINE = re.compile(r"error|fail|terminate called|what\(\)|abort", re.IGNORECASE)
# A request-rate run whose sending threads fell behind the schedule says so once, over its stable windows.
DELAYED_LINE = re.compile(r"not able to keep up with the desired request rate\. ([\d.]+)% of the requests were delayed")


# tritonclient's gRPC client shares a channel (one HTTP/2 connection) among this many clients, 6 by default. Our
# generator sends every request in flight on one channel, so a study asks perf_analyzer to do the same.
GRPC_SHARE_ENV = "TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT"


class PerfAnalyzerMissing(Exception):
    """perf_analyzer could not be brought; the message is tools/perf_analyzer.sh's one line saying why."""


def perf_analyzer_binary() -> Path:
    return PERF_ANALYZER_DIR / "bin" / "perf_analyzer"


def perf_analyzer_lib_dir() -> Path:
    return PERF_ANALYZER_DIR / "lib"


def perf_analyzer_ready() -> bool:
    """The binary and both libraries are in place (the script puts each there whole, by a rename)."""
    lib_dir = perf_analyzer_lib_dir()
    return os.access(perf_analyzer_binary(), os.X_OK) and all((lib_dir / name).is_file() for name in LIBRARIES)


def _run_in_session(argv: Sequence[str], env: dict[str, str] | None, timeout_s: float) -> tuple[int, str, bool]:
    """(exit status, stdout and stderr together, timed out) of a command in its own session (the one launcher), so
    that a timeout ends all of it (pip's children too): SIGINT first, its session killed after KILL_GRACE_S."""
    session = Session.piped(argv, env=env, merge_stderr=True)
    ended = session.run_to_end(timeout_s, KILL_GRACE_S, timeout_signal=signal.SIGINT)
    return -1 if ended.returncode is None else ended.returncode, ended.stdout or "", ended.timed_out


def ensure_perf_analyzer() -> Path:
    """The perf_analyzer binary, brought by tools/perf_analyzer.sh when it is missing."""
    if perf_analyzer_ready():
        return perf_analyzer_binary()
    try:
        status, output, timed_out = _run_in_session(["sh", str(SETUP_SCRIPT)], None, SETUP_TIMEOUT_S)
    except OSError as exc:  # no sh: the reason is the exception's own line
        raise PerfAnalyzerMissing(f"{SETUP_SCRIPT.name} could not start: {exc}") from exc
    if timed_out:
        raise PerfAnalyzerMissing(f"{SETUP_SCRIPT.name} did not finish within {SETUP_TIMEOUT_S:g} s")
    if status != 0 or not perf_analyzer_ready():
        # The script's failure is one line on stderr, the last of its output.
        raise PerfAnalyzerMissing(last_line(output) or f"{SETUP_SCRIPT.name} exited with status {status}")
    return perf_analyzer_binary()


def bring_problem() -> str | None:
    """Why perf_analyzer cannot be brought (ensure_perf_analyzer), else None."""
    try:
        ensure_perf_analyzer()
    except PerfAnalyzerMissing as exc:
        return f"perf_analyzer cannot be brought: {exc}"
    return None


def perf_analyzer_env() -> dict[str, str]:
    """os.environ with the cached libraries first on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    existing = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(perf_analyzer_lib_dir()), *([existing] if existing else [])])
    return env


@functools.cache
def perf_analyzer_version() -> str:
    """Its own line, from `perf_analyzer --version` ("?" when it says nothing); RuntimeError when it does not
    answer (not cached: the next run asks again)."""
    _, output, timed_out = _run_in_session([str(ensure_perf_analyzer()), "--version"], perf_analyzer_env(), 30.0)
    if timed_out:
        raise RuntimeError("perf_analyzer --version did not answer within 30 s")
    return last_line(output) or "?"


@dataclass(frozen=True)
class PerfAnalyzerRun:
    """One perf_analyzer run at one concurrency (or one Poisson request rate). Measurement windows: time windows of
    measurement_interval_ms, or, when measurement_request_count is set, count windows of at least that many requests
    (perf_analyzer checks the count once a second, so each such window lasts at least 1 s). The run ends when the
    last 3 windows agree within stability_percentage on both throughput and mean latency (its default; judged on p99
    with --percentile=99, three windows of p99 within 10 % were not reached in 6 of 36 runs on a 2-core VM), or fails
    after max_trials windows."""

    model: str
    url: str  # host:port, no scheme
    csv_file: Path
    profile_export_file: Path
    protocol: str = "http"  # or "grpc"
    concurrency: int = 1
    # Poisson arrivals at this many requests/s instead of a closed loop at `concurrency` (--request-rate-range, with
    # --max-threads sending threads: perf_analyzer needs one per request it has in flight at once)
    request_rate: float | None = None
    max_threads: int = 16
    batch_size: int = 1
    measurement_interval_ms: int = 5000
    measurement_request_count: int | None = None
    max_trials: int = 10
    stability_percentage: float = 10.0
    binary: bool = True  # HTTP: tensors as binary after the JSON header (Triton's extension), else JSON "data"
    shape: Sequence[str] = field(default_factory=tuple)  # "name:1,2,3" per input with a dynamic dimension
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))  # frozen means frozen: no list shared with the caller
        if self.protocol not in NETWORK_TRANSPORTS:
            raise ValueError(f"protocol must be http or grpc, not {self.protocol!r}")
        if "://" in self.url or ":" not in self.url:
            raise ValueError(f"url must be host:port (perf_analyzer adds the scheme), not {self.url!r}")
        if min(self.concurrency, self.batch_size, self.max_trials, self.measurement_interval_ms) < 1:
            raise ValueError("concurrency, batch_size, max_trials and measurement_interval_ms must be >= 1")
        if self.measurement_request_count is not None and self.measurement_request_count < 1:
            raise ValueError("measurement_request_count must be >= 1")
        if self.request_rate is not None and not (self.request_rate > 0 and self.max_threads >= 1):
            raise ValueError("request_rate must be > 0 and max_threads >= 1")

    def command(self, binary_path: Path) -> list[str]:
        """perf_analyzer's argv (flags as its 2.40.0 usage text spells them)."""
        if self.measurement_request_count is None:
            window = ["--measurement-mode", "time_windows", "-p", str(self.measurement_interval_ms)]
        else:
            window = ["--measurement-mode", "count_windows", "--measurement-request-count"]
            window.append(str(self.measurement_request_count))
        if self.request_rate is None:
            load = ["--concurrency-range", f"{self.concurrency}:{self.concurrency}"]
        else:
            rate = f"{self.request_rate:g}"
            load = ["--request-rate-range", f"{rate}:{rate}", "--request-distribution", "poisson"]
            load += ["--max-threads", str(self.max_threads)]
        argv = [
            str(binary_path),
            *("-m", self.model, "-u", self.url, "-i", self.protocol),
            *load,
            *("-b", str(self.batch_size)),
            *window,
            *("--max-trials", str(self.max_trials), "-s", f"{self.stability_percentage:g}"),
            *("-f", str(self.csv_file), "--profile-export-file", str(self.profile_export_file)),
            "-v",  # one line per measurement window: what an unstable run saw
        ]
        if self.protocol == HTTP.name:
            # 2.40.0 follows --input-tensor-format for the outputs too (it asks binary_data: false for JSON inputs);
            # both are given so that the request says what we mean on a release that reads the second.
            tensor_format = "binary" if self.binary else "json"
            argv += [f"--input-tensor-format={tensor_format}", f"--output-tensor-format={tensor_format}"]
        for shape in self.shape:
            argv += ["--shape", shape]
        return argv


@dataclass(frozen=True)
class PerfAnalyzerResult:
    """One run's figures in seconds (None when absent: a failed run, or server columns from a server without the
    statistics extension). ok: exit status 0, no failure line in its output and a CSV row with a throughput."""

    ok: bool
    error: str  # one line; "" when ok
    returncode: int  # 0, 2 (unstable), 99 (any other failure); -6: it aborted itself, -2/-9: our timeout
    error_count: int  # failure lines in its output
    delayed_pct: float | None  # request rate: the share of requests sent late (0.0 when on time); None in a closed loop
    throughput_per_s: float | None  # inferences per second
    p50_latency_s: float | None
    p90_latency_s: float | None
    p95_latency_s: float | None
    p99_latency_s: float | None
    client_send_s: float | None
    client_recv_s: float | None
    network_server_s: float | None
    server_queue_s: float | None
    server_compute_input_s: float | None
    server_compute_infer_s: float | None
    server_compute_output_s: float | None
    stdout: str  # stdout and stderr together
    command: tuple[str, ...]
    wall_s: float
    csv_file: Path
    profile_export_file: Path


def parse_csv(path: Path | str) -> dict[str, float]:
    """The one data row of perf_analyzer's -f CSV, by its column names, as numbers in its units (microseconds for
    latencies, inferences/s for "Inferences/Second"); {} for a header alone. ValueError for anything else."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if len(rows) > 1:
        raise ValueError(f"{path}: {len(rows)} rows; a run at one concurrency writes one")
    if not rows:
        return {}
    row = rows[0]
    if None in row or None in row.values():
        raise ValueError(f"{path}: the row and the header have different lengths")
    try:
        return {name.strip(): float(value) for name, value in row.items()}
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def delayed_pct(output: str) -> float:
    """The share of requests perf_analyzer sent later than its schedule (its warning's last figure), 0.0 without
    the warning. Its latency counts from the late send, so such a run's latency leaves that delay out."""
    found = DELAYED_LINE.findall(output)
    return float(found[-1]) if found else 0.0


def _failure_lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if FAILURE_LINE.search(line)]


def _failure_summary(failures: list[str]) -> str:
    """The last two distinct failure lines in one: the general one ("Failed to ...", "terminate called ...") is
    often followed by the one with the cause ("Thread [0] had error: ...", "what(): ...")."""
    distinct = list(dict.fromkeys(failures))
    return " / ".join(distinct[-2:])


def _figures(row: dict[str, float]) -> dict[str, float | None]:
    figures: dict[str, float | None] = {"throughput_per_s": row.get(THROUGHPUT_COLUMN)}
    for name, column in LATENCY_COLUMNS_US.items():
        figures[name] = row[column] / US_PER_S if column in row else None
    return figures


def run_perf_analyzer(run: PerfAnalyzerRun) -> PerfAnalyzerResult:
    """Runs perf_analyzer (brought when missing) under run.timeout_s; a failure is in the result, never raised."""
    argv = run.command(ensure_perf_analyzer())
    for path in (run.csv_file, run.profile_export_file):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # an old file must not pass for this run's
    start_s = time.monotonic()
    status, output, timed_out = _run_in_session(argv, perf_analyzer_env(), run.timeout_s)
    wall_s = time.monotonic() - start_s
    failures = _failure_lines(output)
    row: dict[str, float] = {}
    error = ""
    if run.csv_file.is_file():
        try:
            row = parse_csv(run.csv_file)
        except (OSError, ValueError) as exc:  # a CSV cut short (a killed run) is a failed run, said in one line
            error = f"unreadable CSV: {exc}"
    if timed_out:
        error = f"perf_analyzer did not finish within {run.timeout_s:g} s (killed)"
    elif status != 0:
        error = _failure_summary(failures) if failures else f"perf_analyzer exited: {last_line(output)}"
        error = f"{error} (exit status {status})"
    elif failures:
        error = _failure_summary(failures)
    elif not error and row.get(THROUGHPUT_COLUMN) is None:
        error = f"perf_analyzer wrote no result row to {run.csv_file}"
    return PerfAnalyzerResult(
        ok=not error,
        error=error,
        returncode=status,
        error_count=len(failures),
        delayed_pct=delayed_pct(output) if run.request_rate is not None else None,
        **_figures(row),
        stdout=output,
        command=tuple(argv),
        wall_s=wall_s,
        csv_file=run.csv_file,
        profile_export_file=run.profile_export_file,
    )
