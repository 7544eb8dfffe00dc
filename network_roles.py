"""The backend of a run over the network with the door inside it (--transport http|grpc --door inline): the door's
loop on a thread of the backend's process. It needs the door's packages (the `door` extra: uvicorn, httptools,
orjson, tritonclient), which worker.py and client.py, the roles over shm and queues, never import: a machine
without them still runs every design over shm and queues. The door in a process of its own is door.py, our
frontend over the network network_frontend.py; serverbench/launch/children.py names each role's module."""

from __future__ import annotations

from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as ProcessEvent

from serverbench.config.options import BenchConfig
from serverbench.door.inline import InlineDoor
from serverbench.launch import procutil
from serverbench.launch.instances import Instance
from serverbench.schema.messages import BackendReport
from serverbench.system import process
from serverbench.transport.responses import ControlChannel
from worker import Backend, serve_and_report


def backend_door_main(
    cfg: BenchConfig,
    control: ControlChannel | None,
    report_conn: Connection,
    stop_event: ProcessEvent,
    finish_event: ProcessEvent,
    instance: Instance,
) -> None:
    """Entry point of a backend process with the network door inside it (--door inline): the door's loop on a thread
    of this process feeds the designs; `control` carries the backend's other messages to our frontend (None with
    --serve_only)."""
    process.setup_child("backend", cfg.verbose)
    instance.keep_beating()
    if control is not None:
        control.keep_writing_end(instance.index)
    door = InlineDoor(cfg, control, finish_event.is_set)
    try:
        responses = door.start()
    except BaseException as exc:  # noqa: BLE001 - reported as data: the door could not listen
        report = BackendReport(status="error", error=f"the door could not start: {process.one_line(exc)}")
        procutil.finish_child(report_conn, report, [])
        return
    backend = Backend(cfg, door.requests, responses, instance, stop_event)
    serve_and_report(backend, report_conn, door.stop)
