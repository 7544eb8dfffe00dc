"""bench.echo_server and bench.frontdoor: the echo answers our own client (server.py --target) over HTTP binary,
HTTP JSON and gRPC and stops cleanly on SIGTERM; a tiny front-door measurement writes its rows, the echo anchor's
among them, and its report; --report_only writes the same report again from the rows; a run that left no row is
reported as failed and fails the command."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
from conftest import ROOT, communicate_or_fail, read_log_until, read_rows, run_command, run_server, start_session

from bench.echo_server import SERVED_PREFIX

TINY_FRONTDOOR = [
    "--repeats",
    "1",
    "--models",
    "identity",
    "--designs",
    "serial",
    "--concurrency",
    "2",
    "--transports",
    "shm",
    "http-binary",
    "--doors",
    "process",
    "--identity_iters",
    "50",
    "--warmup_iters",
    "2",
]
EXPECTED_RUNS = {
    "identity.serial.shm.none.c2",
    "identity.serial.http-binary.process.c2",
    "echo.anchor.http-binary.echo.c2",
}


# Binary HTTP: the tiny measurement below drives that echo too.
@pytest.mark.parametrize("transport", ["http-json", "grpc"])
def test_the_echo_answers_our_client(tmp_path: Path, transport: str) -> None:
    scheme = transport.split("-")[0]
    echo = start_session(
        [sys.executable, "-m", "bench.echo_server", "--transport", scheme, "--port", "0", "--shape", "1,3,4,4"],
        ROOT,
        None,
    )
    said = read_log_until(echo, lambda text: SERVED_PREFIX in text, limit_s=60)
    match = re.search(rf"{SERVED_PREFIX} ({scheme}://127\.0\.0\.1:\d+)", said)
    assert match, said
    # The inputs come from the echo's model metadata: server.py refuses --input with a name that is not a factory's.
    args = ["--target", match.group(1), "--model", "echo", "--batch_size", "1", "--num_iters", "20", "--device", "cpu"]
    args += ["--load", "closed", "--concurrency", "2", *(["--no-binary_data"] if transport == "http-json" else [])]
    run = run_server(args, tmp_path, timeout_s=120)
    assert run.returncode == 0, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "ok" and int(row["responses_received"]) == 20 and row["responses_missing"] == "0"
    assert row["inputs"] == "image:float32:3x4x4"
    os.kill(echo.pid, signal.SIGTERM)
    communicate_or_fail(echo, 30, "bench.echo_server")
    assert echo.returncode == 0


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One tiny measurement (three runs), shared by the tests that read it: its folder and its output."""
    out = tmp_path_factory.mktemp("frontdoor")
    done = run_command([sys.executable, "-m", "bench.frontdoor", "--out", str(out), *TINY_FRONTDOOR], timeout_s=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def test_a_tiny_measurement_writes_rows_and_report(measured: tuple[Path, str]) -> None:
    out, stdout = measured
    rows = read_rows(out / "runs.csv")
    assert {row["experiment"] for row in rows} == EXPECTED_RUNS and len(rows) == 3
    assert all(row["status"] == "ok" and row["responses_received"] == "50" for row in rows), rows
    by_name = {row["experiment"]: row for row in rows}
    assert by_name["echo.anchor.http-binary.echo.c2"]["target"].startswith("http://127.0.0.1:")
    assert by_name["identity.serial.http-binary.process.c2"]["door"] == "process"
    report = (out / "frontdoor.md").read_text()
    assert report.strip() in stdout  # printed too
    assert "- command: `python -m bench.frontdoor --out" in report and "commit " in report
    assert re.search(r"\| shm \| none \| [\d,]+ \([\d,]+-[\d,]+\) \| [\d.]+ \| [\d.]+ \| - \| 1/1 \|", report)
    assert re.search(r"\| http-binary \| process \| [\d,]+ .* \| -?[\d.]+ \| 1/1 \|", report)  # with its added p50
    assert re.search(r"\| http-binary \| 2 \| [\d,]+ .* \| 1/1 \|", report)  # the anchor
    assert re.search(r"http-binary: the door \(process, the only placement measured\) .* = \*\*[\d.]+\*\*", report)
    assert "## Runs that failed: 0" in report


def test_report_only_writes_the_same_report(measured: tuple[Path, str], tmp_path: Path) -> None:
    out = tmp_path / "again"
    shutil.copytree(measured[0], out)
    before = (out / "frontdoor.md").read_text()
    (out / "frontdoor.md").unlink()
    done = run_command([sys.executable, "-m", "bench.frontdoor", "--out", str(out), "--report_only"], timeout_s=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "frontdoor.md").read_text() == before
    assert read_rows(out / "runs.csv") == read_rows(measured[0] / "runs.csv")  # nothing ran


def test_a_run_without_a_row_is_reported_failed(measured: tuple[Path, str], tmp_path: Path) -> None:
    out = tmp_path / "failed"
    shutil.copytree(measured[0], out)
    with open(out / "attempts.csv", "a") as attempts:
        attempts.write("identity.serial.grpc.process.c2,0,2,\n")
    done = run_command([sys.executable, "-m", "bench.frontdoor", "--out", str(out), "--report_only"], timeout_s=60)
    assert done.returncode == 1, done.stderr[-3000:]
    report = (out / "frontdoor.md").read_text()
    assert "## Runs that failed: 1" in report
    assert "- identity.serial.grpc.process.c2 repeat 0: no row (exit 2)" in report
    assert re.search(r"\| grpc \| process \| n/a \| n/a \| n/a \| n/a \| 0/1 \|", report)
