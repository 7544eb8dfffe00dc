"""The NVML sampler of the GPU the backend serves on, run in the frontend process during the measured phase.

NVML's utilisation is a fraction of a window that ends when it is read and may reach back before the phase: at its
start, over the ceiling run just before it. Utilisation is therefore kept only from windows that lie wholly in the
phase. NVML's buffered samples (nvmlDeviceGetSamples) each cover the time since the one before, so a sample counts
once the one before it was taken after the phase began; where NVML has no such samples, nvmlDeviceGetUtilizationRates
covers "the past sample period", 1/6 s to 1 s by product, so its readings count from 1 s into the phase."""

from __future__ import annotations

import logging
import time
from types import ModuleType

from serverbench.schema.records import GpuSample
from serverbench.system.sampler import PeriodicSampler

log = logging.getLogger("gpu_sampler")

UTIL_PERIOD_MAX_S = 1.0  # the longest window nvmlDeviceGetUtilizationRates reads over ("1 second to 1/6 second")
GPU_UTILIZATION_SAMPLES = 1  # nvmlSamplingType_t NVML_GPU_UTILIZATION_SAMPLES
NVML_ERROR_NOT_FOUND = 6  # nvmlDeviceGetSamples: no sample newer than the last seen
# nvmlValueType_t -> the field of nvmlValue_t that holds it (utilisation comes as unsigned int)
VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def nvml_uuid_candidates(uuid: str) -> list[str]:
    """The names NVML may know a torch device UUID by. torch gives a bare UUID; NVML wants "GPU-<uuid>" for a
    whole GPU and "MIG-<uuid>" for a MIG instance, and the bare text does not say which it is."""
    if uuid.startswith(("GPU-", "MIG-")):
        return [uuid]
    return [f"GPU-{uuid}", f"MIG-{uuid}"]


class GpuSampler:
    """Samples NVML utilisation, memory and power of one GPU every period_s, on a PeriodicSampler (stopping is
    immediate and it costs nothing between samples; an NVML error ends the sampling, kept in `error`). Without NVML
    or a GPU it samples nothing and fails nothing. On a MIG instance NVML gives memory (the instance's) but no
    utilisation: utilisation is then recorded as unsupported (`util_note` says why) and memory and power are still
    sampled.

    Utilisation covers the measured phase alone, which starts when the sampler does (module docstring): a sample
    whose NVML window reaches before it has util_pct None. `nvml`: the pynvml module, or a stand-in for it (tests);
    `util_period_max_s`: the longest window nvmlDeviceGetUtilizationRates may read over."""

    def __init__(
        self,
        device_uuid: str | None,
        period_s: float,
        nvml: ModuleType | None = None,
        util_period_max_s: float = UTIL_PERIOD_MAX_S,
    ) -> None:
        self.device_uuid = device_uuid
        self.period_s = period_s
        self.util_period_max_s = util_period_max_s
        self.samples: list[GpuSample] = []
        self.util_note = ""  # why utilisation is missing, when it is
        self.phase_start_ns: int | None = None  # perf_counter_ns of start(): the measured phase's start
        self._periodic = PeriodicSampler("gpu-sampler", period_s, self._sample)
        self._nvml_given = nvml
        self._nvml = None
        self._handle = None
        self._util_supported = True
        self._buffered = False  # utilisation from nvmlDeviceGetSamples (else nvmlDeviceGetUtilizationRates)
        self._newest_at_start_us: int | None = None  # NVML's newest buffered sample when the phase started
        self._last_seen_us: int | None = None  # the newest buffered sample read so far

    def start(self) -> GpuSampler:
        """Starts sampling; the measured phase starts now."""
        self.phase_start_ns = time.perf_counter_ns()
        if self.device_uuid is None:
            return self
        try:
            if self._nvml_given is not None:
                pynvml = self._nvml_given
            else:
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
        if not self._start_buffered():
            try:
                pynvml.nvmlDeviceGetUtilizationRates(self._handle)
            except pynvml.NVMLError as exc:  # MIG: "Not Supported"
                self._util_supported = False
                self.util_note = f"utilisation unsupported by NVML on this device ({exc}; a MIG instance?)"
                log.warning("GPU utilisation not sampled: %s; memory and power still are", self.util_note)
        self._periodic.start()
        return self

    def _start_buffered(self) -> bool:
        """Whether NVML keeps utilisation samples for this device; if so, notes the newest one now, at the
        phase's start: the first one after it covers time before the phase too."""
        nvml = self._nvml
        if getattr(nvml, "nvmlDeviceGetSamples", None) is None:
            return False
        try:
            buffered = self._buffered_since(0)
        except nvml.NVMLError:  # not kept for this device (MIG, an old GPU): read the current rate instead
            return False
        self._buffered = True
        self._newest_at_start_us = self._last_seen_us = max((ts for ts, _ in buffered), default=None)
        return True

    def _buffered_since(self, last_seen_us: int) -> list[tuple[int, float]]:
        """NVML's utilisation samples newer than `last_seen_us` as (timestamp_us, percent), oldest first."""
        nvml = self._nvml
        try:
            value_type, samples = nvml.nvmlDeviceGetSamples(self._handle, GPU_UTILIZATION_SAMPLES, last_seen_us)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NOT_FOUND", NVML_ERROR_NOT_FOUND):
                return []  # nothing newer yet
            raise
        field = VALUE_FIELDS.get(value_type, "uiVal")
        return sorted((int(s.timeStamp), float(getattr(s.sampleValue, field))) for s in samples)

    def _util_pct(self, now_ns: int) -> float | None:
        """Utilisation over the NVML windows that lie wholly in the phase and ended since the last call (their
        time-weighted mean); None where there are none yet."""
        if not self._util_supported:
            return None
        if not self._buffered:
            # The reading covers up to util_period_max_s before now: it counts once that is all in the phase.
            if now_ns - self.phase_start_ns < self.util_period_max_s * 1e9:
                return None
            return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        busy_us = span_us = 0.0
        for timestamp_us, percent in self._buffered_since(self._last_seen_us or 0):
            window_start_us = self._last_seen_us  # a buffered sample covers the time since the one before
            if window_start_us is not None and timestamp_us <= window_start_us:
                continue  # seen already
            self._last_seen_us = timestamp_us
            if window_start_us is None:
                continue  # the first one ever seen: where its window began is unknown
            if self._newest_at_start_us is not None and window_start_us <= self._newest_at_start_us:
                continue  # its window began before the phase did
            busy_us += percent * (timestamp_us - window_start_us)
            span_us += timestamp_us - window_start_us
        return busy_us / span_us if span_us else None

    @property
    def error(self) -> BaseException | None:
        """The NVML error that ended the sampling early, if one did."""
        return self._periodic.error

    def _sample(self) -> None:
        nvml, handle = self._nvml, self._handle
        util = self._util_pct(time.perf_counter_ns())
        mem = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        try:
            power_w: float | None = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except nvml.NVMLError:
            power_w = None
        self.samples.append(GpuSample(time.perf_counter_ns(), util, float(mem), power_w))

    def stop(self) -> list[GpuSample]:
        """The samples so far; NVML is shut down once the thread has ended (an NVML call stuck past the stop's
        timeout keeps it: the process's exit ends both)."""
        ended = self._periodic.stop()
        if ended and self._nvml is not None:
            _nvml_shutdown(self._nvml)
            self._nvml = None
        # Said however the sampling ended: a row with samples and no utilisation always says why.
        if self._util_supported and self.samples and all(s.util_pct is None for s in self.samples):
            self.util_note = self.util_note or (
                "no NVML utilisation window lay wholly in the measured phase (NVML reads over 1/6 s to 1 s): "
                "a longer run gives one (--duration_s)"
            )
        return list(self.samples)


def _nvml_shutdown(nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - nothing left to sample either way
        pass
