"""A served model's statistics, as Triton's statistics extension gives them (Triton and our door serve it), read
before and after a run: what the door counted during it, per stage."""

from __future__ import annotations

import json
import sys
import urllib.request

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from serverbench.config.transport_kinds import HTTP
from serverbench.system.process import one_line

STATS_TIMEOUT_S = 10.0
DOOR_STAGES = ("success", "queue", "compute_input", "compute_infer", "compute_output")


def door_statistics(protocol: str, address: str, model: str) -> dict[str, tuple[int, int]] | None:
    """The door's cumulative statistics: {stage: (count, ns)}; None when they cannot be read (a side figure: its
    absence is said, the run goes on)."""
    names = (*DOOR_STAGES, "fail")
    try:
        if protocol == HTTP.name:
            url = f"http://{address}/v2/models/{model}/stats"
            with urllib.request.urlopen(url, timeout=STATS_TIMEOUT_S) as answer:
                stats = json.loads(answer.read())["model_stats"][0]["inference_stats"]
            return {name: (int(stats[name]["count"]), int(stats[name]["ns"])) for name in names}
        with grpc.insecure_channel(address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            reply = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=model), timeout=STATS_TIMEOUT_S)
        stats = reply.model_stats[0].inference_stats
        return {name: (getattr(stats, name).count, getattr(stats, name).ns) for name in names}
    except Exception as exc:  # noqa: BLE001 - whatever the client library raises
        print(f"bench.peers: the door's statistics could not be read: {one_line(exc)}", file=sys.stderr, flush=True)
        return None


def door_delta(before: dict | None, after: dict | None) -> dict[str, object]:
    """What the door counted during one run: its requests, failures and mean seconds per request of each stage."""
    if before is None or after is None:
        return {}
    delta = {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in after}
    found: dict[str, object] = {"door_requests": delta["success"][0], "door_failed": delta["fail"][0]}
    for stage in DOOR_STAGES:
        count, ns = delta[stage]
        found[f"door_{stage}_s"] = ns / count / 1e9 if count else None
    return found
