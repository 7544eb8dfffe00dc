"""The door's life on its event loop: the model's description from the configuration, the server of the protocol
(uvicorn for HTTP, grpc.aio for gRPC) on a socket bound here, and the watch that keeps its heartbeat, finishes when
the run does (no request taken any more, the backend's end markers sent, the answers in flight let out) and leaves
when the server stops the run. `serve_door_process` is the door's own process (--door process); the inline door
(serverbench/door/inline.py) runs `run_door` on a thread of the backend process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

import uvicorn

from serverbench.config.inputs import wire_dtype_of
from serverbench.config.limits import POLL_S
from serverbench.config.options import BenchConfig
from serverbench.config.transport_kinds import HTTP
from serverbench.door.core import DoorCore, DoorLimits
from serverbench.door.grpc_service import start_grpc_door
from serverbench.door.http_app import HttpDoor
from serverbench.door.http_wire import quiet_cancel_at_close, refusing_protocol
from serverbench.door.links import RingLink
from serverbench.schema.messages import DoorReport
from serverbench.system.net import host_port, listen
from serverbench.transport.channels import ShmRequestChannel
from serverbench.transport.oip import ModelSpec, TensorSpec, oip_datatype
from serverbench.transport.responses import ControlChannel, LoopReader, ResponseChannel

MIB = 1 << 20
MIN_BODY_BYTES = 4 * MIB
BODY_PER_REQUEST = 8  # JSON numbers take several times a binary tensor's bytes
LISTEN_BACKLOG = 2048
KEEP_ALIVE_S = 3600
CLOSE_GRACE_S = 1.0  # connections still open when the door leaves get this long to finish


def model_spec(cfg: BenchConfig) -> ModelSpec:
    """The model as the door describes it before the backend is ready (its outputs come with BackendReady)."""
    inputs = tuple(
        TensorSpec(spec.name, oip_datatype(wire_dtype_of(spec, cfg.wire_dtype)), spec.shape)
        for spec in cfg.model_inputs
    )
    return ModelSpec(
        name=cfg.model_name,
        inputs=inputs,
        outputs=(),
        batch_size=cfg.batch_size,
        max_batch_size=cfg.formed_rows if cfg.batching else cfg.batch_size,
        queue_delay_us=round((cfg.max_queue_delay_ms or 0.0) * 1000) if cfg.batching else None,
    )


def door_limits(cfg: BenchConfig) -> DoorLimits:
    max_body_bytes = (
        round(cfg.max_body_mb * MIB)
        if cfg.max_body_mb is not None
        else max(MIN_BODY_BYTES, BODY_PER_REQUEST * cfg.request_bytes)
    )
    # Every generator of ours sends its own warm-up (--generators): each may wait out the model's build.
    warmup_requests = cfg.warmup_iters * cfg.generators
    return DoorLimits(
        cfg.timeout_s,
        cfg.warmup_timeout_s,
        max_body_bytes,
        warmup_requests,
        cfg.serve_only,
        cfg.instances,
        cfg.auth_token,
    )


def bind(host: str, port: int) -> socket.socket:
    """The door's listening socket."""
    return listen(host, port, LISTEN_BACKLOG)


class QuietUvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the server process decides what a signal does to the run."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class HttpServer:
    """uvicorn serving an ASGI application (the door's; bench.echo_server's, its anchor, the same way) on the socket
    bound here, as a task of this loop; `refused(status)` counts each request refused below the application
    (door/http_wire.py)."""

    def __init__(
        self, app: Callable, sock: socket.socket, refused: Callable[[int], None] = lambda status: None
    ) -> None:
        config = uvicorn.Config(
            app,
            http=refusing_protocol(refused),
            ws="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            server_header=False,
            date_header=False,
            # No X-Forwarded-* rewriting (uvicorn's ProxyHeadersMiddleware wraps every request otherwise: 10 % of the
            # door's samples at concurrency 1 under py-spy): the door has no proxy in front of it.
            proxy_headers=False,
            timeout_graceful_shutdown=CLOSE_GRACE_S,
            # A client's idle connection stays open between its requests however long the gap (a warm-up that
            # compiles, a slow schedule): clients of a benchmark keep their connections, as perf_analyzer does.
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        quiet_cancel_at_close()  # after the Config, which sets uvicorn's loggers up
        self._server = QuietUvicorn(config)
        self._sock = sock
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:  # listening once uvicorn has started on the socket
            if self._task.done():
                self._task.result()  # raises what kept it from starting
                raise RuntimeError("uvicorn stopped before it started serving")
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.wait_for(self._task, CLOSE_GRACE_S + 2 * POLL_S + 1.0)


class GrpcServer:
    def __init__(self, core: DoorCore, sock: socket.socket) -> None:
        self._core = core
        self._sock = sock
        self._server = None

    async def start(self) -> None:
        # grpc binds its own socket: the one bound here held the port until now (and proved it free)
        host, port = self._sock.getsockname()[:2]
        self._sock.close()
        self._server = await start_grpc_door(self._core, host, port)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(CLOSE_GRACE_S)


async def run_door(
    cfg: BenchConfig,
    core: DoorCore,
    sock: socket.socket,
    should_finish: Callable[[], bool],
    should_leave: Callable[[], bool],
    beat: Callable[[], None],
    listening: Callable[[], None] = lambda: None,
) -> None:
    """Serves until the run finishes (then lets the answers in flight out, for at most --timeout_s) or the door is
    told to leave; `listening` is called once it listens, as the log says (the server's "serving on" comes about a
    second before the port accepts)."""
    server = HttpServer(HttpDoor(core), sock, core.failed) if cfg.transport == HTTP.name else GrpcServer(core, sock)
    await server.start()
    logging.getLogger("door").info("listening on %s://%s", cfg.transport, core.report.address)
    listening()
    try:
        deadline_s: float | None = None
        while True:
            beat()
            if should_leave():
                return
            if should_finish() and core.accepting:
                core.finish()
                deadline_s = time.monotonic() + cfg.timeout_s
            if deadline_s is not None and (core.pending == 0 or time.monotonic() > deadline_s):
                return
            await asyncio.sleep(POLL_S)
    finally:
        await server.close()


def loop_factory(transport: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop under uvicorn (what uvicorn[standard] runs on); grpc.aio on asyncio's own loop, the one it supports."""
    if transport == HTTP.name:
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def serve_door_process(
    cfg: BenchConfig,
    sock: socket.socket,
    ring: ShmRequestChannel,
    responses: ResponseChannel,
    control: ControlChannel | None,
    should_finish: Callable[[], bool],
    should_leave: Callable[[], bool],
    beat: Callable[[], None],
) -> DoorReport:
    """--door process: the door's whole life in this process; its report."""

    async def main() -> DoorReport:
        loop = asyncio.get_running_loop()
        core = DoorCore(model_spec(cfg), RingLink(ring, loop), door_limits(cfg), control, address_of(sock))
        LoopReader(responses, loop, core.on_message, core.backend_gone)
        await run_door(cfg, core, sock, should_finish, should_leave, beat)
        return core.ended_report()

    with asyncio.Runner(loop_factory=loop_factory(cfg.transport)) as runner:
        return runner.run(main())


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return host_port(host, port)  # [::1]:8000, as a URL writes it
