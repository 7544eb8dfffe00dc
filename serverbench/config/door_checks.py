"""The network front door's flags taken together (serverbench.config.door_options): what applies with what, the
--target URL, and the values that follow (the port, the model's name, the transport a --target implies). Pure, as
build.py: the port's availability and the target's model metadata are preflight's."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import PurePath
from typing import Any
from urllib.parse import urlsplit

from serverbench.config.door_options import DEFAULT_PORTS, LOOPBACK, NETWORK_TRANSPORTS
from serverbench.config.flags import ConfigError, flag_of
from serverbench.config.inputs import image_input, model_source, request_bytes
from serverbench.config.limits import IDENTITY_MODEL
from serverbench.config.loads import DEFAULT_LOAD
from serverbench.config.options import BenchConfig, RankInfo
from serverbench.config.transport_kinds import DEFAULT_TRANSPORT

# Flags that only our own backend acts on: with --target the server is someone else's, and they would change nothing.
BACKEND_ONLY = {
    "verify": "the reference answers come from our backend",
    "compile": "the model is compiled by our backend",
    "aoti": "the model is compiled by our backend",
    "profile": "the profiler runs in our backend",
    "max_batch_size": "dynamic batching is our backend's; the target's is its own configuration",
    "checkpoint": "the target serves its own weights",
    "model_kwargs": "the target builds its own model",
    "design": "the target's server has its own design",
    "num_workers": "the target's server has its own threads",
    "precision": "the target's model runs at its own precision",
    "channels_last": "the target's model keeps its own memory layout",
    "planted_delay_us": "the delay is planted in our backend's forward",
    "spin_wait": "the spin-wait is our backend's",
    "ring_slots": "the ring joins our door to our backend",
    "ceiling_s": "the model-alone ceiling is timed in our backend",
}
# Each flag's default: a flag left as it is was not given.
MODEL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")  # safe in a URL path and a gRPC message as it is
DEFAULTS = {field.name: spec.default for field in dataclasses.fields(BenchConfig) if (spec := flag_of(field))}


def resolve_door(args: argparse.Namespace, rank: RankInfo | None) -> dict[str, Any]:
    """Checks the door's flags; returns transport, port and model_name resolved. Raises ConfigError."""
    transport = args.transport
    if args.target is not None:
        transport = _check_target(args)
    network = transport in NETWORK_TRANSPORTS
    if not network:
        _refuse_door_flags(args)
        return {}
    if rank is not None:
        raise ConfigError(
            f"--transport {transport} under torchrun: every rank's door would need a port of its own; "
            "run the ranks without a door, or one server.py --serve_only per host"
        )
    if args.door == "inline" and args.instances > 1:
        raise ConfigError(
            f"--door inline --instances {args.instances}: an inline door lives in one backend process; "
            "use --door process to serve several instances from one door"
        )
    if args.serve_only:
        for name, given in serve_only_refusals(args):
            if given:
                raise ConfigError(
                    f"{name} with --serve_only: there is no frontend of ours to do it; the clients decide"
                )
        if args.stability_pct is not None:
            raise ConfigError("--stability_pct with --serve_only: the door serves until it is stopped")
    _check_door_values(args)
    if args.target is not None:
        host, port = _target_address(args.target, transport)
        return {"transport": transport, "host": host, "port": port, "model_name": args.model_name or args.model}
    port = DEFAULT_PORTS[transport] if args.port is None else args.port
    return {"transport": transport, "port": port, "model_name": args.model_name or served_name(args.model)}


TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{8,256}")  # RFC 6750's b64token, and long enough to be one


def _check_door_values(args: argparse.Namespace) -> None:
    """Values the door could not serve with: refused here rather than found out as a failed run."""
    if not args.host.strip():
        raise ConfigError("--host '': give the interface to listen on (127.0.0.1: this machine; 0.0.0.0: every one)")
    if args.auth_token is not None and not TOKEN.fullmatch(args.auth_token):
        raise ConfigError("--auth_token: 8 to 256 of letters, digits and -._~+/= (a header value as it is)")
    name = args.model_name
    if name is not None and not MODEL_NAME.fullmatch(name):
        raise ConfigError(
            f"--model_name {name[:60]!r}: letters, digits, '_', '.' and '-' only, at most 256 (it goes into the "
            "protocol's URLs and gRPC names as it is)"
        )
    if args.max_body_mb is None:
        return
    if not args.max_body_mb > 0:
        raise ConfigError(f"--max_body_mb {args.max_body_mb:g}: must be positive")
    sized = args.inputs or model_source(args.model) != "pt2"  # a program's inputs are read in preflight
    if args.serve_only or not sized:
        return  # the clients that come decide their requests' sizes
    need = request_bytes(tuple(args.inputs or (image_input(args.image_size),)), args.batch_size, args.wire_dtype)
    if args.max_body_mb * 2**20 < need:
        raise ConfigError(
            f"--max_body_mb {args.max_body_mb:g}: below one request's {need / 2**20:.3g} MiB of tensor data; every "
            "request would be answered 413"
        )


def serve_only_refusals(args: argparse.Namespace) -> tuple[tuple[str, bool], ...]:
    """What only our frontend does, refused with --serve_only (the clients that come decide the load)."""
    return (
        ("--verify", args.verify),
        ("--find_peak", args.find_peak),
        (f"--load {args.load}", args.load != DEFAULT_LOAD.name),
        ("--concurrency", args.concurrency is not None),
        ("--rate", args.rate_rps is not None),
        ("--slo_ms", args.slo_ms is not None),
        ("--no-binary_data", not args.binary_data),
    )


def served_name(model: str) -> str:
    """The name the door serves --model under: identity, the torchvision name, a factory's name or a .pt2's stem."""
    if model == IDENTITY_MODEL:
        return model
    if ":" in model:
        return model.rpartition(":")[2]
    if model.endswith(".pt2"):
        return PurePath(model).stem
    return model


def _refuse_door_flags(args: argparse.Namespace) -> None:
    given = [
        flag
        for flag, is_given in (
            ("--door inline", args.door != "process"),
            ("--host", args.host != LOOPBACK),
            ("--port", args.port is not None),
            ("--model_name", args.model_name is not None),
            ("--serve_only", args.serve_only),
            ("--no-binary_data", not args.binary_data),
            ("--max_body_mb", args.max_body_mb is not None),
            ("--auth_token", args.auth_token is not None),
            ("--open_to_anyone", args.open_to_anyone),
        )
        if is_given
    ]
    if given:
        raise ConfigError(
            f"{given[0]} applies with --transport http or grpc only (this run is --transport {args.transport})"
        )


def _check_target(args: argparse.Namespace) -> str:
    """The transport a --target implies, after refusing what cannot go with it."""
    try:
        scheme = urlsplit(args.target).scheme
    except ValueError as exc:  # a bracketed host that is no IPv6 address, or brackets left open
        raise ConfigError(f"--target {args.target!r}: not a URL ({exc}); expected http://host:port") from None
    if scheme not in NETWORK_TRANSPORTS:
        raise ConfigError(
            f"--target {args.target!r}: expected http://host:port or grpc://host:port"
            + (" (TLS is not supported)" if scheme in ("https", "grpcs") else "")
        )
    if args.transport not in (DEFAULT_TRANSPORT.name, scheme):  # the default: not given
        raise ConfigError(f"--target {args.target} speaks {scheme}, and this run asks --transport {args.transport}")
    if args.serve_only:
        raise ConfigError("--target with --serve_only: the first drives a server, the second is one; give one")
    if args.instances != 1:
        raise ConfigError("--instances with --target: the target's instances are its own configuration")
    for name, why in BACKEND_ONLY.items():
        if getattr(args, name) != DEFAULTS[name]:
            raise ConfigError(f"--{name} with --target: {why}")
    if args.port is not None or args.host != LOOPBACK:
        raise ConfigError("--host and --port are the door's; with --target, the URL says where the server is")
    for name, given in (
        ("--door inline", args.door != "process"),
        ("--max_body_mb", args.max_body_mb is not None),
        ("--wire_dtype uint8", args.wire_dtype != "float32"),
        ("--open_to_anyone", args.open_to_anyone),
    ):
        if given:
            raise ConfigError(f"{name} with --target: the target's server and model decide it, not our door")
    return scheme


def _target_address(url: str, scheme: str) -> tuple[str, int]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"--target {url!r}: the port is not a number from 0 to 65535") from None
    if not parts.hostname:
        raise ConfigError(f"--target {url!r}: no host; expected {scheme}://host:port")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"--target {url!r}: give only {scheme}://host:port (the model is --model_name or --model)")
    return parts.hostname, DEFAULT_PORTS[scheme] if port is None else port
