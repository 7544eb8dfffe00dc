"""perf_analyzer (Triton's C++ load generator, tritonclient 2.40.0) on this machine: tools/perf_analyzer.sh brings it
once per machine into a cache that each checkout links to and is a no-op after (fast, nothing changed; another
checkout only links), its failure is one line that ensure_perf_analyzer raises; the argv
that PerfAnalyzerRun builds uses only flags the binary's usage text lists; a real run against a fake Open Inference
Protocol server (standard library, below) gives a throughput and latencies, and the fake server's log pins what
perf_analyzer asks of a server. A machine where the binary cannot be brought fails these tests with the script's
reason: they are never skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import bench.perf_analyzer as pa
from bench.perf_analyzer import (
    PerfAnalyzerMissing,
    PerfAnalyzerRun,
    ensure_perf_analyzer,
    parse_csv,
    perf_analyzer_env,
    run_perf_analyzer,
)

SCRIPT = pa.SETUP_SCRIPT
SCRIPT_TIMEOUT_S = 300
CACHED_RUN_MAX_S = 1.0
CACHE_FILES = {".stamp", "bin/perf_analyzer", "lib/libb64.so.0d", "lib/libcudart.so.12"}
# An index that cannot answer, and no pip configuration that could name another: the download must fail, fast.
NO_INDEX_ENV = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0"}
NO_INDEX_ENV["PIP_TIMEOUT"] = "2"

# The fake server's model: x (FP32, 4 per row) in, the same bytes out as y; batches up to 8.
MODEL = "echo"
METADATA = {
    "name": MODEL,
    "versions": ["1"],
    "platform": "fake",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
}
CONFIG = {
    "name": MODEL,
    "max_batch_size": 8,
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
}
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


class FakeServer(ThreadingHTTPServer):
    """Just enough of Triton's HTTP endpoints for perf_analyzer, with a log of (method, path) of every request."""

    daemon_threads = True  # a hanging infer must not hold up the test's end

    def __init__(self, extensions: list[str], infer_mode: str = "echo") -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.extensions = extensions
        self.infer_mode = infer_mode  # echo | fail (500 with an error) | hang (until the test ends)
        self.lock = threading.Lock()
        self.log: list[tuple[str, str]] = []
        self.request_count = 0
        self.inference_count = 0  # rows: requests x batch size
        self.infer_ns = 0
        self.released = threading.Event()

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a killed perf_analyzer breaks its connections
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def requests(self) -> Counter[tuple[str, str]]:
        with self.lock:
            return Counter(self.log)

    def stats(self) -> dict:
        """GET /v2/models/echo/stats in Triton's shape: counts and ns as integers, the version as a string; the
        durations count requests (perf_analyzer's averages are ns / count), inference_count counts rows."""
        with self.lock:
            count, rows, ns = self.request_count, self.inference_count, self.infer_ns
        parts = {"queue": ns // 10, "compute_input": ns // 10, "compute_infer": ns // 2, "compute_output": ns // 10}
        durations = {name: {"count": count, "ns": parts.get(name, ns)} for name in DURATIONS}
        durations["fail"] = durations["cache_hit"] = durations["cache_miss"] = {"count": 0, "ns": 0}
        model = {"name": MODEL, "version": "1", "last_inference": 0, "inference_count": rows}
        model |= {"execution_count": count, "inference_stats": durations, "batch_stats": []}
        return {"model_stats": [model]}


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer
    protocol_version = "HTTP/1.1"  # perf_analyzer keeps its connections
    disable_nagle_algorithm = True  # headers and body are two writes: without this, 40 ms delayed ACKs per request

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _record(self) -> None:
        with self.server.lock:
            self.server.log.append((self.command, self.path))

    def _send(self, status: int, body: bytes, content_type: str, header_length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if header_length is not None:
            self.send_header("Inference-Header-Content-Length", str(header_length))
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, document: object, status: int = 200) -> None:
        self._send(status, json.dumps(document).encode(), "application/json")

    def do_GET(self) -> None:
        self._record()
        documents = {
            "/v2": {"name": "fake", "version": "1", "extensions": self.server.extensions},
            "/v2/health/live": {},
            "/v2/health/ready": {},
            f"/v2/models/{MODEL}": METADATA,
            f"/v2/models/{MODEL}/ready": {},
            f"/v2/models/{MODEL}/config": CONFIG,
        }
        if self.path == f"/v2/models/{MODEL}/stats":
            self._send_json(self.server.stats())
        elif self.path in documents:
            self._send_json(documents[self.path])
        else:
            self._send_json({"error": f"no {self.path}"}, 404)

    def do_POST(self) -> None:
        self._record()
        start_ns = time.perf_counter_ns()
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != f"/v2/models/{MODEL}/infer":
            return self._send_json({"error": f"no {self.path}"}, 404)
        if self.server.infer_mode == "fail":
            return self._send_json({"error": "boom: the fake server fails every inference"}, 500)
        if self.server.infer_mode == "hang":
            self.server.released.wait(30)
            return self._send_json({"error": "released"}, 503)
        header_length = int(self.headers.get("Inference-Header-Content-Length", len(body)))
        request = json.loads(body[:header_length])
        (tensor,) = request["inputs"]
        output = {"name": "y", "datatype": "FP32", "shape": tensor["shape"]}
        # "id" always: perf_analyzer's async mode fails on an answer without one.
        answer: dict = {"model_name": MODEL, "model_version": "1", "id": request.get("id", ""), "outputs": [output]}
        wants_binary = all(o.get("parameters", {}).get("binary_data") for o in request.get("outputs", [{}]))
        if "data" in tensor:
            raw = struct.pack(f"<{len(tensor['data'])}f", *tensor["data"])
        else:
            raw = body[header_length : header_length + tensor["parameters"]["binary_data_size"]]
        if wants_binary:
            output["parameters"] = {"binary_data_size": len(raw)}
            header = json.dumps(answer).encode()
            self._send(200, header + raw, "application/octet-stream", len(header))
        else:
            # No "parameters" on a JSON output: perf_analyzer fails on one without binary_data_size (unless empty).
            output["data"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
            self._send_json(answer)
        with self.server.lock:
            self.server.request_count += 1
            self.server.inference_count += tensor["shape"][0]
            self.server.infer_ns += time.perf_counter_ns() - start_ns


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    extensions, infer_mode = getattr(request, "param", (["statistics"], "echo"))
    server = FakeServer(extensions, infer_mode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.released.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def run_script(script: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    start_s = time.monotonic()
    proc = subprocess.run(
        ["sh", str(script)], capture_output=True, text=True, env=env, timeout=SCRIPT_TIMEOUT_S, cwd="/"
    )
    return proc, time.monotonic() - start_s


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    """The binary, brought by the script (a minute at most the first time); a failure is the script's line."""
    proc, _ = run_script(SCRIPT)
    if proc.returncode != 0:
        pytest.fail(proc.stderr.strip() or f"{SCRIPT} exited with status {proc.returncode}", pytrace=False)
    return ensure_perf_analyzer()


def cache_state() -> dict[str, tuple[int, int, int]]:
    """Every file in the cache (hidden ones too): size, modification time and inode."""
    files = (path for path in pa.PERF_ANALYZER_DIR.rglob("*") if path.is_file())
    return {
        str(path.relative_to(pa.PERF_ANALYZER_DIR)): (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino)
        for path in files
    }


def test_the_script_is_idempotent_and_the_binary_starts(perf_analyzer: Path) -> None:
    assert pa.PERF_ANALYZER_DIR.is_symlink()  # to the machine's cache, not brought into the checkout
    assert pa.PERF_ANALYZER_DIR.resolve().name.startswith("perf_analyzer-")
    before = cache_state()
    assert set(before) == CACHE_FILES  # the three files and the stamp: no wheel, .deb or temporary folder left
    proc, elapsed_s = run_script(SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert elapsed_s < CACHED_RUN_MAX_S, f"a run with everything in place took {elapsed_s:.2f} s"
    assert cache_state() == before
    assert "Perf Analyzer Version 2.40.0" in proc.stdout
    # 2.40.0 has no --help: it says the option is unknown, prints its usage text (stderr) and exits 99.
    usage = subprocess.run([perf_analyzer, "--help"], capture_output=True, text=True, env=perf_analyzer_env())
    assert "--concurrency-range" in usage.stdout + usage.stderr


def test_the_script_takes_no_arguments_and_says_so_before_bringing_anything(tmp_path: Path) -> None:
    """--help is its usage (exit 0); anything else one line and exit 2, with nothing brought (it downloaded before)."""
    env = {**os.environ, "SERVERBENCH_TOOLS": str(tmp_path / "cache")}
    helped = subprocess.run(["sh", str(SCRIPT), "--help"], capture_output=True, text=True, env=env, timeout=30)
    assert helped.returncode == 0 and helped.stdout.startswith("Usage: tools/perf_analyzer.sh")
    bogus = subprocess.run(["sh", str(SCRIPT), "--bogus"], capture_output=True, text=True, env=env, timeout=30)
    assert bogus.returncode == 2 and bogus.stderr.strip().splitlines() == [
        "tools/perf_analyzer.sh: takes no arguments (got --bogus); --help says what it does"
    ]
    assert not (tmp_path / "cache").exists()


def test_a_failed_bring_is_one_line_that_ensure_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tools").mkdir()
    script = Path(shutil.copy(SCRIPT, tmp_path / "tools" / SCRIPT.name))
    cache = tmp_path / "cache"  # an empty cache: the machine's would have the binary
    proc, _ = run_script(script, {**os.environ, **NO_INDEX_ENV, "SERVERBENCH_TOOLS": str(cache)})
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith("tools/perf_analyzer.sh: cannot download tritonclient 2.40.0 from the package index"), line
    assert "127.0.0.1:9" in line
    assert not (tmp_path / ".tools").exists()  # no link to a folder that is not whole
    brought = [path.name for path in cache.rglob("*") if path.is_file()]
    assert brought and all(name.endswith(".lock") for name in brought), brought  # nothing half-brought

    for name, value in {**NO_INDEX_ENV, "SERVERBENCH_TOOLS": str(cache)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(pa, "SETUP_SCRIPT", script)
    monkeypatch.setattr(pa, "PERF_ANALYZER_DIR", tmp_path / ".tools" / "perf_analyzer")
    with pytest.raises(PerfAnalyzerMissing) as raised:
        ensure_perf_analyzer()
    assert str(raised.value) == line


def pins_of(script: Path) -> str:
    """The script's PINS (its stamp) as it sets them: its own assignment lines, evaluated by sh."""
    names = {"TRITONCLIENT", "CUDART", "PINS"}
    lines = "\n".join(line for line in script.read_text().splitlines() if line.split("=")[0] in names)
    return subprocess.run(["sh", "-c", f'{lines}\nprintf "%s" "$PINS"'], capture_output=True, text=True).stdout


@pytest.mark.parametrize("before", ["none", "stale symlink", "folder of its own", "other pins in the cache"])
def test_a_second_checkout_takes_the_cache_through_a_symlink(tmp_path: Path, before: str) -> None:
    """Another checkout with the machine's cache (here a fake, stamped one whose binary is a script) only links to it
    and runs --version: nothing downloaded (no index answers), in well under a second. A stale link or a folder of
    the checkout's own is replaced; a cached folder stamped with other pins is never taken."""
    checkout, cache = tmp_path / "checkout", tmp_path / "cache"
    (checkout / "tools").mkdir(parents=True)
    script = Path(shutil.copy(SCRIPT, checkout / "tools" / SCRIPT.name))
    pins = pins_of(script)
    assert pins.startswith("tritonclient==2.40.0 ")
    key = subprocess.run(["cksum"], input=pins + "\n", capture_output=True, text=True).stdout.split()[0]
    folder = cache / f"perf_analyzer-{key}"
    (folder / "bin").mkdir(parents=True)
    (folder / "lib").mkdir()
    (folder / "bin" / "perf_analyzer").write_text("#!/bin/sh\necho 'Perf Analyzer Version 2.40.0 (fake)'\n")
    (folder / "bin" / "perf_analyzer").chmod(0o755)
    (folder / "lib" / "libb64.so.0d").write_bytes(b"")
    (folder / "lib" / "libcudart.so.12").write_bytes(b"")
    (folder / ".stamp").write_text(("other pins" if before == "other pins in the cache" else pins) + "\n")
    link = checkout / ".tools" / "perf_analyzer"
    link.parent.mkdir()
    if before == "stale symlink":
        link.symlink_to(cache / "perf_analyzer-0")
    elif before == "folder of its own":
        (link / "bin").mkdir(parents=True)
    cached = {str(p.relative_to(cache)): (p.stat().st_mtime_ns, p.stat().st_ino) for p in cache.rglob("*")}
    proc, elapsed_s = run_script(script, {**os.environ, **NO_INDEX_ENV, "SERVERBENCH_TOOLS": str(cache)})
    if before == "other pins in the cache":
        assert proc.returncode == 1 and proc.stderr.startswith("tools/perf_analyzer.sh: cannot download tritonclient")
        assert not link.exists()
        return
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "bringing" not in proc.stdout and "Perf Analyzer Version 2.40.0 (fake)" in proc.stdout
    assert link.is_symlink() and os.readlink(link) == str(folder)
    assert {str(p.relative_to(cache)): (p.stat().st_mtime_ns, p.stat().st_ino) for p in cache.rglob("*")} == cached
    assert elapsed_s < CACHED_RUN_MAX_S, f"linking to the cache took {elapsed_s:.2f} s"


def test_the_command_uses_only_flags_the_binary_knows(perf_analyzer: Path, tmp_path: Path) -> None:
    common = {"model": MODEL, "url": "127.0.0.1:8000", "csv_file": tmp_path / "a.csv"}
    common["profile_export_file"] = tmp_path / "a.json"
    http = PerfAnalyzerRun(**common, concurrency=4, batch_size=2, stability_percentage=12.5, shape=["x:4"])
    argv = http.command(perf_analyzer)
    assert argv[0] == str(perf_analyzer)
    assert argv[argv.index("--concurrency-range") + 1] == "4:4"
    assert argv[argv.index("-b") + 1] == "2" and argv[argv.index("-s") + 1] == "12.5"
    assert argv[argv.index("--measurement-mode") + 1] == "time_windows" and argv[argv.index("-p") + 1] == "5000"
    assert "--input-tensor-format=binary" in argv and not any(arg.startswith("--percentile") for arg in argv)
    assert argv[argv.index("--shape") + 1] == "x:4"
    grpc = PerfAnalyzerRun(**common, protocol="grpc", binary=False, measurement_request_count=50).command(perf_analyzer)
    assert grpc[grpc.index("-i") + 1] == "grpc" and not [arg for arg in grpc if "tensor-format" in arg]
    assert grpc[grpc.index("--measurement-mode") + 1] == "count_windows" and "-p" not in grpc
    assert grpc[grpc.index("--measurement-request-count") + 1] == "50"
    json_http = PerfAnalyzerRun(**common, binary=False).command(perf_analyzer)
    assert "--input-tensor-format=json" in json_http and "--output-tensor-format=json" in json_http
    usage = subprocess.run([perf_analyzer, "--help"], capture_output=True, text=True, env=perf_analyzer_env()).stderr
    flags = {arg.split("=")[0] for arg in [*argv, *grpc] if arg.startswith("-")}
    assert not [flag for flag in flags if flag not in usage], usage
    with pytest.raises(ValueError, match="host:port"):
        PerfAnalyzerRun(**{**common, "url": "http://127.0.0.1:8000"})


def test_parse_csv_reads_the_one_row(tmp_path: Path) -> None:
    # As 2.40.0 writes it against a server with the statistics extension (taken from a run on the fake server).
    sample = tmp_path / "sample.csv"
    sample.write_text(
        "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
        "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
        "1,8250.84,19,70,3,3,19,3,0,117,125,138,159\n"
    )
    row = parse_csv(sample)
    assert row["Inferences/Second"] == 8250.84 and row["p99 latency"] == 159.0 and row["Server Queue"] == 3.0
    assert len(row) == 13
    header_only = tmp_path / "header.csv"
    header_only.write_text("Concurrency,Inferences/Second,Client Send,Client Recv,p50 latency\n")
    assert parse_csv(header_only) == {}
    two_rows = tmp_path / "two.csv"
    two_rows.write_text("Concurrency,Inferences/Second\n1,10\n2,20\n")
    with pytest.raises(ValueError, match="2 rows"):
        parse_csv(two_rows)


def quick_run(server: FakeServer, tmp_path: Path, **options: object) -> PerfAnalyzerRun:
    """About 2 s: three windows of 0.5 s (perf_analyzer sleeps 1.2 x the interval) that agree within 100 %."""
    settings = {"measurement_interval_ms": 500, "max_trials": 8, "stability_percentage": 100.0, "timeout_s": 60.0}
    settings |= options
    return PerfAnalyzerRun(
        model=MODEL,
        url=server.url,
        csv_file=tmp_path / "perf.csv",
        profile_export_file=tmp_path / "profile.json",
        **settings,  # type: ignore[arg-type]
    )


def expected_requests(stats: bool) -> set[tuple[str, str]]:
    """What perf_analyzer 2.40.0 asks over HTTP: no health or readiness check, the stats only with the extension."""
    paths = {("GET", f"/v2/models/{MODEL}"), ("GET", f"/v2/models/{MODEL}/config"), ("GET", "/v2")}
    paths.add(("POST", f"/v2/models/{MODEL}/infer"))
    return paths | ({("GET", f"/v2/models/{MODEL}/stats")} if stats else set())


def test_a_run_against_the_fake_server(perf_analyzer: Path, fake_server: FakeServer, tmp_path: Path) -> None:
    result = run_perf_analyzer(quick_run(fake_server, tmp_path))
    print(f"requests: {dict(fake_server.requests())}\n{result.stdout}")
    assert result.ok, result.error + "\n" + result.stdout
    assert result.returncode == 0 and result.error == "" and result.error_count == 0
    assert result.throughput_per_s and result.throughput_per_s > 0
    assert result.p99_latency_s and result.p99_latency_s > 0
    assert result.p50_latency_s is not None and result.p50_latency_s <= result.p99_latency_s
    assert result.server_compute_infer_s is not None and result.server_queue_s is not None  # the extension is on
    assert result.csv_file.is_file() and result.profile_export_file.is_file()
    assert json.loads(result.profile_export_file.read_text())["version"] == "2.40.0"
    assert set(parse_csv(result.csv_file)) >= {"Inferences/Second", "p99 latency", "Server Compute Infer"}
    assert set(fake_server.requests()) == expected_requests(stats=True)


@pytest.mark.parametrize("fake_server", [([], "echo")], indirect=True)
def test_json_tensors_and_no_statistics(perf_analyzer: Path, fake_server: FakeServer, tmp_path: Path) -> None:
    result = run_perf_analyzer(quick_run(fake_server, tmp_path, binary=False))
    assert result.ok, result.error + "\n" + result.stdout
    assert result.throughput_per_s and result.p99_latency_s
    assert result.server_queue_s is None and result.network_server_s is None  # no statistics extension, no columns
    assert set(fake_server.requests()) == expected_requests(stats=False)


@pytest.mark.parametrize("fake_server", [(["statistics"], "fail")], indirect=True)
def test_a_failing_server_is_a_failed_result(perf_analyzer: Path, fake_server: FakeServer, tmp_path: Path) -> None:
    result = run_perf_analyzer(quick_run(fake_server, tmp_path))
    assert not result.ok and result.returncode == 99 and result.error_count >= 1
    assert "boom" in result.error and "\n" not in result.error
    assert result.throughput_per_s is None and result.p99_latency_s is None
    assert not result.csv_file.exists()  # perf_analyzer writes no CSV for a failed run
    assert fake_server.requests()[("POST", f"/v2/models/{MODEL}/infer")] == 1  # the first failure ends it


@pytest.mark.parametrize("fake_server", [(["statistics"], "hang")], indirect=True)
def test_a_run_past_its_timeout_is_killed(perf_analyzer: Path, fake_server: FakeServer, tmp_path: Path) -> None:
    result = run_perf_analyzer(quick_run(fake_server, tmp_path, timeout_s=1.0))
    assert not result.ok and "did not finish within 1 s" in result.error
    assert result.wall_s < 1.0 + pa.KILL_GRACE_S + 2.0
