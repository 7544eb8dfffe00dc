"""python -m bench.peer_client: perf_analyzer and our generator against one `server.py --serve_only` door per
protocol, for real on a tiny scale (one repeat, concurrency 2, a few hundred requests each), both protocols with zero
errors, and --report_only writing the same report again; a perf_analyzer that cannot be brought is exit status 2
before anything starts; a failed run and a missed target are in the report and the exit status. A machine where
perf_analyzer cannot be brought fails the real run with tools/perf_analyzer.sh's reason: it is never skipped.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, communicate_or_fail, pids_running, start_session

from bench import peer_client
from bench.perf_analyzer import THROUGHPUT_COLUMN, PerfAnalyzerMissing, ensure_perf_analyzer, parse_csv

TOOL_TIMEOUT_S = 150  # about 15 s on 2 idle cores; a busy machine stretches every run
# Stability within 1000 %: the machine's noise must not fail a test of the plumbing (the measurement keeps 10 %).
TINY = [
    "--repeats",
    "1",
    "--concurrency",
    "2",
    "--pa_requests",
    "200",
    "--our_iters",
    "100",
    "--pa_stability_pct",
    "1000",
]


def test_perf_analyzer_and_ours_measure_one_door_per_protocol(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ensure_perf_analyzer()  # PerfAnalyzerMissing fails the test with the script's reason
    out = tmp_path / "peer"
    proc = start_session([sys.executable, "-m", "bench.peer_client", "--out", str(out), *TINY], ROOT, None)
    stdout, stderr = communicate_or_fail(proc, TOOL_TIMEOUT_S, "bench.peer_client")
    assert proc.returncode == 0, f"{stdout[-4000:]}\n{stderr[-3000:]}"
    assert pids_running(str(out)) == []  # both servers stopped, no client left

    runs = pd.read_csv(out / peer_client.RUNS_CSV)
    assert sorted(zip(runs["protocol"], runs["tool"])) == sorted(
        (protocol, tool) for protocol in ("http", "grpc") for tool in ("perf_analyzer", "ours", "server")
    )
    assert runs["ok"].all(), runs[["protocol", "tool", "error"]].to_string()
    measured = runs[runs["tool"] != "server"]
    assert (measured["throughput_rps"] > 0).all() and (measured["p99_latency_s"] > 0).all()
    assert (measured["door_failed"] == 0).all() and (measured["door_requests"] >= measured["requests"]).all()
    for protocol in ("http", "grpc"):
        pa_csv = out / "perf_analyzer" / f"{protocol}_c2_r0.csv"
        assert parse_csv(pa_csv)[THROUGHPUT_COLUMN] > 0
        assert (out / "perf_analyzer" / f"{protocol}_c2_r0.json").is_file()
        log = (out / "perf_analyzer" / f"{protocol}_c2_r0.log").read_text()
        assert "Using synchronous calls for inference" in log and "error" not in log.lower()

    ours = pd.read_csv(out / peer_client.OURS_CSV)
    assert sorted(ours["experiment"]) == ["grpc_c2", "http_c2"] and (ours["status"] == "ok").all()
    assert (ours["responses_received"] == 100).all() and (ours["concurrency"] == 2).all()
    served = pd.read_csv(out / peer_client.SERVED_CSV)
    assert sorted(served["experiment"]) == ["served_grpc", "served_http"] and (served["status"] == "ok").all()
    assert (served["door_errors"] == 0).all() and (served["requests_sent"] > 100).all()

    report = (out / peer_client.REPORT_MD).read_text()
    assert report in stdout
    assert "## HTTP" in report and "## GRPC" in report and "## Failures\n\n- none\n" in report
    assert "| 2 | 1/1 / 1/1 |" in report  # both clients ok at concurrency 2, for each protocol
    assert "TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT=3" in report  # 2 workers and its statistics client, one channel

    capsys.readouterr()
    again = peer_client.main(["--out", str(out), "--report_only"])  # reads only the folder: in this process
    printed = capsys.readouterr()
    assert again == 0, printed.err[-3000:]
    assert (out / peer_client.REPORT_MD).read_text() == report and report in printed.out


def test_perf_analyzer_missing_is_exit_2_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def missing() -> Path:
        raise PerfAnalyzerMissing("tools/perf_analyzer.sh: cannot download tritonclient 2.40.0: no network")

    monkeypatch.setattr(peer_client.pa, "ensure_perf_analyzer", missing)
    out = tmp_path / "peer"
    assert peer_client.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot download tritonclient 2.40.0: no network" in err
    assert not out.exists()


def test_failures_and_missed_targets_are_reported_and_fail_the_exit_status(tmp_path: Path) -> None:
    settings = peer_client.Settings(("http",), (1, 4), 1, 0, 200, 10.0, 10, 100, "identity", 16, 1, "serial")
    meta = {"command": "python -m bench.peer_client", "date": "today", "commit": "abc", "cores": 2}
    meta |= {"cpus_online": 2, "perf_analyzer": "Perf Analyzer Version 2.40.0", "grpc_channel_share": "5"}
    (tmp_path / peer_client.META_JSON).write_text(json.dumps({**meta, "settings": dataclasses.asdict(settings)}))
    pd.DataFrame([{"experiment": "served_http", "status": "ok", "device_name": "AMD EPYC"}]).to_csv(
        tmp_path / peer_client.SERVED_CSV, index=False
    )
    where = {"protocol": "http", "repeat": 0}
    figures = {"ok": True, "error": "", "throughput_rps": 1000.0, "p50_latency_s": 0.001}
    peer_client.append_run(
        tmp_path, {**where, "concurrency": 1, "tool": "perf_analyzer", **figures, "p99_latency_s": 0.002}
    )
    peer_client.append_run(tmp_path, {**where, "concurrency": 1, "tool": "ours", **figures, "p99_latency_s": 0.003})
    failure = "Thread [0] had error: failed to connect (exit status 99)"
    peer_client.append_run(
        tmp_path, {**where, "concurrency": 4, "tool": "perf_analyzer", "ok": False, "error": failure}
    )
    peer_client.append_run(tmp_path, {**where, "concurrency": 4, "tool": "ours", **figures, "p99_latency_s": 0.002})

    assert peer_client.main(["--out", str(tmp_path), "--report_only"]) == 1
    report = (tmp_path / peer_client.REPORT_MD).read_text()
    assert f"- http concurrency 4 repeat 0, perf_analyzer: {failure}" in report
    assert "- NOT met: http concurrency 1: our p99 / perf_analyzer's 1.50 (target 0.9-1.1)" in report
    assert "- NOT met: http concurrency 4: our p99 / perf_analyzer's n/a (target 0.9-1.1)" in report
    assert "| 4 | 0/1 / 1/1 |" in report and "machine: AMD EPYC; 2 usable CPU cores" in report


def test_a_server_that_refuses_its_flags_stops_the_tool_with_its_line_and_exit_2(tmp_path: Path) -> None:
    """server.py's one-line refusal (a model it cannot build) ends the tool at once, said on stderr, instead of
    every run reported failed and exit 1."""
    ensure_perf_analyzer()
    out = tmp_path / "peer"
    proc = start_session([sys.executable, "-m", "bench.peer_client", "--out", str(out), "--model", "a b"], ROOT, None)
    stdout, stderr = communicate_or_fail(proc, TOOL_TIMEOUT_S, "bench.peer_client")
    assert proc.returncode == 2, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    [line] = stderr.strip().splitlines()
    assert line.startswith("python -m bench.peer_client: error: the server refused to start: server.py: error: ")
    assert "--model 'a b'" in line and pids_running(str(out)) == []
