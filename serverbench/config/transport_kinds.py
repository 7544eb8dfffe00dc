"""The transports --transport offers, declared once each: how requests reach the backend (the shm ring, a
multiprocessing queue, or the network front door in front of the ring), what bounds them, and the door's port.
The channels that carry them are serverbench/transport/'s (channels.py: the ring and the queue, written to one
interface, `RequestSender`; network.py: the door's client), chosen by these declarations. Adding a transport: its
declaration here and its line in TRANSPORT_KINDS, its channel there (docs/architecture.md: "Adding a transport")."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from serverbench.config.flags import ConfigError


@dataclass(frozen=True)
class TransportKind:
    name: str
    help: str  # its clause of --transport's help
    through_ring: bool  # requests reach the backend through the shm ring: --ring_slots bounds them
    network: bool = False  # the network front door receives them, and the frontend is its client
    default_port: int | None = None  # the door's, as Triton's
    # Our client opens a connection for each request in flight (HTTP/1.1 answers one request at a time per
    # connection): the frontend and the door each hold an open file per request out
    connection_per_request: bool = False


SHM = TransportKind(
    "shm",
    "shm: a ring of --ring_slots shared-memory slots made once before the processes start (page-locked once on "
    "CUDA); each request is written into a free slot and only a small header crosses the queue; the slot is handed "
    "back once its bytes are on the device",
    through_ring=True,
)
QUEUE = TransportKind(
    "queue",
    "queue: the reference's tensors through multiprocessing queues, a fresh shared-memory segment per request, "
    "pinned again on arrival (--max_queued_requests bounds them)",
    through_ring=False,
)
_DOOR = (
    "a front door speaking the Open Inference Protocol (Triton's and KServe's) receives the requests over the network "
    "and hands them on over the shm ring (--door process) or inside the backend (--door inline); the frontend is its "
    "client"
)
HTTP = TransportKind(
    "http", f"http: {_DOOR}", through_ring=True, network=True, default_port=8000, connection_per_request=True
)
GRPC = TransportKind("grpc", "grpc: the same door over gRPC", through_ring=True, network=True, default_port=8001)
TRANSPORT_KINDS: tuple[TransportKind, ...] = (SHM, QUEUE, HTTP, GRPC)
TRANSPORTS = tuple(kind.name for kind in TRANSPORT_KINDS)
DEFAULT_TRANSPORT = SHM
NETWORK_TRANSPORTS = tuple(kind.name for kind in TRANSPORT_KINDS if kind.network)
DEFAULT_PORTS = {kind.name: kind.default_port for kind in TRANSPORT_KINDS if kind.network}


def transport_kind(name: str) -> TransportKind:
    for kind in TRANSPORT_KINDS:
        if kind.name == name:
            return kind
    raise ConfigError(f"--transport {name!r}: expected one of {', '.join(TRANSPORTS)}")


class Hop(enum.Enum):
    """How a run's requests cross into the backend's process."""

    RING = "the shm ring"  # shm, and a door in its own process
    QUEUE = "multiprocessing queues"  # the reference's
    NONE = "no process boundary"  # a door inside the backend, or another server (--target)


class HopSettings(Protocol):
    transport: str
    door: str  # with a network transport: "process" or "inline"
    target: str | None


def request_hop(settings: HopSettings) -> Hop:
    kind = transport_kind(settings.transport)
    if settings.target is not None or (kind.network and settings.door == "inline"):
        return Hop.NONE
    return Hop.RING if kind.through_ring else Hop.QUEUE


def help_text() -> str:
    return "; ".join(kind.help for kind in TRANSPORT_KINDS) + f" (default {DEFAULT_TRANSPORT.name})"
