"""The run's child processes, made by role and not started yet: the backend (--instances of it), the network door
in its own process (--transport http|grpc --door process), and our frontend (none with --serve_only), each with the
channels its role uses.

    shm, queue          frontend --requests--> backend --responses--> frontend
    door process        frontend --HTTP/gRPC--> door --ring--> backend --responses--> door --HTTP/gRPC--> frontend
                        (the backend's other messages: door --control--> frontend)
    door inline         frontend --HTTP/gRPC--> backend (its door thread); its other messages --control--> frontend
    --target            frontend --HTTP/gRPC--> someone else's server

With --generators N (the network only) there are N frontends, each with its own share of the load
(config.generators.generator_config), its own control channel and heartbeat: the backend's other messages go to
every one of them (responses.ControlFanout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from serverbench.config.door_options import NETWORK_TRANSPORTS
from serverbench.config.generators import generator_config
from serverbench.config.options import BenchConfig
from serverbench.launch.frontends import generator_roles
from serverbench.launch.instances import Instance, backend_roles
from serverbench.launch.procutil import run_role
from serverbench.transport.channels import Heartbeat, StartGate
from serverbench.transport.responses import ControlChannel, ControlFanout, ResponseChannel


@dataclass
class Children:
    """The run's child processes by role (the backend's, one per instance, then the door's and the frontend's), the
    server's end of each one's report pipe, the children's ends (closed here once they have started) and each one's
    heartbeat."""

    roles: list[str]  # the backend's
    frontends: list[str] = field(default_factory=list)  # our load generators' (none with --serve_only)
    processes: dict[str, BaseProcess] = field(default_factory=dict)
    conns: dict[str, Connection] = field(default_factory=dict)
    child_ends: list[Connection] = field(default_factory=list)
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    # --instances: held here for the run, because Process.start() drops its args and a spawned child opens the
    # barrier's semaphores only as it starts: collected with the args, they would be gone before it could.
    barrier: object | None = None
    # --transport http|grpc: set once the run is to finish (our frontend has reported, or --serve_only was told to
    # stop): the door takes no more requests and sends the backend its end markers.
    finish_event: object | None = None
    control: ControlChannel | None = None  # held here until the children have their ends (the server closes it)
    environment: dict[str, str] = field(default_factory=dict)  # what each child sets first (its TMPDIR)

    def add(self, ctx, role: str, module: str, function: str, *args) -> None:
        self.conns[role], report_end = ctx.Pipe(duplex=False)
        self.child_ends.append(report_end)
        # The report pipe goes after the channels, as each entry point takes it.
        channels, rest = args
        self.processes[role] = ctx.Process(
            target=run_role, name=role, args=(module, function, self.environment, *channels, report_end, *rest)
        )


def is_network(cfg: BenchConfig) -> bool:
    return cfg.transport in NETWORK_TRANSPORTS


def make_children(
    ctx,
    cfg: BenchConfig,
    requests,
    responses: ResponseChannel,
    stop_event,
    gate: StartGate,
    environment: dict[str, str],
) -> Children:
    """Every child process of the run, not started yet. `requests`: the ring or queue into the backend (None for an
    inline door and a --target); `responses`: the backend's answers to whoever reads them (the frontend, or the
    door in its own process); `environment`: what every child sets before it imports its role."""
    roles = [] if cfg.target is not None else backend_roles(cfg.instances)
    children = Children(roles, environment=environment)
    children.heartbeats = {role: Heartbeat(ctx) for role in roles}
    # --instances: every instance passes this before each ceiling loop, so that they time it together.
    children.barrier = ctx.Barrier(cfg.instances) if cfg.instances > 1 else None
    network = is_network(cfg)
    inline = network and cfg.door == "inline" and cfg.target is None
    # Our frontends hear of the backend's readiness and failures over `control` when requests do not come back
    # on the backend's response channel: a channel for each.
    children.frontends = [] if cfg.serve_only else generator_roles(cfg.generators)
    # The backend instances write their control channel themselves with an inline door, else the door alone.
    writers = cfg.instances if inline else 1
    controls = [ResponseChannel(ctx, cfg.timeout_s, writers) for _ in children.frontends] if network else []
    control = (controls[0] if len(controls) == 1 else ControlFanout(controls)) if controls else None
    children.control = control
    if network and cfg.target is None:
        children.finish_event = ctx.Event()
    for index, role in enumerate(roles):
        instance = Instance(index, cfg.instances, children.barrier, children.heartbeats[role])
        if inline:
            children.add(
                ctx,
                role,
                "network_roles",
                "backend_door_main",
                (cfg, control),
                (stop_event, children.finish_event, instance),
            )
        else:
            children.add(ctx, role, "worker", "backend_main", (cfg, requests, responses), (stop_event, instance))
    if network and not inline and cfg.target is None:
        children.heartbeats["door"] = Heartbeat(ctx)
        rest = (stop_event, children.finish_event, children.heartbeats["door"])
        children.add(ctx, "door", "door", "door_main", (cfg, requests, responses, control), rest)
    for index, role in enumerate(children.frontends):
        children.heartbeats[role] = Heartbeat(ctx)
        own = generator_config(cfg, index)  # its share of the load, its block of request ids
        # Over the network each frontend's requests go out through its own client; it reads its control channel.
        rest = (stop_event, gate, children.heartbeats[role])
        if network:
            children.add(ctx, role, "network_frontend", "network_frontend_main", (own, controls[index]), rest)
        else:
            children.add(ctx, role, "client", "frontend_main", (own, requests, responses), rest)
    return children
