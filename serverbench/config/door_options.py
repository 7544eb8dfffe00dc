"""The network front door's flags: --transport http|grpc puts a door that speaks the Open Inference Protocol (KServe
v2, Triton's HTTP/gRPC) in front of the backend, and makes the frontend a client of it; --target points the frontend
at any such server that already runs; --serve_only runs the door and backend with no frontend of ours."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from serverbench.config.flags import flag
from serverbench.config.limits import DOORS, MAX_BODY_MB
from serverbench.config.transport_kinds import DEFAULT_PORTS as DEFAULT_PORTS  # re-exported: the door's modules
from serverbench.config.transport_kinds import NETWORK_TRANSPORTS as NETWORK_TRANSPORTS

LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = (LOOPBACK, "localhost", "::1")  # a door listening on these is reachable from this machine only
AUTH_TOKEN_ENV = "SERVERBENCH_AUTH_TOKEN"  # --auth_token's default, read by preflight
# The `door` extra of pyproject.toml, as the modules each needs (import name -> package): the door (uvicorn and its
# h11, grpc), its codec and our client of it (orjson, httptools, tritonclient's stubs). A run over shm or queues
# imports none of them; preflight refuses a network run on a machine without one, naming it.
DOOR_EXTRA = "door"
DOOR_PACKAGES = {
    "uvicorn": "uvicorn",
    "h11": "h11",
    "httptools": "httptools",
    "orjson": "orjson",
    "grpc": "grpcio",
    "tritonclient": "tritonclient[grpc]",
}


@dataclass(frozen=True)
class DoorOptions:
    door: str = flag(
        "door",
        "with --transport http|grpc, where the door runs: process (a process of its own that hands each request to "
        "the backend over the shm ring, as Triton's C++ front end hands them to its Python stub) or inline (on an "
        "event loop inside the backend process, sharing its GIL with the H2D, predict and D2H threads, as a "
        "FastAPI app that calls the model) (default process)",
        default="process",
        choices=DOORS,
    )
    host: str = flag(
        "door",
        f"interface the door listens on (default {LOOPBACK}: this machine only). Beyond loopback the door needs "
        "--auth_token (or --open_to_anyone)",
        default=LOOPBACK,
    )
    auth_token: str | None = flag(
        "door",
        "a token every request to the door must carry (HTTP: Authorization: Bearer TOKEN; gRPC: the same as "
        "metadata), the health endpoints excepted; a request without it is answered 401 (UNAUTHENTICATED) and "
        f"counted. Our generator sends it, to our door or to --target's server. Default: ${AUTH_TOKEN_ENV} (for a "
        "door beyond loopback and a --target), which keeps it out of the process list",
        metavar="TOKEN",
    )
    open_to_anyone: bool = flag(
        "door",
        "let a door listening beyond loopback serve without a token: anything that reaches the port can send it "
        "requests of any size",
        default=False,
        action="store_true",
    )
    port: int | None = flag(
        "door",
        "port the door listens on (default 8000 for http, 8001 for grpc, as Triton's; 0: any free port)",
        type=int,
        at_least=0,
        at_most=65535,
        why="a TCP port",
    )
    model_name: str | None = flag(
        "door",
        "the name the door serves the model under (default: identity, the torchvision name, a factory's name or a "
        ".pt2's file stem); with --target, the model to ask the server for",
    )
    target: str | None = flag(
        "door",
        "drive an Open Inference Protocol server that is already running (Triton, KServe, MLServer, or a door "
        "started by server.py --serve_only), e.g. http://host:8000 or grpc://host:8001: no backend of ours is "
        "started; the inputs come from the server's model metadata (--input overrides), and the columns that need "
        "our backend (stages, ceiling, efficiency, --verify) are left empty",
        metavar="URL",
    )
    serve_only: bool = flag(
        "door",
        "with --transport http|grpc: start the door and the backend and serve whoever sends requests until SIGINT or "
        "SIGTERM, then write the row from the door's own records (no frontend of ours)",
        default=False,
        action="store_true",
    )
    binary_data: bool = flag(
        "door",
        "as a client over HTTP: send tensors and ask for outputs in Triton's binary tensor extension rather than "
        "JSON lists (default on)",
        default=True,
        action=argparse.BooleanOptionalAction,
    )
    max_body_mb: float | None = flag(
        "door",
        "largest request body the door reads, in MiB; a larger one is answered 413 (default: 8 times a request's "
        "binary size, at least 4)",
        type=float,
        at_most=MAX_BODY_MB,
        why="a body is held in memory whole",
    )
