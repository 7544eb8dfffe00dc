"""bench.echo_server, the network study's anchor: the echo answers our own client (server.py --target) over HTTP
binary, HTTP JSON and gRPC, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
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
    start_server,
    start_session,
)

from bench.echo_server import SERVED_PREFIX

ECHO_TRANSPORTS = ["http-binary", "http-json", "grpc"]


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
    background, beside each other; each test waits for its own, then stops its echo."""
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
