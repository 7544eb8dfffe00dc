"""What the frontend's threads share: each request's send times (the sender writes them, the receiver reads them),
the counters that say when every response is in, the events that open and end the run's phases, and the report
with its first failure. The sender, the receiver and the frontend's main thread each hold the one FrontendState."""

from __future__ import annotations

import collections
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from serverbench.config.limits import POLL_S
from serverbench.load.loadgen import LoadGenDriver
from serverbench.schema.messages import FrontendReport
from serverbench.system import process
from serverbench.transport.channels import StopRequested


class StopSignal(Protocol):
    """The server's stop: a multiprocessing Event in the frontend process, a threading one in tests."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class SendTimes:
    sent_ns: int  # latency origin: the intended time under a schedule, else when sending began
    start_ns: int  # when sending began
    done_ns: int | None = None  # when the transport had taken it
    due_ns: int | None = None  # when the load wanted it sent (schedule slot, or the response that freed its place)


class FrontendState:
    def __init__(self, stop_event: StopSignal, concurrency: int) -> None:
        self.report = FrontendReport()
        self.stop_event = stop_event
        self.lock = threading.Lock()  # guards `sends` and the counters written by several threads
        self.sends: dict[int, SendTimes] = {}
        self.sends_begun = 0  # measured requests whose send began: in flight from then on, as their records say
        self.measured_received = 0
        self.sending_done = False
        self.warmup_answered = threading.Semaphore(0)  # the receiver lets the next warm-up request go
        self.places = threading.Semaphore(concurrency)  # closed loop: free places for requests
        self.freed_ns: collections.deque[int] = collections.deque()  # closed loop: when each place was freed
        self.warmup_done = threading.Event()
        self.all_instances_ready = threading.Event()  # every backend instance sent BackendReady (--instances)
        self.waiting_at_gate = threading.Event()  # no response is due meanwhile: the no-progress clock pauses
        self.finished = threading.Event()  # set once: all responses in, or a failure
        self.stop_sending = threading.Event()  # the windows are stable, or there are --max_windows of them
        self.loadgen: LoadGenDriver | None = None  # --load loadgen: completes LoadGen's samples as they arrive

    # -------------------------------------------------------------------------------- failure and stop

    def fail(self, status: str, error: str, tb: str = "") -> None:
        """The first failure is the run's; the run ends now."""
        with self.lock:
            if self.report.status == "ok":
                self.report.status, self.report.error, self.report.traceback = status, error, tb
        self.finished.set()
        self.stop_sending.set()  # a sender asleep until its next scheduled request wakes now

    def should_stop(self) -> bool:
        return self.finished.is_set() or self.stop_event.is_set() or process.parent_gone()

    def guard(self, loop: Callable[[], None]) -> None:
        """Runs a thread's loop; whatever it raises (but the stop it was asked for) fails the run with it."""
        try:
            loop()
        except StopRequested:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the report
            self.fail("error", process.one_line(exc), traceback.format_exc())

    def wait_for(self, attempt: Callable[[float], bool], timeout_s: float) -> bool:
        """Calls a blocking `attempt(timeout)` (a semaphore's acquire, an event's wait) until it succeeds;
        False once the run is stopping or timeout_s has passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if attempt(POLL_S):
                return True
            if self.should_stop() or time.monotonic() > deadline:
                return False

    # -------------------------------------------------------------------------------- counting

    def inflight(self) -> int:
        """Measured requests sent (or being sent) and not yet answered."""
        with self.lock:
            return self.sends_begun - self.measured_received

    def sending_finished(self) -> None:
        with self.lock:
            self.sending_done = True
        self.finish_if_complete()

    def finish_if_complete(self) -> None:
        with self.lock:
            complete = self.sending_done and self.measured_received >= self.report.requests_sent
        if complete:
            self.finished.set()  # the last response: no idle tail
