"""The device layer, chosen once per run: CUDA streams and events on a GPU, CPU stand-ins with the same interface.

The backend's threads, queues and semaphores are the same code on both; only this module knows which it is.

CPU stand-in semantics: work issued on a CPU "stream" runs synchronously on the calling thread, so it is complete
when the call returns. An event therefore records the host clock at `record()`, `wait_event` has nothing left to
wait for, and `elapsed_time` is the host time between two records. As on CUDA, waiting on an event that was never
recorded does not block: ordering between threads comes from the hand-offs (queues, semaphores) of the designs
(serverbench/backend/designs.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from serverbench.system.provenance import cpu_model

NO_CONTEXT = contextlib.nullcontext()  # stateless, so one instance serves every `with` on every thread


def _no_push(name: str) -> None:
    """NVTX on the CPU: nothing to annotate (Nsight Systems traces CUDA); --nvtx costs only the call."""


def _no_pop() -> None:
    """See _no_push."""


class NvtxRange:
    """One NVTX range for a `with`: pushed on entry, popped on exit on every path, an exception's included."""

    __slots__ = ("_layer", "_name")

    def __init__(self, layer: DeviceLayer, name: str) -> None:
        self._layer = layer
        self._name = name

    def __enter__(self) -> None:
        self._layer.nvtx_push(self._name)

    def __exit__(self, *exc_info) -> None:
        self._layer.nvtx_pop()


class Event(Protocol):
    def record(self, stream: Stream | None = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end_event: Event) -> float: ...  # milliseconds


class Stream(Protocol):
    def wait_event(self, event: Event) -> None: ...
    def synchronize(self) -> None: ...


class CpuEvent:
    """Stands in for torch.cuda.Event: remembers the host monotonic time of its last record."""

    def __init__(self, blocking: bool = False) -> None:
        self.recorded_ns: int | None = None
        self.blocking = blocking  # what a CUDA event would be made with; nothing waits on the CPU either way

    def record(self, stream: CpuStream | None = None) -> None:
        self.recorded_ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        return None  # the work before record() already ran on the recording thread

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: CpuEvent) -> float:
        if self.recorded_ns is None or end_event.recorded_ns is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end_event.recorded_ns - self.recorded_ns) / 1e6


class CpuStream:
    """Stands in for torch.cuda.Stream; CPU work is synchronous, so there is nothing to order or drain."""

    def wait_event(self, event: CpuEvent) -> None:
        return None

    def synchronize(self) -> None:
        return None


def place_on_host_clock(events: dict[str, Event], anchors_ns: dict[str, int]) -> dict[str, int]:
    """Host-clock times of the events. An anchor is the host time read just after synchronize() on an event
    returned, so it is late by the wake-up (up to a GIL switch interval); an event placed from an anchor by their
    elapsed GPU time is late by as much, never early. Each event takes the earliest placement over the anchors,
    the one with the least delay."""
    return {
        name: min(host_ns - round(event.elapsed_time(events[anchor]) * 1e6) for anchor, host_ns in anchors_ns.items())
        for name, event in events.items()
    }


@dataclass(frozen=True)
class DeviceInfo:
    device: str  # "cpu" or "cuda:N"
    name: str  # "NVIDIA H200" or the CPU model
    uuid: str | None  # the GPU really used (respects CUDA_VISIBLE_DEVICES), as torch gives it: "GPU-...",
    # "MIG-..." or a bare UUID (gpu_sampler.nvml_uuid_candidates turns it into the names NVML knows)
    timing_source: str  # "cuda_events" or "host_clock"


class DeviceLayer:
    """Streams, events, host buffers and copies for one device."""

    def __init__(self, device: torch.device, spin_wait: bool = False, nvtx: bool = False) -> None:
        self.device = device
        self.spin_wait = spin_wait  # host waits busy-poll (the reference's way) instead of sleeping
        self.is_cuda = device.type == "cuda"  # asked a dozen times per request: an attribute, not a property
        # --nvtx: named ranges for Nsight Systems. Without it nothing is wrapped or pushed (nvtx_range and
        # nvtx_step give their argument back); on the CPU the calls are no-ops. Chosen once, here.
        self.nvtx = nvtx
        self.nvtx_push: Callable[[str], object] = torch.cuda.nvtx.range_push if self.is_cuda else _no_push
        self.nvtx_pop: Callable[[], object] = torch.cuda.nvtx.range_pop if self.is_cuda else _no_pop

    def nvtx_range(self, name: str) -> AbstractContextManager:
        """A `with` in an NVTX range named `name` on the calling thread (--nvtx); nothing otherwise."""
        return NvtxRange(self, name) if self.nvtx else NO_CONTEXT

    def nvtx_step(self, step: str, method: Callable, request_id_of: Callable[[object], int]) -> Callable:
        """`method(item, ...)` in an NVTX range "<step> #<request id>" on the thread that calls it (--nvtx); the
        method itself otherwise, so that a run without the flag pays nothing per request."""
        if not self.nvtx:
            return method

        @functools.wraps(method)
        def ranged(item, *args, **kwargs):
            self.nvtx_push(f"{step} #{request_id_of(item)}")
            try:
                return method(item, *args, **kwargs)
            finally:
                self.nvtx_pop()

        return ranged

    def bind_thread(self) -> None:
        """Makes this device current on the calling thread (the CUDA current device is per thread), and the
        process's intra-op thread count this thread's: OpenMP keeps the count per thread, and torch copies its own
        into a thread on the first get_num_threads or parallel_for there, which a forward's first oneDNN
        convolution comes before."""
        torch.get_num_threads()
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def new_stream(self) -> Stream:
        return torch.cuda.Stream(self.device) if self.is_cuda else CpuStream()

    def default_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device) if self.is_cuda else CpuStream()

    def use_stream(self, stream: Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream) if self.is_cuda else NO_CONTEXT

    def new_event(self, host_waits: bool = False) -> Event:
        """A timing event. One the host will `synchronize()` on (`host_waits`) is made with blocking sync, so the
        waiting thread sleeps in the driver instead of spinning a CPU core until the GPU gets there; with
        --spin_wait it spins, as events made without the flag do."""
        blocking = host_waits and not self.spin_wait
        if self.is_cuda:
            return torch.cuda.Event(enable_timing=True, blocking=blocking)
        return CpuEvent(blocking=blocking)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def release_cache(self) -> None:
        """Returns the caching allocator's unused blocks to the device: blocks freed on a stream are reused on that
        stream only, so memory a finished phase cached on its own streams would stay reserved. CPU: nothing."""
        if self.is_cuda:
            torch.cuda.empty_cache()

    def stage_wire(self, dst: torch.Tensor, host: torch.Tensor, decode_copies: bool) -> torch.Tensor:
        """The request's wire bytes where decoding reads them. CUDA: the H2D copy into `dst` on the current stream
        (asynchronous from page-locked memory). CPU: host memory is the device's, so when decoding writes a
        buffer of its own anyway (uint8, a cast, a layout change) it reads the request where it lies, and that
        pass is the one copy out of it; otherwise a real copy into `dst`. Either way the request's memory can be
        handed back once the step is done, as on a GPU."""
        if not self.is_cuda and decode_copies:
            return host
        return dst.copy_(host, non_blocking=self.is_cuda)

    def host_output_buffer(self, buffers, leaf: int, output: torch.Tensor) -> torch.Tensor | None:
        """Where output leaf `leaf`'s D2H copy goes: the buffer set's page-locked buffer, made once and reused
        (CUDA); made before the copy's start event is recorded, so a first allocation is not timed as the copy.
        CPU: None."""
        return buffers.host_output_for(leaf, output) if self.is_cuda else None

    def stage_output(self, host_buffer: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor:
        """The output where the response reads it. CUDA: the D2H copy into `host_buffer` on the current stream
        (asynchronous; wait for its event). CPU: the output is in host memory already, so as it is: the response
        copies its rows out, the one copy a CPU server makes (a copy into a host buffer as well would be a torch
        op per request, and in the pipelined design each lets another serving thread take the GIL)."""
        if host_buffer is None:
            return output
        return host_buffer.copy_(output, non_blocking=True)

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        """Page-locks a request (a host copy, as the reference does on arrival) unless it already is; CPU: as is."""
        return host.pin_memory() if self.is_cuda and not host.is_pinned() else host

    def register_host(self, host: torch.Tensor) -> None:
        """Page-locks existing host memory in place (cudaHostRegister), once: copies from it are then
        asynchronous and need no pinning step. CPU: nothing to do."""
        if not self.is_cuda:
            return
        result = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
        torch.cuda.check_error(result)
        if not host.is_pinned():
            raise RuntimeError("cudaHostRegister succeeded but the ring does not read as page-locked")

    def unregister_host(self, host: torch.Tensor) -> None:
        """Only once no copy from `host` can still run (every serving thread ended, the device synchronised):
        unregistering memory a queued copy reads is undefined behaviour."""
        if self.is_cuda:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))

    def host_times(self, events: dict[str, Event], anchors_ns: dict[str, int]) -> dict[str, int]:
        """Host-clock times of recorded events. CPU: the host time each one recorded. CUDA: placed from the anchors
        (host times read just after synchronize() on some of them) by their elapsed GPU time."""
        if self.is_cuda:
            return place_on_host_clock(events, anchors_ns)
        return {name: event.recorded_ns for name, event in events.items()}

    def keep_alive_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Tells the caching allocator that `stream` uses `tensor`, so its memory is not handed out again
        before the work queued on `stream` is done (the reference's input-buffer race)."""
        if self.is_cuda:
            tensor.record_stream(stream)

    def info(self) -> DeviceInfo:
        if self.is_cuda:
            props = torch.cuda.get_device_properties(self.device)
            uuid = getattr(props, "uuid", None)
            return DeviceInfo(str(self.device), props.name, None if uuid is None else str(uuid), "cuda_events")
        return DeviceInfo("cpu", cpu_model(), None, "host_clock")


def make_device_layer(device: str, spin_wait: bool = False, nvtx: bool = False) -> DeviceLayer:
    layer = DeviceLayer(torch.device(device), spin_wait, nvtx)
    layer.bind_thread()
    return layer


# ------------------------------------------------------------------------ a GPU that torch cannot use

NVIDIA_PROC_VERSION = Path("/proc/driver/nvidia/version")
# The oldest driver each CUDA build of torch runs on (Linux, with CUDA's minor-version compatibility: 13.x needs
# 580, 12.x 525, 11.x 450), newest build first: (lowest driver major, wheel index suffix, CUDA version). cu126 is
# the 12.x build every torch release from 2.6 on publishes; cu118 stops at torch 2.7.
TORCH_BUILDS = ((580, "cu130", "13.0"), (525, "cu126", "12.6"), (450, "cu118", "11.8"))
TORCH_INDEX = "https://download.pytorch.org/whl/"


def gpus_hidden(environ=os.environ) -> bool:
    """CUDA_VISIBLE_DEVICES hides every GPU on purpose (empty, -1, or a first entry that names no device, as
    SLURM's NoDevFiles: CUDA stops at the first invalid entry): the CPU is what the user wants."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return False
    first = visible.split(",", 1)[0].strip()
    return not (first.isdigit() or first.startswith(("GPU-", "MIG-")))


def nvidia_driver_version(proc_version: Path = NVIDIA_PROC_VERSION) -> str | None:
    """The NVIDIA driver's version when this machine has an NVIDIA GPU (NVML, else the kernel module's /proc
    file); None when it has none. "unknown" when a driver is there but says no version."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() > 0:
                version = pynvml.nvmlSystemGetDriverVersion()
                return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML library or no driver: look for the kernel module instead
        pass
    try:
        text = proc_version.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ..." (or "Open Kernel Module for ...")
    match = re.search(r"\s(\d{3,}\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else "unknown"


def torch_build_for_driver(driver: str) -> tuple[str, str] | None:
    """(wheel index suffix, CUDA version) of the newest torch CUDA build that runs on this driver; None when the
    driver is older than any (or its version is unknown)."""
    major = _major(driver)  # 0 when unknown: older than every build
    for lowest, suffix, cuda in TORCH_BUILDS:
        if major >= lowest:
            return suffix, cuda
    return None


def unusable_gpu_reason() -> str | None:
    """One line when this machine has an NVIDIA GPU that torch cannot use (a torch built for a newer CUDA than
    the driver runs, or a CPU-only torch), naming the driver, torch's CUDA and the command that installs a
    matching build; None when torch can use the GPU, when there is none, or when CUDA_VISIBLE_DEVICES hides it."""
    if gpus_hidden() or torch.cuda.is_available():
        return None
    driver = nvidia_driver_version()
    if driver is None:
        return None
    build = torch_build_for_driver(driver)
    torch_cuda = torch.version.cuda
    if torch_cuda is not None and build is not None and _major(torch_cuda) <= _major(build[1]):
        # The build suits the driver: something else hides the GPU from CUDA.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (
            f"an NVIDIA GPU is visible (driver {driver}) and torch {torch.__version__} (CUDA {torch_cuda}) "
            "suits that driver, yet CUDA finds no device: check CUDA_VISIBLE_DEVICES "
            f"({'not set' if visible is None else repr(visible)}), that a MIG-enabled GPU has instances, and "
            "nvidia-smi; or run on the CPU with --device cpu"
        )
    built_for = f"CUDA {torch_cuda}" if torch_cuda else "no CUDA (a CPU-only build)"
    if build is None:
        fix = "update the NVIDIA driver (525 or newer runs torch's CUDA 12 builds)"
    else:
        suffix, cuda = build
        fix = (
            f"install torch's CUDA {cuda} build: TORCH_INDEX_URL={TORCH_INDEX}{suffix} ./venv.sh python "
            f"server.py (or pip install --force-reinstall torch torchvision --index-url {TORCH_INDEX}{suffix})"
        )
    return (
        f"an NVIDIA GPU is visible (driver {driver}) but torch {torch.__version__} is built for {built_for} and "
        f"cannot use it; {fix}; or run on the CPU with --device cpu"
    )


def _major(version: str) -> int:
    """The leading number of a version ("550.54.15" -> 550, "12.6" -> 12); 0 when there is none."""
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0
