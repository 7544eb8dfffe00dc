"""--generators N: the load generator in N frontend processes, each our door's client with its share of the load.
The splitting (every accepted split gives each generator a request; Poisson schedules of their own), the control
fan-out past a generator that has gone, and the merging in-process on hand-made values; then server.py end to end
over HTTP and gRPC (every request answered once, ids from each generator's block, the closed loop's places split), a
Poisson run's achieved rate, and a generator killed mid-run ending the run with a status (the survivor's requests
kept in the row). The refusals are rows of tests/test_bad_input.py.
"""

from __future__ import annotations

import csv
import itertools
import math
import multiprocessing as mp
import os
import queue
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    communicate_or_fail,
    live_processes_in_session,
    make_config,
    read_log_until,
    read_rows,
    run_server,
    start_server,
)

import server
from serverbench.config.flags import ConfigError
from serverbench.config.generators import GENERATOR_ID_BLOCK, generator_config, split_shares
from serverbench.config.loads import POISSON
from serverbench.config.schedules import arrival_offsets_s
from serverbench.launch.frontends import combine_frontend_reports, summed_load_samples, surviving_generators
from serverbench.load.noise import merged_noise
from serverbench.schema.messages import BackendFailure, BackendReport, FrontendReport, RunResult
from serverbench.schema.records import LoadSample, NoiseStats
from serverbench.transport.responses import ControlFanout, ResponseChannel

SMALL = ["--device", "cpu", "--model", "identity", "--image_size", "16", "--batch_size", "1", "--no-ceiling"]
SMALL += ["--port", "0", "--generators", "2"]


def test_shares_add_up_and_follow_the_weights() -> None:
    assert split_shares(5, [1, 1]) == [2, 3]
    assert split_shares(7, [1, 1, 1]) == [2, 2, 3]
    assert split_shares(10, [2, 3]) == [4, 6]
    assert sum(split_shares(1001, [1] * 7)) == 1001


def test_each_generator_gets_its_share_of_the_load(tmp_path: Path) -> None:
    base = [*SMALL, "--transport", "http", "--results_dir", str(tmp_path)]
    closed = make_config([*base, "--load", "closed", "--concurrency", "5", "--num_iters", "100"])
    shares = [generator_config(closed, index) for index in range(2)]
    assert [(c.concurrency, c.num_iters, c.generator) for c in shares] == [(2, 40, 0), (3, 60, 1)]
    poisson = make_config([*base, "--load", "poisson", "--rate", "300", "--num_iters", "9"])
    assert [(generator_config(poisson, i).rate_rps, generator_config(poisson, i).num_iters) for i in (0, 1)] == [
        (150.0, 4),
        (150.0, 5),
    ]
    one = make_config([*base, "--generators", "1"])
    assert generator_config(one, 0) is one  # one generator: the run's config as it is


@pytest.mark.parametrize("count", [2, 3, 4, 5])
def test_every_accepted_closed_split_gives_every_generator_a_request(tmp_path: Path, count: int) -> None:
    """Over a grid of --concurrency and --num_iters: a combination is accepted exactly when every generator gets at
    least one place and one measured request, and the accepted ones' shares add up to what was asked."""
    base = [*SMALL, "--transport", "http", "--results_dir", str(tmp_path), "--load", "closed"]
    base += ["--generators", str(count)]
    for concurrency, num_iters in itertools.product(range(1, 13), range(1, 16)):
        places = split_shares(concurrency, [1] * count)
        feasible = min(places) >= 1 and min(split_shares(num_iters, places)) >= 1
        try:
            cfg = make_config([*base, "--concurrency", str(concurrency), "--num_iters", str(num_iters)])
        except ConfigError:
            assert not feasible, (count, concurrency, num_iters)
            continue
        assert feasible, (count, concurrency, num_iters)
        shares = [generator_config(cfg, index) for index in range(count)]
        assert all(share.num_iters >= 1 and share.concurrency >= 1 for share in shares)
        assert sum(share.num_iters for share in shares) == num_iters
        assert sum(share.concurrency for share in shares) == concurrency


def test_poisson_generators_have_schedules_of_their_own_and_their_rates_add_up(tmp_path: Path) -> None:
    argv = [*SMALL, "--transport", "http", "--results_dir", str(tmp_path), "--load", "poisson", "--rate", "250"]
    cfg = make_config([*argv, "--generators", "3", "--num_iters", "30"])
    shares = [generator_config(cfg, index) for index in range(3)]
    assert math.isclose(math.fsum(share.rate_rps for share in shares), 250.0)
    assert len({POISSON.seed(share) for share in shares}) == 3
    firsts = [
        list(itertools.islice(arrival_offsets_s(s.rate_rps, s.burstiness, POISSON.seed(s), count=10), 5))
        for s in shares
    ]
    gaps = [tuple(b - a for a, b in itertools.pairwise(first)) for first in firsts]
    assert len(set(gaps)) == 3 and all(len(set(g[i] for g in gaps)) == 3 for i in range(4)), gaps


def test_a_backend_failure_reaches_every_generator_still_reading() -> None:
    """A generator that finished its share has closed its end of its control channel: the fan-out skips it and
    still tells the others."""
    ctx = mp.get_context("spawn")
    channels = [ResponseChannel(ctx, lock_timeout_s=1.0) for _ in range(3)]
    channels[0].keep_writing_end()  # the first generator is gone (its reading end is in no process)
    fanout = ControlFanout(channels)
    failure = BackendFailure(status="error", error="boom", traceback="")
    fanout.send(failure)
    assert [channel.receive(1.0) for channel in channels[1:]] == [failure, failure]
    channels[2].keep_writing_end()
    fanout.send(failure)  # the middle one still hears, the closed ones stop nothing
    assert channels[1].receive(1.0) == failure
    with pytest.raises(queue.Empty):
        channels[1].receive(0.05)
    fanout.close()


def test_in_flight_adds_up_over_the_generators() -> None:
    first = [LoadSample(10, 2, None), LoadSample(20, 1, None)]
    second = [LoadSample(15, 3, None), LoadSample(25, 3, None)]
    # At 10 only the first has begun; at 20 the second's sample of 15 still holds; after 20 the first has ended.
    assert [(s.t_ns, s.inflight) for s in summed_load_samples([first, second])] == [(10, 2), (15, 5), (20, 4), (25, 3)]


def test_the_reports_merge_into_one_and_the_first_failure_is_the_runs() -> None:
    ok = FrontendReport(requests_sent=3, noise=NoiseStats(cpu_steal_pct=0.5, runqueue_wait_pct={"frontend": 4.0}))
    other = FrontendReport(requests_sent=4, noise=NoiseStats(cpu_steal_pct=2.5, runqueue_wait_pct={"backend": 1.0}))
    merged = combine_frontend_reports({"frontend 0": ok, "frontend 1": other}, ["frontend 0", "frontend 1"])
    assert merged.status == "ok" and merged.requests_sent == 7
    assert merged.noise.cpu_steal_pct == 2.5 and merged.noise.runqueue_wait_pct == {"frontend": 4.0, "backend": 1.0}
    failed = FrontendReport(status="error", error="boom")
    merged = combine_frontend_reports({"frontend 0": ok, "frontend 1": failed}, ["frontend 0", "frontend 1"])
    assert (merged.status, merged.error) == ("error", "frontend 1: boom")
    merged = combine_frontend_reports({"frontend 1": other}, ["frontend 0", "frontend 1"])
    assert (merged.status, merged.error) == ("error", "no report from frontend 0")
    assert merged_noise([None, None]) is None


def test_a_dead_generator_leaves_the_survivors_records_in_the_run() -> None:
    """Of several generators, one died: the run fails with the death, and keeps what the others sent and received,
    saying whose they are. One dead frontend alone: its stand-in has no records, and the row no counts."""
    roles = ["frontend 0", "frontend 1"]
    survivor = FrontendReport(status="stopped", requests_sent=5)
    dead = FrontendReport(status="frontend_died", error="the frontend 1 process died (killed by SIGKILL)")
    reports = {"frontend 0": survivor, "frontend 1": dead}
    assert surviving_generators(reports, roles) == ["frontend 0"]
    merged = combine_frontend_reports(reports, roles)
    assert merged.status == "frontend_died" and merged.requests_sent == 5
    assert merged.error.endswith("; the row counts the requests of frontend 0 only"), merged.error
    result = RunResult(status="ok")
    server._merge_reports(result, merged, BackendReport(), None, survivors=True)
    assert (result.status, result.frontend) == ("frontend_died", merged)
    alone = RunResult(status="ok")
    assert surviving_generators({"frontend": dead}, ["frontend"]) == []
    server._merge_reports(alone, dead, BackendReport(), None)
    assert (alone.status, alone.frontend) == ("frontend_died", None)


def request_records(results_dir: Path, row: dict[str, str]) -> list[dict[str, str]]:
    with open(results_dir / row["requests_file"], newline="") as f:
        return [r for r in csv.DictReader(f) if r["warmup"] == "False"]


def most_in_flight(records: list[dict[str, str]]) -> int:
    """Requests in flight at once, from their send's start to their answer's arrival."""
    events = sorted([(int(r["send_start_ns"]), 1) for r in records] + [(int(r["received_ns"]), -1) for r in records])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


@pytest.mark.parametrize(
    "transport, load",
    [
        # A Poisson schedule shared by the two (150 + 150 requests/s): the run also shows the rate it offers.
        ("http", ["--load", "poisson", "--rate", "300", "--num_iters", "200"]),
        ("grpc", ["--load", "closed", "--concurrency", "4", "--num_iters", "200"]),
        ("http", ["--num_iters", "200"]),  # a burst: each sends its share at once
    ],
    ids=["http-poisson", "grpc-closed", "http-burst"],
)
def test_two_generators_answer_every_request_once(tmp_path: Path, transport: str, load: list[str]) -> None:
    args = [*SMALL, *load, "--transport", transport, "--verify", "--save_requests", "--load_poll_ms", "5"]
    run = run_server(args, tmp_path, timeout_s=120)
    assert run.returncode == 0, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "ok" and row["generators"] == "2" and row["wrong_outputs"] == "0", row["error"]
    assert row["requests_sent"] == row["responses_received"] == "200" and row["responses_duplicated"] == "0"
    assert row["door_answered"] == "202"  # every measured request, and each generator's warm-up
    records = request_records(tmp_path, row)
    ids = [int(r["request_id"]) for r in records]
    assert len(set(ids)) == 200  # no id twice: each generator's from its own block
    by_generator = [[r for r in records if int(r["request_id"]) // GENERATOR_ID_BLOCK == g] for g in (0, 1)]
    assert [len(mine) for mine in by_generator] == [100, 100]
    if "closed" in load:  # concurrency 4 over two generators: 2 + 2 places
        assert [most_in_flight(mine) for mine in by_generator] == [2, 2]
        assert most_in_flight(records) == int(row["inflight_max"]) == 4
    if "poisson" in load:  # the two schedules together offer the rate asked
        assert row["offered_rate_rps"] == "300.0"
        assert 0.7 * 300 <= float(row["achieved_rate_rps"]) <= 1.3 * 300, row["achieved_rate_rps"]
        # Both schedules count from the one instant the server opened the gate for: each generator's first
        # intended send is its first offset after the same zero, to the nanoseconds' rounding (each from when it
        # woke, they were 0.5-8 ms apart).
        cfg = make_config([*args, "--results_dir", str(tmp_path)])
        firsts_s = [next(POISSON.offsets_s(generator_config(cfg, g))) for g in (0, 1)]
        zeros_ns = [min(int(r["sent_ns"]) for r in by_generator[g]) - round(firsts_s[g] * 1e9) for g in (0, 1)]
        assert abs(zeros_ns[0] - zeros_ns[1]) <= 2, zeros_ns


def test_a_generator_killed_mid_run_fails_the_run(tmp_path: Path) -> None:
    args = [*SMALL, "--transport", "http", "--load", "poisson", "--rate", "100", "--num_iters", "100000"]
    proc = start_server(args, tmp_path, output_file="output.csv", cwd=ROOT)
    text = read_log_until(proc, lambda log: log.count("then the measured phase") == 2, limit_s=120)
    pids = re.search(r"frontend pid=(\d+),(\d+)", text)
    assert pids, text[-3000:]
    time.sleep(0.3)  # into the measured phase
    started = time.monotonic()
    os.kill(int(pids.group(2)), signal.SIGKILL)
    communicate_or_fail(proc, 60, "server.py")
    assert time.monotonic() - started < 15  # the death seen at once, then the others' grace
    row = read_rows(tmp_path / "output.csv")[-1]
    assert proc.returncode == 1 and row["status"] == "frontend_died", row
    assert "frontend 1" in row["error"] and row["generators"] == "2"
    # The survivor's requests stay in the row: what it sent and what came back, the dead one's unknown.
    assert int(row["responses_received"]) > 0 and int(row["requests_sent"]) >= int(row["responses_received"]), row
    assert "frontend 0" in row["error"], row["error"]  # the counts say whose they are
    assert live_processes_in_session(proc.pid) == []
