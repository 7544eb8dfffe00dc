"""The network front door's process (--transport http|grpc --door process): listens on --host:--port, speaks the
Open Inference Protocol over HTTP (uvicorn) or gRPC (grpc.aio), and hands each request to the backend over the shm
ring, as our own frontend does over shm. The door is in serverbench/door; this module is the process's entry."""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as ProcessEvent

from serverbench.config.options import BenchConfig
from serverbench.door.serving import bind, serve_door_process
from serverbench.launch import procutil
from serverbench.schema.messages import DoorReport
from serverbench.system import process
from serverbench.transport.channels import Heartbeat, ShmRequestChannel
from serverbench.transport.responses import ControlChannel, ResponseChannel


def door_main(
    cfg: BenchConfig,
    ring: ShmRequestChannel,
    responses: ResponseChannel,
    control: ControlChannel | None,
    report_conn: Connection,
    stop_event: ProcessEvent,
    finish_event: ProcessEvent,
    heartbeat: Heartbeat,
) -> None:
    """Entry point of the door process. `responses`: the backend's answers, read here; `control`: where the
    backend's other messages go on to our frontend (None with --serve_only)."""
    process.setup_child("door", cfg.verbose)
    heartbeat.beat()
    responses.keep_reading_end()
    if control is not None:
        control.keep_writing_end()
    try:
        sock = bind(cfg.host, cfg.port)
        report = serve_door_process(
            cfg,
            sock,
            ring,
            responses,
            control,
            finish_event.is_set,
            lambda: stop_event.is_set() or process.parent_gone(),
            heartbeat.beat,
        )
    except BaseException as exc:  # noqa: BLE001 - reported as data
        report = DoorReport(status="error", error=process.one_line(exc), traceback=traceback.format_exc())
    channels = [ring, responses] + ([control] if control is not None else [])
    procutil.finish_child(report_conn, report, channels)
