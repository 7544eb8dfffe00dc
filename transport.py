"""Request transport (frontend -> backend) and response transport (backend -> frontend), with their messages.

The queue transport is the reference's: a request's batch travels as a tensor through a torch.multiprocessing
queue, which moves it into a fresh shared-memory segment on the way. Every request is written afresh from the
frontend's pre-generated pool (as data arriving from a network would be), so no request rides for free on a
segment an earlier request already shared.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
import torch

import procutil

POLL_S = 0.1  # how often blocked calls look at their stop condition


class StopRequested(Exception):
    """A blocking transport call gave up because the run is being stopped."""


@dataclass
class Request:
    request_id: int  # 0 is the warm-up request
    batch: torch.Tensor  # [B, 3, H, W] float32 on the CPU
    sent_ns: int  # perf_counter_ns when the frontend began sending it


@dataclass
class Response:
    request_id: int
    output: np.ndarray  # [B, ...] on the CPU
    taken_ns: int  # backend took the request off the queue
    h2d_done_ns: int  # the input was on the device
    compute_done_ns: int  # the forward was done
    d2h_done_ns: int  # the output was on the host, synchronised
    h2d_copy_ms: float  # duration of the copy itself (CUDA events on a GPU, host clock on the CPU)
    forward_ms: float
    d2h_copy_ms: float
    worker: int  # index of the prediction worker that served it
    h2d_start_ns: int  # the copies and the forward began (host clock, placed from their events)
    forward_start_ns: int
    d2h_start_ns: int
    threads: tuple[str, str, str]  # names of the threads that ran h2d, predict and d2h


@dataclass
class BackendReady:
    """Sent once, before the first response: what the backend built and where it runs."""

    device: str
    device_name: str
    device_uuid: Optional[str]
    timing_source: str
    model_build_s: float
    torch_load_time_s: Optional[float]
    compile_time_s: Optional[float]
    torch_version: str
    cuda_version: Optional[str]
    reference_outputs: Optional[list[np.ndarray]] = None  # --verify: the answer for each pool batch


@dataclass
class BackendFailure:
    status: str  # "error" or "oom"
    error: str  # one line
    traceback: str


BackendMessage = Union[BackendReady, Response, BackendFailure]


def _put(q, item: object, should_stop: Callable[[], bool]) -> None:
    while True:
        try:
            q.put(item, timeout=POLL_S)
            return
        except queue.Full:
            if should_stop():
                raise StopRequested from None


class RequestChannel:
    """Frontend -> backend. Bounded: requests in transit hold shared memory."""

    def __init__(self, mp_context, max_queued: int) -> None:
        self._queue = mp_context.Queue(maxsize=max_queued)

    def send(self, request_id: int, batch: torch.Tensor, sent_ns: int, should_stop: Callable[[], bool]) -> None:
        # One fresh copy per request; the queue then moves it into its own shared-memory segment.
        _put(self._queue, Request(request_id, batch.clone(), sent_ns), should_stop)

    def send_end(self, should_stop: Callable[[], bool]) -> None:
        _put(self._queue, None, should_stop)

    def receive(self, timeout_s: float) -> Optional[Request]:
        """The next request, or None when the frontend has no more; raises queue.Empty after timeout_s."""
        return self._queue.get(timeout=timeout_s)

    def depth(self) -> Optional[int]:
        try:
            return self._queue.qsize()
        except NotImplementedError:  # macOS
            return None

    def flush(self, timeout_s: float) -> None:
        procutil.flush_queue(self._queue, timeout_s)


class ResponseChannel:
    """Backend -> frontend: BackendReady, then Responses, or a BackendFailure."""

    def __init__(self, mp_context) -> None:
        self._queue = mp_context.Queue()

    def send(self, message: BackendMessage) -> None:
        self._queue.put(message)

    def receive(self, timeout_s: float) -> BackendMessage:
        """Raises queue.Empty after timeout_s."""
        return self._queue.get(timeout=timeout_s)

    def flush(self, timeout_s: float) -> None:
        procutil.flush_queue(self._queue, timeout_s)
