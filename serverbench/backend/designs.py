"""The three designs, each a small class over `Stages`, chosen by name from `DESIGNS`.

Every design composes the same four steps of `Stages` (h2d, predict, d2h, respond: stages.py); they differ only in
which thread runs which step and on which stream:

- serial: one loop does get -> H2D -> forward -> D2H -> put on one stream (the original baseline);
- threaded (PR 115286): the loop only polls the queue; a one-worker ThreadPoolExecutor runs the rest;
- pipelined (PRs 116189, 116190): an H2D thread, `num_workers` prediction threads and a D2H thread, each on its
  own stream. A step records an event on its stream *before* handing the item to the next thread through a
  queue, so the next thread never waits on an event that was not yet recorded (what the reference's semaphores
  were for). A semaphore bounds the requests inside the pipeline, and with them the device memory.

Any exception in any thread ends the run: it is recorded once (`Failure`) and every loop sees it within POLL_S.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import ClassVar

from serverbench.backend.ceiling import STOP_JOIN_S
from serverbench.backend.stages import (
    Aborted,
    Failure,
    RequestSource,
    Stages,
    WorkItem,
    acquire_or_abort,
    get_or_abort,
)
from serverbench.config.design_kinds import PIPELINED, SERIAL, THREADED, DesignKind
from serverbench.config.limits import POLL_S
from serverbench.config.options import BenchConfig
from serverbench.device.layer import Stream


@dataclass(frozen=True)
class DesignSpec:
    """What a design reads of the configuration."""

    num_workers: int  # prediction threads (pipelined; serial and threaded have exactly one)
    max_inflight: int  # requests inside the backend at once
    timeout_s: float  # how long the requests still inside get to drain once the last has arrived

    @classmethod
    def of(cls, cfg: BenchConfig) -> DesignSpec:
        return cls(cfg.num_workers, cfg.max_inflight, cfg.timeout_s)


def serve_in_turn(stages: Stages, item: WorkItem, stream: Stream) -> None:
    """Every step of one item, one after another on one stream and one thread."""
    stages.h2d(item, stream)
    stages.predict(item, stream, worker=0)
    stages.respond(item, stages.d2h(item, stream))


class Design(ABC):
    """A way to run the four steps: `serve(source)` returns once every request is answered, raises Aborted (or the
    failure) when the run fails or stops. `kind`: its declaration (name, workers, label)."""

    kind: ClassVar[DesignKind]

    def __init__(self, stages: Stages, spec: DesignSpec, failure: Failure) -> None:
        self.stages = stages
        self.spec = spec
        self.failure = failure

    @staticmethod
    def forward_threads(num_workers: int) -> int:
        """Forwards the design runs at once: one, on one thread and one stream."""
        return 1

    @abstractmethod
    def serve(self, source: RequestSource) -> None: ...


class Serial(Design):
    """One loop on the reading thread: get -> H2D -> forward -> D2H -> put, on the default stream."""

    kind = SERIAL

    def serve(self, source: RequestSource) -> None:
        stream = self.stages.layer.default_stream()
        for item in source:
            serve_in_turn(self.stages, item, stream)


class Threaded(Design):
    """The loop only reads requests; a one-worker thread pool runs each one's steps (PR 115286)."""

    kind = THREADED

    def __init__(self, stages: Stages, spec: DesignSpec, failure: Failure) -> None:
        super().__init__(stages, spec, failure)
        self.inflight = threading.BoundedSemaphore(spec.max_inflight)
        self.pending: set[Future] = set()
        self.pending_lock = threading.Lock()

    def _done(self, future: Future) -> None:
        with self.pending_lock:
            self.pending.discard(future)
        self.inflight.release()
        # A future cancelled at shutdown has no exception to give (exception() would raise CancelledError, which the
        # executor logs with a traceback on stderr); one that stopped on Aborted only followed another's failure.
        if future.cancelled() or isinstance(future.exception(), Aborted):
            return
        if future.exception() is not None:  # futures are never left unawaited: a failure ends the run
            self.failure.record(future.exception())

    def _serve_one(self, item: WorkItem, stream: Stream) -> None:
        """One request's steps on the pool's worker; none once the run has failed (queued before it did)."""
        if self.failure.aborted.is_set():
            raise Aborted
        serve_in_turn(self.stages, item, stream)

    def _drain(self) -> None:
        """Waits for what was submitted, still watching for failures."""
        deadline = time.monotonic() + self.spec.timeout_s
        while True:
            with self.pending_lock:
                left = list(self.pending)
            if not left:
                return
            self.failure.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(left)} requests still running {self.spec.timeout_s} s after the last arrived")
            futures_wait(left, timeout=POLL_S)

    def serve(self, source: RequestSource) -> None:
        stream = self.stages.layer.default_stream()
        executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="predict", initializer=self.stages.layer.bind_thread
        )
        try:
            for item in source:
                acquire_or_abort(self.inflight, self.failure)
                future = executor.submit(self._serve_one, item, stream)
                with self.pending_lock:
                    self.pending.add(future)
                future.add_done_callback(self._done)
            self._drain()
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            with self.pending_lock:
                running = [f for f in self.pending if not f.cancelled()]
            futures_wait(running, timeout=STOP_JOIN_S)  # a request the worker is serving: let it finish
            if not all(f.done() for f in running):
                self.stages.note_threads_left(["predict (thread pool worker)"])


class Pipelined(Design):
    """H2D thread -> num_workers prediction threads -> D2H thread, each on its own stream. The H2D thread reads the
    request transport itself: a hand-off from a reading thread would cost a thread switch per request."""

    kind = PIPELINED

    def __init__(self, stages: Stages, spec: DesignSpec, failure: Failure) -> None:
        super().__init__(stages, spec, failure)
        self.inflight = threading.BoundedSemaphore(spec.max_inflight)
        # The semaphore bounds what the queues hold (the in-flight items and the end markers), so they need no
        # bound of their own: SimpleQueue, whose put never waits and whose get (C, a lock with a timeout) costs a
        # fraction of queue.Queue's Condition, at every hand-off of every request.
        self.to_predict: queue.SimpleQueue = queue.SimpleQueue()
        self.to_d2h: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._guard, args=(self.predict_worker, i), name=f"predict-{i}")
            for i in range(spec.num_workers)
        ]
        self.threads.append(threading.Thread(target=self._guard, args=(self.d2h_worker,), name="d2h"))
        stages.show_queues(lambda: {"to_predict": self.to_predict.qsize(), "to_d2h": self.to_d2h.qsize()})

    @staticmethod
    def forward_threads(num_workers: int) -> int:
        """Its prediction threads, each on its own stream."""
        return num_workers

    def _guard(self, loop: Callable, *args) -> None:
        try:
            self.stages.layer.bind_thread()
            loop(*args)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the report
            self.failure.record(exc)

    def h2d_worker(self, source: RequestSource) -> None:
        stream = self.stages.layer.new_stream()
        for item in source:
            acquire_or_abort(self.inflight, self.failure)
            self.stages.h2d(item, stream)
            self.to_predict.put(item)
        for _ in range(self.spec.num_workers):  # one end marker per prediction worker
            self.to_predict.put(None)

    def predict_worker(self, worker: int) -> None:
        stream = self.stages.layer.new_stream()
        while (item := get_or_abort(self.to_predict, self.failure)) is not None:
            self.stages.predict(item, stream, worker)
            self.to_d2h.put(item)
        self.to_d2h.put(None)

    def d2h_worker(self) -> None:
        stream = self.stages.layer.new_stream()
        ends_seen = 0
        while ends_seen < self.spec.num_workers:
            item = get_or_abort(self.to_d2h, self.failure)
            if item is None:
                ends_seen += 1
                continue
            self.stages.respond(item, self.stages.d2h(item, stream))
            self.inflight.release()

    def _join_all(self) -> list[str]:
        """Joins every thread: the last requests drain within timeout_s; once the run is failing or stopping (now or
        during the drain), the threads get STOP_JOIN_S to leave. Returns the names of those still running."""
        deadline = time.monotonic() + self.spec.timeout_s
        aborting = False
        for thread in self.threads:
            while thread.is_alive() and time.monotonic() < deadline:
                if not aborting and self.failure.should_stop():
                    aborting = True
                    self.failure.aborted.set()  # make every stage loop leave at its next poll
                    deadline = min(deadline, time.monotonic() + STOP_JOIN_S)
                thread.join(timeout=POLL_S)
        return [t.name for t in self.threads if t.is_alive()]

    def serve(self, source: RequestSource) -> None:
        h2d = threading.Thread(target=self._guard, args=(self.h2d_worker, source), name="h2d")
        self.threads.insert(0, h2d)
        for thread in self.threads:
            thread.start()
        alive: list[str] = []
        try:
            # The H2D thread reads requests for as long as the frontend sends them (the frontend watches progress
            # with its own timeout, and stops the run through the stop event).
            while h2d.is_alive() and not self.failure.should_stop():
                h2d.join(timeout=POLL_S)
        finally:
            alive = self._join_all()
            self.stages.note_threads_left(alive)
        self.failure.check()
        if alive:
            raise TimeoutError(f"backend threads still running after the last request: {', '.join(alive)}")


# How each declared design (serverbench/config/design_kinds.py) serves, by its name.
DESIGNS: dict[str, type[Design]] = {cls.kind.name: cls for cls in (Serial, Threaded, Pipelined)}


def ceiling_concurrencies(design: str, num_workers: int) -> list[int]:
    """The concurrencies the ceiling times the model alone at: 1 to the forwards the design runs at once (serial
    and threaded: one forward thread, one stream; pipelined: its prediction threads, each on its own stream)."""
    return list(range(1, DESIGNS[design].forward_threads(num_workers) + 1))
