"""The row's columns about model instances (--instances): how many, the measured requests each answered, whether MPS
took their contexts, and the slowest instance's build figures; and which instance's ceiling the warm-up waited for."""

from __future__ import annotations

from collections.abc import Sequence

from serverbench.schema.messages import BackendReady, BackendReport
from serverbench.schema.records import RequestRecord


def warmup_busy_ns(backend: BackendReport, records: Sequence[RequestRecord]) -> tuple[int, int] | None:
    """When the backend instance that answered the first warm-up request was timing its ceiling before serving:
    that wait is left out of warmup_latency. One instance: its own span, as before instances existed."""
    spans = backend.ceiling_before_ns_by_instance
    if spans is None:
        return backend.ceiling_before_ns
    first = min((r for r in records if r.warmup), key=lambda r: r.request_id, default=None)
    return spans.get(first.instance) if first is not None else None


def requests_per_instance(records: Sequence[RequestRecord], count: int) -> str:
    """Measured requests each instance answered, ';'-separated in instance order (e.g. '52;48')."""
    served = [0] * count
    for record in records:
        if not record.warmup and 0 <= record.instance < count:
            served[record.instance] += 1
    return ";".join(str(n) for n in served)


def instance_columns(
    count: int, records: Sequence[RequestRecord], mps: bool | None, readies: Sequence[BackendReady]
) -> dict[str, object]:
    """The row's columns about instances: how many, the measured requests each answered, whether MPS was in use
    (None off CUDA). With several, the build and compile figures are the slowest instance's: the measured phase
    waited for it."""
    columns: dict[str, object] = {
        "instances": count,
        "requests_per_instance": requests_per_instance(records, count),
        "mps": mps,
    }
    if count > 1 and readies:

        def slowest(values: Sequence[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return max(known) if known else None

        columns.update(
            model_build_s=slowest([r.model_build_s for r in readies]),
            torch_load_time=slowest([r.torch_load_time_s for r in readies]),
            m_compile_time=slowest([r.compile_time_s for r in readies]),
        )
    return columns
