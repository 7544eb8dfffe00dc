"""Load shapes: the arrival schedule, open-loop and closed-loop runs, the duration rule, SLO columns, peak search."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TINY, ServerRun, read_rows, run_server

import server
from serverbench.config.schedules import arrival_offsets_s
from serverbench.launch.peak import bisect_peak

IDENTITY = [*TINY, "--model", "identity", "--image_size", "16"]


def _first(n: int, rate: float, burstiness: float = 1.0, seed: int = 0, count: int = 0) -> np.ndarray:
    return np.fromiter(itertools.islice(arrival_offsets_s(rate, burstiness, seed, count), n), dtype=float)


def test_a_counted_schedule_offers_exactly_its_rate() -> None:
    for seed in range(5):
        offsets = _first(301, rate=60.0, seed=seed, count=300)
        assert offsets[300] == pytest.approx(300 / 60.0)  # 300 gaps span exactly 5 s
        gaps = np.diff(offsets[:300])
        assert 0.7 < gaps.std() / gaps.mean() < 1.3  # still exponential-looking gaps
    assert np.array_equal(_first(400, 60.0, count=300), _first(400, 60.0, count=300))


def test_the_burstiest_schedule_still_offers_its_rate_where_every_gamma_draw_underflows() -> None:
    """--burstiness 0.001, its least: gamma draws of that shape fall below the smallest float, and a count's gaps
    that all did were divided by their zero sum (NaN send times, the run an error). Seeds 8 and 12 did."""
    for seed in (8, 12, *range(4)):
        for count in (2, 300):
            with np.errstate(divide="raise", invalid="raise"):  # underflow to 0 is the draw of this shape
                offsets = list(itertools.islice(arrival_offsets_s(10.0, 0.001, seed, count=count), count + 1))
            assert np.isfinite(offsets).all() and (np.diff(offsets) >= 0).all(), (seed, count, offsets[:5])
            assert offsets[count] == pytest.approx(count / 10.0)


def test_schedule_has_the_right_mean_gap_and_is_reproducible() -> None:
    offsets = _first(20_000, rate=250.0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 250.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: Poisson arrivals
    assert np.array_equal(offsets, _first(20_000, rate=250.0))
    assert not np.array_equal(offsets, _first(20_000, rate=250.0, seed=1))
    bursty = np.diff(_first(20_000, rate=250.0, burstiness=0.25))
    assert bursty.mean() == pytest.approx(1 / 250.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(burstiness)


# 150 requests at 60 a second: a phase of 2.5 s, whose last response would have to come 0.25 s late for the
# achieved rate to miss the offered one by 10 % (the counted schedule offers exactly its rate: see above).
POISSON_RATE, POISSON_COUNT = 60.0, 150


@pytest.fixture(scope="module")
def poisson_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[ServerRun, Path]:
    """An open loop of 150 requests at 60 a second, with a --duration_s far shorter than the count takes: the
    offered-rate test reads it, and the duration test (the count wins). Its run and its results folder."""
    results_dir = tmp_path_factory.mktemp("poisson")
    args = [*IDENTITY, "--num_iters", str(POISSON_COUNT), "--load", "poisson", "--rate", str(POISSON_RATE)]
    return run_server([*args, "--slo_ms", "1000", "--duration_s", "0.000001"], results_dir), results_dir


@pytest.fixture(scope="module")
def closed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[ServerRun, Path]:
    """A closed loop, 3 at a time, whose --duration_s outlasts its count: the concurrency and Little's-law test
    reads it, and the duration test (the duration wins). Its run and its results folder."""
    # Requests of 5 ms, 3 at a time, for 1 s: some 500 polls of the load sampler at 2 ms, so that one stall of the
    # sampler's thread, or a machine twice as slow, moves its mean by far less than the 10 % that Little's law is
    # checked to (60 requests alone, a 0.1 s phase of 50 polls, once came out 0.80). The 60 requests of the count
    # take a tenth of the duration: the duration is what ends the phase, on a machine many times slower too.
    results_dir = tmp_path_factory.mktemp("closed")
    args = [*IDENTITY, "--num_iters", "60", "--duration_s", "1", "--warmup_iters", "3", "--load", "closed"]
    args += ["--concurrency", "3", "--inject_delay_ms", "5", "--save_requests", "--load_poll_ms", "2"]
    return run_server(args, results_dir), results_dir


def test_poisson_run_reaches_its_offered_rate(poisson_run: tuple[ServerRun, Path]) -> None:
    run, _ = poisson_run
    assert run.returncode == 0, run.stderr
    row = run.row
    assert (row["load"], float(row["offered_rate_rps"])) == ("poisson", POISSON_RATE)
    assert float(row["achieved_rate_rps"]) == pytest.approx(POISSON_RATE, rel=0.10)
    assert float(row["slo_attainment"]) == 1.0 and row["slo_p99_met"] == "True"
    assert float(row["goodput_samples_per_s"]) == pytest.approx(float(row["throughput"]))
    # An open loop idles the server between requests by design: no efficiency, how busy it was instead.
    assert row["efficiency"] == "" and float(row["ceiling_throughput"]) > 0 and 0 < float(row["utilisation"]) < 1
    # 60 requests a second of about a millisecond each: the sampler sees too few in flight for Little's law to
    # say anything (it read 0.0 or 1.9 by chance), so the row leaves the check empty rather than alarm.
    assert row["littles_law_ratio"] == "" and "Little's law" not in run.stdout


def test_closed_loop_never_exceeds_its_concurrency(closed_run: tuple[ServerRun, Path]) -> None:
    run, results_dir = closed_run
    assert run.returncode == 0, run.stderr
    requests = pd.read_csv(results_dir / run.row["requests_file"]).query("not warmup")
    events = sorted(
        [(t, 1) for t in requests["sent_ns"]] + [(t, -1) for t in requests["received_ns"]], key=lambda e: (e[0], e[1])
    )  # at a tie, a response frees its place first
    outstanding = np.cumsum([delta for _, delta in events])
    assert outstanding.max() == 3  # used, never exceeded
    assert int(run.row["inflight_max"]) == 3  # the records' count, exact
    # Little's law: the sampler's count of requests in flight against the records' rate x latency.
    load = pd.read_csv(results_dir / run.row["load_samples_file"])
    assert len(load) >= 100, len(load)  # enough polls for the mean to mean something
    assert float(run.row["littles_law_ratio"]) == pytest.approx(1.0, abs=0.10)
    assert float(run.row["efficiency"]) > 0  # a closed loop keeps the server busy: efficiency applies
    [littles_line] = [
        line for line in run.stdout.splitlines() if "Little's law  in flight / (rate x latency) = " in line
    ]
    assert "WARNING" not in littles_line  # (a machine-noise warning, on its own line, may be there: not this test's)


def test_latency_from_the_intended_time_shows_a_slow_servers_backlog(tmp_path: Path) -> None:
    # A serial server that needs >= 20 ms per request, offered 80 requests/s: the backlog must show.
    run = run_server(
        [
            *IDENTITY,
            "--design",
            "serial",
            "--inject_delay_ms",
            "20",
            "--num_iters",
            "60",
            "--load",
            "poisson",
            "--rate",
            "80",
            "--save_requests",
            "--slo_ms",
            "100",
            "--ring_slots",
            "16",
        ],
        tmp_path,
    )  # room for the backlog to be sent, as a 16-deep queue
    assert run.returncode == 0, run.stderr
    requests = pd.read_csv(tmp_path / run.row["requests_file"]).query("not warmup").sort_values("request_id")
    latency_s = requests["latency_s"].to_numpy()
    assert latency_s[-10:].mean() > 3 * latency_s[:10].mean()  # grows with the backlog
    assert latency_s[-10:].mean() > 0.2  # ~20 requests behind after 60 arrivals at 80/s vs 50/s served
    assert float(run.row["achieved_rate_rps"]) < 60
    assert run.row["slo_p99_met"] == "False" and float(run.row["slo_attainment"]) < 0.8
    assert int(run.row["inflight_max"]) >= 10
    load = pd.read_csv(tmp_path / run.row["load_samples_file"])
    assert load["inflight"].max() >= 10 and len(load) > 5  # the backlog over time, saved with the run


def test_duration_and_count_both_bound_the_measured_phase(
    closed_run: tuple[ServerRun, Path], poisson_run: tuple[ServerRun, Path]
) -> None:
    run, _ = closed_run  # 60 requests, 1 s: the duration wins when the count is done sooner
    assert run.returncode == 0, run.stderr
    row = run.row
    assert float(row["duration_s"]) >= 1 and int(row["responses_received"]) > 60
    assert int(row["requests_sent"]) == int(row["responses_received"])
    assert int(row["warmup_iters"]) == 3
    short, _ = poisson_run  # 150 requests, a microsecond: the count wins when it takes longer
    assert int(short.row["responses_received"]) == POISSON_COUNT


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--load", "closed"], "needs --concurrency"),
        (["--load", "closed", "--concurrency", "0"], "--concurrency 0"),
        (["--load", "poisson"], "needs --rate"),
        (["--load", "poisson", "--rate", "0"], "must be positive"),
        (["--load", "poisson", "--rate", "-5"], "must be positive"),
        (["--load", "poisson", "--rate", "5", "--burstiness", "0"], "--burstiness"),
        (["--rate", "5"], "poisson only"),
        (["--duration_s", "-1"], "must not be negative"),
        (["--find_peak"], "needs --slo_ms"),
        (["--slo_ms", "0"], "must be positive"),
        (["--warmup_iters", "0"], "--warmup_iters 0"),
    ],
)
def test_bad_load_flags_exit_2(argv: list[str], expected: str, tmp_path: Path, capsys) -> None:
    assert server.main([*argv, "--results_dir", str(tmp_path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "server[" not in line]
    assert len(err) == 1 and expected in err[0]


def test_bisection_finds_a_passing_rate_below_a_failing_one() -> None:
    def p99_s(step: int, rate: float) -> float:  # a server that saturates at 100 requests/s
        return 0.01 / max(1e-9, 1 - rate / 100)

    passing, failing = bisect_peak(p99_s, offline_rps=100.0, slo_s=0.05, steps=8)
    assert passing[1] <= 0.05 < failing[1]
    assert passing[0] < failing[0]
    assert 78 < passing[0] <= 80 <= failing[0] < 82  # the true answer is 80 requests/s
    keeps_up, none = bisect_peak(lambda step, rate: 0.001, offline_rps=50.0, slo_s=0.05, steps=8)
    assert keeps_up == (50.0, 0.001) and none is None
    never, _ = bisect_peak(lambda step, rate: None, offline_rps=50.0, slo_s=0.05, steps=3)
    assert never is None


def test_find_peak_from_the_command_line_finds_the_planted_capacity(tmp_path: Path) -> None:
    """A serial server whose forward takes 20 ms can serve at most 50 requests/s: the capacity the test plants.
    Arrivals nearly evenly spaced (--burstiness 25: gaps with a CV of 0.2) keep the latency at about one forward
    below that rate, so the search's answer is the capacity itself, to its resolution: the offline rate when it
    meets the SLO there (as it does, a p99 of about 60 ms against 200), else at least the 3rd step's 3/4 of it
    (a 200 ms SLO holds a stall of 150 ms there)."""
    capacity_rps, slo_s = 1000 / 20, 0.2
    run = run_server(
        [
            *IDENTITY,
            "--design",
            "serial",
            "--inject_delay_ms",
            "20",
            "--num_iters",
            "40",
            "--slo_ms",
            str(slo_s * 1e3),
            "--burstiness",
            "25",
            "--find_peak",
            "--peak_steps",
            "3",
        ],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    [peak] = read_rows(tmp_path / "peak.csv")
    rows = run.rows
    assert rows[0]["load"] == "burst" and rows[0]["peak_search_step"] == "offline"
    assert all(r["load"] == "poisson" for r in rows[1:]) and 2 <= len(rows) <= 4
    offline_rps = float(peak["offline_rate_rps"])
    assert offline_rps == pytest.approx(float(rows[0]["achieved_rate_rps"]))
    assert float(rows[1]["offered_rate_rps"]) == pytest.approx(offline_rps)  # tried first
    # Never above the capacity (2 % for the clocks), and at most 20 % below it: a forward's 20 ms sleep plus the
    # request's way through the identity server (well under a millisecond here).
    assert 0.8 * capacity_rps < offline_rps < 1.02 * capacity_rps, offline_rps
    assert peak["status"] == "ok" and 0.75 * offline_rps <= float(peak["peak_rate_rps"]) <= offline_rps, peak
    assert float(peak["peak_throughput"]) == pytest.approx(2 * float(peak["peak_rate_rps"]))  # samples: batch 2
    assert float(peak["peak_p99_latency_s"]) <= slo_s
    if peak["over_slo_rate_rps"]:  # the step that missed, above the peak
        assert float(peak["over_slo_p99_latency_s"]) > slo_s
        assert float(peak["peak_rate_rps"]) < float(peak["over_slo_rate_rps"])
    # What the search ran with, so that repeats and thread counts can be told apart in one peak.csv.
    assert peak["repeat"] == "0" and peak["design"] == "serial" and peak["max_batch_size"] == ""
    assert peak["intra_op_threads"] == rows[0]["intra_op_threads"] != "" and peak["burstiness"] == "25.0"
    assert f"peak: {float(peak['peak_rate_rps']):.2f} req/s" in run.stdout
    # Its own id, unlike every step's: what bench.serving finds its search's line by (Runner.server_row)
    assert peak["run_id"].endswith("_peak") and peak["run_id"] not in {r["run_id"] for r in rows}
