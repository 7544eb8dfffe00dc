"""Triton's statistics extension as the door keeps it: each model's counts and durations (`ModelStats`, which the
door adds to as it answers) and the document GET /v2/models/{m}/stats and gRPC's ModelStatistics give of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from serverbench.transport.oip import ModelSpec


@dataclass(frozen=True)
class Durations:
    count: int = 0
    ns: int = 0


@dataclass
class ModelStats:
    """What the door counts for the statistics endpoint (mutable: the door adds to it)."""

    success: Durations = field(default_factory=Durations)
    fail: Durations = field(default_factory=Durations)
    queue: Durations = field(default_factory=Durations)
    compute_input: Durations = field(default_factory=Durations)
    compute_infer: Durations = field(default_factory=Durations)
    compute_output: Durations = field(default_factory=Durations)
    inference_count: int = 0  # rows served
    execution_count: int = 0  # forwards run (a formed batch counts once) -- the door fills it
    last_inference_ms: int = 0  # ms since the epoch

    def add(self, name: str, ns: int, count: int = 1) -> None:
        """Add `count` events taking `ns` in all to the Durations field `name` ("success", "queue", ...)."""
        current = getattr(self, name, None)
        if not isinstance(current, Durations):
            raise ValueError(f"{name!r} is not a duration of ModelStats (one of {', '.join(_DURATION_FIELDS)})")
        setattr(self, name, Durations(current.count + count, current.ns + ns))


_DURATION_FIELDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def stats_document(spec: ModelSpec, stats: ModelStats) -> dict:
    """GET /v2/models/{name}/stats in Triton's shape. perf_analyzer reads every count and ns below as an unsigned
    integer, cache_hit and cache_miss included, and the version as a string."""
    durations = {name: asdict(getattr(stats, name)) for name in _DURATION_FIELDS}
    durations["cache_hit"] = durations["cache_miss"] = {"count": 0, "ns": 0}  # no response cache
    model = {
        "name": spec.name,
        "version": spec.version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": durations,
        "batch_stats": [],
    }
    return {"model_stats": [model]}
