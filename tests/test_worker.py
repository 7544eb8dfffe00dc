"""The backend's designs in-process on the CPU stand-ins: the real threads, queues, semaphores and events."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import make_config
from torch import nn

from serverbench.backend import designs
from serverbench.backend.batcher import batch_rule
from serverbench.backend.stages import Aborted, Failure, RequestSource, Stages
from serverbench.device.layer import CpuEvent, CpuStream, DeviceLayer, make_device_layer
from serverbench.schema.messages import Request, Response


class FakeRequests:
    def __init__(self, batches: list[torch.Tensor]) -> None:
        self._queue: queue.Queue = queue.Queue()
        for i, batch in enumerate(batches):
            self._queue.put(Request(i, (batch,), time.perf_counter_ns()))
        self._queue.put(None)

    def receive(self, timeout_s: float):
        return self._queue.get(timeout=timeout_s)


class CollectResponses:
    def __init__(self) -> None:
        self.messages: list = []
        self._lock = threading.Lock()

    def send(self, message) -> None:
        with self._lock:
            self.messages.append(message)


class ConcurrencyProbe(nn.Module):
    """A model that notes how many threads run it at once (the sleep releases the GIL, as kernels do)."""

    def __init__(self, fail_on_call: int = -1) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.active = self.max_active = self.calls = 0
        self.fail_on_call = fail_on_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.calls += 1
            if self.calls == self.fail_on_call:
                raise RuntimeError("model failed")
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(0.02)
        with self.lock:
            self.active -= 1
        return x.sum(dim=(1, 2, 3)).unsqueeze(1) * 2


def _cfg(tmp_path: Path, design: str, workers: int = 1, **overrides):
    argv = [
        "--device",
        "cpu",
        "--design",
        design,
        "--num_workers",
        str(workers),
        "--image_size",
        "8",
        "--batch_size",
        "3",
        "--results_dir",
        str(tmp_path),
        "--max_inflight",
        "4",
    ]
    return replace(make_config(argv), **overrides)


def _stages(cfg, layer: DeviceLayer, model, responses, **kwargs) -> Stages:
    """The steps as the backend makes them for cfg's design."""
    forward_threads = designs.DESIGNS[cfg.design].forward_threads(cfg.num_workers)
    return Stages(cfg, layer, model, responses, forward_threads=forward_threads, **kwargs)


def _run(cfg, stages: Stages, failure: Failure, requests: FakeRequests) -> None:
    """Serves `requests` with cfg's design from the table, as the backend process does."""
    source = RequestSource(requests, failure, stages, batch_rule(cfg))
    designs.DESIGNS[cfg.design](stages, designs.DesignSpec.of(cfg), failure).serve(source)


def _serve(cfg, model: nn.Module, batches: list[torch.Tensor]) -> tuple[CollectResponses, Failure]:
    layer = make_device_layer("cpu")
    responses = CollectResponses()
    failure = Failure(threading.Event())
    _run(cfg, _stages(cfg, layer, model, responses), failure, FakeRequests(batches))
    return responses, failure


DESIGNS = [("serial", 1), ("threaded", 1), ("pipelined", 1), ("pipelined", 3)]


@pytest.mark.parametrize("design,workers", DESIGNS, ids=[f"{d}-{w}w" for d, w in DESIGNS])
def test_every_request_gets_its_own_correct_answer(tmp_path: Path, design: str, workers: int) -> None:
    cfg = _cfg(tmp_path, design, workers)
    batches = [torch.randn(3, 3, 8, 8) for _ in range(12)]
    model = ConcurrencyProbe()
    responses, _ = _serve(cfg, model, batches)
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
    cfg = _cfg(tmp_path, design, workers)
    batches = [torch.randn(3, 3, 8, 8) for _ in range(50)]
    threads_before = set(threading.enumerate())
    start = time.monotonic()
    with pytest.raises((Aborted, RuntimeError)):
        responses, failure = _serve(cfg, ConcurrencyProbe(fail_on_call=3), batches)
        failure.check()
    assert time.monotonic() - start < 5
    leftover = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    for thread in leftover:  # a pool thread may still be unwinding: it must end, not linger
        thread.join(timeout=5)
    assert not [t for t in leftover if t.is_alive()]


def test_pipelined_failure_is_recorded_with_its_traceback(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "pipelined", 2)
    layer = make_device_layer("cpu")
    failure = Failure(threading.Event())
    stages = _stages(cfg, layer, ConcurrencyProbe(fail_on_call=2), CollectResponses())
    with pytest.raises(Aborted):
        _run(cfg, stages, failure, FakeRequests([torch.randn(3, 3, 8, 8) for _ in range(20)]))
    assert isinstance(failure.exception, RuntimeError)
    assert "model failed" in failure.traceback and "forward" in failure.traceback


def test_buffers_are_reused_not_allocated_per_request(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "pipelined", 3, max_inflight=2)
    layer = make_device_layer("cpu")
    responses = CollectResponses()
    failure = Failure(threading.Event())
    stages = _stages(cfg, layer, ConcurrencyProbe(), responses)
    batches = [torch.randn(3, 3, 8, 8) for _ in range(10)]
    _run(cfg, stages, failure, FakeRequests(batches))
    got = {m.request_id: m for m in responses.messages}
    assert sorted(got) == list(range(10))
    assert stages.buffers.made == 2  # ten requests through two buffer sets...
    for i, batch in enumerate(batches):  # ...and each answer is still its own request's
        assert torch.equal(torch.from_numpy(got[i].outputs[0]), batch.sum(dim=(1, 2, 3)).unsqueeze(1) * 2)
    outputs = [m.outputs[0] for m in got.values()]
    assert len({o.ctypes.data for o in outputs}) == len(outputs)  # responses own their bytes, not the pool's


def test_inflight_requests_are_bounded(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "pipelined", 3, max_inflight=2)
    model = ConcurrencyProbe()
    _serve(cfg, model, [torch.randn(3, 3, 8, 8) for _ in range(10)])
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
    cfg = replace(_cfg(tmp_path, "pipelined", 2), device="cuda:0")
    layer = make_device_layer("cuda:0")
    model = nn.Conv2d(3, 4, 3).to(layer.device).eval()
    responses = CollectResponses()
    failure = Failure(threading.Event())
    stages = _stages(cfg, layer, model, responses)
    batches = [torch.randn(3, 3, 8, 8) for _ in range(8)]
    _run(cfg, stages, failure, FakeRequests(batches))
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

    cfg = _cfg(tmp_path, "serial")
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
