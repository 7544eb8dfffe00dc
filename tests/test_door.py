"""The network front door end to end (--transport http|grpc): every design, dynamic batching, instances and a
user's model behind it over both protocols and both door placements, each response checked (--verify); a door
started by --serve_only driven by a second server.py --target; the bad inputs a network server meets, each answered
and counted while the door serves on; a port in use refused before anything starts; a frozen or killed door ending
the run with a status."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from conftest import (
    ROOT,
    communicate_or_fail,
    kill_session,
    live_processes_in_session,
    new_shm_entries,
    outlive_the_test,
    read_log_until,
    read_rows,
    run_server,
    shm_entries,
    start_server,
)
from helpers import QUICK, Background, ok_row, serve

ENCODER = ["--model", "examples.tiny_encoder:make_model", "--model_kwargs", '{"depth": 1}']
TOKENS = ["--input", "ids:int64:8:0-999", "--input", "mask:int64:8:1-1"]
IDENTITY = ["--model", "identity"]
USERS_MODEL = [*ENCODER, *TOKENS]
CLOSED_4 = ["--load", "closed", "--concurrency", "4"]


# A user's model (two int64 inputs) rides one case of each protocol: its own run would ask nothing more.
DESIGN_CASES = {
    "http-process-pipelined-batching-users": (
        USERS_MODEL,
        ["--transport", "http", "--door", "process", "--design", "pipelined", "--max_batch_size", "4"],
    ),
    "grpc-inline-serial": (
        IDENTITY,
        ["--transport", "grpc", "--door", "inline", "--design", "serial", "--load", "closed", "--concurrency", "3"],
    ),
    # On IPv6 loopback: the door binds an IPv6 socket, our client reaches it in brackets.
    "http-json-inline-threaded": (
        IDENTITY,
        ["--transport", "http", "--door", "inline", "--design", "threaded", "--no-binary_data", "--host", "::1"],
    ),
    "grpc-instances-users": (
        USERS_MODEL,
        ["--transport", "grpc", "--door", "process", "--design", "pipelined", "--instances", "2"],
    ),
}


@pytest.fixture(scope="module", autouse=True)
def design_runs(tmp_path_factory) -> Iterator[dict[str, Future]]:
    """Every design's run behind the door, on a thread of its own from the module's first test: they need nothing
    of the others, and the tests before theirs mostly wait on a door or a server's start."""
    folder = tmp_path_factory.mktemp("designs")
    runs = Background("door-designs")
    yield {
        case: runs.submit([*QUICK, *model, "--verify", "--port", "0", *args], folder / case)
        for case, (model, args) in DESIGN_CASES.items()
    }
    runs.stop()


def start_serving(tmp_path: Path, args: list[str]):
    """server.py --serve_only on a free port, and that port once the door listens."""
    proc = start_server(["--serve_only", "--port", "0", *args], tmp_path / "served", output_file="output.csv")
    text = read_log_until(proc, lambda log: "ready on" in log and "listening on" in log, limit_s=120)
    match = re.search(r"door\[\d+\] INFO listening on \w+://127\.0\.0\.1:(\d+)", text)
    assert match, text[-3000:]
    socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=1).close()  # it says so once it accepts
    return proc, int(match.group(1))


def stop_serving(proc) -> list[dict[str, str]]:
    """SIGTERM: the door stops as asked (exit 0), printing no traceback, and its row."""
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = communicate_or_fail(proc, 60, "server.py --serve_only")
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    # Each request refused below the door's application is counted in the row, not a line of uvicorn's here.
    assert "Invalid HTTP request" not in stderr and "running task(s)" not in stderr, stderr[-3000:]
    return read_rows(Path(proc.args[proc.args.index("--results_dir") + 1]) / "output.csv")


@dataclass
class LiveDoor:
    """A door started by --serve_only that several tests meet in turn, and the good requests it has answered."""

    proc: subprocess.Popen
    port: int
    answered: int = 0
    unparseable: int = 0  # 400s of its table's rows besides UNPARSEABLE's


@pytest.fixture(scope="module")
def live_door(tmp_path_factory) -> Iterator[LiveDoor]:
    """One HTTP door (--serve_only, a body limit of 1 MiB) that a --target run drives first (its warm-up is the
    door's), then every bad request of the table meets in turn; its row, written when the last test stops it,
    counts all of it."""
    tmp_path = tmp_path_factory.mktemp("door")
    proc, port = start_serving(tmp_path, [*QUICK, *IDENTITY, "--transport", "http", "--max_body_mb", "1"])
    outlive_the_test(proc.pid)
    yield LiveDoor(proc, port)
    kill_session(proc.pid)


def check_served_row(row: dict[str, str], answered: int) -> None:
    """The door's own row: `answered` requests, the first of them the warm-up."""
    assert row["status"] == "ok", row
    assert int(row["door_answered"]) == answered and int(row["responses_received"]) == answered - 1, row
    assert float(row["p99_latency_s"]) > 0  # the door's own records: arrival to answer written
    # Whoever came sent the load: our generator's columns stay empty, the noise note says why
    assert row["load"] == row["num_iters"] == row["efficiency"] == "", row
    assert row["noise_note"].startswith("--serve_only: no load generator of ours ran")


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_target_drives_a_door_that_serve_only_started(
    tmp_path: Path, transport: str, request: pytest.FixtureRequest
) -> None:
    """Over HTTP the module's live door (its row checked when the last test stops it); over gRPC a door of its own."""
    if transport == "http":
        door = request.getfixturevalue("live_door")
        proc, port = door.proc, door.port
    else:
        proc, port = start_serving(tmp_path, [*QUICK, *IDENTITY, "--transport", transport])
    # --image_size 32 against the door's 8x8: the row said 32 while 3x8x8 ran
    target = [*IDENTITY, "--image_size", "32", "--target", f"{transport}://127.0.0.1:{port}"]
    run = serve([*QUICK, *target, *CLOSED_4], tmp_path / "driver")
    assert run.returncode == 0, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "ok" and int(row["responses_received"]) == 10
    assert row["target"] == f"{transport}://127.0.0.1:{port}" and row["experiment"] == "target"
    assert row["inputs"] == "image:float32:3x8x8" and row["image_size"] == "8"  # from the door's model metadata
    # Someone else's server as far as the driver knows: no backend stamps, so no stages and no ceiling.
    assert row["mean_predict_ms"] == row["ceiling_throughput"] == row["efficiency"] == ""
    if transport == "http":
        door.answered += 11  # 10 measured and the warm-up
        return
    served = stop_serving(proc)
    assert len(served) == 1, served
    check_served_row(served[0], answered=11)
    assert live_processes_in_session(proc.pid) == []


# ------------------------------------------------------------------------------------------------ bad input


def _post(port: int, body: bytes, path: str = "/v2/models/identity/infer", headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", path, body=body, headers=headers or {"Content-Type": "application/json"})
    answer = connection.getresponse()
    data = answer.read()
    connection.close()
    return answer.status, data


def _good(rows: int = 2) -> dict:
    return {"inputs": [{"name": "image", "datatype": "FP32", "shape": [rows, 3, 8, 8], "data": [0.5] * rows * 192}]}


def _binary(size: int) -> tuple[bytes, dict]:
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "image", "datatype": "FP32", "shape": [2, 3, 8, 8], "parameters": {"binary_data_size": size}}
            ]
        }
    )
    return header + b"\0" * (2 * 192 * 4), {"Inference-Header-Content-Length": str(len(header))}


BAD_REQUESTS = {
    "malformed JSON": (lambda: (b'{"inputs": [', {}), 400, "JSON"),
    "wrong shape": (lambda: (orjson.dumps(_good(rows=3)), {}), 400, "expected [2, 3, 8, 8]"),
    "wrong datatype": (
        lambda: (orjson.dumps({"inputs": [{**_good()["inputs"][0], "datatype": "INT32"}]}), {}),
        400,
        "is INT32, but model 'identity' takes FP32",
    ),
    "wrong input name": (
        lambda: (orjson.dumps({"inputs": [{**_good()["inputs"][0], "name": "x"}]}), {}),
        400,
        "unknown input 'x'",
    ),
    "binary_data_size disagrees": (lambda: _binary(100), 400, "binary_data_size"),
    # A length HTTP would not write: int() took them (" 3190 ", "1_0") and the request went on.
    "header length with spaces": (lambda: _binary_with_length(lambda n: f" {n} "), 400, "is not a number"),
    "header length with an underscore": (lambda: _binary_with_length(lambda n: f"{n // 10}_{n % 10}"), 400, "number"),
}


def _binary_with_length(write) -> tuple[bytes, dict]:
    body, headers = _binary(2 * 192 * 4)
    return body, {"Inference-Header-Content-Length": write(int(headers["Inference-Header-Content-Length"]))}


def serves_on(door: LiveDoor) -> None:
    """The next good request is served (and counted for the door's row)."""
    assert _post(door.port, orjson.dumps(_good()))[0] == 200
    door.answered += 1


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_is_answered_and_the_door_serves_on(live_door: LiveDoor, case: str) -> None:
    make, status, phrase = BAD_REQUESTS[case]
    body, extra = make()
    answered, data = _post(live_door.port, body, headers={"Content-Type": "application/json", **extra})
    assert answered == status, data[:300]
    assert phrase.lower() in orjson.loads(data)["error"].lower()
    serves_on(live_door)


def _raw(port: int, head: bytes) -> bytes:
    """What the door answers to a request's head alone (the body never sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


INFER = b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n"
# Bytes no HTTP/1.1 parser takes, each refused below the application (door/http_wire.py): they got uvicorn's plain
# 400, a warning line each on stderr, and no count in the row.
UNPARSEABLE = {
    "Content-Length -5": INFER + b"Content-Length: -5\r\n\r\n",
    "Content-Length abc": INFER + b"Content-Length: abc\r\n\r\n",
    "Content-Length 1e30": INFER + b"Content-Length: 1e30\r\n\r\n",
    "two Content-Lengths": INFER + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    "a bad chunk": INFER + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n",
    "HTTP/2's preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "0xFF in the path": b"GET /v2/\xff HTTP/1.1\r\nHost: x\r\n\r\n",
    "CONNECT": b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    "a WebSocket upgrade": b"GET /v2 HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
}


@pytest.mark.parametrize("case", list(UNPARSEABLE))
def test_bytes_no_http_parser_takes_get_a_counted_400_and_the_door_serves_on(live_door: LiveDoor, case: str) -> None:
    answer = _raw(live_door.port, UNPARSEABLE[case])  # read to the end: the door closed the connection
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert "error" in orjson.loads(answer.split(b"\r\n\r\n", 1)[1])
    serves_on(live_door)


def test_pipelined_requests_are_answered_in_order_when_the_second_is_not_http(live_door: LiveDoor) -> None:
    """A good request and bytes no parser takes, in one write: the 400 went out before the first one's 200."""
    body = orjson.dumps(_good())
    good = INFER + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    # then the second's head read whole, queued behind the first, and its chunked body bad
    bad_body = INFER + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"
    for second in (b"BAD LINE\r\n\r\n", bad_body):
        answer = _raw(live_door.port, good + second)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 400 ") == 1, answer[:300]
        assert answer.index(b"HTTP/1.1 400 ") > answer.index(b'"outputs"')
        live_door.answered += 1
        live_door.unparseable += 1


def test_a_head_over_its_limit_is_431_and_not_kept(live_door: LiveDoor) -> None:
    """A header of 8 MiB (one of 200 MiB was answered 200, the door growing by 260 MB): refused once the head
    passes 1 MiB, the rest never read."""
    with socket.create_connection(("127.0.0.1", live_door.port), timeout=10) as sock:
        sock.sendall(INFER + b"X-Filler: ")
        with contextlib.suppress(ConnectionError):  # the door closes while the rest is still being sent
            for _ in range(128):
                sock.sendall(b"a" * 65536)
        answer = b""
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:300]
    serves_on(live_door)


def test_a_body_over_the_limit_is_413_before_it_is_read(live_door: LiveDoor) -> None:
    head = b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2097152\r\n\r\n"
    answer = _raw(live_door.port, head)
    assert answer.startswith(b"HTTP/1.1 413") and b"limit" in answer, answer[:300]
    serves_on(live_door)


def test_an_unknown_model_or_path_is_404_and_a_client_gone_mid_body_is_counted(live_door: LiveDoor) -> None:
    port = live_door.port
    assert _post(port, orjson.dumps(_good()), path="/v2/models/nope/infer")[0] == 404
    assert _post(port, b"", path="/v3/anything")[0] == 404
    ready = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    ready.request("GET", "/v2/models/identity/versions//ready")  # names no version: no such endpoint (it was 200)
    assert ready.getresponse().status == 404
    ready.close()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # says 100000 bytes, sends 10, leaves
        sock.sendall(b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n0123456789")
    time.sleep(0.3)
    serves_on(live_door)


def test_a_client_gone_before_its_answer_is_a_disconnect_and_another_clients_requests_are_named(
    tmp_path: Path,
) -> None:
    """A run of our generator behind an HTTP door, a forward of 100 ms: a client that sends a whole request and
    leaves before its answer is a disconnect (it was counted answered, with a latency nobody received; gRPC counted
    it so already), and the requests another client sends meanwhile are answered and named in the summary (they
    passed without a word)."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    args = [*QUICK, *IDENTITY, "--transport", "http", "--port", str(port), "--design", "serial", "--num_iters", "15"]
    proc = start_server([*args, "--load", "poisson", "--rate", "5", "--planted_delay_us", "100000"], tmp_path)
    text = read_log_until(proc, lambda log: "then the measured phase" in log, limit_s=120)
    assert "then the measured phase" in text, text[-3000:]
    body = orjson.dumps(_good())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as leaving:
        leaving.sendall(INFER + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.03)  # the door has read it whole; its forward alone takes 100 ms
    for _ in range(3):
        assert _post(port, body)[0] == 200
    stdout, stderr = communicate_or_fail(proc, 120, "server.py --transport http")
    row = read_rows(tmp_path / "out.csv")[-1]
    assert proc.returncode == 0 and row["status"] == "ok", stderr[-3000:]
    assert row["door_disconnects"] == "1" and row["door_errors"] == "0", row
    assert int(row["door_answered"]) == int(row["responses_received"]) + 1 + 3, row  # ours, our warm-up, the other's
    assert "the door answered 3 request(s) that no generator of this run sent" in stdout, stdout[-3000:]


def test_a_door_beyond_loopback_serves_only_requests_with_its_token_and_our_generator_sends_it(
    tmp_path: Path,
) -> None:
    """A --serve_only door on 0.0.0.0 (it served anyone, with a warning only), its token from the environment:
    health checks need none; an infer without it, or with another, is 401 and counted; our generator driving it as
    --target with --auth_token reads its metadata and is served."""
    token = "s3cret.token-1"
    args = ["--serve_only", "--port", "0", "--host", "0.0.0.0", *QUICK, *IDENTITY, "--transport", "http"]
    proc = start_server(args, tmp_path / "served", output_file="output.csv", env={"SERVERBENCH_AUTH_TOKEN": token})
    text = read_log_until(proc, lambda log: "ready on" in log and "serving on" in log, limit_s=120)
    match = re.search(r"serving on http://0\.0\.0\.0:(\d+)", text)
    assert match, text[-3000:]
    port = int(match.group(1))
    health = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    health.request("GET", "/v2/health/ready")
    assert health.getresponse().status == 200
    health.close()
    for headers in ({}, {"Authorization": "Bearer another.token"}):
        status, data = _post(port, orjson.dumps(_good()), headers={"Content-Type": "application/json", **headers})
        assert status == 401 and b"Authorization: Bearer <token>" in data, data[:300]
    driven = [*QUICK, *IDENTITY, "--target", f"http://127.0.0.1:{port}", "--auth_token", token]
    run = run_server(driven, tmp_path / "target", output_file="output.csv")
    assert run.returncode == 0 and run.row["status"] == "ok", run.stderr[-3000:]
    assert run.row["responses_received"] == "10" and run.row["target"] == f"http://127.0.0.1:{port}"
    [served] = stop_serving(proc)
    assert served["door_error_statuses"] == "401:2" and served["door_answered"] == "11", served
    assert token not in (tmp_path / "served" / "output.csv").read_text()  # a secret is no figure


def test_ctrl_c_before_the_backend_is_ready_is_an_interrupt_not_the_broken_pipe_it_leaves(tmp_path: Path) -> None:
    """Ctrl-C to a --serve_only server whose backend still builds its model: the door leaves, and the backend's
    broken pipe that follows was the run's status ("aborted: BrokenPipeError", exit 1, a traceback file)."""
    args = ["--serve_only", "--port", "0", *QUICK, "--model", "resnet18", "--image_size", "32", "--transport", "http"]
    proc = start_server(args, tmp_path, output_file="output.csv")
    text = read_log_until(proc, lambda log: "serving on" in log, limit_s=60)
    assert "ready on" not in text, text[-3000:]  # still building: torch's import alone takes a second
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = communicate_or_fail(proc, 60, "server.py --serve_only")
    [row] = read_rows(tmp_path / "output.csv")
    assert proc.returncode == 130 and row["status"] == "interrupted", (row["status"], row["error"], stderr[-2000:])
    assert "BrokenPipe" not in stderr and row["traceback_file"] == ""
    assert live_processes_in_session(proc.pid) == []


def test_the_live_door_s_row_counts_every_request_it_met(live_door: LiveDoor) -> None:
    """Last of the module's tests on the live door (module order): the --target run's requests, every error and
    the disconnect above are in the row the door writes at SIGTERM. A body still coming in as the door closes
    (100 kB announced, 9 bytes sent) is let go as a disconnect, with no traceback (it printed 20 lines)."""
    with socket.create_connection(("127.0.0.1", live_door.port), timeout=10) as stuck:
        stuck.sendall(b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n012345678")
        time.sleep(0.3)
        rows = stop_serving(live_door.proc)
    assert len(rows) == 1, rows
    row = rows[-1]
    check_served_row(row, answered=live_door.answered)
    statuses = dict(item.split(":") for item in row["door_error_statuses"].split(";"))
    assert statuses.get("404") == "3" and statuses.get("413") == "1" and statuses.get("431") == "1", statuses
    assert int(statuses.get("400", 0)) == len(BAD_REQUESTS) + len(UNPARSEABLE) + live_door.unparseable, statuses
    assert int(row["door_disconnects"]) == 2  # the client gone mid-body above, and the one still sending here
    assert live_processes_in_session(live_door.proc.pid) == []


# ------------------------------------------------------------------------------------------------ every design


@pytest.mark.parametrize("case", list(DESIGN_CASES))
def test_every_design_answers_right_behind_the_door(design_runs: dict[str, Future], case: str) -> None:
    model, args = DESIGN_CASES[case]
    row = ok_row(design_runs[case].result(timeout=240))
    assert row["transport"] == args[1] and row["door"] == args[3]
    assert int(row["door_answered"]) == 11 and row["door_errors"] == "0"  # 10 measured and the warm-up
    assert re.fullmatch(r"\[::1\]:\d+" if "::1" in args else r"127\.0\.0\.1:\d+", row["door_address"])
    # Our own door sends the backend's stamps back: the stages are there, not empty.
    assert float(row["mean_predict_ms"]) >= 0 and row["ceiling_throughput"] == ""  # QUICK: --no-ceiling
    inputs = "ids:int64:8:0-999 mask:int64:8:1-1" if model is USERS_MODEL else "image:float32:3x8x8"
    assert row["inputs"] == inputs


# ------------------------------------------------------------------------------------------------ the door's process


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = serve(["--model", "identity", "--transport", "http", "--port", str(port)], tmp_path / "results")
    assert run.returncode == 2 and run.rows == []
    assert len(run.stderr.strip().splitlines()) == 1 and "cannot listen" in run.stderr, run.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("how", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_a_frozen_or_killed_door_ends_the_run_with_a_status(
    tmp_path: Path, how: signal.Signals, design_runs: dict[str, Future]
) -> None:
    wait(design_runs.values(), timeout=240)  # their shared memory is no leak of this run's
    before = shm_entries()
    args = ["--model", "identity", "--device", "cpu", "--image_size", "8", "--batch_size", "1", "--no-ceiling"]
    args += ["--transport", "http", "--port", "0", "--num_iters", "1000000", "--timeout_s", "1"]
    proc = start_server(args, tmp_path, output_file="output.csv", cwd=ROOT)
    text = read_log_until(proc, lambda log: "measured phase" in log, limit_s=120)
    door_pid = int(re.search(r"door pid=(\d+)", text).group(1))
    started = time.monotonic()
    os.kill(door_pid, how)
    stdout, stderr = communicate_or_fail(proc, 60, "server.py")
    assert time.monotonic() - started < 1 + 15  # --timeout_s, then the stop's grace
    row = read_rows(tmp_path / "output.csv")[-1]
    assert proc.returncode == 1 and row["status"] == ("timeout" if how == signal.SIGSTOP else "door_died"), row
    # What the door counted went with it: unknown, not zeros
    assert row["door_answered"] == row["door_errors"] == row["door_disconnects"] == ""
    assert "? answered, ? error answers" in stdout
    assert live_processes_in_session(proc.pid) == []
    assert new_shm_entries(before) == set()
