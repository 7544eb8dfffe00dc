"""What a test or an A/B study plants in the serving steps: the test-only --inject_fault (a failure in one step of
the first measured request, a planted buffer-reuse bug, an instance that exits) and --inject_delay_ms, and the
user-facing --planted_delay_us (a known slowdown bench.resolution measures the A/B verdicts with).

They live in a subclass of `Stages`, chosen once per run by `stages_class`, so that a run without them executes
none of their branches per request: the hot path is the plain `Stages`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from serverbench.backend.buffers import BufferSet
from serverbench.backend.compiled import ForwardModels
from serverbench.backend.stages import Stages, WorkItem
from serverbench.config.limits import INSTANCE_EXIT_STATUS
from serverbench.config.options import BenchConfig
from serverbench.device.layer import Stream

log = logging.getLogger("backend")

STICKY_CUDA_ERROR = "CUDA error: an illegal memory access was encountered (injected)"


class InjectedFault(RuntimeError):
    """Raised by the test-only --inject_fault switch."""


def busy_wait(seconds: float) -> None:
    """--planted_delay_us: holds this thread on a core for `seconds`, as more compute would; a sleep would give the
    core away and plant a smaller slowdown."""
    end_s = time.perf_counter() + seconds
    while time.perf_counter() < end_s:
        pass


def _delayed(forward: Callable[..., object], cfg: BenchConfig) -> Callable[..., object]:
    """The forward followed by the planted delays, inside the forward's timing events as more compute would be."""
    sleep_s = cfg.inject_delay_ms / 1e3  # test-only: a slower model that leaves the core free
    busy_s = cfg.planted_delay_us / 1e6

    def forward_then_wait(*inputs: torch.Tensor) -> object:
        output = forward(*inputs)
        if sleep_s:
            time.sleep(sleep_s)
        if busy_s:
            busy_wait(busy_s)
        return output

    return forward_then_wait


class PlantedStages(Stages):
    """`Stages` with the run's planted faults and delays."""

    def __init__(self, cfg: BenchConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        if cfg.inject_delay_ms or cfg.planted_delay_us:
            self.models = ForwardModels(tuple(_delayed(forward, cfg) for forward in self.models.copies))
        self._shared_buffers: BufferSet | None = None  # the planted early_reuse bug's one set

    def fault(self, stage: str, item: WorkItem) -> None:
        """Test-only faults, all on the first measured request (instance_exit: the first that instance 1 takes)."""
        fault = self.cfg.inject_fault
        if fault == "instance_exit" and stage == "h2d" and self.instance == 1:
            if item.request_id >= self.cfg.warmup_iters:
                log.error("injected: backend instance 1 exits now, in the middle of request %d", item.request_id)
                logging.shutdown()
                os._exit(INSTANCE_EXIT_STATUS)  # no report, no teardown: as a crash or the OOM killer leaves it
        if fault is None or all(m.request_id != self.cfg.warmup_iters for m in item.members):
            return
        if fault == stage:
            raise InjectedFault(f"injected fault in the {stage} step of request {item.request_id}")
        if stage == "predict" and fault == "sticky_cuda":  # and every teardown step fails the same way
            raise RuntimeError(STICKY_CUDA_ERROR)
        if stage == "predict" and fault == "oom":
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 96.00 GiB")
        if stage == "predict" and fault == "hang":
            time.sleep(3600)  # stuck like a kernel that never ends: deaf to every stop signal

    def take_buffers(self, item: WorkItem) -> None:
        if self.cfg.inject_fault != "early_reuse":
            return super().take_buffers(item)
        # The planted bug: one buffer set for all, reused while read.
        if self._shared_buffers is None:
            self._shared_buffers = self.buffers.take()
        item.buffers = self._shared_buffers
        item.events = self.new_events()

    def give_back_buffers(self, buffers: BufferSet) -> None:
        if buffers is not self._shared_buffers:
            super().give_back_buffers(buffers)

    def h2d(self, item: WorkItem, stream: Stream) -> None:
        self.fault("h2d", item)
        super().h2d(item, stream)

    def predict(self, item: WorkItem, stream: Stream, worker: int) -> None:
        self.fault("predict", item)
        super().predict(item, stream, worker)

    def d2h(self, item: WorkItem, stream: Stream) -> int:
        self.fault("d2h", item)
        return super().d2h(item, stream)


def stages_class(cfg: BenchConfig) -> type[Stages]:
    """PlantedStages where the run plants something, the plain steps otherwise."""
    planted = cfg.inject_fault is not None or cfg.inject_delay_ms or cfg.planted_delay_us
    return PlantedStages if planted else Stages
