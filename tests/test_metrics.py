"""The summary is a pure function of hand-made records: formulas, warm-up exclusion, counts, units."""

from __future__ import annotations

import pytest

from serverbench.records.summary import summarize, summary_columns
from serverbench.schema.records import GpuSample, RecordSample, RequestRecord
from serverbench.schema.stats import LatencyStats
from tests.helpers import timed_record

MS = 1_000_000  # ns


def record(
    request_id: int,
    sent_ms: float,
    received_ms: float,
    batch_size: int = 8,
    warmup: bool = False,
    stages_ms: tuple[float, float, float, float] = (1, 2, 3, 4),
) -> RequestRecord:
    sent = round(sent_ms * MS)
    taken = sent + round(stages_ms[0] * MS)
    h2d = taken + round(stages_ms[1] * MS)
    forward_done = h2d + round(stages_ms[2] * MS)
    d2h = forward_done + round(stages_ms[3] * MS)
    stamps = (sent, taken, h2d, forward_done, d2h, round(received_ms * MS))
    return timed_record(request_id, stamps, warmup=warmup, batch_size=batch_size, copy_ms=(0.5, 2.5, 0.25))


def test_throughput_is_samples_over_first_send_to_last_response() -> None:
    records = [record(0, 0, 5000, warmup=True)]  # a slow warm-up must not count
    records += [record(i, 10_000 + i, 10_000 + 100 + 50 * i) for i in range(1, 5)]
    summary = summarize(records, requests_sent=4)
    # 4 requests x 8 samples over (last response 10_300 ms - first send 10_001 ms)
    assert summary.throughput_samples_per_s == pytest.approx(32 / 0.299)
    assert summary.duration_s == pytest.approx(0.299)
    assert summary.warmup_latency_s == pytest.approx(5.0)


def test_latency_statistics_exclude_warmup() -> None:
    records = [record(0, 0, 9000, warmup=True)] + [record(i, 0, 10 * i) for i in range(1, 101)]
    lat = summarize(records, requests_sent=100).latency
    assert lat.min_s == pytest.approx(0.010)
    assert lat.max_s == pytest.approx(1.000)
    assert lat.mean_s == pytest.approx(0.505)
    assert lat.p50_s == pytest.approx(0.505)
    assert lat.p99_s == pytest.approx(0.9901)
    assert lat.p90_s < lat.p95_s < lat.p99_s <= lat.max_s


def test_stage_means_add_up_to_latency() -> None:
    records = [record(i, 0, 20, stages_ms=(1, 2, 3, 4)) for i in range(1, 4)]
    summary = summarize(records, requests_sent=3)
    assert summary.stage_mean_ms == pytest.approx(
        {"request_queue": 1, "batch_wait": 0, "h2d": 2, "predict": 3, "d2h": 4, "response_queue": 10}
    )
    assert sum(summary.stage_mean_ms.values()) == pytest.approx(summary.latency.mean_s * 1e3)
    assert summary.copy_mean_ms == pytest.approx({"h2d_copy": 0.5, "forward": 2.5, "d2h_copy": 0.25})


def test_missing_and_duplicated_are_counted() -> None:
    records = [record(0, 0, 1, warmup=True), record(1, 1, 2), record(3, 1, 3)]
    summary = summarize(records, requests_sent=5, responses_duplicated=2)
    assert summary.responses_received == 2
    assert summary.responses_missing == 3
    assert summary.responses_duplicated == 2


def test_no_responses_gives_empty_metrics_not_a_crash() -> None:
    summary = summarize([], requests_sent=3)
    columns = summary_columns(summary)
    assert summary.latency is None and summary.throughput_samples_per_s is None
    assert columns["average_latency"] is None and columns["throughput"] is None
    assert columns["responses_missing"] == 3


def test_reference_columns_keep_their_units() -> None:
    records = [record(0, 0, 2000, warmup=True), record(1, 2000, 2250), record(2, 2000, 2500)]
    gpu = [
        GpuSample(round(2100 * MS), 50.0, 1000.0, 300.0),
        GpuSample(round(2200 * MS), 70.0, 1200.0, 320.0),
        GpuSample(round(9000 * MS), 0.0, 10.0, 50.0),
    ]  # after the last response: not in the window
    columns = summary_columns(summarize(records, requests_sent=2, gpu_samples=gpu))
    assert columns["warmup_latency"] == pytest.approx(2.0)  # seconds
    assert columns["average_latency"] == pytest.approx(0.375)  # seconds
    assert columns["throughput"] == pytest.approx(16 / 0.5)  # samples per second
    assert columns["gpu_util"] == pytest.approx(60.0)  # percent
    assert columns["gpu_mem_used_max_mib"] == pytest.approx(1200.0)
    assert columns["gpu_power_mean_w"] == pytest.approx(310.0)


def test_latency_stats_of_one_value() -> None:
    stats = LatencyStats.from_values([0.25])
    assert stats.mean_s == stats.p99_s == stats.min_s == stats.max_s == 0.25
    assert stats.std_s == 0.0


def test_a_short_run_gives_no_in_flight_figures_rather_than_a_wrong_zero() -> None:
    from serverbench.records.summary import MIN_LOAD_SAMPLES, summarize
    from serverbench.schema.records import LoadSample

    few = [LoadSample(i, 0, 0) for i in range(MIN_LOAD_SAMPLES - 1)]
    summary = summarize([], 0, load_samples=few)
    assert (summary.inflight_max, summary.inflight_mean, summary.queue_depth_max) == (None, None, None)
    enough = [LoadSample(i, i, 1) for i in range(MIN_LOAD_SAMPLES)]
    summary = summarize([], 0, load_samples=enough)
    assert summary.inflight_max == MIN_LOAD_SAMPLES - 1 and summary.queue_depth_max == 1


def test_in_flight_max_is_exact_from_the_records_where_the_sampler_misses_a_peak() -> None:
    """Three requests overlap for 1 ms between two samples 50 ms apart, which each saw one: the most in flight is
    3 from the records; a request never answered, which only the sampler saw, still counts."""
    from serverbench.records.summary import MIN_LOAD_SAMPLES, summarize
    from serverbench.schema.records import LoadSample

    ms = 1_000_000
    spans_ms = [(0, 100), (50, 51), (50.5, 52), (200, 210)]  # send start, answer
    records = [
        timed_record(i, tuple(int(t * ms) for t in (a, a, a, a, a, b)), send_start_ns=int(a * ms))
        for i, (a, b) in enumerate(spans_ms)
    ]
    samples = [LoadSample(t * 50 * ms, 1, 0) for t in range(MIN_LOAD_SAMPLES)]  # each saw one
    assert summarize(records, 4, load_samples=samples).inflight_max == 3
    unanswered = [LoadSample(t * 50 * ms, 4, 0) for t in range(MIN_LOAD_SAMPLES)]
    assert summarize(records, 8, load_samples=unanswered).inflight_max == 4
    assert summarize(records, 4).inflight_max == 3  # no sampler's figure: the records'


def test_a_record_sample_is_bounded_uniform_and_keeps_exact_totals() -> None:
    """A --serve_only door's records over hours grew about 1 KB a request; the sample keeps at most its capacity of
    the measured ones (every warm-up one), drawn uniformly, reproducibly, beside the exact totals."""
    sample = RecordSample(capacity=100, seed=3)
    for request_id in range(3):
        sample.add(record(request_id, 0, 10, warmup=True))
    assert sample.totals() is None  # nothing measured left out yet
    for request_id in range(3, 10_003):
        sample.add(record(request_id, request_id * 10, request_id * 10 + 20, batch_size=2))
    kept = sample.records()
    assert len(kept) == 103 and sum(r.warmup for r in kept) == 3
    totals = sample.totals()
    assert (totals.count, totals.samples, totals.kept) == (10_000, 20_000, 100)
    assert (totals.first_sent_ns, totals.last_received_ns) == (30 * MS, (10_002 * 10 + 20) * MS)
    ids = sorted(r.request_id for r in kept if not r.warmup)
    assert ids[0] < 1500 and ids[-1] > 8500 and 3500 < sum(ids) / len(ids) < 6500  # spread over the whole run
    again = RecordSample(capacity=100, seed=3)
    for r in (record(i, i * 10, i * 10 + 20, batch_size=2) for i in range(3, 10_003)):
        again.add(r)
    assert [r.request_id for r in again.records()] == [r.request_id for r in kept if not r.warmup]


def test_a_summary_of_a_sample_takes_counts_and_throughput_from_the_totals() -> None:
    sample = RecordSample(capacity=50)
    for request_id in range(1000):  # 1000 requests of 2 rows, one a ms, each answered in 20 ms: 1.019 s in all
        sample.add(record(request_id, request_id, request_id + 20, batch_size=2))
    summary = summarize(sample.records(), requests_sent=1000, totals=sample.totals())
    assert summary.responses_received == 1000 and summary.responses_missing == 0
    assert summary.throughput_samples_per_s == pytest.approx(2000 / 1.019)
    assert summary.achieved_rate_rps == pytest.approx(1000 / 1.019)
    assert summary.latency.p50_s == pytest.approx(0.020)  # the sample's: every request took 20 ms
