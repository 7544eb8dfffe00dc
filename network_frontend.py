"""Our frontend over the network (--transport http|grpc, --target): the load generator of client.py, its requests
sent by our client of the door or of the --target server. It needs the door's client packages (orjson, httptools,
tritonclient), which client.py never imports, and never imports torch: it sends the numpy pool, so the run's start
waits for no second torch import (network_roles.py, the backend with the door inside, does import it)."""

from __future__ import annotations

from multiprocessing.connection import Connection

from client import frontend_main
from serverbench.config.options import BenchConfig
from serverbench.load.state import StopSignal
from serverbench.transport.channels import Heartbeat, StartGate
from serverbench.transport.network import NetworkClient, network_client
from serverbench.transport.responses import ResponseChannel


def network_frontend_main(
    cfg: BenchConfig,
    control: ResponseChannel,
    report_conn: Connection,
    stop_event: StopSignal,
    gate: StartGate,
    heartbeat: Heartbeat,
) -> None:
    """Entry point of a frontend whose requests go out over the network: our client of the door (or of --target)
    is both its request and its response channel; `control` brings the backend's readiness and failures."""

    def connect() -> NetworkClient:
        client = network_client(cfg, control)
        client.start()
        return client

    frontend_main(cfg, None, control, report_conn, stop_event, gate, heartbeat, connect)
