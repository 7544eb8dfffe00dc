"""bench.echo_server and bench.frontdoor: the echo answers our own client (server.py --target) over HTTP binary,
HTTP JSON and gRPC and stops cleanly on SIGTERM; a tiny front-door measurement on the study harness writes its rows,
the echo anchor's among them (its echo started around its run by the runner's fixture), and its report; the same
command resumes running nothing; --report_only writes the same report again from the rows; a failed run, an echo
that never served among them, is reported and fails the command."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    communicate_or_fail,
    kill_session,
    outlive_the_test,
    read_log_until,
    read_rows,
    run_command,
    start_server,
    start_session,
)

from bench import frontdoor
from bench.echo_server import SERVED_PREFIX
from serverbench.launch.study import Cell, Experiment, Runner

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


ECHO_TRANSPORTS = ["http-json", "grpc"]  # binary HTTP: the tiny measurement below drives that echo too


@dataclass
class EchoCase:
    """One transport's echo and our client against it (None when the echo never said where it listens)."""

    echo: subprocess.Popen
    said: str  # the echo's output up to its address
    results: Path  # the client's results folder
    client: subprocess.Popen | None = None


@pytest.fixture(scope="module")
def echo_cases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EchoCase]]:
    """Per transport, an echo and our client (server.py --target, 20 requests) against it, both started in the
    background: they run beside the tiny measurement (which asks for them first) and beside each other; each test
    waits for its own, then stops its echo."""
    cases: dict[str, EchoCase] = {}
    try:
        for transport in ECHO_TRANSPORTS:
            scheme = transport.split("-")[0]
            argv = ["--transport", scheme, "--port", "0", "--shape", "1,3,4,4"]
            echo = start_session([sys.executable, "-m", "bench.echo_server", *argv], ROOT, None)
            outlive_the_test(echo.pid)
            cases[transport] = EchoCase(echo, "", tmp_path_factory.mktemp(f"echo-{transport}"))
        for transport, case in cases.items():
            scheme = transport.split("-")[0]
            case.said = read_log_until(case.echo, lambda text: SERVED_PREFIX in text, limit_s=60)
            match = re.search(rf"{SERVED_PREFIX} ({scheme}://127\.0\.0\.1:\d+)", case.said)
            if match is None:
                continue
            # The inputs come from the echo's model metadata: server.py refuses --input with a name that is not a
            # factory's.
            args = ["--target", match.group(1), "--model", "echo", "--batch_size", "1", "--num_iters", "20"]
            args += ["--device", "cpu", "--load", "closed", "--concurrency", "2"]
            args += ["--no-binary_data"] if transport == "http-json" else []
            case.client = start_server(args, case.results)
            outlive_the_test(case.client.pid)
        yield cases
    finally:
        for case in cases.values():
            for proc in (case.client, case.echo):
                if proc is not None and proc.poll() is None:
                    kill_session(proc.pid)
                if proc is not None:
                    proc.communicate()


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory, echo_cases: dict[str, EchoCase]) -> tuple[Path, str]:
    """One tiny measurement (three runs), shared by the tests that read it: its folder and its output. The echo
    cases are asked for first so that they run meanwhile."""
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
    assert "- command: `python -m bench.frontdoor --out" in report and "- commit: " in report
    assert "- rows: 3 (3 ok)" in report
    assert re.search(r"\| shm \| none \| [\d,]+ \([\d,]+-[\d,]+\) \| [\d.]+ \| [\d.]+ \| - \| 1/1 \|", report)
    assert re.search(r"\| http-binary \| process \| [\d,]+ .* \| -?[\d.]+ \| 1/1 \|", report)  # with its added p50
    assert re.search(r"\| http-binary \| 2 \| [\d,]+ .* \| 1/1 \|", report)  # the anchor
    assert re.search(r"http-binary: the door \(process, the only placement measured\) .* = \*\*[\d.]+\*\*", report)
    assert "## Runs that failed: 0" in report


def test_report_only_writes_the_same_report(
    measured: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--report_only reads only the folder: called in this process (the measurement ran as a command)."""
    out = tmp_path / "again"
    shutil.copytree(measured[0], out)
    before = (out / "frontdoor.md").read_text()
    (out / "frontdoor.md").unlink()
    assert frontdoor.main(["--out", str(out), "--report_only"]) == 0, capsys.readouterr().err[-3000:]
    again = (out / "frontdoor.md").read_text()
    assert again[again.index("\n### ") :] == before[before.index("\n### ") :]  # all but the header's command
    assert read_rows(out / "runs.csv") == read_rows(measured[0] / "runs.csv")  # nothing ran


def test_the_same_command_resumes_running_nothing(
    measured: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """In this process (nothing is run: the checks before the runs, then the runner finds every row)."""
    out = tmp_path / "again"
    shutil.copytree(measured[0], out)
    assert frontdoor.main(["--out", str(out), *TINY_FRONTDOOR]) == 0, capsys.readouterr().err[-3000:]
    said = capsys.readouterr().out
    assert "3 runs (phase 1 of 1, 1 interleaved rounds)" in said and "3 already done" in said
    assert read_rows(out / "runs.csv") == read_rows(measured[0] / "runs.csv")


def test_an_echo_that_never_serves_fails_its_run_not_the_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture's failure is the cell's row (status error, what the launcher said); the study goes on."""

    def never_serves(transport: str, log_path: Path) -> Iterator[str]:
        raise frontdoor.EchoFailed("the echo server did not serve within 30 s")

    monkeypatch.setattr(frontdoor, "echo_server", never_serves)
    cell = Cell(Experiment("echo.anchor.grpc.echo.c2", ()), 1, False, 0)
    assert Runner("test", tmp_path, fixture=frontdoor.echo_fixture).run_cell(cell) == "error"
    [row] = read_rows(tmp_path / "runs.csv")
    assert (row["experiment"], row["status"]) == ("echo.anchor.grpc.echo.c2", "error")
    assert row["error"] == "the echo server did not serve within 30 s"


def test_a_failed_run_is_reported_and_fails_the_command(
    measured: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "failed"
    shutil.copytree(measured[0], out)
    with open(out / "runs.csv") as runs:
        columns = runs.readline().strip().split(",")
    failed = {"experiment": "identity.serial.grpc.process.c2", "repeat": "0", "batch_size": "1", "compile": "False"}
    failed |= {"load": "closed", "concurrency": "2", "status": "crashed", "error": "server.py exit status -9"}
    with open(out / "runs.csv", "a") as runs:
        runs.write(",".join(failed.get(column, "") for column in columns) + "\n")
    assert frontdoor.main(["--out", str(out), "--report_only"]) == 1, capsys.readouterr().err[-3000:]
    report = (out / "frontdoor.md").read_text()
    assert "## Runs that failed: 1" in report
    assert "- identity.serial.grpc.process.c2 repeat 0: crashed: server.py exit status -9" in report
    assert re.search(r"\| grpc \| process \| n/a \| n/a \| n/a \| n/a \| 0/1 \|", report)


@pytest.mark.parametrize("transport", ECHO_TRANSPORTS)
def test_the_echo_answers_our_client(echo_cases: dict[str, EchoCase], transport: str) -> None:
    case = echo_cases[transport]
    assert case.client is not None, case.said
    _, stderr = communicate_or_fail(case.client, 120, "server.py")
    assert case.client.returncode == 0, stderr[-3000:]
    rows = read_rows(case.results / "out.csv")
    assert len(rows) == 1, f"expected one row, got {len(rows)}\n{stderr}"
    row = rows[0]
    assert row["status"] == "ok" and int(row["responses_received"]) == 20 and row["responses_missing"] == "0"
    assert row["inputs"] == "image:float32:3x4x4"
    os.kill(case.echo.pid, signal.SIGTERM)
    communicate_or_fail(case.echo, 30, "bench.echo_server")
    assert case.echo.returncode == 0
