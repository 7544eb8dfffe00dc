"""The door's HTTP side: a bare ASGI application (no framework, no per-request validation layer on the hot path)
under uvicorn with httptools, speaking the Open Inference Protocol's REST API with Triton's binary tensor extension
and the two Triton endpoints perf_analyzer reads (model configuration and statistics).

    GET  /v2                                  server metadata (with the extensions perf_analyzer reads)
    GET  /v2/health/live, /v2/health/ready
    GET  /v2/models/{m}[/versions/{v}]        model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready
    GET  /v2/models/{m}[/versions/{v}]/config Triton's model configuration
    GET  /v2/models[/{m}[/versions/{v}]]/stats Triton's statistics: our stages as queue and compute times
    POST /v2/models/{m}[/versions/{v}]/infer  JSON tensors, or binary ones after an Inference-Header-Content-Length
                                              JSON header

Every error is an answer with {"error": "..."} and its status (400 malformed, 404 unknown model or path, 405 wrong
method, 413 body too large, 503 not ready, ending or backend failed), counted for the row; the door serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import orjson

from serverbench.door.core import DoorCore
from serverbench.door.http_wire import CLIENT_GONE, REFUSED
from serverbench.transport.oip import (
    TIMINGS_PARAMETER,
    ProtocolError,
    error_body,
    parse_http_infer,
    render_http_infer,
)
from serverbench.transport.oip_stats import stats_document

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

HEADER_LENGTH = b"inference-header-content-length"
JSON_TYPE = b"application/json"
BINARY_TYPE = b"application/octet-stream"
SERVER_EXTENSIONS = ("binary_tensor_data", "statistics", "model_configuration")
SERVER_VERSION = "2"  # the Open Inference Protocol's version the door speaks


class ClientGone(Exception):
    """The client disconnected before its request was read whole."""


class HttpDoor:
    """The ASGI application over one DoorCore."""

    def __init__(self, core: DoorCore) -> None:
        self.core = core
        self.server_metadata = orjson.dumps(
            {"name": "serverbench", "version": SERVER_VERSION, "extensions": list(SERVER_EXTENSIONS)}
        )

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not spoken here
        arrived_ns = time.perf_counter_ns()
        try:
            await self._route(scope, receive, send, arrived_ns)
        except ProtocolError as exc:
            self.core.failed(exc.status)
            await send_answer(send, exc.status, error_body(exc.message), close=exc.status == 413)
        except ClientGone:
            if not scope.get(REFUSED):  # else the protocol answered it already, and counted it
                self.core.failed(0, disconnected=True)
        except asyncio.CancelledError:
            # The door closing while a body still comes in (its grace over): that client is let go, counted as a
            # disconnect, with no traceback (uvicorn logs one for anything that leaves the application).
            self.core.failed(0, disconnected=True)
            with contextlib.suppress(Exception):
                await send_answer(send, 503, error_body("the door is closing"), close=True)

    async def _route(self, scope: dict, receive: Receive, send: Send, arrived_ns: int) -> None:
        method, parts = scope["method"], scope["path"].strip("/").split("/")
        if parts[:1] != ["v2"]:
            raise ProtocolError(404, f"no such endpoint: {scope['path']}")
        rest = parts[1:]
        if self.core.limits.auth_token is not None and rest[:1] != ["health"]:  # health checks carry no token
            self.core.check_token(_header(scope, b"authorization"))
        if rest == [] or rest[0] == "health":
            _need(method, "GET")
            await self._server_endpoint(rest, send)
            return
        if rest[0] != "models" or len(rest) < 2:
            raise ProtocolError(404, f"no such endpoint: {scope['path']}")
        if rest[1:] == ["stats"]:
            _need(method, "GET")
            await send_answer(send, 200, orjson.dumps(stats_document(self.core.spec, self.core.stats)))
            return
        name, version, action = _model_path(rest[1:], scope["path"])
        self.core.check_model(name, version)
        if action == "infer":
            _need(method, "POST")
            await self._infer(scope, receive, send, arrived_ns)
            return
        _need(method, "GET")
        await self._model_endpoint(action, send)

    async def _server_endpoint(self, rest: list[str], send: Send) -> None:
        if rest == []:
            await send_answer(send, 200, self.server_metadata)
        elif rest == ["health", "live"]:
            await send_answer(send, 200, b"")
        elif rest == ["health", "ready"]:
            await send_answer(send, 200 if self.core.ready else 503, b"")
        else:
            raise ProtocolError(404, f"no such endpoint: /v2/{'/'.join(rest)}")

    async def _model_endpoint(self, action: str, send: Send) -> None:
        core = self.core
        if action == "":
            await send_answer(send, 200, orjson.dumps(core.described_spec().metadata()))
        elif action == "ready":
            await send_answer(send, 200 if core.ready else 503, b"")
        elif action == "config":
            await send_answer(send, 200, orjson.dumps(core.described_spec().config()))
        elif action == "stats":
            await send_answer(send, 200, orjson.dumps(stats_document(core.spec, core.stats)))
        else:
            raise ProtocolError(404, f"no such model endpoint: {action}")

    async def _infer(self, scope: dict, receive: Receive, send: Send, arrived_ns: int) -> None:
        core = self.core
        headers = dict(scope["headers"])
        body = await _read_body(receive, headers, core.limits.max_body_bytes)
        header_length = _header_length(headers)
        request = parse_http_infer(body, header_length, core.spec)
        answer = await core.infer(request.arrays, arrived_ns)
        response = answer.response
        parameters = None
        if request.parameters.get(TIMINGS_PARAMETER):
            parameters = {TIMINGS_PARAMETER: orjson.dumps(list(response.timings.__dict__.values())).decode()}
        out, out_header_length = render_http_infer(
            core.spec, request.id, response.outputs, request.binary_outputs, request.outputs, parameters
        )
        await send_answer(send, 200, out, header_length=out_header_length)
        if scope.get(CLIENT_GONE, _never_gone)():  # it left before its answer: the answer went nowhere
            core.failed(0, disconnected=True)
        else:
            core.answered(answer, time.perf_counter_ns())


def _never_gone() -> bool:
    return False


def _header(scope: dict, name: bytes) -> bytes | None:
    """A request header's value (the first of that name), or None."""
    return next((value for key, value in scope["headers"] if key == name), None)


def _need(method: str, allowed: str) -> None:
    if method != allowed:
        raise ProtocolError(405, f"{method} is not allowed here: use {allowed}")


def _model_path(rest: list[str], path: str) -> tuple[str, str | None, str]:
    """(model, version or None, action) of /v2/models/{m}[/versions/{v}][/action]."""
    name, tail = rest[0], rest[1:]
    version = None
    if tail[:1] == ["versions"]:
        if len(tail) < 2 or not tail[1]:  # /versions//ready names no version
            raise ProtocolError(404, f"no such endpoint: {path}")
        version, tail = tail[1], tail[2:]
    if len(tail) > 1:
        raise ProtocolError(404, f"no such endpoint: {path}")
    return name, version, tail[0] if tail else ""


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(HEADER_LENGTH)
    if value is None:
        return None
    # Digits only, as HTTP writes a length: int() would take " 3190 ", "+5" and "1_0" too.
    if not value.isdigit():
        raise ProtocolError(400, f"Inference-Header-Content-Length {value[:40]!r} is not a number")
    return int(value)


async def _read_body(receive: Receive, headers: dict[bytes, bytes], max_bytes: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to be over max_bytes (its Content-Length, or what
    has come so far)."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ProtocolError(413, f"the body of {int(declared)} bytes is over the door's limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise ProtocolError(413, f"the body is over the door's limit of {max_bytes} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_answer(
    send: Send, status: int, body: bytes, header_length: int | None = None, close: bool = False
) -> None:
    headers = [
        (b"content-type", JSON_TYPE if header_length is None else BINARY_TYPE),
        (b"content-length", str(len(body)).encode()),
    ]
    if header_length is not None:
        headers.append((HEADER_LENGTH, str(header_length).encode()))
    if close:
        headers.append((b"connection", b"close"))  # the rest of an oversized body is not read
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
