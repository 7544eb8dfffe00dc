"""The device layer, chosen once per run: CUDA streams and events on a GPU, CPU stand-ins with the same interface.

The backend's threads, queues and semaphores are the same code on both; only this module knows which it is.

CPU stand-in semantics: work issued on a CPU "stream" runs synchronously on the calling thread, so it is complete
when the call returns. An event therefore records the host clock at `record()`, `wait_event` has nothing left to
wait for, and `elapsed_time` is the host time between two records. As on CUDA, waiting on an event that was never
recorded does not block: ordering between threads comes from the hand-offs (queues, semaphores) in worker.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import ContextManager, Optional, Protocol

import torch


class Event(Protocol):
    def record(self, stream: Optional["Stream"] = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end_event: "Event") -> float: ...  # milliseconds


class Stream(Protocol):
    def wait_event(self, event: Event) -> None: ...
    def synchronize(self) -> None: ...


class CpuEvent:
    """Stands in for torch.cuda.Event: remembers the host monotonic time of its last record."""

    def __init__(self) -> None:
        self.recorded_ns: Optional[int] = None

    def record(self, stream: Optional["CpuStream"] = None) -> None:
        self.recorded_ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        return None  # the work before record() already ran on the recording thread

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        if self.recorded_ns is None or end_event.recorded_ns is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end_event.recorded_ns - self.recorded_ns) / 1e6


class CpuStream:
    """Stands in for torch.cuda.Stream; CPU work is synchronous, so there is nothing to order or drain."""

    def wait_event(self, event: CpuEvent) -> None:
        return None

    def synchronize(self) -> None:
        return None


@dataclass(frozen=True)
class DeviceInfo:
    device: str  # "cpu" or "cuda:N"
    name: str  # "NVIDIA H200" or the CPU model
    uuid: Optional[str]  # NVML-style "GPU-..." id of the GPU really used (respects CUDA_VISIBLE_DEVICES)
    timing_source: str  # "cuda_events" or "host_clock"


class DeviceLayer:
    """Streams, events, host buffers and copies for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def bind_thread(self) -> None:
        """Makes this device current on the calling thread (the CUDA current device is per thread)."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def new_stream(self) -> Stream:
        return torch.cuda.Stream(self.device) if self.is_cuda else CpuStream()

    def default_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device) if self.is_cuda else CpuStream()

    def use_stream(self, stream: Stream) -> ContextManager:
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def new_event(self) -> Event:
        return torch.cuda.Event(enable_timing=True) if self.is_cuda else CpuEvent()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def stage_wire(self, dst: torch.Tensor, host: torch.Tensor, decode_copies: bool) -> torch.Tensor:
        """The request's wire bytes where decoding reads them. CUDA: the H2D copy into `dst` on the current stream
        (asynchronous from page-locked memory). CPU: host memory is the device's, so when decoding writes a
        buffer of its own anyway (uint8, a cast, a layout change) it reads the request where it lies, and that
        pass is the one copy out of it; otherwise a real copy into `dst`. Either way the request's memory can be
        handed back once the step is done, as on a GPU."""
        if not self.is_cuda and decode_copies:
            return host
        return dst.copy_(host, non_blocking=self.is_cuda)

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
        if self.is_cuda:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))

    def keep_alive_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Tells the caching allocator that `stream` uses `tensor`, so its memory is not handed out again
        before the work queued on `stream` is done (the reference's input-buffer race)."""
        if self.is_cuda:
            tensor.record_stream(stream)

    def info(self) -> DeviceInfo:
        if self.is_cuda:
            props = torch.cuda.get_device_properties(self.device)
            uuid = getattr(props, "uuid", None)
            uuid_text = None if uuid is None else (str(uuid) if str(uuid).startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
            return DeviceInfo(str(self.device), props.name, uuid_text, "cuda_events")
        return DeviceInfo("cpu", _cpu_name(), None, "host_clock")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def make_device_layer(device: str) -> DeviceLayer:
    layer = DeviceLayer(torch.device(device))
    layer.bind_thread()
    return layer
