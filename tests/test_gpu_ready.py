"""What a first GPU run relies on, tested on the CPU where the logic allows (device choice, rank-to-device mapping,
which event kind is made, NVML lookups, teardown after a sticky CUDA error), and on a GPU where it does not."""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY, cuda_tests_verdict, live_processes_in_session, make_config, run_server

import server
import worker
from serverbench.backend import designs
from serverbench.backend.prepare import set_precision_flags
from serverbench.backend.stages import EVENT_NAMES, Aborted, Failure, RequestSource, Stages
from serverbench.config import options as config
from serverbench.config.flags import ConfigError
from serverbench.config.options import RankInfo
from serverbench.device import layer as device
from serverbench.device.gpu_sampler import GpuSampler
from serverbench.device.layer import DeviceLayer
from serverbench.launch import preflight
from serverbench.records.console import format_summary
from serverbench.records.summary import GpuStats, order_violations, summarize, summary_columns
from serverbench.schema.records import RequestRecord
from serverbench.system import process
from tests.helpers import CollectResponses, FakeRequests, timed_record, worker_config


@pytest.fixture
def unusable_gpu(monkeypatch):
    """A machine whose NVIDIA driver (550) is older than the CUDA (13.2) torch was built for."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.2")
    monkeypatch.setattr(device, "nvidia_driver_version", lambda *a: "550.54.15")


# ------------------------------------------------------------------ 1. a GPU that torch cannot use


@pytest.mark.parametrize("requested", ["auto", "cuda", "cuda:0"])
def test_a_visible_gpu_that_torch_cannot_use_is_a_usage_error_not_cpu_numbers(
    unusable_gpu, tmp_path: Path, requested: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        make_config(("--device", requested, "--results_dir", str(tmp_path)))
    message = str(caught.value)
    assert "\n" not in message
    assert "driver 550.54.15" in message and "CUDA 13.2" in message
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 ./venv.sh" in message
    assert "--device cpu" in message


def test_the_refusal_exits_2_with_one_line_before_any_process_starts(unusable_gpu, tmp_path: Path, capsys) -> None:
    assert server.main(["--results_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("server.py: error: --device auto: an NVIDIA GPU is visible")
    assert not (tmp_path / "output.csv").exists()


def test_the_cpu_stays_available_explicitly_and_when_gpus_are_hidden(unusable_gpu, tmp_path: Path, monkeypatch) -> None:
    assert make_config(("--device", "cpu", "--results_dir", str(tmp_path))).device == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose: auto means the CPU
    assert make_config(("--results_dir", str(tmp_path))).device == "cpu"


def test_the_comparison_refuses_too_rather_than_measure_the_cpu(unusable_gpu, tmp_path: Path, capsys) -> None:
    from bench import compare

    assert compare.main(["--out", str(tmp_path / "cmp")]) == 2
    assert "driver 550.54.15" in capsys.readouterr().err and not (tmp_path / "cmp").exists()


@pytest.mark.parametrize(
    "visible,hidden",
    [
        ("", True),
        ("-1", True),
        ("NoDevFiles", True),
        (" ", True),
        ("0", False),
        ("1,0", False),
        ("GPU-8c7e", False),
        ("MIG-8c7e", False),
    ],
)
def test_gpus_hidden_on_purpose_mean_the_cpu(visible: str, hidden: bool) -> None:
    assert device.gpus_hidden({"CUDA_VISIBLE_DEVICES": visible}) is hidden
    assert device.gpus_hidden({}) is False


def test_a_build_that_suits_the_driver_is_not_blamed(unusable_gpu, monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # driver 550 runs CUDA 12.x: something else hides the GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    reason = device.unusable_gpu_reason()
    assert "suits that driver" in reason and "CUDA_VISIBLE_DEVICES ('1')" in reason and "TORCH_INDEX_URL" not in reason


def test_a_cpu_only_torch_on_a_gpu_machine_is_named_as_such(unusable_gpu, monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    reason = device.unusable_gpu_reason()
    assert "a CPU-only build" in reason and "cu126" in reason


def test_no_gpu_at_all_still_means_the_cpu(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "nvidia_driver_version", lambda *a: None)
    assert device.unusable_gpu_reason() is None
    assert make_config(("--results_dir", str(tmp_path))).device == "cpu"
    with pytest.raises(ConfigError, match="no CUDA GPU is available"):
        make_config(("--device", "cuda", "--results_dir", str(tmp_path)))


@pytest.mark.parametrize(
    "driver,build",
    [
        ("580.65.06", "cu130"),
        ("590.1", "cu130"),
        ("575.51.03", "cu126"),
        ("550.54.15", "cu126"),
        ("525.60.13", "cu126"),
        ("470.256.02", "cu118"),
        ("390.157", None),
        ("unknown", None),
    ],
)
def test_each_driver_gets_the_newest_build_it_runs(driver: str, build) -> None:
    found = device.torch_build_for_driver(driver)
    assert (found[0] if found else None) == build


@pytest.mark.parametrize(
    "text,version",
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
            "GCC version:  gcc",
            "550.54.15",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n",
            "580.65.06",
        ),
        ("something else entirely\n", "unknown"),
    ],
)
def test_the_driver_version_is_read_from_the_kernel_module_without_nvml(
    monkeypatch, tmp_path: Path, text: str, version: str
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML library: import fails
    proc = tmp_path / "version"
    proc.write_text(text)
    assert device.nvidia_driver_version(proc) == version
    assert device.nvidia_driver_version(tmp_path / "absent") is None


def test_cuda_tests_fail_instead_of_skipping_when_the_gpu_is_unusable(unusable_gpu) -> None:
    verdict, reason = cuda_tests_verdict()
    assert verdict == "fail" and "driver 550.54.15" in reason


def test_cuda_tests_skip_without_a_gpu_and_run_with_one(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "nvidia_driver_version", lambda *a: None)
    assert cuda_tests_verdict()[0] == "skip"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_tests_verdict() == ("run", "")


# ------------------------------------------------------------------ 2, 3. teardown after a sticky CUDA error


def test_a_sticky_cuda_error_still_reaches_the_row_with_its_traceback(tmp_path: Path) -> None:
    run = run_server([*TINY, "--model", "identity", "--inject_fault", "sticky_cuda"], tmp_path)
    assert run.returncode == 1, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "error", row["error"]  # not backend_died: the report got out
    assert "illegal memory access" in row["error"]
    assert "Traceback" not in run.stderr  # kept in the file the row names
    kept = (tmp_path / row["traceback_file"]).read_text()
    assert kept.startswith("Traceback (most recent call last):") and "illegal memory access" in kept
    assert "teardown: could not release the page-locked ring" in run.stderr
    assert "teardown: could not stop the compile workers" in run.stderr
    assert live_processes_in_session(run.session_id) == []


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.is_page_locked = True

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def page_unlock(self) -> None:
        self.calls.append("unregister")


def test_the_ring_is_unregistered_only_after_the_device_is_synchronised() -> None:
    recorder = _Recorder()
    worker.release_ring(recorder, recorder, threads_left=[])
    assert recorder.calls == ["synchronize", "unregister"]


def test_the_ring_stays_registered_while_a_serving_thread_may_still_copy_from_it() -> None:
    recorder = _Recorder()
    worker.release_ring(recorder, recorder, threads_left=["h2d"])
    assert recorder.calls == []


class _StuckModel(torch.nn.Module):
    """Its forward blocks until released: a request still on the device when the run aborts."""

    def __init__(self, fail_first: bool) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail_first = fail_first
        self.calls = 0
        self._lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self.calls += 1
            call = self.calls
        if self.fail_first and call == 1:
            self.entered.wait(5.0)  # the other worker is inside its forward: now fail
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.entered.set()
        self.release.wait(10.0)
        return x.mean(dim=(1, 2, 3)).unsqueeze(1)


def _serving(tmp_path: Path, design: str, num_workers: int):
    cfg = replace(worker_config(tmp_path, design, num_workers), ceiling=False)
    return cfg, device.make_device_layer("cpu"), CollectResponses()


@pytest.mark.parametrize("design,workers", [("threaded", 1), ("pipelined", 2)])
def test_an_abort_that_leaves_a_serving_thread_running_says_so(
    tmp_path: Path, monkeypatch, design: str, workers: int
) -> None:
    monkeypatch.setattr(designs, "STOP_JOIN_S", 0.3)
    cfg, layer, responses = _serving(tmp_path, design, workers)
    model = _StuckModel(fail_first=design == "pipelined")
    stop = threading.Event()
    failure = Failure(stop)
    stages = Stages(cfg, layer, model, responses, should_stop=failure.should_stop)
    source = RequestSource(FakeRequests([torch.randn(3, 3, 8, 8) for _ in range(4)]), failure, stages, None)
    if design == "threaded":  # the server stops the run while the only worker is inside a forward
        threading.Thread(target=lambda: model.entered.wait(5.0) and stop.set(), daemon=True).start()
    try:
        with pytest.raises((Aborted, RuntimeError, TimeoutError)):
            designs.DESIGNS[design](stages, designs.DesignSpec.of(cfg), failure).serve(source)
        assert stages.threads_left, "a thread inside a forward was not noticed"
        recorder = _Recorder()
        worker.release_ring(recorder, recorder, stages.threads_left)
        assert recorder.calls == []
    finally:
        model.release.set()


def test_a_clean_end_leaves_no_thread_behind(tmp_path: Path) -> None:
    cfg, layer, responses = _serving(tmp_path, "pipelined", 2)
    failure = Failure(threading.Event())
    stages = Stages(cfg, layer, torch.nn.Identity(), responses)
    designs.Pipelined(stages, designs.DesignSpec.of(cfg), failure).serve(
        RequestSource(FakeRequests([torch.randn(3, 3, 8, 8) for _ in range(4)]), failure, stages, None)
    )
    assert stages.threads_left == [] and len(responses.messages) == 4


# ------------------------------------------------------------------ 4. MIG instances and NVML


class _FakeNvml(types.ModuleType):
    """Just enough pynvml: a device known under `known_uuid`, with or without utilisation."""

    class NVMLError(Exception):
        pass

    def __init__(self, known_uuid: str, util_supported: bool) -> None:
        super().__init__("pynvml")
        self.known_uuid = known_uuid
        self.util_supported = util_supported
        self.looked_up: list[str] = []
        self.buffered_us = 0  # the timestamp of the driver's newest utilisation sample

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        self.looked_up.append(uuid)
        if uuid != self.known_uuid:
            raise self.NVMLError("Not Found")
        return "handle"

    def nvmlDeviceGetUtilizationRates(self, handle):
        if not self.util_supported:
            raise self.NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=42)

    def nvmlDeviceGetSamples(self, handle, sampling_type: int, last_seen_us: int):
        if not self.util_supported:
            raise self.NVMLError("Not Supported")
        self.buffered_us += 10_000  # one more sample each call, 10 ms after the one before
        return 1, [types.SimpleNamespace(timeStamp=self.buffered_us, sampleValue=types.SimpleNamespace(uiVal=42))]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=3 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 150_000


def _sample(monkeypatch, nvml: _FakeNvml, uuid: str) -> GpuSampler:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    sampler = GpuSampler(uuid, period_s=0.01).start()
    time.sleep(0.1)
    sampler.stop()
    return sampler


def test_a_mig_instance_is_found_and_its_memory_and_power_are_sampled_without_utilisation(monkeypatch) -> None:
    bare = "0c9d8f6e-1111-2222-3333-444455556666"
    nvml = _FakeNvml(f"MIG-{bare}", util_supported=False)
    sampler = _sample(monkeypatch, nvml, bare)  # torch gives the bare UUID
    assert nvml.looked_up == [f"GPU-{bare}", f"MIG-{bare}"]
    assert sampler.samples and all(s.util_pct is None for s in sampler.samples)
    assert all(s.mem_used_mib == 3072 and s.power_w == 150 for s in sampler.samples)
    assert "unsupported" in sampler.util_note and "Not Supported" in sampler.util_note
    stats = GpuStats.from_samples(sampler.samples)
    assert stats.util_mean_pct is None and stats.mem_used_max_mib == 3072
    columns = summary_columns(summarize([], 0, gpu_samples=sampler.samples))
    assert columns["gpu_util"] is None and columns["gpu_samples"] == len(sampler.samples)


def test_a_whole_gpu_is_found_by_its_gpu_uuid_with_utilisation(monkeypatch) -> None:
    bare = "0c9d8f6e-1111-2222-3333-444455556666"
    nvml = _FakeNvml(f"GPU-{bare}", util_supported=True)
    sampler = _sample(monkeypatch, nvml, bare)
    assert nvml.looked_up == [f"GPU-{bare}"] and sampler.util_note == ""
    # The first sample's NVML window began before the sampler (the measured phase) did: no utilisation in it.
    assert sampler.samples and sampler.samples[0].util_pct is None
    assert all(s.util_pct == 42 for s in sampler.samples[1:]) and len(sampler.samples) > 1


def test_a_device_nvml_does_not_know_turns_sampling_off_with_the_reason(monkeypatch) -> None:
    sampler = _sample(monkeypatch, _FakeNvml("GPU-other", util_supported=True), "abc")
    assert sampler.samples == [] and "NVML does not know the device" in sampler.util_note


# ------------------------------------------------------------------ 5. torchrun: one visible GPU per rank


@pytest.mark.parametrize(
    "visible,local_rank,expected",
    [(1, 0, "cuda:0"), (1, 3, "cuda:0"), (8, 3, "cuda:3"), (8, 0, "cuda:0"), (2, 3, None)],
)
def test_each_rank_maps_to_the_gpu_it_sees(monkeypatch, visible: int, local_rank: int, expected) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(local_rank) if visible == 1 else ",".join(map(str, range(visible))))
    rank = RankInfo(rank=local_rank, world_size=8, local_rank=local_rank, local_world_size=8)
    if expected is None:
        with pytest.raises(ConfigError, match="only 2 GPUs are visible"):
            preflight._rank_device("cuda", rank)
    else:
        assert preflight._rank_device("cuda", rank) == expected
        assert preflight._rank_device("auto", rank) == expected
    assert preflight._rank_device("cpu", rank) == "cpu"


def test_ranks_that_would_share_the_nodes_one_gpu_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # not one GPU per rank: the node has one
    with pytest.raises(ConfigError, match="2 ranks on this node but it has one GPU"):
        preflight._rank_device("cuda", RankInfo(rank=1, world_size=2, local_rank=1, local_world_size=2))
    assert preflight._rank_device("cuda", RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1)) == "cuda:0"


# ------------------------------------------------------------------ 6. which event kind the layer makes


def test_events_the_host_waits_on_are_made_with_blocking_sync(monkeypatch) -> None:
    made: list[dict] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: made.append(kwargs) or kwargs)
    layer = DeviceLayer(torch.device("cuda:0"))
    layer.new_event(host_waits=True)
    layer.new_event()
    DeviceLayer(torch.device("cuda:0"), spin_wait=True).new_event(host_waits=True)
    assert made == [
        {"enable_timing": True, "blocking": True},
        {"enable_timing": True, "blocking": False},
        {"enable_timing": True, "blocking": False},
    ]


@pytest.mark.parametrize("spin_wait", [False, True])
def test_a_request_gets_blocking_events_exactly_where_the_host_waits(tmp_path: Path, spin_wait: bool) -> None:
    cfg = worker_config(tmp_path, "pipelined", 2)
    stages = Stages(cfg, DeviceLayer(torch.device("cpu"), spin_wait), torch.nn.Identity(), CollectResponses())
    events = stages.buffers.take().events  # every request's events are its buffer set's
    assert set(events) == set(EVENT_NAMES)
    blocking = {name for name, event in events.items() if event.blocking}
    assert blocking == (set() if spin_wait else {"h2d_end", "d2h_end"})


# ------------------------------------------------------------------ 7. placed timestamps and their order


class _GpuEvent:
    def __init__(self, gpu_ms: float) -> None:
        self.gpu_ms = gpu_ms

    def elapsed_time(self, end: _GpuEvent) -> float:
        return end.gpu_ms - self.gpu_ms


def test_each_event_is_placed_from_the_anchor_with_the_least_delay() -> None:
    # GPU times 0..5 ms; host clock = GPU clock + 1000 ms. The h2d anchor was read 0.1 ms late, the d2h one 3 ms late.
    events = {name: _GpuEvent(float(i)) for i, name in enumerate(EVENT_NAMES)}
    true_ns = {name: round((1000 + i) * 1e6) for i, name in enumerate(EVENT_NAMES)}
    anchors = {"h2d_end": true_ns["h2d_end"] + 100_000, "d2h_end": true_ns["d2h_end"] + 3_000_000}
    placed = device.place_on_host_clock(events, anchors)
    assert all(placed[n] - true_ns[n] == 100_000 for n in EVENT_NAMES)  # never early, least late
    only_d2h = device.place_on_host_clock(events, {"d2h_end": anchors["d2h_end"]})
    assert all(only_d2h[n] - true_ns[n] == 3_000_000 for n in EVENT_NAMES)


def _record(request_id: int = 1, **starts: int | None) -> RequestRecord:
    """A request with every stamp, its steps' starts included, 10 ns apart; `starts` replaces any start."""
    starts = {"h2d_start_ns": 20, "forward_start_ns": 40, "d2h_start_ns": 60, **starts}
    return timed_record(request_id, (0, 10, 30, 50, 70, 80), batch_size=2, **starts)


def test_stamps_out_of_causal_order_are_counted_and_the_summary_warns(tmp_path: Path) -> None:
    good, bad = _record(), _record(request_id=2, forward_start_ns=25)  # forward "began" before its input arrived
    assert order_violations(good) == 0 and order_violations(bad) == 1
    assert order_violations(_record(h2d_start_ns=None, forward_start_ns=None, d2h_start_ns=None)) == 0
    columns = summary_columns(summarize([good, bad], requests_sent=2))
    assert columns["timestamp_order_violations"] == 1
    cfg = make_config(("--device", "cpu", "--results_dir", str(tmp_path)))
    row = {
        **dict.fromkeys(
            ["status", "error", "responses_received", "requests_sent", "responses_missing", "responses_duplicated"], 0
        ),
        **columns,
    }
    assert "1 request(s) have stamps out of order" in format_summary(cfg, row)


# ------------------------------------------------------------------ 8. precision: PyTorch's defaults, and the flags


@pytest.fixture
def restore_precision_flags():
    saved = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    yield
    torch.backends.cudnn.allow_tf32 = saved[0]
    torch.set_float32_matmul_precision(saved[1])


def test_default_precision_leaves_pytorchs_flags_and_fp32_is_strict(restore_precision_flags) -> None:
    torch.backends.cudnn.allow_tf32, _ = True, torch.set_float32_matmul_precision("highest")  # PyTorch's defaults
    assert set_precision_flags("default") == {"cudnn_allow_tf32": True, "matmul_precision": "highest"}
    assert set_precision_flags("fp32") == {"cudnn_allow_tf32": False, "matmul_precision": "highest"}
    assert set_precision_flags("tf32") == {"cudnn_allow_tf32": True, "matmul_precision": "high"}


def test_the_default_precision_is_pytorchs_and_the_row_says_which_flags_ran(tmp_path: Path) -> None:
    assert make_config(("--device", "cpu", "--results_dir", str(tmp_path))).precision == "default"
    assert (
        config.verify_tolerance("cuda:0", "fp32")
        < config.verify_tolerance("cuda:0", "default")
        < config.verify_tolerance("cuda:0", "bf16")
    )
    run = run_server([*TINY, "--model", "identity", "--precision", "fp32"], tmp_path, output_file="fp32.csv")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (run.row["cudnn_allow_tf32"], run.row["matmul_precision"]) == ("False", "highest")
    assert run.row["spin_wait"] == "False" and float(run.row["backend_cpu_cores"]) > 0
    assert run.row["timestamp_order_violations"] == "0"


# ------------------------------------------------------------------ 9. a first run that looks clean


def test_verbose_lets_torchs_lines_through_and_quiet_drops_only_them() -> None:
    import io
    import logging

    sink = io.StringIO()
    quiet = process.DropLines(sink, process.QUIET_LINES)
    print("No CUDA runtime is found, using CUDA_HOME='/usr/local'", file=quiet)  # older torch: print()
    print("backend INFO model ready", file=quiet)
    assert sink.getvalue() == "backend INFO model ready\n"
    stderr = sys.stderr
    try:
        process.quiet_environment_messages()  # what a child does unless --verbose
        assert logging.getLogger("torch.utils.cpp_extension").level == logging.ERROR  # newer torch: a logger
        assert isinstance(sys.stderr, process.DropLines)
    finally:
        sys.stderr = stderr
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.NOTSET)


# ------------------------------------------------------------------ on a GPU


@pytest.mark.cuda
def test_cuda_blocking_events_time_and_wait(tmp_path: Path) -> None:
    layer = device.make_device_layer("cuda:0")
    start, end = layer.new_event(), layer.new_event(host_waits=True)
    x = torch.randn(2048, 2048, device="cuda:0")
    start.record()
    for _ in range(20):
        x = x @ x / 2048
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) > 0


@pytest.mark.cuda
def test_cuda_run_with_the_ring_registered_ends_cleanly_and_records_the_flags(tmp_path: Path) -> None:
    run = run_server(
        [
            "--device",
            "cuda",
            "--image_size",
            "64",
            "--batch_size",
            "8",
            "--num_iters",
            "30",
            "--model",
            "resnet18",
            "--verify",
            "--save_requests",
        ],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    row = run.row
    assert row["status"] == "ok" and row["wrong_outputs"] == "0"
    assert row["timestamp_order_violations"] == "0"
    assert row["cudnn_allow_tf32"] == "True" and row["precision"] == "default"
    assert "ring stays page-locked" not in run.stderr and "teardown" not in run.stderr


@pytest.mark.cuda
def test_cuda_device_uuid_is_found_by_nvml(tmp_path: Path) -> None:
    info = device.make_device_layer("cuda:0").info()
    sampler = GpuSampler(info.uuid, period_s=0.01).start()
    time.sleep(0.1)
    samples = sampler.stop()
    assert samples, f"NVML found no samples for {info.uuid}: {sampler.util_note}"
    if sampler.util_note:  # a MIG instance: memory still sampled
        assert all(s.util_pct is None for s in samples)
    assert os.environ.get("CUDA_VISIBLE_DEVICES", "x") != ""
