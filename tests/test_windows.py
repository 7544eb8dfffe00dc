"""Numbers that hold still (issue 14): the window stop rule, the span a row reports, the ceiling at the design's
concurrency, utilisation and Little's law, each on hand-made figures or on the CPU stand-ins."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
from conftest import make_config

from serverbench.load.windows import WindowRule, WindowTracker, is_stable, reported_span_ns, spread_pct, window_columns
from serverbench.records.console import format_summary
from serverbench.records.row import ceiling_columns
from serverbench.records.summary import (
    busy_fraction,
    ceiling_interval,
    ceiling_stats,
    efficiency_interval,
    efficiency_verdict,
    summarize,
)
from serverbench.schema.messages import BackendReport
from serverbench.schema.records import LoadSample, RequestRecord, Window
from tests.helpers import timed_record

MS = 1_000_000  # ns
S = 1_000_000_000


def window(index: int, throughput: float, p99_ms: float, length_s: float = 1.0) -> Window:
    start = round(index * length_s * S)
    return Window(
        start,
        start + round(length_s * S),
        requests=10,
        samples=round(throughput * length_s),
        p99_latency_s=p99_ms / 1e3,
    )


def test_stable_means_the_last_three_windows_throughput_and_p99_each_within_pct_of_their_mean() -> None:
    assert spread_pct([95.0, 100.0, 105.0]) == pytest.approx(5.0)
    calm = [window(0, 50, 300), window(1, 96, 41), window(2, 100, 40), window(3, 104, 42)]
    assert is_stable(calm, 5.0)  # the slow first window is not among the last three
    assert not is_stable(calm, 3.9)  # 104 is 4 % above the mean of 96, 100, 104
    jumpy_p99 = [window(0, 100, 40), window(1, 100, 40), window(2, 100, 48)]  # 48 is 12.5 % above 42.7
    assert not is_stable(jumpy_p99, 12.0) and is_stable(jumpy_p99, 13.0)
    assert not is_stable(calm[:2], 50.0)  # fewer than three windows are never stable


def feed(tracker: WindowTracker, gaps_ms: list[float], latency_ms: float = 10.0, samples: int = 4) -> list[Window]:
    """Responses at the given gaps after one another, from the tracker's start; the windows they closed."""
    closed, t_ns = [], tracker.start_ns
    for gap in gaps_ms:
        t_ns += round(gap * MS)
        window = tracker.add(t_ns, latency_ms / 1e3, samples)
        if window is not None:
            closed.append(window)
    return closed


def test_a_window_closes_at_the_first_response_that_makes_it_long_enough_and_big_enough() -> None:
    tracker = WindowTracker(WindowRule(stability_pct=5, window_s=0.1, window_requests=5, max_windows=10), 0)
    assert feed(tracker, [50] * 3) == []  # 150 ms but only 3 responses
    tracker = WindowTracker(WindowRule(stability_pct=5, window_s=0.1, window_requests=5, max_windows=10), 0)
    closed = feed(tracker, [10] * 12)  # 5 responses in 50 ms: the window waits until 100 ms
    assert len(closed) == 1 and closed[0].requests == 10 and closed[0].end_ns == 100 * MS
    assert closed[0].throughput == pytest.approx(10 * 4 / 0.1)


def test_the_phase_stops_when_stable_and_the_row_reports_the_last_three_windows() -> None:
    tracker = WindowTracker(WindowRule(stability_pct=5, window_s=0.1, window_requests=1, max_windows=10), 0)
    feed(tracker, [50] * 2 + [10] * 40)  # a slow start, then steady
    assert tracker.stop == "stable" and tracker.stable and len(tracker.windows) == 4
    assert [w.requests for w in tracker.windows] == [2, 10, 10, 10]
    assert tracker.add(10 * S, 0.01, 4) is None and len(tracker.windows) == 4  # in-flight stragglers: no window
    assert reported_span_ns(tracker.windows) == (tracker.windows[1].start_ns, tracker.windows[3].end_ns)
    columns = window_columns(tracker.windows, tracker.stable)
    assert columns["windows"] == 4 and columns["stable"] is True
    assert columns["window_throughput_cv_pct"] == pytest.approx(0.0, abs=1e-9)
    assert columns["window_throughputs"] == "80;400;400;400"  # the slow first window stays visible


def test_reaching_max_windows_ends_the_phase_unstable_flagged_not_failed() -> None:
    tracker = WindowTracker(WindowRule(stability_pct=1, window_s=0.1, window_requests=1, max_windows=4), 0)
    gaps = [10] * 10 + [20] * 5 + [10] * 10 + [20] * 5 + [10] * 20  # throughput alternates 400, 200, ...
    feed(tracker, gaps)
    assert tracker.stop == "max_windows" and not tracker.stable and len(tracker.windows) == 4
    assert window_columns(tracker.windows, tracker.stable)["stable"] is False
    assert window_columns([], None) == {
        "windows": None,
        "stable": None,
        "window_throughput_cv_pct": None,
        "window_throughputs": "",
        "noisy_windows": None,
        "stability_note": "",
    }


def record(
    request_id: int, sent_ms: float, received_ms: float, forward_ms: tuple[float, float] = (0, 0), batch_size: int = 4
) -> RequestRecord:
    sent, received = round(sent_ms * MS), round(received_ms * MS)
    start, done = round((sent_ms + forward_ms[0]) * MS), round((sent_ms + forward_ms[1]) * MS)
    return timed_record(
        request_id, (sent, sent, start, done, done, received), batch_size=batch_size, forward_start_ns=start
    )


def test_with_a_span_the_statistics_are_of_the_requests_answered_in_it() -> None:
    records = [record(i, 100 * i, 100 * i + 50) for i in range(10)]  # answered at 50, 150, ... 950 ms
    summary = summarize(records, requests_sent=10, span_ns=(300 * MS, 800 * MS))
    assert summary.reported_requests == 5 and summary.responses_received == 10  # 350 ... 750 ms
    assert summary.throughput_samples_per_s == pytest.approx(5 * 4 / 0.5)  # samples over the span's length
    assert summary.duration_s == pytest.approx(0.5)


def test_utilisation_is_the_fraction_of_the_time_with_a_forward_running() -> None:
    # Forwards at 10-30 and 20-40 ms overlap (one busy span 10-40), and 60-70 ms: 40 ms of a 100 ms span.
    records = [record(0, 0, 40, (10, 30)), record(1, 0, 45, (20, 40)), record(2, 50, 100, (10, 20))]
    assert busy_fraction(records, (0, 100 * MS)) == pytest.approx(0.4)
    assert busy_fraction(records, (25 * MS, 65 * MS)) == pytest.approx((15 + 5) / 40)  # clipped to the span
    assert busy_fraction([record(0, 0, 10)], (0, 10 * MS)) is None  # no forward spans known


def test_littles_law_holds_on_whole_records_and_catches_records_that_miss_time() -> None:
    # A closed loop of 2: each request takes 100 ms, a new one sent as one is answered, for 1 s.
    records = [record(2 * k + j, 100 * k, 100 * (k + 1)) for k in range(10) for j in range(2)]
    samples = [LoadSample(round(t * 10 * MS), 2, 0) for t in range(1, 100)]  # the sampler sees 2 in flight
    summary = summarize(records, requests_sent=20, load_samples=samples)
    assert summary.achieved_rate_rps == pytest.approx(20.0) and summary.littles_law_ratio == pytest.approx(1.0)
    # Records that miss the first half of each request's life (say, time before its send was stamped).
    short = [replace(r, sent_ns=r.sent_ns + 50 * MS) for r in records]
    ratio = summarize(short, requests_sent=20, load_samples=samples).littles_law_ratio
    assert ratio == pytest.approx(2 / (20 / 0.95 * 0.05), rel=1e-6) and abs(ratio - 1) > 0.10


def test_the_ceiling_runs_at_each_concurrency_the_design_uses_and_keeps_the_best() -> None:
    from serverbench.backend.ceiling import measure_ceiling
    from serverbench.backend.designs import ceiling_concurrencies
    from serverbench.device.layer import make_device_layer

    assert ceiling_concurrencies("serial", 1) == [1]
    assert ceiling_concurrencies("threaded", 1) == [1]
    assert ceiling_concurrencies("pipelined", 3) == [1, 2, 3]

    threads_seen: set[str] = set()

    class SleepyModel(torch.nn.Module):
        """A forward that waits 4 ms without holding the GIL: two at once take as long as one."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            threads_seen.add(threading.current_thread().name)
            time.sleep(0.004)
            return x

    loops = measure_ceiling(
        SleepyModel(),
        (torch.zeros(2, 3, 4, 4),),
        make_device_layer("cpu"),
        batch_size=2,
        concurrencies=[1, 2],
        total_s=0.1,
        loops=3,
    )
    assert sorted(loops) == [1, 2] and all(len(v) == 3 for v in loops.values())
    one, two = (sorted(loops[c])[1] for c in (1, 2))
    assert one == pytest.approx(2 / 0.004, rel=0.35) and two / one > 1.5  # two threads: nearly twice the rate
    assert {"ceiling-0", "ceiling-1", threading.current_thread().name} <= threads_seen  # c=1 on this thread
    stats = ceiling_stats({1: loops[1]}, {2: loops[2]})
    assert stats.concurrency == 2 and stats.before is None and stats.after == pytest.approx(two)


def test_every_ceiling_loop_runs_several_forwards_on_each_thread() -> None:
    """However short --ceiling_s is against a forward, no loop times one or two forwards per thread (a loop that
    short times its start signal and the threads' uneven finish as much as the model)."""
    from collections import Counter

    from serverbench.backend.ceiling import MIN_CEILING_FORWARDS, measure_ceiling
    from serverbench.device.layer import make_device_layer

    calls: Counter = Counter()
    idents: dict[str, set[int]] = {}

    class CountingModel(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls[threading.current_thread().name] += 1
            idents.setdefault(threading.current_thread().name, set()).add(threading.get_ident())
            time.sleep(0.002)
            return x

    measure_ceiling(
        CountingModel(),
        (torch.zeros(2, 3, 4, 4),),
        make_device_layer("cpu"),
        batch_size=2,
        concurrencies=[2],
        total_s=1e-6,
        loops=2,
    )  # one forward would fill each loop's time
    warm = 2  # each thread's stream is warmed with two forwards before the timed loops
    assert MIN_CEILING_FORWARDS >= 3
    assert calls["ceiling-0"] == calls["ceiling-1"] == warm + 2 * MIN_CEILING_FORWARDS
    assert len(idents["ceiling-0"]) == len(idents["ceiling-1"]) == 1  # one thread each, kept for every loop
    assert not any(t.name.startswith("ceiling-") for t in threading.enumerate())  # and ended with the measurement


def test_the_ceiling_is_the_faster_phase_at_the_best_concurrency() -> None:
    stats = ceiling_stats({1: [100.0, 102.0, 98.0], 2: [150.0, 160.0, 155.0]}, {1: [101.0], 2: [145.0, 140.0, 150.0]})
    assert stats.concurrency == 2 and stats.throughput == pytest.approx(155.0)  # before's median, the faster
    assert stats.before == pytest.approx(155.0) and stats.after == pytest.approx(145.0)
    assert stats.spread_pct == pytest.approx(50**0.5 / 150 * 100)  # CV of the six loops at concurrency 2
    # The machine slowed the phase after serving: the ceiling stays what the model did before, not their mix.
    slowed = ceiling_stats({1: [230.0, 232.0, 228.0]}, {1: [170.0, 168.0, 172.0]})
    assert slowed.throughput == pytest.approx(230.0) and slowed.after == pytest.approx(170.0)
    assert ceiling_stats({1: [200.0]}, {1: [210.0, 212.0]}).throughput == pytest.approx(211.0)  # after faster
    # The best concurrency is the one whose faster phase is highest, even where its other phase is the lowest
    # (pooled, concurrency 2's median would be 80 and concurrency 1 would win).
    best = ceiling_stats({1: [100.0], 2: [80.0, 80.0, 80.0]}, {1: [100.0], 2: [110.0]})
    assert best.concurrency == 2 and best.throughput == pytest.approx(110.0)
    assert ceiling_stats({}, {}) is None
    assert ceiling_stats({1: [10.0, 10.0]}, {2: [10.0]}).concurrency == 1  # a tie: the fewest threads


STEADY = [100.0, 101.0, 99.0, 100.0, 102.0]  # five loops of a quiet phase, samples/s


def test_the_ceilings_interval_holds_it_and_a_phase_the_machine_slowed_widens_it() -> None:
    steady = ceiling_stats({1: STEADY}, {1: [100.0, 98.0, 101.0, 100.0, 99.0]})
    assert (steady.low, steady.high) == (98.0, 102.0)  # the slowest and the fastest loop of both phases
    assert steady.low <= steady.throughput <= steady.high
    # The machine slowed the phase after serving: the ceiling stays the quiet phase's, the interval reaches down.
    slowed = ceiling_stats({1: STEADY}, {1: [80.0, 75.0, 82.0, 78.0, 79.0]})
    assert slowed.throughput == steady.throughput and (slowed.low, slowed.high) == (75.0, 102.0)
    assert slowed.low <= slowed.throughput <= slowed.high
    # Only the loops at the ceiling's concurrency count: concurrency 1's slow loops do not widen it.
    best = ceiling_stats({1: [10.0, 50.0], 2: [120.0, 118.0]}, {2: [119.0, 121.0]})
    assert best.concurrency == 2 and (best.low, best.high) == (118.0, 121.0)
    # One loop: the interval is the point. None without loops.
    assert ceiling_interval([42.0]) == (42.0, 42.0) and ceiling_interval([]) is None
    # The efficiency's: throughput over the high end and over the low end; it holds the efficiency.
    low, high = efficiency_interval(95.0, slowed)
    assert (low, high) == pytest.approx((95.0 / 102.0, 95.0 / 75.0))
    assert low <= 95.0 / slowed.throughput <= high
    steady_low, steady_high = efficiency_interval(95.0, steady)
    assert high - low > steady_high - steady_low  # the slowed phase widened it
    assert efficiency_interval(None, steady) is None and efficiency_interval(95.0, None) is None
    # Reading it: 1.0 inside is the ceiling within noise; wholly above 1 is not noise; below 1 says nothing more.
    assert efficiency_verdict(0.98, 1.41) == "at the ceiling within noise"
    assert efficiency_verdict(1.02, 1.2).startswith("above every timed loop")
    assert efficiency_verdict(0.7, 0.9) is None and efficiency_verdict(None, None) is None


def test_an_efficiency_of_1_13_whose_interval_holds_1_reads_within_noise(tmp_path) -> None:
    cfg = make_config(("--device", "cpu", "--model", "identity", "--results_dir", str(tmp_path)))
    # A noisy machine: one fast loop before serving (115), the phase after it slowed (80 to 85); ceiling 100.
    backend = BackendReport(
        ceiling_before={1: [100.0, 100.0, 100.0, 115.0, 98.0]}, ceiling_after={1: [80.0, 85.0, 82.0, 84.0, 83.0]}
    )
    columns = ceiling_columns(cfg, backend, 113.0)
    assert columns["efficiency"] == pytest.approx(1.13)  # exactly as before: throughput / ceiling_throughput
    assert (columns["efficiency_low"], columns["efficiency_high"]) == pytest.approx((113.0 / 115.0, 113.0 / 80.0))
    row = {
        **dict.fromkeys(
            ["status", "error", "responses_received", "requests_sent", "responses_missing", "responses_duplicated"], 0
        ),
        **columns,
    }
    line = next(line for line in format_summary(cfg, row).splitlines() if line.startswith("  ceiling"))
    assert line.endswith("efficiency 1.130 (0.983-1.413), at the ceiling within noise")
    # Serving beat every loop: no "within noise".
    fast = ceiling_columns(cfg, BackendReport(ceiling_before={1: STEADY}, ceiling_after={1: STEADY}), 113.0)
    text = format_summary(cfg, {**row, **fast})
    assert "efficiency 1.130 (1.108-1.141), above every timed loop" in text and "within noise" not in text
    assert "that timing was slowed" in text and "so this is no efficiency" in text  # why, and that it is no result
    # The row says it too: a reader of the CSV sees it without the console.
    assert columns["efficiency_note"] == "at the ceiling within noise"
    assert fast["efficiency_note"].startswith("above every timed loop of the model alone: that timing was slowed")
    assert ceiling_columns(cfg, backend, 50.0)["efficiency_note"] is None  # below the ceiling: nothing to say
    # No efficiency (an open-loop load), no interval; a row without the interval prints the bare figure.
    assert ceiling_columns(replace(cfg, load="poisson"), backend, 113.0)["efficiency_low"] is None
    bare = {**row, "efficiency_low": None, "efficiency_high": None}
    assert next(x for x in format_summary(cfg, bare).splitlines() if x.startswith("  ceiling")).endswith(
        "efficiency 1.130"
    )


def test_the_concurrent_ceiling_counts_the_window_every_thread_was_busy() -> None:
    from serverbench.backend.ceiling import busy_window_rate

    # Two threads, each three 0.1 s forwards of 4 samples, side by side: 2 x 4 / 0.1 = 80 samples/s.
    together = [[(0.0, 0.1), (0.1, 0.2), (0.2, 0.3)], [(0.0, 0.1), (0.1, 0.2), (0.2, 0.3)]]
    assert busy_window_rate(together, batch_size=4) == pytest.approx(80.0)
    # The second starts 0.05 s late. Start signal to the last thread done would give 24 samples / 0.35 s = 68.6;
    # the busy window [0.05, 0.3] holds 2.5 forwards of each: 20 samples / 0.25 s, the rate while both ran.
    late = [[(0.0, 0.1), (0.1, 0.2), (0.2, 0.3)], [(0.05, 0.15), (0.15, 0.25), (0.25, 0.35)]]
    assert busy_window_rate(late, batch_size=4) == pytest.approx(80.0)
    # A thread slowed after its first forward (0.2 s each) lowers the rate over the window [0, 0.3], as it would
    # serving's: three forwards of one thread and two of the other.
    slowed = [[(0.0, 0.1), (0.1, 0.2), (0.2, 0.3)], [(0.0, 0.1), (0.1, 0.3), (0.3, 0.5)]]
    assert busy_window_rate(slowed, batch_size=4) == pytest.approx((3 + 2) * 4 / 0.3)
    # No window in which both ran, a thread with no forwards, or a forward of no length: no figure.
    assert busy_window_rate([[(0.0, 0.1)], [(0.2, 0.3)]], batch_size=4) is None
    assert busy_window_rate([[(0.0, 0.1)], []], batch_size=4) is None
    assert busy_window_rate([[(0.0, 0.1)], [(0.05, 0.05)]], batch_size=4) is None


def test_a_noisy_window_does_not_count_towards_stable() -> None:
    """Windows the machine made (steal, other processes, a stall) are not judged: stable needs 3 clean windows that
    agree, and a phase that never had them ends unstable, saying why."""
    noisy = iter(["", "steal 7.0 %", "", "", ""])
    tracker = WindowTracker(
        WindowRule(stability_pct=5, window_s=0.1, window_requests=1, max_windows=10),
        0,
        noise_of=lambda p99: next(noisy),
    )
    feed(tracker, [10] * 60)  # every window alike: only the noisy one is in the way
    assert [bool(w.noise) for w in tracker.windows] == [False, True, False, False, False]
    assert tracker.stable and len(tracker.windows) == 5  # windows 3 to 5: the first clean three in a row
    columns = window_columns(tracker.windows, tracker.stable, 5)
    assert columns["noisy_windows"] == 1 and columns["stability_note"] == ""
    always = WindowTracker(
        WindowRule(stability_pct=5, window_s=0.1, window_requests=1, max_windows=4),
        0,
        noise_of=lambda p99: "a 9 ms stall",
    )
    feed(always, [10] * 60)
    assert always.stop == "max_windows" and not always.stable
    note = window_columns(always.windows, always.stable, 5)["stability_note"]
    assert note.startswith("the machine: 4 of 4 windows noisy") and "a 9 ms stall" in note
    quiet = WindowTracker(WindowRule(stability_pct=1, window_s=0.1, window_requests=1, max_windows=4), 0)
    feed(quiet, [10] * 10 + [20] * 5 + [10] * 10 + [20] * 5 + [10] * 20)
    assert window_columns(quiet.windows, quiet.stable, 1)["stability_note"] == (
        "the last 3 windows never agreed within 1 %"
    )
    once = iter(["a 2 ms stall", "", "", "", ""])
    some = WindowTracker(
        WindowRule(stability_pct=1, window_s=0.1, window_requests=1, max_windows=5), 0, noise_of=lambda p99: next(once)
    )
    feed(some, [10] * 10 + [20] * 5 + [10] * 10 + [20] * 5 + [10] * 20 + [20] * 10)
    assert window_columns(some.windows, some.stable, 1)["stability_note"] == (
        "the last 3 windows never agreed within 1 % (1 noisy windows not counted)"
    )


def test_littles_law_counts_from_the_send_and_needs_enough_requests_seen_in_flight() -> None:
    # A Poisson sender 30 ms late on every request: latency runs from the schedule, the sampler counts from the send.
    records = [
        replace(record(2 * k + j, 100 * k, 100 * (k + 1)), send_start_ns=(100 * k + 30) * MS)
        for k in range(10)
        for j in range(2)
    ]
    seen = [LoadSample(round(t * 10 * MS), 2 if (t % 10) >= 3 else 0, 0) for t in range(1, 100)]
    ratio = summarize(records, requests_sent=20, load_samples=seen).littles_law_ratio
    assert ratio == pytest.approx(sum(s.inflight for s in seen) / len(seen) / (20 / 1.0 * 0.07), rel=1e-6)
    assert abs(ratio - 1) < 0.10  # no false alarm from the late sender
    # Only a few requests ever seen in flight (49 of them summed over the samples): no figure, no alarm.
    sparse = [LoadSample(round(t * 10 * MS), 1 if t < 50 else 0, 0) for t in range(1, 100)]
    assert summarize(records, requests_sent=20, load_samples=sparse).littles_law_ratio is None
