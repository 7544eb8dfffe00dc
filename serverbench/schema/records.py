"""The records a run is made of, declared once: what the backend stamps on each request (BackendTimings, carried
unchanged in the Response and into the frontend's RequestRecord), the samplers' samples, the stability windows, the
machine's share and LoadGen's verdict. Plain values: they cross processes and are read by the summary, the CSV
store and the row.

One name per step and per instant: a request is *taken* off the transport, *formed* into the batch a forward runs
(the batcher closes it; without a batcher formed = taken), copied host-to-device (*h2d*), run through the model's
*forward* by a prediction thread (the *predict* stage spans from the input on the device to the forward done, so it
holds the wait for a free predictor), copied device-to-host (*d2h*) and *received* by the frontend.

Units: every stamp is time.perf_counter_ns() (CLOCK_MONOTONIC on Linux), one clock for the frontend and the backend;
durations name their unit.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

STAGES = ("request_queue", "batch_wait", "h2d", "predict", "d2h", "response_queue")


# Not frozen, nor the RequestRecord that extends it: a frozen dataclass sets each field through object.__setattr__,
# and one is built per request on each side of the pipe: frozen, a response took 3.6 us to build and pickle (2.3
# not frozen) and 6.5 us to read into its record (2.9), against 24 us per request of the serial identity server.
# Nothing writes them once built.
@dataclass
class BackendTimings:
    """What the backend stamps on one request, declared once: the Response carries it and the frontend's
    RequestRecord extends it, so no field is copied by hand between the two."""

    taken_ns: int  # the backend took the request off the transport
    h2d_done_ns: int  # the input was on the device
    forward_done_ns: int  # the forward was done
    d2h_done_ns: int  # the output was on the host, synchronised
    h2d_copy_ms: float  # duration of the copy itself (CUDA events on a GPU, host clock on the CPU)
    forward_ms: float  # duration of the forward itself
    d2h_copy_ms: float
    worker: int  # index of the prediction worker that served it
    # When each step began (host clock, placed from their events) and which thread ran it (None, "": unknown).
    h2d_start_ns: int | None = None
    forward_start_ns: int | None = None
    d2h_start_ns: int | None = None
    h2d_thread: str = ""
    predict_thread: str = ""
    d2h_thread: str = ""
    # The forward that served it (dynamic batching: a formed batch of several requests).
    formed_ns: int | None = None  # the batcher closed its formed batch; None: no batcher (taken_ns)
    formed_images: int | None = None  # images of the requests in that forward
    padded_images: int | None = None  # images the forward ran on, padding included
    batch_id: int | None = None  # the forward's number in its backend
    instance: int = 0  # --instances: the backend process that served it


TIMING_FIELDS = tuple(BackendTimings.__dataclass_fields__)


@dataclass(kw_only=True)
class RequestRecord(BackendTimings):
    """One request's life: the frontend's stamps around the backend's (BackendTimings), on the shared clock."""

    request_id: int
    warmup: bool
    batch_size: int
    sent_ns: int  # when the request counts as sent: the intended time under a schedule, else when sending began
    received_ns: int
    send_done_ns: int | None = None
    send_start_ns: int | None = None  # when sending began
    due_ns: int | None = None  # when the load wanted it sent (Poisson: its slot; closed loop: the freeing response)

    @property
    def latency_s(self) -> float:
        return (self.received_ns - self.sent_ns) / 1e9

    def stage_ms(self) -> dict[str, float]:
        """Where the latency went; the six spans add up to it (batch_wait is 0 without a batcher)."""
        formed_ns = self.taken_ns if self.formed_ns is None else self.formed_ns
        stamps = (
            self.sent_ns,
            self.taken_ns,
            formed_ns,
            self.h2d_done_ns,
            self.forward_done_ns,
            self.d2h_done_ns,
            self.received_ns,
        )
        return {stage: (stamps[i + 1] - stamps[i]) / 1e6 for i, stage in enumerate(STAGES)}


@dataclass(frozen=True)
class RecordTotals:
    """Exact totals of a run's measured requests when its records are a sample of them (RecordSample)."""

    count: int  # measured requests answered
    samples: int  # their rows (batch sizes) together
    first_sent_ns: int
    last_received_ns: int
    kept: int  # measured records in the sample


class RecordSample:
    """A door's records over a run of any length in bounded memory (--serve_only runs for hours: about 750 bytes a
    record grew the door by 1 KB a request): every warm-up record, and a uniform sample of at most `capacity` of the
    measured ones (reservoir sampling, Vitter's algorithm R, seeded), beside exact totals. Percentiles from a
    uniform sample of 100,000 are within about 0.03 % of rank of the whole's."""

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity = capacity
        self.warmup: list[RequestRecord] = []
        self.measured: list[RequestRecord] = []
        self.count = self.samples = 0
        self.first_sent_ns: int | None = None
        self.last_received_ns: int | None = None
        self._rng = random.Random(seed)

    def add(self, record: RequestRecord) -> None:
        if record.warmup:
            self.warmup.append(record)
            return
        self.count += 1
        self.samples += record.batch_size
        if self.first_sent_ns is None or record.sent_ns < self.first_sent_ns:
            self.first_sent_ns = record.sent_ns
        if self.last_received_ns is None or record.received_ns > self.last_received_ns:
            self.last_received_ns = record.received_ns
        if len(self.measured) < self.capacity:
            self.measured.append(record)
        elif (slot := self._rng.randrange(self.count)) < self.capacity:
            self.measured[slot] = record

    def records(self) -> list[RequestRecord]:
        return [*self.warmup, *self.measured]

    def totals(self) -> RecordTotals | None:
        """The exact totals, once the sample holds fewer measured records than there were (else None: the
        records are all of them)."""
        if self.count <= len(self.measured):
            return None
        return RecordTotals(self.count, self.samples, self.first_sent_ns, self.last_received_ns, len(self.measured))


# The per-request file's columns: the frontend's fields first, then the backend's stamps.
RECORD_COLUMNS = (*(name for name in RequestRecord.__dataclass_fields__ if name not in TIMING_FIELDS), *TIMING_FIELDS)


@dataclass(frozen=True)
class GpuSample:
    t_ns: int
    # None where NVML cannot give it (a MIG instance), and where no NVML window since the last sample lies wholly in
    # the measured phase (device/gpu_sampler.py)
    util_pct: float | None
    mem_used_mib: float
    power_w: float | None


@dataclass(frozen=True)
class LoadSample:
    t_ns: int
    inflight: int  # measured requests sent and not yet answered
    queue_depth: int | None  # requests waiting in the request queue (None where the OS cannot tell)


@dataclass(frozen=True)
class Window:
    start_ns: int  # the previous window's last response (the measured phase's first send for the first)
    end_ns: int  # this window's last response
    requests: int
    samples: int
    p99_latency_s: float
    noise: str = ""  # why the machine made this window's numbers, when it did; "" for a clean window

    @property
    def throughput(self) -> float:
        """Samples answered per second of the window."""
        return self.samples / max((self.end_ns - self.start_ns) / 1e9, 1e-9)


@dataclass(frozen=True)
class NoiseStats:
    """The machine's share in a measured phase. None where it could not be read; `note` says why."""

    cpu_steal_pct: float | None = None
    other_cpu_pct: float | None = None  # CPU time of processes other than the benchmark's, % of all CPU time
    shares_reliable: bool = False  # the phase held MIN_SHARE_TICKS of CPU time: steal and other CPU can warn
    runqueue_wait_pct: Mapping[str, float] = field(default_factory=dict)  # role -> % of the phase, threads summed
    involuntary_switches: Mapping[str, int] = field(default_factory=dict)  # role -> count in the phase
    max_stall_ms: float | None = None
    note: str = ""


@dataclass
class LoadGenResult:
    """What the frontend hands on about its LoadGen test: plain values, so that it pickles with the report."""

    scenario: str
    log_dir: str  # where LoadGen wrote its logs (moved to loadgen/<run_id> when the row is written)
    results: dict[str, object] = field(default_factory=dict)  # the detail log's result_* keys (parse_detail_log)
    unanswered: int = 0  # samples completed without an answer because the run was failing
    error: str = ""  # LoadGen's test or its log failed: why
