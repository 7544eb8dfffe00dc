"""Our load generator's HTTP/1.1 client: keep-alive connections on the network client's event loop, one per request
in flight (as perf_analyzer opens them), each an asyncio Protocol whose answers httptools parses (the parser
uvicorn serves with). A request is framed once on the sender's thread (its request line, four headers, the body);
the loop only writes it and parses the answer.

Why not aiohttp: against the same door (identity, 1 image of 16x16, closed loop of 4, on this project's 2-core VM,
other work running) aiohttp's client spent 112-117 us of CPU per request, a prototype of this one 36 us; with
aiohttp the generator, not the server, set the pace (results/peer_client/NOTES.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httptools
import numpy as np
import orjson

from serverbench.system.net import host_port
from serverbench.transport.caller import CallError, auth_headers
from serverbench.transport.oip import (
    HEADER_LENGTH,
    TIMINGS_PARAMETER,
    InferResult,
    parse_http_result,
    render_http_request,
)

HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()
CONNECT_RETRY_S = 0.05


class Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer parsed as it arrives."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiting: asyncio.Future | None = None
        self.received = False  # a byte of the current answer has come
        self.closed = False
        self._body: list[bytes] = []
        self._header_length: int | None = None
        self._keep_alive = True

    # -------------------------------------------------------------------------------- asyncio's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(CallError("malformed", f"the answer is not HTTP/1.1: {exc}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"the server closed the connection{f': {exc}' if exc else ''}"))

    # -------------------------------------------------------------------------------- httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == HEADER_LENGTH_KEY:
            self._header_length = int(value)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        status, body = self.parser.get_status_code(), b"".join(self._body)
        header_length, self._keep_alive = self._header_length, self.parser.should_keep_alive()
        self._body, self._header_length = [], None
        waiting, self.waiting = self.waiting, None
        if waiting is not None and not waiting.done():
            waiting.set_result((status, body, header_length))

    # -------------------------------------------------------------------------------- ours

    def _fail(self, exc: Exception) -> None:
        waiting, self.waiting = self.waiting, None
        if waiting is not None and not waiting.done():
            waiting.set_exception(exc)

    async def exchange(self, request: bytes) -> tuple[int, bytes, int | None]:
        """Writes a request and waits for its whole answer: (status, body, Inference-Header-Content-Length)."""
        if not self.reusable:  # the server closed it while it was idle
            raise ConnectionError("the server closed the connection while it was idle")
        self.received = False
        self.waiting = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiting

    @property
    def reusable(self) -> bool:
        return not self.closed and self._keep_alive and not self.transport.is_closing()


class HttpCaller:
    """The Caller of HTTP: the Open Inference Protocol's REST infer call, binary tensors or JSON."""

    def __init__(
        self,
        host: str,
        port: int,
        model: str,
        names: Sequence[str],
        binary: bool,
        timings: bool,
        timeout_s: float,
        token: str | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.auth = "".join(f"{name}: {value}\r\n" for name, value in auth_headers(token).items())
        self.path = f"/v2/models/{model}/infer"
        self.names = tuple(names)
        self.binary = binary
        self.parameters = {TIMINGS_PARAMETER: True} if timings else None
        self.timeout_s = timeout_s
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()

    def encode(self, request_id: int, arrays: Sequence[np.ndarray]) -> bytes:
        body, header_length = render_http_request(
            str(request_id), list(zip(self.names, arrays)), self.binary, self.binary, self.parameters
        )
        kind = "application/json" if header_length is None else "application/octet-stream"
        extra = "" if header_length is None else f"{HEADER_LENGTH}: {header_length}\r\n"
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {host_port(self.host, self.port)}\r\n{self.auth}"
            f"Content-Type: {kind}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def open(self) -> None:
        return None  # connections are opened as requests need them

    async def call(self, payload: bytes) -> InferResult:
        status, body, header_length = await self._exchange(payload)
        if status != 200:
            raise CallError(status, _error_text(body))
        try:
            return parse_http_result(body, header_length)
        except ValueError as exc:  # an answer that is not the protocol's
            raise CallError("malformed", str(exc)) from None

    async def _exchange(self, request: bytes) -> tuple[int, bytes, int | None]:
        """On an idle connection, or a new one; a kept-alive connection the server closed meanwhile (before any
        byte of the answer) is replaced once."""
        for attempt in (0, 1):
            while self._idle and not self._idle[-1].reusable:  # closed by the server while idle: forgotten
                self._all.discard(self._idle.pop())
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await self._connect()
            try:
                answer = await asyncio.wait_for(connection.exchange(request), self.timeout_s)
            except ConnectionError as exc:
                self._all.discard(connection)
                if reused and attempt == 0 and not connection.received:
                    continue
                raise CallError("unreachable", str(exc)) from None
            except asyncio.TimeoutError:
                connection.transport.close()
                self._all.discard(connection)
                raise CallError("timeout", f"no answer within {self.timeout_s:g} s") from None
            if connection.reusable:
                self._idle.append(connection)
            else:
                self._all.discard(connection)
            return answer
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _connect(self) -> Connection:
        """A new connection. Refused, it is tried again every CONNECT_RETRY_S within the call's timeout: our door
        listens only once its process (or, inline, the backend's) has started, and the first request may be sent
        before that, as gRPC's wait_for_ready waits."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + self.timeout_s
        while True:
            try:
                _, connection = await loop.create_connection(Connection, self.host, self.port)
                break
            except ConnectionRefusedError as exc:
                if loop.time() > deadline_s:
                    raise CallError("unreachable", f"cannot connect to {self.host}:{self.port}: {exc}") from None
                await asyncio.sleep(CONNECT_RETRY_S)
            except OSError as exc:
                raise CallError("unreachable", f"cannot connect to {self.host}:{self.port}: {exc}") from None
        self._all.add(connection)
        return connection

    async def close(self) -> None:
        for connection in self._all:
            connection.transport.close()
        self._all.clear()
        self._idle.clear()


def _error_text(data: bytes) -> str:
    try:
        return str(orjson.loads(data).get("error", data[:200]))
    except (orjson.JSONDecodeError, AttributeError):
        return data[:200].decode(errors="replace")
