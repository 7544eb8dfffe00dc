"""The NVML sampler of the GPU the backend serves on, run in the frontend process during the measured phase."""

from __future__ import annotations

import logging
import time

from serverbench.device.layer import nvml_uuid_candidates
from serverbench.schema.records import GpuSample
from serverbench.system.sampler import PeriodicSampler

log = logging.getLogger("gpu_sampler")


class GpuSampler:
    """Samples NVML utilisation, memory and power of one GPU every period_s, on a PeriodicSampler (stopping is
    immediate and it costs nothing between samples; an NVML error ends the sampling, kept in `error`). Without NVML
    or a GPU it samples nothing and fails nothing. On a MIG instance NVML gives memory (the instance's) but no
    utilisation: utilisation is then recorded as unsupported (`util_note` says why) and memory and power are still
    sampled."""

    def __init__(self, device_uuid: str | None, period_s: float) -> None:
        self.device_uuid = device_uuid
        self.period_s = period_s
        self.samples: list[GpuSample] = []
        self.util_note = ""  # why utilisation is missing, when it is
        self._periodic = PeriodicSampler("gpu-sampler", period_s, self._sample)
        self._nvml = None
        self._handle = None
        self._util_supported = True

    def start(self) -> GpuSampler:
        if self.device_uuid is None:
            return self
        try:
            import pynvml  # imported only where an NVIDIA GPU is in use

            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - no NVML means empty columns, not a failed run
            self.util_note = f"no NVML: {exc}"
            log.warning("GPU sampling off: NVML unavailable (%s)", exc)
            return self
        errors = []
        for uuid in nvml_uuid_candidates(self.device_uuid):  # a bare UUID: a whole GPU or a MIG instance
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                break
            except pynvml.NVMLError as exc:
                errors.append(f"{uuid}: {exc}")
        if self._handle is None:
            self.util_note = f"NVML does not know the device ({'; '.join(errors)})"
            log.warning("GPU sampling off: %s", self.util_note)
            _nvml_shutdown(pynvml)
            return self
        self._nvml = pynvml
        try:
            pynvml.nvmlDeviceGetUtilizationRates(self._handle)
        except pynvml.NVMLError as exc:  # MIG: "Not Supported"
            self._util_supported = False
            self.util_note = f"utilisation unsupported by NVML on this device ({exc}; a MIG instance?)"
            log.warning("GPU utilisation not sampled: %s; memory and power still are", self.util_note)
        self._periodic.start()
        return self

    @property
    def error(self) -> BaseException | None:
        """The NVML error that ended the sampling early, if one did."""
        return self._periodic.error

    def _sample(self) -> None:
        nvml, handle = self._nvml, self._handle
        util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu) if self._util_supported else None
        mem = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        try:
            power_w: float | None = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except nvml.NVMLError:
            power_w = None
        self.samples.append(GpuSample(time.perf_counter_ns(), util, float(mem), power_w))

    def stop(self) -> list[GpuSample]:
        """The samples so far; NVML is shut down once the thread has ended (an NVML call stuck past the stop's
        timeout keeps it: the process's exit ends both)."""
        if not self._periodic.stop():
            return list(self.samples)
        if self._nvml is not None:
            _nvml_shutdown(self._nvml)
            self._nvml = None
        return list(self.samples)


def _nvml_shutdown(nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - nothing left to sample either way
        pass
