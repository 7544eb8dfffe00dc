"""The summary of a run: a pure function of its per-request records (serverbench/schema/records.py), as the CSV
row's columns.

Units: the reference's columns keep theirs (seconds, samples/s, percent); every added column names its unit.
All timestamps are `time.perf_counter_ns()`, CLOCK_MONOTONIC on Linux, so the frontend's and the backend's
stamps are on one clock.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from serverbench.schema.columns import REFERENCE_COLUMNS as REFERENCE_COLUMNS  # re-exported: tests read it here
from serverbench.schema.records import STAGES, GpuSample, LoadSample, RecordTotals, RequestRecord
from serverbench.schema.stats import LatencyStats, cv_pct

MIN_LOAD_SAMPLES = 5  # in-flight figures need at least this many load samples of the measured phase
# Little's law needs the sampler to have seen this many requests in flight, summed over its samples: at 4 requests
# a second of 1 ms each it sees one now and then, and one more or less moved the ratio from 1.23 to 1.90.
MIN_INFLIGHT_SEEN = 50


@dataclass(frozen=True)
class SloStats:
    slo_ms: float
    attainment: float  # fraction of measured requests answered within slo_ms
    goodput_samples_per_s: float  # samples answered within slo_ms, per second of the measured phase
    p99_met: bool


@dataclass(frozen=True)
class GpuStats:
    util_mean_pct: float | None  # None when no sample had it (MIG)
    mem_used_max_mib: float
    power_mean_w: float | None
    samples: int

    @classmethod
    def from_samples(cls, samples: Sequence[GpuSample]) -> GpuStats | None:
        if not samples:
            return None
        powers = [s.power_w for s in samples if s.power_w is not None]
        utils = [s.util_pct for s in samples if s.util_pct is not None]
        return cls(
            float(np.mean(utils)) if utils else None,
            float(max(s.mem_used_mib for s in samples)),
            float(np.mean(powers)) if powers else None,
            len(samples),
        )


@dataclass(frozen=True)
class RunSummary:
    warmup_latency_s: float | None
    latency: LatencyStats | None  # measured requests only, warm-up excluded
    throughput_samples_per_s: float | None
    duration_s: float | None  # first measured send to last measured response
    stage_mean_ms: dict[str, float]  # spans on the host timeline: request_queue, batch_wait, h2d, predict, d2h,
    # response_queue
    copy_mean_ms: dict[str, float]  # the operations alone: h2d_copy, forward, d2h_copy
    requests_sent: int
    responses_received: int
    responses_missing: int
    responses_duplicated: int
    gpu: GpuStats | None
    achieved_rate_rps: float | None = None  # answered requests per second of the measured phase
    slo: SloStats | None = None
    inflight_max: int | None = None
    inflight_mean: float | None = None
    queue_depth_max: int | None = None
    timestamp_order_violations: int = 0  # records whose stamps are out of their causal order
    copy_overlap: float | None = None  # fraction of forward time with another request's copy running
    reported_requests: int = 0  # requests the statistics are of: all measured ones, or the reported windows'
    busy_fraction: float | None = None  # fraction of the reported time with a forward running
    littles_law_ratio: float | None = None  # mean in flight / (achieved rate x mean latency); ~1 when sound
    formed: FormedBatchStats | None = None  # the forwards' sizes (dynamic batching: the formed batches)


def order_violations(record: RequestRecord) -> int:
    """Stamps of one request out of causal order: sent <= taken <= batched <= h2d start <= h2d done <= forward
    start <= forward done <= d2h start <= d2h done <= received (stamps that are unknown are left out). Event times
    are placed on the host clock from anchors; a violation means a placement went wrong."""
    stamps = [
        record.sent_ns,
        record.taken_ns,
        record.formed_ns,
        record.h2d_start_ns,
        record.h2d_done_ns,
        record.forward_start_ns,
        record.forward_done_ns,
        record.d2h_start_ns,
        record.d2h_done_ns,
        record.received_ns,
    ]
    known = [t for t in stamps if t is not None]
    return sum(later < earlier for earlier, later in zip(known, known[1:]))


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def forward_key(record: RequestRecord) -> tuple[str, int, int]:
    """The forward that served a request: the members of a formed batch share one (numbered per instance)."""
    if record.batch_id is None:
        return ("request", 0, record.request_id)
    return ("batch", record.instance, record.batch_id)


def one_per_forward(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """A record per forward (the first member's): copies and forwards of a formed batch happened once."""
    first: dict[tuple[str, int, int], RequestRecord] = {}
    for record in records:
        first.setdefault(forward_key(record), record)
    return list(first.values())


@dataclass(frozen=True)
class FormedBatchStats:
    """The forwards' sizes in images: with dynamic batching, what the batcher formed and how much was padding."""

    mean_images: float
    p50_images: float
    padding_pct: float  # padded images over all images the forwards ran on, in %
    forwards: int


def formed_batch_stats(records: Iterable[RequestRecord]) -> FormedBatchStats | None:
    forwards = [r for r in one_per_forward(records) if r.formed_images is not None and r.padded_images is not None]
    if not forwards:
        return None
    formed = np.array([r.formed_images for r in forwards], dtype=np.float64)
    padded = np.array([r.padded_images for r in forwards], dtype=np.float64)
    return FormedBatchStats(
        float(formed.mean()),
        float(np.median(formed)),
        float(100 * (padded - formed).sum() / padded.sum()),
        len(forwards),
    )


def copy_overlap_fraction(records: Sequence[RequestRecord]) -> float | None:
    """The fraction of forward time during which an H2D or D2H copy of another forward was running: 0 when the
    copies never overlap the forwards (one stream, or streams that serialise), up to 1 when every forward hides a
    copy. None without forward spans."""
    records = one_per_forward(records)
    copies = sorted(
        (start, end, forward_key(r))
        for r in records
        for start, end in ((r.h2d_start_ns, r.h2d_done_ns), (r.d2h_start_ns, r.d2h_done_ns))
        if start is not None and end > start
    )
    starts = [c[0] for c in copies]
    longest_ns = max((end - start for start, end, _ in copies), default=0)
    forward_ns = overlapped_ns = 0
    for r in records:
        if r.forward_start_ns is None or r.forward_done_ns <= r.forward_start_ns:
            continue
        start, end = r.forward_start_ns, r.forward_done_ns
        forward_ns += end - start
        # Only copies that began less than the longest copy before this forward can reach into it.
        first = bisect.bisect_left(starts, start - longest_ns)
        last = bisect.bisect_left(starts, end)
        others = [
            (max(s, start), min(e, end)) for s, e, rid in copies[first:last] if rid != forward_key(r) and e > start
        ]
        overlapped_ns += sum(e - s for s, e in _merged(others))
    return overlapped_ns / forward_ns if forward_ns else None


def busy_fraction(records: Sequence[RequestRecord], span_ns: tuple[int, int]) -> float | None:
    """The fraction of span_ns in which at least one forward was running (the union of the records' forward
    spans, clipped to it): how much of the time the server's model was busy. None without forward spans."""
    start_ns, end_ns = span_ns
    spans = [
        (max(r.forward_start_ns, start_ns), min(r.forward_done_ns, end_ns))
        for r in records
        if r.forward_start_ns is not None and r.forward_done_ns > r.forward_start_ns
    ]
    spans = [(s, e) for s, e in spans if e > s]
    if not spans or end_ns <= start_ns:
        return None
    return sum(e - s for s, e in _merged(spans)) / (end_ns - start_ns)


def most_in_flight(records: Sequence[RequestRecord], load_samples: Sequence[LoadSample]) -> int | None:
    """The most measured requests in flight at once. Exact from the records, each in flight from its send's start to
    its answer (a response at the same instant frees its place first): the load sampler's samples, 50 ms apart,
    miss a burst's peak. The sampler's where it saw more: a request never answered has no record. None with
    neither (a sample of the records, or a run too short for the sampler to mean anything, and no records)."""
    events = sorted([(r.send_start_ns or r.sent_ns, 1) for r in records] + [(r.received_ns, -1) for r in records])
    counted = [max(itertools.accumulate(step for _, step in events), default=0)] if records else []
    return max([*counted, *(s.inflight for s in load_samples)], default=None)


def littles_law_ratio(
    inflight_mean: float | None, rate_rps: float | None, mean_latency_s: float | None
) -> float | None:
    """Little's law, L = lambda x W, as a check of the records: requests in flight on average (counted by the
    load sampler, apart from the records) over achieved rate x mean time in the system (from the records: from
    when sending began, as the sampler counts a request in flight from then, to its response). Near 1 when the
    records hold every request's whole life; off by more than 10 % means they miss something."""
    if inflight_mean is None or not rate_rps or not mean_latency_s:
        return None
    return inflight_mean / (rate_rps * mean_latency_s)


@dataclass(frozen=True)
class CeilingStats:
    """The model alone at the design's concurrency, from the loops timed before and after serving."""

    throughput: float  # samples/s: the faster phase's median loop, at the best concurrency
    concurrency: int  # the count of concurrent forwards that gave the best
    spread_pct: float | None  # coefficient of variation of those loops, both phases pooled, in %
    before: float | None  # the median before serving, at that concurrency
    after: float | None  # and after
    low: float | None = None  # the interval (ceiling_interval): the slowest loop of both phases at that concurrency
    high: float | None = None  # and the fastest


def ceiling_interval(loops: Sequence[float]) -> tuple[float, float] | None:
    """The ceiling's interval: from the slowest to the fastest timed loop of both phases at the ceiling's
    concurrency. The ceiling is one phase's median loop, so the range always holds it. The loops are the same work
    timed back to back on this machine, before and after serving; how far apart they lie is how far the machine
    moved the model alone during this run (what `spread_pct` sums up as a CV), and serving, timed in between,
    could have met the machine anywhere in that range. A range rather than a mean +- k x CV: the noise is
    one-sided (another process only slows a loop) and 10 loops are too few for percentiles or a normal
    approximation. It is not a confidence interval with a stated coverage: the machine can move further while
    serving, seconds away from either phase. None without loops."""
    if not loops:
        return None
    return float(min(loops)), float(max(loops))


def efficiency_interval(throughput: float | None, stats: CeilingStats | None) -> tuple[float, float] | None:
    """(efficiency_low, efficiency_high): throughput over the ceiling interval's high end and over its low end.
    It holds `throughput / stats.throughput`, the efficiency. None without a throughput or an interval."""
    if throughput is None or stats is None or stats.low is None or stats.high is None or stats.low <= 0:
        return None
    return throughput / stats.high, throughput / stats.low


WITHIN_NOISE = "at the ceiling within noise"
# Serving cannot beat the model alone on inputs already on the device: an efficiency above every timed loop of it
# says the machine slowed that timing (another process, a short loop), not that the server did better.
ABOVE_CEILING = (
    "above every timed loop of the model alone: that timing was slowed (the machine was busy while it ran), so "
    "this is no efficiency; time the model alone on a quiet machine (--ceiling_s) before reading it"
)


def efficiency_verdict(low: float | None, high: float | None) -> str | None:
    """How to read an efficiency's interval: 1.0 inside it is the ceiling within the machine's noise, however far
    past 1 the point estimate is; an interval wholly above 1 means serving beat every timed loop of the model
    alone, which the noise does not explain. None below the ceiling or without an interval."""
    if low is None or high is None:
        return None
    if low <= 1.0 <= high:
        return WITHIN_NOISE
    return ABOVE_CEILING if low > 1.0 else None


def ceiling_stats(before: Mapping[int, Sequence[float]], after: Mapping[int, Sequence[float]]) -> CeilingStats | None:
    """Per concurrency, each phase's median loop; the ceiling is the faster phase's, and the best concurrency the
    one with the highest. Another process on the cores only ever slows a loop down, so the slower phase measured
    the machine as much as the model (as timeit takes the fastest repeat); the spread of both phases' loops
    together says by how much. None when nothing was timed."""
    phases = {
        c: [float(np.median(loops)) for loops in (before.get(c), after.get(c)) if loops] for c in {*before, *after}
    }
    phases = {c: medians for c, medians in phases.items() if medians}
    if not phases:
        return None
    best = max(sorted(phases), key=lambda c: max(phases[c]))  # ties: the fewest threads
    loops = [*before.get(best, ()), *after.get(best, ())]
    low, high = ceiling_interval(loops) or (None, None)
    return CeilingStats(
        max(phases[best]),
        best,
        cv_pct(loops),
        float(np.median(before[best])) if before.get(best) else None,
        float(np.median(after[best])) if after.get(best) else None,
        low,
        high,
    )


def warmup_latency_s(first: RequestRecord, backend_busy_ns: tuple[int, int] | None) -> float:
    """The first warm-up request's latency less its overlap with backend_busy_ns (one monotonic clock)."""
    waited_ns = 0
    if backend_busy_ns is not None:
        waited_ns = max(0, min(backend_busy_ns[1], first.received_ns) - max(backend_busy_ns[0], first.sent_ns))
    return (first.received_ns - first.sent_ns - waited_ns) / 1e9


def step_means_ms(reported: Sequence[RequestRecord]) -> tuple[dict[str, float], dict[str, float]]:
    """Mean ms of each stage (STAGES, which add up to the latency) and of the copies' and the forward's own time."""
    if not reported:
        return {}, {}
    stages = [r.stage_ms() for r in reported]
    stage_mean_ms = {s: float(np.mean([st[s] for st in stages])) for s in STAGES}
    copy_mean_ms = {
        "h2d_copy": float(np.mean([r.h2d_copy_ms for r in reported])),
        "forward": float(np.mean([r.forward_ms for r in reported])),
        "d2h_copy": float(np.mean([r.d2h_copy_ms for r in reported])),
    }
    return stage_mean_ms, copy_mean_ms


def slo_stats(
    reported: Sequence[RequestRecord], slo_ms: float | None, latency: LatencyStats | None, duration_s: float | None
) -> SloStats | None:
    """--slo_ms: the share of requests answered within it, their samples per second, and whether p99 met it."""
    if slo_ms is None or latency is None:
        return None
    within = [r for r in reported if r.latency_s * 1e3 <= slo_ms]
    return SloStats(
        slo_ms,
        len(within) / len(reported),
        sum(r.batch_size for r in within) / duration_s if duration_s else 0.0,
        latency.p99_s * 1e3 <= slo_ms,
    )


def mean_in_system_s(reported: Sequence[RequestRecord]) -> float | None:
    """The mean time a request was in the system as the load sampler counts it: from when its sending began. Under
    a schedule its latency counts from when it was due, earlier when the sender ran late: Little's law compares like
    with like."""
    if not reported:
        return None
    return float(np.mean([(r.received_ns - (r.send_start_ns or r.sent_ns)) / 1e9 for r in reported]))


def summarize(
    records: Iterable[RequestRecord],
    requests_sent: int,
    responses_duplicated: int = 0,
    gpu_samples: Sequence[GpuSample] = (),
    slo_ms: float | None = None,
    load_samples: Sequence[LoadSample] = (),
    span_ns: tuple[int, int] | None = None,
    backend_busy_ns: tuple[int, int] | None = None,
    totals: RecordTotals | None = None,
) -> RunSummary:
    """The run's metrics from its records. `requests_sent` counts measured requests (the warm-up excluded);
    `records` hold at most one record per request id (the first response). `backend_busy_ns`: when the backend
    timed the ceiling before serving; the first warm-up request's wait for it is left out of its latency (the
    reference's figure has no such wait in it).

    Without `span_ns` every measured request counts, and throughput is the reference's fixed formula: samples /
    (last response - first request). With stability windows, `span_ns` = (start, end] of the reported windows:
    the statistics are of the requests answered in it, and throughput is their samples / its length. `totals`: the
    measured records are a uniform sample (a --serve_only door's); the counts, span and throughput are the totals'
    the latency and stage figures the sample's."""
    records = list(records)
    warmup = sorted((r for r in records if r.warmup), key=lambda r: r.request_id)
    measured = sorted((r for r in records if not r.warmup), key=lambda r: r.request_id)
    if span_ns is not None:
        reported = [r for r in measured if span_ns[0] < r.received_ns <= span_ns[1]]
    else:
        reported = measured
        if measured:
            span_ns = (min(r.sent_ns for r in measured), max(r.received_ns for r in measured))
    latency = LatencyStats.from_values([r.latency_s for r in reported]) if reported else None
    span_ns, answered, samples = _counted(reported, span_ns, totals)
    throughput = duration_s = None
    if reported:
        duration_s = (span_ns[1] - span_ns[0]) / 1e9
        # The reference's fixed formula: samples / (last response time - first request time).
        if duration_s > 0:
            throughput = samples / duration_s
    # A server that is not ours (--target) sends no backend stamps: the figures made of them stay empty.
    stamped = [r for r in reported if r.taken_ns is not None]
    stage_mean_ms, copy_mean_ms = step_means_ms(stamped)
    window = [s for s in gpu_samples if reported and span_ns[0] <= s.t_ns <= span_ns[1]]
    if reported:
        load_samples = [s for s in load_samples if span_ns[0] <= s.t_ns <= span_ns[1]]
    slo = slo_stats(reported, slo_ms, latency, duration_s)
    depths = [s.queue_depth for s in load_samples if s.queue_depth is not None]
    # A few samples of a short run say nothing of what was in flight: no figure rather than a wrong 0.
    enough_load = len(load_samples) >= MIN_LOAD_SAMPLES
    inflight_mean = float(np.mean([s.inflight for s in load_samples])) if enough_load else None
    achieved_rate_rps = answered / duration_s if reported and duration_s else None
    enough_seen = enough_load and sum(s.inflight for s in load_samples) >= MIN_INFLIGHT_SEEN
    received = totals.count if totals is not None else len(measured)
    # Of a sample, the forwards summed over the whole run's span would read a tenth as busy: no figure then
    busy = busy_fraction([r for r in measured if r.taken_ns is not None], span_ns) if stamped and not totals else None
    return RunSummary(
        timestamp_order_violations=sum(order_violations(r) > 0 for r in records),
        copy_overlap=copy_overlap_fraction(stamped),
        achieved_rate_rps=achieved_rate_rps,
        slo=slo,
        inflight_max=most_in_flight(reported if totals is None else (), load_samples if enough_load else ()),
        inflight_mean=inflight_mean,
        queue_depth_max=max(depths) if len(depths) >= MIN_LOAD_SAMPLES else None,
        warmup_latency_s=warmup_latency_s(warmup[0], backend_busy_ns) if warmup else None,
        latency=latency,
        throughput_samples_per_s=throughput,
        duration_s=duration_s,
        stage_mean_ms=stage_mean_ms,
        copy_mean_ms=copy_mean_ms,
        requests_sent=requests_sent,
        responses_received=received,
        responses_missing=max(0, requests_sent - received),
        responses_duplicated=responses_duplicated,
        gpu=GpuStats.from_samples(window or list(gpu_samples)),
        reported_requests=answered,
        busy_fraction=busy,
        littles_law_ratio=littles_law_ratio(
            inflight_mean if enough_seen else None, achieved_rate_rps, mean_in_system_s(reported)
        ),
        formed=formed_batch_stats(stamped),
    )


def _counted(
    reported: list[RequestRecord], span_ns: tuple[int, int] | None, totals: RecordTotals | None
) -> tuple[tuple[int, int] | None, int, int]:
    """The span, the requests and the samples a summary's counts and throughput are of: the records', or the
    exact totals of which they are a sample."""
    if totals is not None:
        return (totals.first_sent_ns, totals.last_received_ns), totals.count, totals.samples
    return span_ns, len(reported), sum(r.batch_size for r in reported)


def summary_columns(summary: RunSummary) -> dict[str, object]:
    """The summary as CSV columns: the reference's (seconds, samples/s, percent) and ours (units in names)."""
    lat = summary.latency
    gpu = summary.gpu
    row: dict[str, object] = {
        "warmup_latency": summary.warmup_latency_s,
        "average_latency": lat.mean_s if lat else None,
        "max_latency": lat.max_s if lat else None,
        "min_latency": lat.min_s if lat else None,
        "throughput": summary.throughput_samples_per_s,
        "gpu_util": gpu.util_mean_pct if gpu else None,
        "p50_latency_s": lat.p50_s if lat else None,
        "p90_latency_s": lat.p90_s if lat else None,
        "p95_latency_s": lat.p95_s if lat else None,
        "p99_latency_s": lat.p99_s if lat else None,
        "std_latency_s": lat.std_s if lat else None,
        "duration_s": summary.duration_s,
    }
    for stage in STAGES:
        row[f"mean_{stage}_ms"] = summary.stage_mean_ms.get(stage)
    for op in ("h2d_copy", "forward", "d2h_copy"):
        row[f"mean_{op}_ms"] = summary.copy_mean_ms.get(op)
    row.update(
        requests_sent=summary.requests_sent,
        responses_received=summary.responses_received,
        responses_missing=summary.responses_missing,
        responses_duplicated=summary.responses_duplicated,
        gpu_mem_used_max_mib=gpu.mem_used_max_mib if gpu else None,
        gpu_power_mean_w=gpu.power_mean_w if gpu else None,
        gpu_samples=gpu.samples if gpu else 0,
        achieved_rate_rps=summary.achieved_rate_rps,
        slo_attainment=summary.slo.attainment if summary.slo else None,
        goodput_samples_per_s=summary.slo.goodput_samples_per_s if summary.slo else None,
        slo_p99_met=summary.slo.p99_met if summary.slo else None,
        inflight_max=summary.inflight_max,
        inflight_mean=summary.inflight_mean,
        request_queue_depth_max=summary.queue_depth_max,
        timestamp_order_violations=summary.timestamp_order_violations,
        copy_overlap=summary.copy_overlap,
        reported_requests=summary.reported_requests,
        utilisation=summary.busy_fraction,
        littles_law_ratio=summary.littles_law_ratio,
        mean_formed_batch=summary.formed.mean_images if summary.formed else None,
        p50_formed_batch=summary.formed.p50_images if summary.formed else None,
        padding_pct=summary.formed.padding_pct if summary.formed else None,
    )
    return row
