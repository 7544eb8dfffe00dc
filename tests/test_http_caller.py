"""Our HTTP client (serverbench/transport/http_caller.py) against tiny servers made here: answers parsed whole
whatever the chunks, a kept-alive connection the server closed meanwhile replaced once, a refused connection tried
again within the call's deadline and then reported, an error answer's message carried up."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
import pytest

from serverbench.transport.caller import CallError
from serverbench.transport.http_caller import HttpCaller
from serverbench.transport.oip import ModelSpec, TensorSpec, render_http_infer

SPEC = ModelSpec("m", (TensorSpec("x", "FP32", (4,)),), (TensorSpec("output0", "FP32", (4,)),), 1, 1)
ROW = np.arange(4, dtype=np.float32).reshape(1, 4)


def answer_bytes(status: int = 200) -> bytes:
    if status != 200:
        body, extra = orjson.dumps({"error": "no such model"}), ""
    else:
        body, length = render_http_infer(SPEC, "0", [ROW], binary=True)
        extra = f"Inference-Header-Content-Length: {length}\r\n"
    head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
    return head + body


async def serve(handle) -> tuple[asyncio.AbstractServer, int]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    await reader.readexactly(length)
    return True


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 20))


def test_answers_in_small_chunks_and_a_closed_keep_alive_connection_replaced() -> None:
    connections = []

    async def handle(reader, writer) -> None:
        connections.append(writer)
        await read_request(reader)
        data = answer_bytes()
        for start in range(0, len(data), 7):  # the answer in pieces: parsed whole all the same
            writer.write(data[start : start + 7])
            await writer.drain()
        writer.close()  # after one answer, without saying so: the client's next request finds it gone

    async def main() -> None:
        server, port = await serve(handle)
        caller = HttpCaller("127.0.0.1", port, "m", ["x"], True, False, 5.0)
        for request_id in range(3):
            result = await caller.call(caller.encode(request_id, [ROW]))
            assert np.array_equal(result.outputs[0][1], ROW)
            await asyncio.sleep(0.05)  # the server has closed the connection by now
        await caller.close()
        server.close()
        assert len(connections) == 3

    run(main())


def test_an_error_answer_carries_its_status_and_message() -> None:
    async def handle(reader, writer) -> None:
        await read_request(reader)
        writer.write(answer_bytes(404))
        await writer.drain()

    async def main() -> None:
        server, port = await serve(handle)
        caller = HttpCaller("127.0.0.1", port, "m", ["x"], True, False, 5.0)
        with pytest.raises(CallError) as caught:
            await caller.call(caller.encode(0, [ROW]))
        assert (caught.value.status, caught.value.message) == (404, "no such model")
        await caller.close()
        server.close()

    run(main())


def test_a_refused_connection_is_tried_until_the_deadline_then_reported() -> None:
    async def main() -> None:
        server, port = await serve(lambda reader, writer: None)
        server.close()
        await server.wait_closed()  # nothing listens on the port any more
        caller = HttpCaller("127.0.0.1", port, "m", ["x"], True, False, 0.5)
        started = time.monotonic()
        with pytest.raises(CallError) as caught:
            await caller.call(caller.encode(0, [ROW]))
        assert caught.value.status == "unreachable" and 0.4 < time.monotonic() - started < 5

    run(main())


def test_a_request_that_got_no_answer_is_not_called_answered() -> None:
    """Out of open files, the client cannot connect: the run's error says no answer came, not that the server
    answered "unreachable"."""
    emfile = CallError("unreachable", "cannot connect to 127.0.0.1:8000: [Errno 24] Too many open files")
    assert (
        emfile.described(381)
        == "request 381 got no answer: cannot connect to 127.0.0.1:8000: [Errno 24] Too many open files"
    )
    assert CallError("timeout", "no answer within 5 s").described(2) == "request 2 got no answer: no answer within 5 s"
    assert CallError(503, "closing").described(2) == "the server answered request 2 with 503: closing"
