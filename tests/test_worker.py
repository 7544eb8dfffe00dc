"""The backend's designs in-process on the CPU stand-ins: the real threads, queues, semaphores and events."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from serverbench.backend.planted import PlantedStages, stages_class
from serverbench.backend.stages import SHARED_TIMINGS, Aborted, Failure, Stages
from serverbench.device.layer import CpuEvent, CpuStream, make_device_layer
from serverbench.schema.messages import Response
from serverbench.schema.records import TIMING_FIELDS
from tests.helpers import (
    IN_PROCESS_DESIGNS,
    CollectResponses,
    ConcurrencyProbe,
    FakeRequests,
    design_stages,
    run_design,
    serve_in_process,
    worker_config,
)

DESIGNS = IN_PROCESS_DESIGNS


@pytest.mark.parametrize("design,workers", DESIGNS, ids=[f"{d}-{w}w" for d, w in DESIGNS])
def test_every_request_gets_its_own_correct_answer(tmp_path: Path, design: str, workers: int) -> None:
    cfg = worker_config(tmp_path, design, workers)
    batches = [torch.randn(3, 3, 8, 8) for _ in range(12)]
    model = ConcurrencyProbe()
    responses, _ = serve_in_process(cfg, model, batches)
    got = {m.request_id: m for m in responses.messages if isinstance(m, Response)}
    assert sorted(got) == list(range(12)) and len(responses.messages) == 12
    for request_id, batch in enumerate(batches):
        response = got[request_id]
        assert torch.equal(torch.from_numpy(response.outputs[0]), batch.sum(dim=(1, 2, 3)).unsqueeze(1) * 2)
        timings = response.timings
        assert timings.taken_ns <= timings.h2d_done_ns <= timings.forward_done_ns <= timings.d2h_done_ns
        assert timings.forward_ms >= 15  # the probe sleeps 20 ms per call
        assert 0 <= timings.worker < workers
    if design == "pipelined" and workers > 1:
        assert model.max_active >= 2  # prediction workers really overlap
        assert len({m.timings.worker for m in got.values()}) >= 2
    else:
        assert model.max_active == 1


@pytest.mark.parametrize("design,workers", DESIGNS, ids=[f"{d}-{w}w" for d, w in DESIGNS])
def test_a_failing_forward_aborts_promptly_with_its_error(tmp_path: Path, design: str, workers: int) -> None:
    """The 3rd forward of 150 raises: no forward starts after it but those already under way on the other
    prediction threads, none of the rest is answered, and serve returns in well under the time serving the rest
    would take (147 forwards of 20 ms, over the design's forward threads: 1 s with 3 workers, 2.9 s with one)."""
    cfg = worker_config(tmp_path, design, workers)
    requests, fail_on_call = 150, 3
    batches = [torch.randn(3, 3, 8, 8) for _ in range(requests)]
    model, responses = ConcurrencyProbe(fail_on_call=fail_on_call), CollectResponses()
    threads_before = set(threading.enumerate())
    with pytest.raises((Aborted, RuntimeError)):
        _, failure = serve_in_process(cfg, model, batches, responses)
        failure.check()
    ended_s = time.monotonic()
    forward_threads = workers if design == "pipelined" else 1
    assert model.failed_at_s is not None
    assert model.calls <= fail_on_call + forward_threads - 1, f"{model.calls} forwards began of {requests}"
    assert len(responses.messages) <= model.calls - 1  # only forwards that finished, the failing one never
    rest_s = (requests - fail_on_call) * ConcurrencyProbe.FORWARD_S / forward_threads
    assert ended_s - model.failed_at_s < rest_s / 2, (ended_s - model.failed_at_s, rest_s)
    leftover = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    for thread in leftover:  # a pool thread may still be unwinding: it must end, not linger
        thread.join(timeout=5)
    assert not [t for t in leftover if t.is_alive()]


def test_pipelined_failure_is_recorded_with_its_traceback(tmp_path: Path) -> None:
    cfg = worker_config(tmp_path, "pipelined", 2)
    layer = make_device_layer("cpu")
    failure = Failure(threading.Event())
    stages = design_stages(cfg, layer, ConcurrencyProbe(fail_on_call=2), CollectResponses())
    with pytest.raises(Aborted):
        run_design(cfg, stages, failure, FakeRequests([torch.randn(3, 3, 8, 8) for _ in range(20)]))
    assert isinstance(failure.exception, RuntimeError)
    assert "model failed" in failure.traceback and "forward" in failure.traceback


@pytest.mark.parametrize("design,workers", [("serial", 1), ("pipelined", 2)])
def test_each_response_carries_its_own_timings_in_their_fields(tmp_path: Path, design: str, workers: int) -> None:
    """The shared timings go to BackendTimings by position (half a keyword call's cost): each lands in its field."""
    assert SHARED_TIMINGS == TIMING_FIELDS[1:]
    cfg = worker_config(tmp_path, design, workers)
    responses, _ = serve_in_process(cfg, nn.Identity(), [torch.randn(3, 3, 8, 8) for _ in range(6)])
    assert sorted(m.request_id for m in responses.messages) == list(range(6))
    for m in responses.messages:
        t = m.timings
        stamps = [t.taken_ns, t.h2d_start_ns, t.h2d_done_ns, t.forward_start_ns, t.forward_done_ns]
        assert stamps + [t.d2h_start_ns, t.d2h_done_ns] == sorted(stamps + [t.d2h_start_ns, t.d2h_done_ns]), t
        assert all(isinstance(v, float) and v >= 0 for v in (t.h2d_copy_ms, t.forward_ms, t.d2h_copy_ms)), t
        threads = (t.h2d_thread, t.predict_thread, t.d2h_thread)
        assert all(isinstance(name, str) and name for name in threads), t
        assert (t.formed_images, t.padded_images, t.instance) == (3, 3, 0), t
        assert t.formed_ns == t.taken_ns and 0 <= t.batch_id < 6 and 0 <= t.worker < workers, t
    assert len({m.timings.batch_id for m in responses.messages}) == 6


def test_buffers_are_reused_not_allocated_per_request(tmp_path: Path) -> None:
    cfg = worker_config(tmp_path, "pipelined", 3, max_inflight=2)
    layer = make_device_layer("cpu")
    responses = CollectResponses()
    failure = Failure(threading.Event())
    stages = design_stages(cfg, layer, ConcurrencyProbe(), responses)
    batches = [torch.randn(3, 3, 8, 8) for _ in range(10)]
    run_design(cfg, stages, failure, FakeRequests(batches))
    got = {m.request_id: m for m in responses.messages}
    assert sorted(got) == list(range(10))
    assert stages.buffers.made == 2  # ten requests through two buffer sets...
    for i, batch in enumerate(batches):  # ...and each answer is still its own request's
        assert torch.equal(torch.from_numpy(got[i].outputs[0]), batch.sum(dim=(1, 2, 3)).unsqueeze(1) * 2)
    outputs = [m.outputs[0] for m in got.values()]
    assert len({o.ctypes.data for o in outputs}) == len(outputs)  # responses own their bytes, not the pool's


def test_a_run_that_plants_nothing_runs_the_plain_steps_and_a_planted_delay_is_inside_the_forward(
    tmp_path: Path,
) -> None:
    """The test-only faults and the planted delays live in PlantedStages: a plain run's steps have none of their
    branches per request. A delay is timed as the forward's, as more compute would be."""
    cfg = worker_config(tmp_path, "serial")
    assert stages_class(cfg) is Stages
    for planted in ({"inject_fault": "predict"}, {"inject_delay_ms": 1.0}, {"planted_delay_us": 1.0}):
        assert stages_class(replace(cfg, **planted)) is PlantedStages, planted
    delayed = replace(cfg, planted_delay_us=20_000.0)  # 20 ms a forward, on a model that takes microseconds
    responses = CollectResponses()
    stages = design_stages(delayed, make_device_layer("cpu"), nn.Identity(), responses)
    run_design(delayed, stages, Failure(threading.Event()), FakeRequests([torch.randn(3, 3, 8, 8) for _ in range(3)]))
    forward_ms = [m.timings.forward_ms for m in responses.messages]
    assert len(forward_ms) == 3 and min(forward_ms) >= 20.0, forward_ms


def test_inflight_requests_are_bounded(tmp_path: Path) -> None:
    cfg = worker_config(tmp_path, "pipelined", 3, max_inflight=2)
    model = ConcurrencyProbe()
    serve_in_process(cfg, model, [torch.randn(3, 3, 8, 8) for _ in range(10)])
    assert model.max_active <= 2


def test_cpu_stand_ins_have_the_cuda_interface() -> None:
    for name in ("record", "synchronize", "query", "elapsed_time"):
        assert callable(getattr(CpuEvent(), name)) and hasattr(torch.cuda.Event, name)
    for name in ("wait_event", "synchronize"):
        assert callable(getattr(CpuStream(), name)) and hasattr(torch.cuda.Stream, name)
    start, end = CpuEvent(), CpuEvent()
    start.record(CpuStream())
    time.sleep(0.01)
    end.record(CpuStream())
    assert 5 <= start.elapsed_time(end) < 1000
    with pytest.raises(RuntimeError):
        CpuEvent().elapsed_time(end)


@pytest.mark.cuda
def test_cuda_events_time_the_copies_and_forward(tmp_path: Path) -> None:
    cfg = replace(worker_config(tmp_path, "pipelined", 2), device="cuda:0")
    layer = make_device_layer("cuda:0")
    model = nn.Conv2d(3, 4, 3).to(layer.device).eval()
    responses = CollectResponses()
    failure = Failure(threading.Event())
    stages = design_stages(cfg, layer, model, responses)
    batches = [torch.randn(3, 3, 8, 8) for _ in range(8)]
    run_design(cfg, stages, failure, FakeRequests(batches))
    got = {m.request_id: m for m in responses.messages}
    assert sorted(got) == list(range(8))
    for i, batch in enumerate(batches):
        expected = model(batch.to(layer.device)).cpu()
        assert torch.allclose(torch.from_numpy(got[i].outputs[0]), expected, atol=1e-5)
        timings = got[i].timings
        assert timings.h2d_copy_ms > 0 and timings.forward_ms > 0 and timings.d2h_copy_ms > 0


def test_the_output_reaches_the_host_by_the_device_s_own_rule(tmp_path: Path) -> None:
    """CPU: the output is in host memory already and is handed over as it is (the response copies its rows out).
    CUDA (the layer's rule, run here on CPU tensors): a D2H copy into the buffer set's one host buffer, reused."""
    from serverbench.backend.buffers import BufferSet

    cfg = worker_config(tmp_path, "serial")
    layer = make_device_layer("cpu")
    buffers = BufferSet(cfg, layer.device, pin_host=False)
    output = torch.randn(3, 10)
    assert layer.host_output_buffer(buffers, 0, output) is None
    assert layer.stage_output(None, output) is output

    layer.is_cuda = True  # the CUDA branch, without a GPU: only its buffer handling is exercised
    first = layer.host_output_buffer(buffers, 0, output)
    assert first is not None and first.data_ptr() != output.data_ptr()
    staged = layer.stage_output(first, output)
    assert staged.data_ptr() == first.data_ptr() and torch.equal(staged, output)
    again = layer.host_output_buffer(buffers, 0, torch.randn(3, 10))
    assert again.data_ptr() == first.data_ptr()  # made once per set, then reused
