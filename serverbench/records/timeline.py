"""The per-request timeline of one run, as Chrome trace / Perfetto JSON (`server.py --trace`).

One lane per thread that works on requests (the frontend's sender and receiver; the backend's H2D, prediction
and D2H threads, or the one loop of the serial design) with one span per request per step, so the overlap of
copies and compute, or its absence, is visible. The waits between threads (request queue, response queue) are
async spans, which trace viewers draw on tracks of their own. GPU samples become counter tracks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from serverbench.schema.records import GpuSample, RequestRecord

FRONTEND_PID, BACKEND_PID = 1, 2  # --instances: instance i shows as process BACKEND_PID + i, with its own lanes


class TraceBuilder:
    """Chrome trace events on one time origin, with one lane (tid) per process and thread name."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self.lanes: dict[tuple[int, str], int] = {}
        self.events: list[dict] = []

    def us(self, t_ns: int) -> float:
        return (t_ns - self.origin_ns) / 1e3

    def tid(self, pid: int, name: str) -> int:
        return self.lanes.setdefault((pid, name), len(self.lanes) + 1)

    def span(self, pid: int, lane: str, name: str, start_ns: int | None, end_ns: int | None, args: dict) -> None:
        """A step a thread ran (left out when either end is unknown)."""
        if start_ns is None or end_ns is None:
            return
        self.events.append(
            {
                "name": name,
                "cat": "step",
                "ph": "X",
                "pid": pid,
                "tid": self.tid(pid, lane),
                "ts": self.us(start_ns),
                "dur": max(0.0, (end_ns - start_ns) / 1e3),
                "args": args,
            }
        )

    def wait(self, name: str, request_id: int, start_ns: int, end_ns: int) -> None:
        """A request waiting in a queue: an async span, so that the waits of many requests may overlap."""
        common = {"name": name, "cat": "wait", "id": request_id, "pid": FRONTEND_PID}
        common["tid"] = self.tid(FRONTEND_PID, "sender")
        self.events.append({**common, "ph": "b", "ts": self.us(start_ns)})
        self.events.append({**common, "ph": "e", "ts": self.us(end_ns)})

    def request(self, r: RequestRecord) -> None:
        """One request's life: send, request queue, h2d, forward, d2h, response queue, received."""
        label = "warm-up" if r.warmup else f"#{r.request_id}"
        args = {"request_id": r.request_id, "latency_ms": (r.received_ns - r.sent_ns) / 1e6}
        self.span(FRONTEND_PID, "sender", f"send {label}", r.send_start_ns or r.sent_ns, r.send_done_ns, args)
        self.wait(f"request queue {label}", r.request_id, r.send_done_ns or r.sent_ns, r.taken_ns)
        backend = BACKEND_PID + r.instance
        copy_in = {**args, "copy_ms": r.h2d_copy_ms}
        self.span(backend, r.h2d_thread or "h2d", f"h2d {label}", r.h2d_start_ns, r.h2d_done_ns, copy_in)
        forward = {**args, "forward_ms": r.forward_ms, "worker": r.worker}
        lane = r.predict_thread or "predict"
        self.span(backend, lane, f"forward {label}", r.forward_start_ns, r.forward_done_ns, forward)
        copy_out = {**args, "copy_ms": r.d2h_copy_ms}
        self.span(backend, r.d2h_thread or "d2h", f"d2h {label}", r.d2h_start_ns, r.d2h_done_ns, copy_out)
        self.wait(f"response queue {label}", r.request_id, r.d2h_done_ns, r.received_ns)
        received = {"name": f"received {label}", "cat": "step", "ph": "i", "s": "t", "pid": FRONTEND_PID}
        received.update(tid=self.tid(FRONTEND_PID, "receiver"), ts=self.us(r.received_ns), args=args)
        self.events.append(received)

    def gpu(self, samples: Sequence[GpuSample]) -> None:
        for s in samples:
            counters = {"util_pct": s.util_pct, "mem_used_mib": s.mem_used_mib}
            if s.power_w is not None:
                counters["power_w"] = s.power_w
            self.events.append({"name": "gpu", "ph": "C", "pid": BACKEND_PID, "ts": self.us(s.t_ns), "args": counters})

    def metadata(self, instances: Sequence[int]) -> list[dict]:
        """The processes' and the lanes' names."""
        names = [(FRONTEND_PID, "frontend")]
        names += [
            (BACKEND_PID + i, "backend" if list(instances) == [0] else f"backend instance {i}") for i in instances
        ]
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}} for pid, name in names]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": lane_tid, "args": {"name": lane}}
            for (pid, lane), lane_tid in self.lanes.items()
        ]
        return meta


def build_timeline(records: Sequence[RequestRecord], gpu_samples: Sequence[GpuSample] = ()) -> dict:
    if not records:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    trace = TraceBuilder(min(r.sent_ns for r in records))
    for r in sorted(records, key=lambda rec: rec.request_id):
        trace.request(r)
    trace.gpu(gpu_samples)
    meta = trace.metadata(sorted({r.instance for r in records} | {0}))
    return {"traceEvents": meta + trace.events, "displayTimeUnit": "ms"}


def write_timeline(path: Path, records: Sequence[RequestRecord], gpu_samples: Sequence[GpuSample] = ()) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(build_timeline(records, gpu_samples)))
