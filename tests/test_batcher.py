"""Dynamic batching: the batcher's size and delay rules on a fake clock, the split of a formed batch's output back
to its requests in every design, padding to the compiled sizes, and the whole path end to end with --verify (compiled
end to end: tests/test_compiled.py)."""

from __future__ import annotations

import csv
import queue
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ServedMeanwhile

from serverbench.backend.batcher import Batcher, BatchRule, padded_size, padded_sizes
from serverbench.schema.messages import Response
from serverbench.schema.records import BackendTimings
from tests.helpers import IN_PROCESS_DESIGNS, ConcurrencyProbe, serve_in_process, worker_config


class FakeArrivals:
    """A transport on a fake clock: `arrivals` are (time_s, member) pairs, None as a member is the end marker.
    take(timeout) returns the next arrival due by now + timeout, advancing the clock to it, or advances the clock
    by the whole timeout and raises queue.Empty: the batcher's waits cost fake time only."""

    def __init__(self, arrivals: list[tuple[float, str | None]]) -> None:
        self.arrivals = list(arrivals)
        self.due_s = {member: due_s for due_s, member in arrivals}
        self.now_s = 0.0
        self.timeouts: list[float] = []

    def clock_s(self) -> float:
        return self.now_s

    def arrived_s(self, member: str) -> float:
        return self.due_s[member]

    def take(self, timeout_s: float) -> str | None:
        self.timeouts.append(timeout_s)
        if self.arrivals and self.arrivals[0][0] <= self.now_s + timeout_s:
            due_s, member = self.arrivals.pop(0)
            self.now_s = max(self.now_s, due_s)
            return member
        self.now_s += timeout_s
        raise queue.Empty


def formed(
    arrivals: list[tuple[float, str | None]], max_images: int, delay_s: float, request_images: int = 1
) -> list[tuple[list[str], float]]:
    """Each formed batch's members and the fake time it went."""
    fake = FakeArrivals(arrivals)
    batcher = Batcher(
        BatchRule(request_images, max_images, delay_s), fake.take, lambda: None, fake.clock_s, fake.arrived_s
    )
    return [(members, fake.now_s) for members in batcher]


def test_a_full_batch_goes_at_once_without_waiting_for_the_delay() -> None:
    arrivals = [(0.0, f"r{i}") for i in range(6)] + [(10.0, None)]
    batches = formed(arrivals, max_images=4, delay_s=5.0)
    assert batches[0] == (["r0", "r1", "r2", "r3"], 0.0)  # full: no wait at all
    assert batches[1][0] == ["r4", "r5"]
    assert batches[1][1] == pytest.approx(5.0)  # two waiting requests: it goes when the delay has passed
    assert len(batches) == 2


def test_a_partial_batch_goes_once_the_delay_has_passed_since_its_oldest_request() -> None:
    arrivals = [(1.0, "a"), (1.002, "b"), (1.009, "c"), (1.02, "d"), (1.021, None)]
    batches = formed(arrivals, max_images=8, delay_s=0.005)
    assert [members for members, _ in batches] == [["a", "b"], ["c"], ["d"]]
    assert batches[0][1] == pytest.approx(1.005)  # a's arrival + 5 ms; c came later and waits for the next
    assert batches[1][1] == pytest.approx(1.014)


def test_zero_delay_batches_only_what_is_already_waiting() -> None:
    arrivals = [(0.0, "a"), (0.0, "b"), (0.001, "c"), (0.002, None)]
    batches = formed(arrivals, max_images=8, delay_s=0.0)
    assert [members for members, _ in batches] == [["a", "b"], ["c"]]
    assert batches[0][1] == 0.0  # no request waited for another


def formed_behind_busy_forwards(
    arrivals: list[tuple[float, str | None]], delay_s: float, busy_s: float
) -> list[tuple[list[str], float]]:
    """Each formed batch's members and the fake time it went, where each forward keeps the one worker busy for
    `busy_s` after its batch went (the fake clock moves on while the batcher waits for room); at most 8 images."""
    fake = FakeArrivals(arrivals)
    busy_until_s = [0.0]

    def wait_for_room() -> None:
        fake.now_s = max(fake.now_s, busy_until_s[0])

    went = []
    for members in Batcher(
        BatchRule(1, 8, delay_s), fake.take, lambda: None, fake.clock_s, fake.arrived_s, wait_for_room
    ):
        went.append((members, fake.now_s))
        busy_until_s[0] = fake.now_s + busy_s
    return went


def test_a_batch_forms_only_once_a_forward_is_free_and_takes_what_arrived_meanwhile() -> None:
    # One request every 10 ms; each forward keeps its worker busy for 35 ms. Formed while the worker is busy,
    # batches would hold one request each; formed when it is free, each takes the requests that arrived during the
    # previous forward.
    arrivals = [(i * 0.010, f"r{i}") for i in range(10)] + [(1.0, None)]
    batches = [members for members, _ in formed_behind_busy_forwards(arrivals, delay_s=0.0, busy_s=0.035)]
    assert batches == [["r0"], ["r1", "r2", "r3"], ["r4", "r5", "r6", "r7"], ["r8", "r9"]]  # at 0, 35, 70, 105 ms


def test_the_delay_runs_from_the_oldest_requests_arrival_not_from_when_the_batcher_took_it() -> None:
    # One request every 10 ms, a 5 ms delay, each forward busy for 33 ms. After the first forward, the requests
    # waiting behind it are all older than the delay: their batch goes the moment the forward is free, with what
    # has arrived, and the model never idles for a delay a waiting request has already spent.
    arrivals = [(i * 0.010, f"r{i}") for i in range(8)] + [(1.0, None)]
    went = formed_behind_busy_forwards(arrivals, delay_s=0.005, busy_s=0.033)
    assert [members for members, _ in went] == [["r0"], ["r1", "r2", "r3"], ["r4", "r5", "r6", "r7"]]
    assert went[0][1] == pytest.approx(0.005)  # alone, r0 waits out its delay
    assert went[1][1] == pytest.approx(0.038)  # free at 38 ms; r1 arrived at 10: no wait (from its take: 43 ms)
    assert went[2][1] == pytest.approx(0.071)
    # Requests taken as they arrive wait as before: from the first one's arrival.
    assert formed([(0.0, "a"), (0.004, "b"), (0.006, "c"), (0.007, None)], max_images=8, delay_s=0.005)[0] == (
        ["a", "b"],
        pytest.approx(0.005),
    )


def test_a_sent_time_ahead_of_the_backends_clock_never_makes_a_batch_wait_longer_than_the_delay() -> None:
    fake = FakeArrivals([(1.0, "a"), (1.5, None)])
    ahead_s = lambda member: 9.0  # noqa: E731  (a stamp later than any time the batcher sees)
    went = [
        (members, fake.now_s)
        for members in Batcher(BatchRule(1, 8, 0.005), fake.take, lambda: None, fake.clock_s, ahead_s)
    ]
    assert went[0] == (["a"], pytest.approx(1.005))  # taken at 1.0: a delay from then, not from 9.0


def test_whole_requests_only_up_to_max_images() -> None:
    arrivals = [(0.0, f"r{i}") for i in range(5)] + [(0.0, None)]
    # 3 images per request, at most 8 images: 2 requests per batch (a third would make 9).
    batches = formed(arrivals, max_images=8, delay_s=1.0, request_images=3)
    assert [len(members) for members, _ in batches] == [2, 2, 1]


def test_the_end_marker_serves_what_was_gathered_then_stops() -> None:
    batches = formed([(0.0, "a"), (0.001, None), (0.002, "never")], max_images=4, delay_s=1.0)
    assert batches == [(["a"], 0.001)]


def test_every_wait_is_bounded_by_the_stop_poll_and_a_stop_ends_the_batcher() -> None:
    fake = FakeArrivals([(100.0, "late")])
    calls = []

    def check() -> None:
        calls.append(fake.now_s)
        if len(calls) > 3:
            raise RuntimeError("stopping")

    with pytest.raises(RuntimeError, match="stopping"):
        next(iter(Batcher(BatchRule(1, 4, 0.0), fake.take, check, fake.clock_s, fake.arrived_s)))
    assert max(fake.timeouts) <= 0.1  # limits.POLL_S: a stop is seen within it


def test_padded_sizes_are_powers_of_two_from_the_request_up_and_the_largest_batch() -> None:
    assert padded_sizes(1, 16) == [1, 2, 4, 8, 16]
    assert padded_sizes(1, 12) == [1, 2, 4, 8, 12]
    assert padded_sizes(3, 8) == [4, 6]  # formed batches of 3 or 6 images
    assert padded_sizes(4, 32) == [4, 8, 16, 32]
    assert [padded_size(n, [4, 6]) for n in (3, 4, 6)] == [4, 4, 6]
    with pytest.raises(ValueError):
        padded_size(7, [4, 6])


@pytest.mark.parametrize("design,workers", IN_PROCESS_DESIGNS, ids=[f"{d}-{w}w" for d, w in IN_PROCESS_DESIGNS])
def test_each_request_gets_its_own_rows_of_a_formed_batch(tmp_path: Path, design: str, workers: int) -> None:
    cfg = worker_config(tmp_path, design, workers, max_batch_size=9, max_queue_delay_ms=50.0)  # 3 requests of 3 images
    batches = [torch.randn(3, 3, 8, 8) for _ in range(12)]
    model = ConcurrencyProbe()
    responses, failure = serve_in_process(cfg, model, batches)
    assert failure.exception is None
    got = {m.request_id: m for m in responses.messages if isinstance(m, Response)}
    assert sorted(got) == list(range(12)) and len(responses.messages) == 12
    for request_id, batch in enumerate(batches):
        assert torch.equal(torch.from_numpy(got[request_id].outputs[0]), batch.sum(dim=(1, 2, 3)).unsqueeze(1) * 2)
    assert model.calls < 12  # requests shared forwards
    by_forward: dict[int, list[BackendTimings]] = {}
    for response in got.values():
        by_forward.setdefault(response.timings.batch_id, []).append(response.timings)
    assert len(by_forward) == model.calls
    for members in by_forward.values():
        assert members[0].formed_images == 3 * len(members) <= 9
        assert len({(m.formed_ns, m.forward_ms, m.d2h_done_ns) for m in members}) == 1  # one forward's timings
        assert all(m.taken_ns <= m.formed_ns <= m.h2d_done_ns for m in members)


def test_formed_batches_are_padded_to_the_compiled_sizes(tmp_path: Path) -> None:
    # As with --compile: 3-image requests, at most 8 images, so forwards of 4 (one request padded) or 6 images.
    cfg = replace(worker_config(tmp_path, "serial", max_batch_size=8, max_queue_delay_ms=0.0), compile=True)
    seen_rows: list[int] = []

    class ShapeProbe(ConcurrencyProbe):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen_rows.append(x.shape[0])
            return super().forward(x)

    batches = [torch.randn(3, 3, 8, 8) for _ in range(5)]
    responses, failure = serve_in_process(cfg, ShapeProbe(), batches)
    assert failure.exception is None
    assert set(seen_rows) <= {4, 6} and sum(seen_rows) >= 15
    for message in responses.messages:
        timings = message.timings
        assert timings.padded_images == (4 if timings.formed_images == 3 else 6)
        assert torch.equal(
            torch.from_numpy(message.outputs[0]), batches[message.request_id].sum(dim=(1, 2, 3)).unsqueeze(1) * 2
        )


def test_every_formed_size_runs_once_before_serving(tmp_path: Path) -> None:
    from serverbench.backend.prepare import warmup_sizes

    batched = worker_config(tmp_path, "serial", max_batch_size=9)  # 3-image requests
    assert warmup_sizes(batched, None, 9) == [3, 6, 9]  # eager: every size a formed batch can take
    compiled = replace(batched, compile=True)
    assert warmup_sizes(compiled, [4, 8, 9], 9) == [4, 8, 9]  # compiled: every padded size
    many = worker_config(tmp_path, "serial", max_batch_size=3 * 100)
    assert warmup_sizes(many, None, 300) == padded_sizes(3, 300)  # too many sizes: the powers of two
    plain = worker_config(tmp_path, "serial")
    assert warmup_sizes(plain, None, 3) == [] and warmup_sizes(replace(plain, compile=True), None, 3) == [3]


def test_a_formed_batch_holds_its_forwards_place_until_its_output_is_on_the_host(tmp_path: Path) -> None:
    # On a GPU the forward's kernels are only queued when predict returns: the place goes back after the D2H event
    # has completed on the host, not before (else the batcher would form small batches that pile up on the streams).
    import threading

    from serverbench.backend.stages import Member, Stages
    from serverbench.device.layer import CpuStream, make_device_layer

    cfg = worker_config(tmp_path, "pipelined", 2, max_batch_size=6)
    stages = Stages(cfg, make_device_layer("cpu"), torch.nn.Identity(), None, forward_threads=2)
    synchronized: list[str] = []
    held = [stages.free_forwards.acquire(blocking=False) for _ in range(2)]  # the batcher formed two batches
    assert held == [True, True] and not stages.free_forwards.acquire(blocking=False)
    item = stages.form([Member(0, torch.randn(3, 3, 8, 8), 0, 0)])
    stream = CpuStream()
    stages.h2d(item, stream)
    stages.predict(item, stream, worker=0)
    assert not stages.free_forwards.acquire(blocking=False)  # predict returned: still held
    item.events["d2h_end"].synchronize = lambda: synchronized.append(threading.current_thread().name)
    stages.d2h(item, stream)
    assert synchronized and stages.free_forwards.acquire(blocking=False)  # given back after the D2H wait


# ------------------------------------------------------------------ end to end
# Last in the file: its run, started at the module's start, has had the time of the tests above.


@pytest.fixture(scope="module")
def batching_run(tmp_path_factory) -> Iterator[ServedMeanwhile]:
    """Dynamic batching end to end, verified: resnet18 (a real network's forward, as in TINY, without the ceiling,
    which is not what is tested here), requests of one image batched up to 4 with a 20 ms delay, pipelined, each
    forward's requests saved."""
    args = ["--device", "cpu", "--image_size", "32", "--model", "resnet18", "--batch_size", "1", "--num_iters", "12"]
    args += ["--no-ceiling", "--verify", "--max_batch_size", "4", "--max_queue_delay_ms", "20", "--design", "pipelined"]
    served = ServedMeanwhile([*args, "--save_requests"], tmp_path_factory.mktemp("batching"))
    yield served
    served.stop()


@pytest.fixture(scope="module", autouse=True)
def _batching_run_starts_first(request: pytest.FixtureRequest) -> None:
    """Starts the end-to-end run before this module's first test, where it is selected (its test is last)."""
    here = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    if any("batching_run" in item.fixturenames for item in here):
        request.getfixturevalue("batching_run")


def test_dynamic_batching_end_to_end_with_verify(batching_run: ServedMeanwhile) -> None:
    """Every response its own request's serial answer (--verify); compiled, the same path pads and never recompiles
    (tests/test_compiled.py)."""
    run = batching_run.run()
    assert run.returncode == 0, run.stderr
    row = run.row
    assert row["status"] == "ok" and row["wrong_outputs"] == "0"
    assert (row["max_batch_size"], row["max_queue_delay_ms"]) == ("4", "20.0")
    assert 1 < float(row["mean_formed_batch"]) <= 4 and float(row["padding_pct"]) == 0  # no compile: no padding
    assert float(row["mean_batch_wait_ms"]) >= 0
    with open(batching_run.results / row["batches_file"], newline="") as f:
        forwards = list(csv.DictReader(f))
    measured = [b for b in forwards if b["warmup"] == "False"]
    assert sum(int(b["requests"]) for b in measured) == 12
    assert all(int(b["formed_images"]) == int(b["requests"]) <= 4 for b in forwards)
    assert sorted(int(i) for b in measured for i in b["request_ids"].split(";")) == list(range(1, 13))
    assert "batching      up to 4 images" in run.stdout
