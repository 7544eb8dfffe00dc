"""CUDA defects found by reading the code, each shown on the CPU where the device layer's stand-ins (recording what
runs on which stream) or a stand-in for NVML can show it, else on a GPU: a formed batch's padding fill ordered
before the copies into its set, GPU utilisation from the measured phase alone, --verify's tolerance relative to the
output's scale, and no emptied allocator cache between the ceiling and the measured phase."""

from __future__ import annotations

import contextlib
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import serverbench.backend.stages as stages_module
from serverbench.backend.buffers import BufferSet
from serverbench.backend.ceiling import measure_ceiling
from serverbench.backend.stages import Member, Stages
from serverbench.config.inputs import padding_value
from serverbench.device.gpu_sampler import GpuSampler
from serverbench.device.layer import CpuEvent, CpuStream, DeviceLayer
from serverbench.load.verify import Verifier, leaf_errors
from serverbench.records.summary import GpuStats
from tests.helpers import worker_config

# ------------------------------------------------------------------ a device layer that records streams


class NamedStream(CpuStream):
    """A CPU stream with a name, whose waits the layer records."""

    def __init__(self, layer: RecordingLayer, name: str) -> None:
        self.layer = layer
        self.name = name

    def wait_event(self, event: CpuEvent) -> None:
        self.layer.log.append(("wait", self, event))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class RecordingEvent(CpuEvent):
    def __init__(self, layer: RecordingLayer, blocking: bool = False) -> None:
        super().__init__(blocking)
        self.layer = layer

    def record(self, stream: CpuStream | None = None) -> None:
        super().record(stream)
        self.layer.log.append(("record", stream if stream is not None else self.layer.current_stream(), self))


class RecordingLayer(DeviceLayer):
    """The CPU layer, which knows its current stream as CUDA does (per thread) and records the work of interest:
    (what, stream, detail) in the order it was issued."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.log: list[tuple[str, CpuStream, object]] = []
        self.default = NamedStream(self, "default")
        self._local = threading.local()
        self._made = 0

    def current_stream(self) -> NamedStream:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.default

    def new_stream(self) -> NamedStream:
        self._made += 1
        return NamedStream(self, f"pool-{self._made}")

    def default_stream(self) -> NamedStream:
        return self.default

    @contextlib.contextmanager
    def _on(self, stream: NamedStream) -> Iterator[None]:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def use_stream(self, stream: NamedStream) -> contextlib.AbstractContextManager:
        return self._on(stream)

    def new_event(self, host_waits: bool = False) -> RecordingEvent:
        return RecordingEvent(self, host_waits)

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.current_stream(), None))

    def release_cache(self) -> None:
        self.log.append(("empty_cache", self.current_stream(), None))


def ordered_before(log: list[tuple[str, CpuStream, object]], first: int, second: int) -> bool:
    """Whether work issued at log[first] runs before work issued at log[second] on a GPU: the same stream, or the
    second's stream waited, after `first`, on an event recorded on the first's stream after it (or the device was
    synchronised in between)."""
    stream_a, stream_b = log[first][1], log[second][1]
    if stream_a is stream_b:
        return first < second
    between = log[first + 1 : second]
    if any(what == "synchronize" for what, _, _ in between):
        return True
    recorded = {id(event) for what, stream, event in between if what == "record" and stream is stream_a}
    return any(what == "wait" and stream is stream_b and id(event) in recorded for what, stream, event in between)


# ------------------------------------------------------------------ 1. the padding fill and the H2D copy


def test_a_formed_batch_set_s_padding_fill_is_ordered_before_the_copies_into_it(tmp_path: Path, monkeypatch) -> None:
    """A set for formed batches is filled with padding when it is made; on a GPU the copies of the batch's rows run
    on the H2D thread's pool stream, which does not wait for the default stream: made there, the padding could
    land over the rows."""
    cfg = worker_config(tmp_path, "pipelined", 2, max_batch_size=6)
    layer = RecordingLayer()

    class RecordedSet(BufferSet):
        def __init__(self, *args, rows: int | None = None, **kwargs) -> None:
            super().__init__(*args, rows=rows, **kwargs)
            if rows is not None:
                layer.log.append(("fill", layer.current_stream(), None))

    monkeypatch.setattr(stages_module, "BufferSet", RecordedSet)
    stages = Stages(cfg, layer, torch.nn.Identity(), None, forward_threads=2)
    gather = stages.gather_wire

    def recorded_gather(*args, **kwargs) -> torch.Tensor:
        layer.log.append(("copy", layer.current_stream(), None))
        return gather(*args, **kwargs)

    stages.gather_wire = recorded_gather
    request = torch.randn(3, 3, 8, 8)
    item = stages.form([Member(0, (request,), 0, 0)])
    h2d_stream = layer.new_stream()  # the pipelined design's H2D thread's own stream
    stages.h2d(item, h2d_stream)

    whats = [what for what, _, _ in layer.log]
    fill, copy = whats.index("fill"), whats.index("copy")
    assert layer.log[copy][1] is h2d_stream
    assert ordered_before(layer.log, fill, copy), f"padding fill on {layer.log[fill][1]}, copy on {h2d_stream}"
    assert torch.equal(item.device_inputs[0][:3], request)


@pytest.mark.cuda
def test_on_a_gpu_a_late_default_stream_does_not_pad_over_the_first_formed_batch(tmp_path: Path) -> None:
    """The default stream is held busy while the first set is made: a fill queued there would run after the copy
    on the H2D stream and overwrite the batch's rows with padding."""
    from dataclasses import replace

    from serverbench.device.layer import make_device_layer

    cfg = replace(worker_config(tmp_path, "pipelined", 2, max_batch_size=6), device="cuda:0")
    layer = make_device_layer("cuda:0")
    stages = Stages(cfg, layer, torch.nn.Identity(), None, forward_threads=2)
    request = torch.randn(3, 3, 8, 8).pin_memory()
    item = stages.form([Member(0, (request,), 0, 0)])
    stream = layer.new_stream()
    torch.cuda._sleep(2_000_000_000)  # about a second of a spinning kernel on the default stream
    stages.h2d(item, stream)
    torch.cuda.synchronize()
    rows = item.device_inputs[0][:3].cpu()
    assert torch.equal(rows, request), "padding landed over the formed batch's rows"
    assert item.buffers.wires[0][3:].eq(padding_value(cfg.model_inputs[0], cfg.wire_dtype)).all()


# ------------------------------------------------------------------ 2. gpu_util from the measured phase alone


class _Sample(types.SimpleNamespace):
    pass


class _NvmlClock(types.ModuleType):
    """Just enough pynvml for the sampler: utilisation 100 % (the ceiling) in every NVML window that began before
    `busy_until_us` (wall clock, as NVML's CPU timestamps), 30 % (serving) after. Buffered samples every `grid_us`,
    each over the time since the one before; nvmlDeviceGetUtilizationRates over the last `rates_window_us`."""

    NVML_ERROR_NOT_FOUND = 6

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    def __init__(
        self, busy_until_us: int, buffered: bool, grid_us: int = 20_000, rates_window_us: int = 1_000_000
    ) -> None:
        super().__init__("pynvml")
        self.busy_until_us = busy_until_us
        self.grid_us = grid_us
        self.rates_window_us = rates_window_us
        if not buffered:
            self.nvmlDeviceGetSamples = None  # an NVML without the buffered samples: the sampler reads the rate

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return "handle"

    def _value(self, window_start_us: int) -> int:
        return 100 if window_start_us < self.busy_until_us else 30

    def nvmlDeviceGetSamples(self, handle: str, sampling_type: int, last_seen_us: int):
        now_us = time.time_ns() // 1000
        first_us = (now_us - 2_000_000) // self.grid_us * self.grid_us  # the driver keeps the last 2 s
        samples = [
            _Sample(timeStamp=ts, sampleValue=types.SimpleNamespace(uiVal=self._value(ts - self.grid_us)))
            for ts in range(first_us, now_us + 1, self.grid_us)
            if ts > last_seen_us
        ]
        if not samples:
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return 1, samples  # NVML_VALUE_TYPE_UNSIGNED_INT

    def nvmlDeviceGetUtilizationRates(self, handle: str):
        return types.SimpleNamespace(gpu=self._value(time.time_ns() // 1000 - self.rates_window_us))

    def nvmlDeviceGetMemoryInfo(self, handle: str):
        return types.SimpleNamespace(used=2**30)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return 100_000


def _sampled(nvml: _NvmlClock, phase_s: float, **kwargs) -> GpuSampler:
    sampler = GpuSampler("GPU-x", period_s=0.01, nvml=nvml, **kwargs).start()
    time.sleep(phase_s)
    sampler.stop()
    return sampler


def test_gpu_util_keeps_only_nvml_samples_whose_window_lies_in_the_measured_phase() -> None:
    """The ceiling ran until the phase began (100 %); serving keeps the GPU 30 % busy. The NVML sample in flight
    when the phase starts covers both: it must not count, nor any sample before it."""
    nvml = _NvmlClock(busy_until_us=time.time_ns() // 1000, buffered=True)
    sampler = _sampled(nvml, phase_s=0.2)
    utils = [s.util_pct for s in sampler.samples if s.util_pct is not None]
    assert utils, "no utilisation from a 0.2 s phase with NVML samples every 20 ms"
    assert utils == [30.0] * len(utils)
    assert GpuStats.from_samples(sampler.samples).util_mean_pct == 30.0
    assert sampler.samples[0].util_pct is None and sampler.util_note == ""


def test_gpu_util_from_the_current_rate_waits_until_nvml_s_window_is_inside_the_phase() -> None:
    """Without buffered samples NVML's rate covers its last sample period (up to 1 s): a reading counts once that
    period lies in the phase."""
    window_us = 50_000
    nvml = _NvmlClock(time.time_ns() // 1000, buffered=False, rates_window_us=window_us)
    sampler = _sampled(nvml, phase_s=0.2, util_period_max_s=window_us / 1e6)
    utils = [s.util_pct for s in sampler.samples if s.util_pct is not None]
    assert utils and utils == [30.0] * len(utils)
    early = [s for s in sampler.samples if s.t_ns - sampler.phase_start_ns < window_us * 1000]
    assert early and all(s.util_pct is None for s in early)
    # A phase shorter than the window: no utilisation rather than the ceiling's, and the row says why.
    short = _sampled(_NvmlClock(time.time_ns() // 1000, buffered=False, rates_window_us=10**6), phase_s=0.0)
    assert all(s.util_pct is None for s in short.samples) and "measured phase" in short.util_note


# ------------------------------------------------------------------ 3. --verify's tolerance and the output's scale


def _logits(seed: int, rows: int = 32, classes: int = 1000) -> np.ndarray:
    """Logits as random-weight resnet18 gives them: a large part the same for every input (up to about 8) and a
    small part that depends on the input (the CPU's resnet18 at 224x224: largest 6.1, root mean square 1.6, another
    request's rows 0.23 to 0.33 away)."""
    common = np.random.default_rng(0).standard_normal(classes) * 2.5
    own = np.random.default_rng(seed).standard_normal((rows, classes)) * 0.05
    return (common + own).astype(np.float32)


def test_verify_allows_reduced_precision_errors_on_large_outputs_and_catches_another_requests_answer() -> None:
    reference, other = _logits(1), _logits(2)
    scale = float(np.abs(reference).max())
    assert scale > 8
    noise = np.random.default_rng(3).uniform(-1, 1, reference.shape).astype(np.float32)
    # Over a network, outputs differ by about 5e-3 of their largest magnitude in bf16 (resnet18 at 224x224 on the
    # CPU); TF32 keeps 3 more mantissa bits (10), 8 times finer, and a larger batch runs other kernels: 1.5e-3 here.
    for tolerance, relative_error in ((1e-2, 1.5e-3), (5e-2, 6e-3)):  # verify_tolerance: tf32 / default, bf16
        rounded = reference + relative_error * scale * noise
        error, wrong = leaf_errors((rounded,), (reference,), tolerance)
        assert error > tolerance and not wrong, (tolerance, error)  # over the old absolute tolerance, yet right
        # The planted race's symptom: a response carrying another request's rows, or one row of them.
        assert leaf_errors((other,), (reference,), tolerance)[1], tolerance
        one_row = rounded.copy()
        one_row[5] = other[5]
        assert leaf_errors((one_row,), (reference,), tolerance)[1], tolerance
    # Small outputs keep the absolute tolerance; the CPU's zero stays exact.
    small = reference / scale * 0.5
    assert leaf_errors((small + 2e-2,), (small,), 1e-2)[1]
    assert leaf_errors((reference + 1e-3,), (reference,), 0.0)[1]


def test_the_verifier_counts_only_the_wrong_responses_at_the_output_s_scale() -> None:
    references = [(_logits(0),), (_logits(1),)]
    report = types.SimpleNamespace(
        backend_ready=types.SimpleNamespace(reference_outputs=references),
        wrong_outputs=0,
        max_abs_error=None,
        status="ok",
        error="",
    )
    verifier = Verifier(1e-2)
    answer = references[0][0]
    scale = float(np.abs(answer).max())
    verifier.check(report, types.SimpleNamespace(request_id=0, outputs=(answer * (1 + 1e-3),)))
    verifier.check(report, types.SimpleNamespace(request_id=2, outputs=(answer + 1.2e-3 * scale,)))
    assert report.wrong_outputs == 0 and report.max_abs_error > 1e-2
    verifier.check(report, types.SimpleNamespace(request_id=1, outputs=(answer,)))  # request 0's answer
    verifier.judge(report)
    assert report.wrong_outputs == 1 and report.status == "wrong_output"


# ------------------------------------------------------------------ 4. the allocator's cache after the ceiling


def test_the_ceiling_leaves_the_allocator_s_cache_as_serving_will_use_it() -> None:
    """The ceiling before serving ends just before the warm-up request: an empty_cache there would make the measured
    phase's first forwards allocate device memory (cudaMalloc) inside the timed window."""
    layer = RecordingLayer()
    model = torch.nn.Linear(8, 4)
    example = (torch.randn(3, 8),)
    loops = measure_ceiling(model, example, layer, 3, concurrencies=[1, 2], total_s=0.02, loops=2)
    assert set(loops) == {1, 2} and all(rate > 0 for rates in loops.values() for rate in rates)
    assert [what for what, _, _ in layer.log if what == "empty_cache"] == []
