"""Builders the tests share (a test module never imports another test module's helpers)."""

from __future__ import annotations

from serverbench.schema.records import RequestRecord


def timed_record(
    request_id: int,
    stamps_ns: tuple[int, int, int, int, int, int],
    *,
    warmup: bool = False,
    batch_size: int = 1,
    copy_ms: tuple[float, float, float] = (0.0, 0.0, 0.0),
    worker: int = 0,
    **more,
) -> RequestRecord:
    """A request's record from its six stamps in order: sent, taken, on the device, forward done, on the host,
    received; copy_ms is (h2d copy, forward, d2h copy); `more` sets any other field."""
    sent, taken, h2d_done, forward_done, d2h_done, received = stamps_ns
    h2d_copy_ms, forward_ms, d2h_copy_ms = copy_ms
    return RequestRecord(
        request_id=request_id,
        warmup=warmup,
        batch_size=batch_size,
        sent_ns=sent,
        taken_ns=taken,
        h2d_done_ns=h2d_done,
        forward_done_ns=forward_done,
        d2h_done_ns=d2h_done,
        received_ns=received,
        h2d_copy_ms=h2d_copy_ms,
        forward_ms=forward_ms,
        d2h_copy_ms=d2h_copy_ms,
        worker=worker,
        **more,
    )
