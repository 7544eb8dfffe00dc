"""The messages that cross processes: a request (frontend -> backend, as the queue transport carries it and as either
transport hands it to the backend), the backend's messages to the frontend (BackendReady, then a Response per
request, or a BackendFailure), and the frontend's report to the server.

The transports that carry them are in serverbench/transport/channels.py; the records they carry are declared in
serverbench/schema/records.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from serverbench.schema.records import (
    BackendTimings,
    GpuSample,
    LoadGenResult,
    LoadSample,
    NoiseStats,
    RecordTotals,
    RequestRecord,
    Window,
)
from serverbench.system.provenance import Provenance

if TYPE_CHECKING:
    import torch


@dataclass
class Request:
    """One request as the backend takes it off either transport (the queue transport carries it as such)."""

    request_id: int  # 0 is the warm-up request
    inputs: tuple[torch.Tensor, ...]  # one [B, ...] tensor per model input, on the CPU, in its wire dtype
    sent_ns: int  # perf_counter_ns when the frontend began sending it
    slot: int | None = None  # shm: the ring slot holding `inputs`, to hand back once they are on the device


@dataclass
class Response:
    request_id: int
    outputs: tuple[np.ndarray, ...]  # the output's leaves (pytree order), each [B, ...] on the CPU
    timings: BackendTimings  # the backend's stamps, which the frontend's RequestRecord extends
    # Over the network: when the client read the answer whole (on its loop's thread), before it was queued for the
    # receiver thread; never on the wire (None: the receiver stamps its arrival itself).
    received_ns: int | None = None

    def to_wire(self) -> tuple:
        """The response as a plain tuple of plain values, each output leaf as (bytes, dtype, shape): pickled in about
        a microsecond, where the dataclasses with their arrays take ten to twenty (the server's cost per request at
        one image per request)."""
        leaves = tuple([(leaf.tobytes(), leaf.dtype.str, leaf.shape) for leaf in self.outputs])
        return (self.request_id, leaves, tuple(self.timings.__dict__.values()))

    @staticmethod
    def from_wire(values: tuple) -> Response:
        # Read-only arrays: never written.
        leaves = tuple([np.frombuffer(data, dtype).reshape(shape) for data, dtype, shape in values[1]])
        return Response(values[0], leaves, BackendTimings(*values[2]))


@dataclass
class BackendReady:
    """Sent once, before the first response: what the backend built and where it runs."""

    device: str
    device_name: str
    device_uuid: str | None
    timing_source: str
    model_build_s: float
    torch_load_time_s: float | None
    compile_time_s: float | None
    torch_version: str
    cuda_version: str | None
    reference_outputs: list[tuple[np.ndarray, ...]] | None = None  # --verify: each pool batch's output leaves
    compile_path: str = "eager"  # eager, inductor (torch.compile) or aoti (AOTInductor)
    aoti_runners: int | None = None  # AOTInductor: model runners loaded, sharing one set of weights
    aoti_compiled_now: bool | None = None  # AOTInductor: compiled in this run (False: the cached package served)
    compile_graph_breaks: int | None = None  # torch.compile: graph breaks met compiling one thread's copy
    cudnn_allow_tf32: bool | None = None  # the TF32 flags in effect in the backend (--precision)
    matmul_precision: str | None = None  # torch.get_float32_matmul_precision(): highest, high or medium
    instance: int = 0  # --instances: which backend process this is; each sends its own
    pid: int | None = None  # its process id: the frontend reads its threads' scheduler counters
    # Each output leaf (pytree order) of one request row: (dtype name, shape without the batch dimension); the
    # network door describes the model's outputs with them.
    output_leaves: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass
class BackendFailure:
    status: str  # "error" or "oom"
    error: str  # one line
    traceback: str
    instance: int = 0  # --instances: the backend process that failed


BackendMessage = BackendReady | Response | BackendFailure


@dataclass
class FrontendReport:
    """What the frontend hands to the server: the records and what went wrong, if anything."""

    status: str = "ok"  # ok, error, timeout, stopped, or the backend's failure status
    error: str = ""
    traceback: str = ""
    records: list[RequestRecord] = field(default_factory=list)
    totals: RecordTotals | None = None  # the records are a sample (a --serve_only door's): the exact totals
    requests_sent: int = 0  # measured requests, warm-up excluded
    responses_duplicated: int = 0
    responses_unexpected: int = 0  # ids that were never sent
    wrong_outputs: int = 0  # --verify: responses that differ from the serial reference answer
    max_abs_error: float | None = None  # --verify: largest difference seen
    response_bytes: int | None = None  # one response's output leaves, in bytes (the first response's)
    backend_ready: BackendReady | None = None  # the first instance's to arrive (its answers serve --verify)
    instances_ready: list[BackendReady] = field(default_factory=list)  # every instance's, without --verify's answers
    gpu_samples: list[GpuSample] = field(default_factory=list)
    load_samples: list[LoadSample] = field(default_factory=list)
    gpu_util_note: str = ""  # why the GPU samples have no utilisation, when they have none (MIG, no NVML)
    windows: list[Window] = field(default_factory=list)  # --stability_pct: the measured phase's windows
    stable: bool | None = None  # --stability_pct: whether the last windows agreed (None: no windows asked)
    noise: NoiseStats | None = None  # the machine's share in the measured phase (None: it never started)
    loadgen: LoadGenResult | None = None  # --load loadgen: LoadGen's verdict and figures


ENDED_AS_ASKED = ("ok", "stopped")  # statuses of a process that did what it was told, stopping included


@dataclass
class BackendReport:
    """What a backend process hands to the server when it ends: how it ended, and what it measured besides the
    requests (the frontend's records carry those). With --instances, the server combines the instances' reports into
    one of these (serverbench.launch.instances.combine_backend_reports)."""

    role: str = "backend"
    status: str = "ok"  # ok, stopped, error, oom, backend_died
    error: str = ""
    traceback: str = ""
    malloc_tuned: bool | None = None  # --tune_malloc took (glibc only)
    backend_cpus: str | None = None  # CPU device: the cores the model ran on, ';'-separated
    intra_op_threads: int | None = None  # torch's intra-op threads while serving
    backend_cpu_cores: float | None = None  # CPU seconds of every backend thread per second of serving
    ceiling_before: dict[int, list[float]] | None = None  # the model alone before serving: loops by concurrency
    ceiling_after: dict[int, list[float]] | None = None  # and after serving
    ceiling_before_ns: tuple[int, int] | None = None  # when the ceiling before serving ran (perf_counter_ns)
    # --instances: each instance's ceiling_before_ns, for the warm-up latency of the request that instance answered
    ceiling_before_ns_by_instance: dict[int, tuple[int, int]] | None = None
    machine_speed_before: float | None = None  # the speed probe just before serving (serverbench.system.speed)
    machine_speed_after: float | None = None  # and just after
    profile_trace: str = ""  # --profile: the trace file(s), ';'-separated
    door: DoorReport | None = None  # --door inline: the door that ran inside this backend process


@dataclass
class DoorReport:
    """What the network front door hands to the server when it ends (--transport http|grpc): its own process's
    report, or inside the backend's with --door inline."""

    role: str = "door"
    status: str = "ok"  # ok, stopped, error
    error: str = ""
    traceback: str = ""
    address: str = ""  # host:port it listened on
    answered: int = 0  # inference requests answered with outputs
    errors: dict[int, int] = field(default_factory=dict)  # answers that were errors, by HTTP status (gRPC mapped)
    disconnects: int = 0  # clients gone before their answer was written
    counted: bool = True  # False: the server's stand-in for a door that never reported; its counts are unknown
    # --serve_only: one record per answered request, on the door's clock (sent: the request arrived; received: its
    # answer was written); with a frontend of ours, its records are the run's and these stay empty.
    records: list[RequestRecord] = field(default_factory=list)
    totals: RecordTotals | None = None  # --serve_only past the door's sample's size: the exact totals
    instances_ready: list[BackendReady] = field(default_factory=list)  # --serve_only: what the backend said it built


def served_as_frontend(door: DoorReport | None) -> FrontendReport | None:
    """--serve_only: the door's records stand for a frontend's (no frontend of ours ran): the row's latency is the
    door's, from a request's arrival to its answer written."""
    if door is None:
        return None
    measured = door.totals.count if door.totals else sum(not record.warmup for record in door.records)
    ready = door.instances_ready
    return FrontendReport(
        status=door.status,
        records=door.records,
        totals=door.totals,
        requests_sent=measured,
        backend_ready=ready[0] if ready else None,
        instances_ready=list(ready),
    )


ChildReport = BackendReport | FrontendReport | DoorReport  # what a child process sends the server as it ends


class HasStatus(Protocol):
    status: str
    error: str
    traceback: str


Reported = TypeVar("Reported", bound=HasStatus)


def first_failure(reports: Iterable[Reported]) -> Reported | None:
    """The one report whose failure the run, the combined instances or the torchrun job takes as its own; None when
    every one ended as asked (ok or stopped). A death comes first, whichever arrived first: what the others then
    report (a timeout, a broken pipe) is its consequence. Then the first failure in the order given (arrival, or
    rank order), and last an 'aborted' one: a rank stopped because another failed."""
    failed = [report for report in reports if report.status not in ENDED_AS_ASKED]
    failed.sort(key=lambda report: (not report.status.endswith("_died"), report.status == "aborted"))  # stable
    return failed[0] if failed else None


def combined_status(named: Sequence[tuple[str, Reported]], missing: Sequence[str]) -> tuple[str, str, str]:
    """(status, error, traceback) of several processes of one kind taken as one (backend instances, load
    generators), from their reports by role: first_failure among them, its error prefixed with its role unless it
    died (a death's error names its process already); else an error when a report is missing, 'stopped' when one
    was stopped, ok."""
    cause = first_failure(report for _, report in named)
    if cause is not None:
        role = next(role for role, report in named if report is cause)
        error = cause.error if cause.status.endswith("_died") else f"{role}: {cause.error}"
        return cause.status, error, cause.traceback
    if missing:
        return "error", f"no report from {', '.join(missing)}", ""
    if any(report.status == "stopped" for _, report in named):
        return "stopped", "", ""
    return "ok", "", ""


@dataclass
class RunResult:
    """One run as the server saw it: how it ended, and the reports its processes sent."""

    status: str  # ok, error, oom, timeout, backend_died, frontend_died, interrupted
    error: str = ""
    traceback: str = ""
    frontend: FrontendReport | None = None  # None when the frontend sent no report (it died, or never started)
    backend: BackendReport = field(default_factory=BackendReport)  # the instances' reports combined
    door: DoorReport | None = None  # --transport http|grpc: the front door's report
    pids: dict = field(default_factory=dict)
    mps: bool | None = None  # CUDA: whether the NVIDIA MPS control daemon took the backends' contexts
    row_saved: bool = True  # False when the row could not be written to the results file
    provenance: Provenance | None = None  # the checkout's commit and the CPU, read as the run started
