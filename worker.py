"""The backend process: builds the model, then serves requests with one of three designs.

Every design composes the same four steps of `Stages` (h2d, predict, d2h, respond); they differ only in which
thread runs which step and on which stream:

- serial: one loop does get -> H2D -> forward -> D2H -> put on one stream (the original baseline);
- threaded (PR 115286): the loop only polls the queue; a one-worker ThreadPoolExecutor runs the rest;
- pipelined (PRs 116189, 116190): an H2D thread, `num_workers` prediction threads and a D2H thread, each on its
  own stream. A step records an event on its stream *before* handing the item to the next thread through a
  queue, so the next thread never waits on an event that was not yet recorded (what the reference's semaphores
  were for). A semaphore bounds the requests inside the pipeline, and with them the device memory.

Any exception in any thread ends the run: it is recorded once (`Failure`), every loop sees it within POLL_S, and
the backend reports it to the frontend and to the server as data (status and traceback) before exiting non-zero.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional

import torch
from torch import nn
from torch.profiler import record_function  # names each step in --profile traces

from serverbench.backend.batcher import Batcher, BatchRule, padded_size, padded_sizes
from serverbench.backend.buffers import BufferPool, BufferSet, Decoder, model_dtype
from serverbench.config.options import BenchConfig
from serverbench.device.layer import NO_CONTEXT, DeviceLayer, Event, Stream, make_device_layer
from serverbench.launch.instances import INSTANCE_EXIT_STATUS, Instance, cpu_split, intra_op_threads, pin_to_cpus, usable_cpus
from serverbench.backend.models import build_model
from serverbench.transport.channels import POLL_S, BackendFailure, BackendReady, RequestChannel, Response, ResponseChannel
from serverbench.launch import procutil

log = logging.getLogger("backend")

STOP_JOIN_S = 5.0  # how long an aborting design waits for its serving threads to leave


class InjectedFault(RuntimeError):
    """Raised by the test-only --inject_fault switch."""


class Aborted(Exception):
    """A loop stopped because another thread failed or the server asked to stop."""


def classify_failure(exc: BaseException) -> str:
    """Status of a run that failed with `exc`: 'oom' lets a sweep move past a batch size that does not fit."""
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if isinstance(exc, oom_types) or "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower():
        return "oom"
    return "error"


class Failure:
    """The first failure of any backend thread, and the abort flag every loop polls."""

    def __init__(self, stop_event) -> None:
        self._lock = threading.Lock()
        self._stop_event = stop_event  # set by the server to stop the whole run
        self.aborted = threading.Event()
        self.exception: Optional[BaseException] = None
        self.traceback: str = ""

    def record(self, exc: BaseException) -> None:
        with self._lock:
            if self.exception is None:
                self.exception = exc
                self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.aborted.set()

    def should_stop(self) -> bool:
        return self.aborted.is_set() or self._stop_event.is_set() or procutil.parent_gone()

    def check(self) -> None:
        if self.should_stop():
            raise Aborted


def get_or_abort(q: queue.SimpleQueue, failure: Failure):
    """queue.get that gives up when the run is aborting."""
    while True:
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            failure.check()


def acquire_or_abort(semaphore: threading.Semaphore, failure: Failure) -> None:
    while not semaphore.acquire(timeout=POLL_S):
        failure.check()


@dataclass
class Member:
    """One request inside the backend, until its bytes are on the device."""

    request_id: int
    host_batch: Optional[torch.Tensor]
    taken_ns: int  # taken off the transport
    sent_ns: int  # when the frontend sent it (under a schedule, when it was due): the batcher's delay starts here
    slot: Optional[int] = None  # shm transport: the ring slot holding host_batch until the H2D copy is done


@dataclass
class WorkItem:
    """One forward's worth of requests on its way through the backend: a single request, or a formed batch of
    several (--max_batch_size) whose rows go back as one response each. Owns its buffers until its responses are
    sent."""

    members: list[Member]
    formed_ns: int  # the batcher closed the formed batch (the member's taken_ns without batching)
    padded_images: int  # images the forward runs on: the members' own, plus padding up to a compiled size
    batch_id: int = 0  # the formed batch's number in this backend
    events: dict[str, Event] = field(default_factory=dict)
    buffers: Optional[BufferSet] = None  # from the pool, until the response is sent
    device_batch: Optional[torch.Tensor] = None  # the model's input, in buffers
    output: Optional[torch.Tensor] = None
    host_output: Optional[torch.Tensor] = None  # where the response reads the output (CUDA: in buffers)
    worker: int = -1
    threads: dict[str, str] = field(default_factory=dict)  # step -> name of the thread that ran it
    anchors_ns: dict[str, int] = field(default_factory=dict)  # event -> host time just after synchronize() on it

    @property
    def request_id(self) -> int:
        """The first member's id: the name of the forward in traces and logs."""
        return self.members[0].request_id


EVENT_NAMES = ("h2d_start", "h2d_end", "forward_start", "forward_end", "d2h_start", "d2h_end")
HOST_WAITED_EVENTS = ("h2d_end", "d2h_end")  # the host synchronizes on these: made with blocking sync
STICKY_CUDA_ERROR = "CUDA error: an illegal memory access was encountered (injected)"


def _unlabelled(step: str, request_id: int) -> ContextManager:
    return NO_CONTEXT


def _labelled(step: str, request_id: int) -> ContextManager:
    return record_function(f"{step} #{request_id}")


_this_thread = threading.local()


def thread_name() -> str:
    """The calling thread's name, looked up once per thread (threading.current_thread().name costs microseconds,
    three times per request)."""
    try:
        return _this_thread.name
    except AttributeError:
        _this_thread.name = threading.current_thread().name
        return _this_thread.name


class Stages:
    """The steps every design runs: h2d, predict, d2h, respond."""

    def __init__(self, cfg: BenchConfig, layer: DeviceLayer, model: nn.Module, responses: ResponseChannel,
                 release_slot: Optional[Callable[[int], None]] = None, decode: Optional[Decoder] = None,
                 should_stop: Callable[[], bool] = lambda: False, instance: int = 0) -> None:
        self.cfg = cfg
        self.instance = instance  # --instances: which backend process this is; every response says so
        self.layer = layer
        self.model = model
        self.responses = responses
        self.release_slot = release_slot  # hands a shm ring slot back to the frontend
        self.should_stop = should_stop  # the run is ending: a wait for a buffer set gives up
        self.decode = decode or Decoder(cfg, layer.device)
        # One buffer set per request the backend may hold at once (the designs bound that by max_inflight).
        # With dynamic batching a set holds the largest formed batch, and a forward uses its first rows.
        rows = cfg.formed_rows if cfg.batching else None
        self.buffers = BufferPool(cfg.max_inflight, lambda: self._new_buffer_set(rows), cfg.timeout_s)
        # --compile with dynamic batching: the sizes compiled at warm-up, to which a formed batch is padded.
        self.padded_sizes = compiled_sizes(cfg)
        # Named steps in --profile traces; otherwise nothing: record_function costs microseconds per call even
        # with no profiler running, a tenth of a request's whole cost at one image per request.
        self.label: Callable[[str, int], ContextManager] = _labelled if cfg.profile else _unlabelled
        self._faults = cfg.inject_fault is not None
        self._batches_formed = 0
        # Dynamic batching: forwards that may run at once (the design's prediction threads). The batcher forms a
        # batch only once one of them is free; a batch gives its place back once its output is on the host (on a
        # GPU the forward's kernels then have run, not only been queued).
        self.free_forwards = threading.BoundedSemaphore(max(ceiling_concurrencies(cfg)))
        self._shared_buffers: Optional[BufferSet] = None  # only for the planted early_reuse bug
        # Requests each step has finished: what a hung run's log shows to tell which step stopped moving.
        self.progress = {"taken": 0, "h2d": 0, "predict": 0, "d2h": 0, "responded": 0}
        self.queue_depths: Callable[[], dict[str, int]] = dict
        # Serving threads a design could not see end (an abort that did not wait for them): copies from the ring
        # may still be queued by them, so the ring stays registered until the process exits.
        self.threads_left: list[str] = []

    def new_events(self) -> dict[str, Event]:
        return {name: self.layer.new_event(host_waits=name in HOST_WAITED_EVENTS) for name in EVENT_NAMES}

    def _new_buffer_set(self, rows: Optional[int]) -> BufferSet:
        """A buffer set with its own timing events: reused with it, recorded again only after the previous
        request's D2H event completed, so no event is made per request."""
        buffers = BufferSet(self.cfg, self.layer.device, pin_host=self.layer.is_cuda, rows=rows)
        buffers.events = self.new_events()
        return buffers

    def _maybe_fault(self, stage: str, item: WorkItem) -> None:
        """Test-only faults, all on the first measured request (instance_exit: the first that instance 1 takes)."""
        fault = self.cfg.inject_fault
        if fault == "instance_exit" and stage == "h2d" and self.instance == 1 \
                and item.request_id >= self.cfg.warmup_iters:
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

    def take(self, request) -> Member:
        member = Member(request.request_id, request.batch, time.perf_counter_ns(), request.sent_ns, request.slot)
        self.progress["taken"] += 1
        return member

    def form(self, members: list[Member]) -> WorkItem:
        """One forward's work item from the requests it serves (one, or a formed batch)."""
        images = len(members) * self.cfg.batch_size
        padded = images if self.padded_sizes is None else padded_size(images, self.padded_sizes)
        formed_ns = members[0].taken_ns if not self.cfg.batching else time.perf_counter_ns()
        item = WorkItem(members, formed_ns, padded, batch_id=self._batches_formed)
        self._batches_formed += 1
        return item

    def h2d(self, item: WorkItem, stream: Stream) -> None:
        """Copies the request to the device and decodes it into the model's input (dtype, layout, uint8
        normalisation); hands its shm slot back once the copy has completed."""
        if self._faults:
            self._maybe_fault("h2d", item)
        item.threads["h2d"] = thread_name()
        if self._faults and self.cfg.inject_fault == "early_reuse":  # planted bug: one buffer set for all, reused while read
            if self._shared_buffers is None:
                self._shared_buffers = self.buffers.take()
            item.buffers = self._shared_buffers
            item.events = self.new_events()
        else:
            item.buffers = self.buffers.take(self.should_stop)
            if item.buffers is None:
                raise Aborted
            item.events = item.buffers.events
        with self.layer.use_stream(stream), self.label("h2d", item.request_id):
            # queue transport: the reference pins every request on arrival (a host copy); shm slots are
            # page-locked once, so this returns them as they are.
            pinned = [self.layer.pin(member.host_batch) for member in item.members]
            item.events["h2d_start"].record(stream)
            if not self.cfg.batching:
                wire = self.layer.stage_wire(item.buffers.wire, pinned[0], item.buffers.decode_copies)
            else:
                wire = self.gather_wire(item.buffers.wire, pinned, item.padded_images)
            item.device_batch = self.decode(item.buffers, wire)
            item.events["h2d_end"].record(stream)
        slots = [member.slot for member in item.members if member.slot is not None]
        if slots:
            item.events["h2d_end"].synchronize()  # the slots' bytes are on the device: they may be written again
            item.anchors_ns["h2d_end"] = time.perf_counter_ns()
            for slot in slots:
                self.release_slot(slot)
        for member in item.members:
            member.host_batch = None  # a queue request's shared-memory segment can go now too
        self.progress["h2d"] += len(item.members)

    def gather_wire(self, wire: torch.Tensor, requests: list[torch.Tensor], padded_images: int) -> torch.Tensor:
        """A formed batch's wire bytes: each request copied straight into its rows of the set's wire buffer (the
        H2D copy itself on a GPU, no host staging copy); rows past the requests are padding (left as they are:
        outputs of padded rows are never sent)."""
        rows = self.cfg.batch_size
        for i, request in enumerate(requests):
            wire[i * rows:(i + 1) * rows].copy_(request, non_blocking=self.layer.is_cuda)
        return wire[:padded_images]

    def predict(self, item: WorkItem, stream: Stream, worker: int) -> None:
        if self._faults:
            self._maybe_fault("predict", item)
        item.threads["predict"] = thread_name()
        stream.wait_event(item.events["h2d_end"])
        with self.layer.use_stream(stream), torch.inference_mode(), self.label("predict", item.request_id):
            item.events["forward_start"].record(stream)
            output = self.model(item.device_batch)
            item.output = output if output.dtype == torch.float32 else output.float()  # bf16 has no numpy dtype
            if self.cfg.inject_delay_ms:
                time.sleep(self.cfg.inject_delay_ms / 1e3)  # test-only: a slower model
            item.events["forward_end"].record(stream)
        item.worker = worker
        self.progress["predict"] += len(item.members)

    def d2h(self, item: WorkItem, stream: Stream) -> int:
        """Copies the output to the set's page-locked host buffer and waits for it; returns the host time it
        was there."""
        if self._faults:
            self._maybe_fault("d2h", item)
        item.threads["d2h"] = thread_name()
        stream.wait_event(item.events["forward_end"])
        with self.layer.use_stream(stream), self.label("d2h", item.request_id):
            # The output was allocated on the prediction stream and is read here: keep it from being reused early.
            self.layer.keep_alive_on(item.output, stream)
            answered = item.output
            images = len(item.members) * self.cfg.batch_size
            if item.padded_images != images:
                answered = answered[:images]  # padded rows stay on the device
            host_buffer = self.layer.host_output_buffer(item.buffers, answered)
            item.events["d2h_start"].record(stream)
            item.host_output = self.layer.stage_output(host_buffer, answered)
            item.events["d2h_end"].record(stream)
        item.events["d2h_end"].synchronize()
        if self.cfg.batching:
            # The forward has run (on a GPU, not only been queued): the next formed batch may go now.
            self.free_forwards.release()
        self.progress["d2h"] += len(item.members)
        return time.perf_counter_ns()

    def respond(self, item: WorkItem, d2h_done_ns: int) -> None:
        """One response per request of the item: its own rows of the output, the item's shared timings."""
        ev = item.events
        host_ns = self.layer.host_times(ev, {**item.anchors_ns, "d2h_end": d2h_done_ns})
        shared = dict(
            h2d_done_ns=host_ns["h2d_end"],
            compute_done_ns=host_ns["forward_end"],
            d2h_done_ns=host_ns["d2h_end"],
            h2d_copy_ms=ev["h2d_start"].elapsed_time(ev["h2d_end"]),
            forward_ms=ev["forward_start"].elapsed_time(ev["forward_end"]),
            d2h_copy_ms=ev["d2h_start"].elapsed_time(ev["d2h_end"]),
            worker=item.worker,
            h2d_start_ns=host_ns["h2d_start"],
            forward_start_ns=host_ns["forward_start"],
            d2h_start_ns=host_ns["d2h_start"],
            threads=(item.threads["h2d"], item.threads["predict"], item.threads["d2h"]),
            batched_ns=item.formed_ns,
            formed_images=len(item.members) * self.cfg.batch_size,
            padded_images=item.padded_images,
            batch_id=item.batch_id,
            instance=self.instance,
        )
        rows = self.cfg.batch_size
        # Copies: the host buffer goes back to the pool before the responses are written, so that a frontend slow to
        # read never holds a buffer set.
        host_output = item.host_output.numpy()  # sliced and copied in numpy: a tenth of torch's cost per slice
        outputs = [host_output[i * rows:(i + 1) * rows].copy() for i in range(len(item.members))]
        # Every buffer of this item is released only now, after the D2H event completed on the host: all work on
        # all streams that touched them is done.
        if item.buffers is not self._shared_buffers:
            self.buffers.give_back(item.buffers)
        item.buffers = item.device_batch = item.output = item.host_output = None
        for member, output in zip(item.members, outputs):
            self.responses.send(Response(request_id=member.request_id, output=output, taken_ns=member.taken_ns,
                                         **shared))
        self.progress["responded"] += len(item.members)


class RequestSource:
    """The backend's reading end of the request transport, with the abort check built in: yields one work item
    per forward (a request, or a formed batch of them with --max_batch_size)."""

    def __init__(self, requests: RequestChannel, failure: Failure, stages: Stages) -> None:
        self.requests = requests
        self.failure = failure
        self.stages = stages

    def take(self, timeout_s: float) -> Optional[Member]:
        """The next request, None at the end marker; queue.Empty after timeout_s."""
        request = self.requests.receive(timeout_s)
        return None if request is None else self.stages.take(request)

    def __iter__(self) -> Iterator[WorkItem]:
        cfg = self.stages.cfg
        if cfg.batching:
            rule = BatchRule(cfg.batch_size, cfg.max_batch_size, cfg.max_queue_delay_ms / 1e3)
            room = lambda: acquire_or_abort(self.stages.free_forwards, self.failure)  # noqa: E731
            # sent_ns is on the frontend's perf_counter: the host's one monotonic clock, shared by its processes.
            arrived_s = lambda member: member.sent_ns / 1e9  # noqa: E731
            for members in Batcher(rule, self.take, self.failure.check, time.perf_counter, arrived_s,
                                   wait_for_room=room):
                yield self.stages.form(members)
            return
        next_check_s = 0.0
        while True:
            # At least every POLL_S, as every wait does; not per request (the stop flags cost microseconds each).
            if (now_s := time.monotonic()) >= next_check_s:
                self.failure.check()
                next_check_s = now_s + POLL_S
            try:
                member = self.take(POLL_S)
            except queue.Empty:
                continue
            if member is None:  # the frontend has sent everything
                return
            yield self.stages.form([member])


def serve_serial(source: RequestSource, stages: Stages, cfg: BenchConfig) -> None:
    stream = stages.layer.default_stream()
    for item in source:
        stages.h2d(item, stream)
        stages.predict(item, stream, worker=0)
        stages.respond(item, stages.d2h(item, stream))


def serve_threaded(source: RequestSource, stages: Stages, cfg: BenchConfig) -> None:
    failure = source.failure
    inflight = threading.BoundedSemaphore(cfg.max_inflight)
    pending: set[Future] = set()
    pending_lock = threading.Lock()
    stream = stages.layer.default_stream()

    def serve_one(item: WorkItem) -> None:
        stages.h2d(item, stream)
        stages.predict(item, stream, worker=0)
        stages.respond(item, stages.d2h(item, stream))

    def on_done(future: Future) -> None:
        with pending_lock:
            pending.discard(future)
        inflight.release()
        if future.exception() is not None:  # futures are never left unawaited: a failure ends the run
            failure.record(future.exception())

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predict", initializer=stages.layer.bind_thread)
    try:
        for item in source:
            acquire_or_abort(inflight, failure)
            future = executor.submit(serve_one, item)
            with pending_lock:
                pending.add(future)
            future.add_done_callback(on_done)
        deadline = time.monotonic() + cfg.timeout_s
        while True:  # drain: wait for what was submitted, still watching for failures
            with pending_lock:
                left = list(pending)
            if not left:
                break
            failure.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(left)} requests still running {cfg.timeout_s} s after the last arrived")
            futures_wait(left, timeout=POLL_S)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        with pending_lock:
            running = [f for f in pending if not f.cancelled()]
        futures_wait(running, timeout=STOP_JOIN_S)  # a request the worker is serving: let it finish
        if not all(f.done() for f in running):
            stages.threads_left = ["predict (thread pool worker)"]


class PipelinedServer:
    """H2D thread -> num_workers prediction threads -> D2H thread, each on its own stream. The H2D thread reads the
    request transport itself: a hand-off from a reading thread would cost a thread switch per request."""

    def __init__(self, stages: Stages, cfg: BenchConfig, failure: Failure) -> None:
        self.stages = stages
        self.cfg = cfg
        self.failure = failure
        self.inflight = threading.BoundedSemaphore(cfg.max_inflight)
        # The semaphore bounds what the queues hold (the in-flight items and the end markers), so they need no
        # bound of their own: SimpleQueue, whose put never waits and whose get (C, a lock with a timeout) costs a
        # fraction of queue.Queue's Condition, at every hand-off of every request.
        self.to_predict: queue.SimpleQueue = queue.SimpleQueue()
        self.to_d2h: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._guard, args=(self.predict_worker, i), name=f"predict-{i}")
                        for i in range(cfg.num_workers)]
        self.threads.append(threading.Thread(target=self._guard, args=(self.d2h_worker,), name="d2h"))
        stages.queue_depths = lambda: {"to_predict": self.to_predict.qsize(), "to_d2h": self.to_d2h.qsize()}

    def _guard(self, loop: Callable, *args) -> None:
        try:
            self.stages.layer.bind_thread()
            loop(*args)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the report
            self.failure.record(exc)

    def h2d_worker(self, source: "RequestSource") -> None:
        stream = self.stages.layer.new_stream()
        for item in source:
            acquire_or_abort(self.inflight, self.failure)
            self.stages.h2d(item, stream)
            self.to_predict.put(item)
        for _ in range(self.cfg.num_workers):  # one end marker per prediction worker
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
        while ends_seen < self.cfg.num_workers:
            item = get_or_abort(self.to_d2h, self.failure)
            if item is None:
                ends_seen += 1
                continue
            self.stages.respond(item, self.stages.d2h(item, stream))
            self.inflight.release()

    def serve(self, source: "RequestSource") -> None:
        h2d = threading.Thread(target=self._guard, args=(self.h2d_worker, source), name="h2d")
        self.threads.insert(0, h2d)
        for thread in self.threads:
            thread.start()
        try:
            # The H2D thread reads requests for as long as the frontend sends them (the frontend watches progress
            # with its own timeout, and stops the run through the stop event).
            while h2d.is_alive() and not self.failure.should_stop():
                h2d.join(timeout=POLL_S)
        finally:
            # The last requests drain within timeout_s; once the run is failing or stopping (now or during the
            # drain), the threads get STOP_JOIN_S to leave.
            deadline = time.monotonic() + self.cfg.timeout_s
            aborting = False
            for thread in self.threads:
                while thread.is_alive() and time.monotonic() < deadline:
                    if not aborting and self.failure.should_stop():
                        aborting = True
                        self.failure.aborted.set()  # make every stage loop leave at its next poll
                        deadline = min(deadline, time.monotonic() + STOP_JOIN_S)
                    thread.join(timeout=POLL_S)
            self.stages.threads_left = [t.name for t in self.threads if t.is_alive()]
        alive = self.stages.threads_left
        self.failure.check()
        if alive:
            raise TimeoutError(f"backend threads still running after the last request: {', '.join(alive)}")


SERVE = {"serial": serve_serial, "threaded": serve_threaded}


def set_precision_flags(precision: str) -> dict[str, object]:
    """Process-wide TF32 flags: `default` leaves PyTorch's own (cuDNN convolutions in TF32, matmuls in IEEE
    float32: what the reference ran); tf32 turns both on; fp32, bf16 and fp16 turn both off (strict IEEE for
    whatever runs in float32). Returns the flags in effect."""
    if precision != "default":
        tf32 = precision == "tf32"
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
    return {"cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul_precision": torch.get_float32_matmul_precision()}


def decoded_on_device(cfg: BenchConfig, layer: DeviceLayer, decode: Decoder, batch: torch.Tensor) -> torch.Tensor:
    """`batch` on the device and decoded as a request would be, in fresh buffers made outside inference mode like
    the serving pool's (a compiled decoder guards on that): the model's input at the served shape, dtype, layout.
    With dynamic batching the buffers have the pool's rows too, and `batch` fills the first of them."""
    buffers = BufferSet(cfg, layer.device, pin_host=False, rows=cfg.formed_rows if cfg.batching else None)
    wire = buffers.wire[:batch.shape[0]]
    # With batching, serving always decodes a view of the wire buffer (gather_wire): so does this, for the guards.
    return decode(buffers, layer.stage_wire(wire, batch, buffers.decode_copies and not cfg.batching))


def compiled_sizes(cfg: BenchConfig) -> Optional[list[int]]:
    """With dynamic batching and anything compiled (model or decoding): the formed-batch sizes compiled at warm-up,
    to which every formed batch is padded. None: each forward runs at its own size."""
    if not cfg.batching or not (cfg.compile or cfg.compile_decode):
        return None
    return padded_sizes(cfg.batch_size, cfg.max_batch_size)


MAX_EAGER_WARMUP_SIZES = 64


def warmup_sizes(cfg: BenchConfig, compiled: Optional[list[int]], example_rows: int) -> list[int]:
    """The batch sizes the model runs at before serving. Compiled: every size compiled. Dynamic batching without
    compile: every size a formed batch can take (whole requests), so that no formed size meets its first forward
    (a CPU library's kernel choice, cuDNN's algorithm search) while serving, as the warm-up request's size alone
    would; beyond MAX_EAGER_WARMUP_SIZES sizes, the powers of two among them. With several --instances, the
    request's size: only one instance serves the warm-up request, and no instance's first forward may land in the
    measured phase. Otherwise none: the warm-up request is the first forward, as in the reference."""
    if compiled is not None:
        return compiled
    if cfg.batching:
        sizes = list(range(cfg.batch_size, cfg.formed_rows + 1, cfg.batch_size))
        return sizes if len(sizes) <= MAX_EAGER_WARMUP_SIZES else padded_sizes(cfg.batch_size, cfg.max_batch_size)
    return [example_rows] if cfg.compile or cfg.instances > 1 else []


def example_input(cfg: BenchConfig, layer: DeviceLayer, decode: Decoder, rows: Optional[int] = None) -> torch.Tensor:
    """The first pool batch as model input (for compile's warm-up and the ceiling), its images repeated to `rows`
    (default: the largest batch the model runs on, a request's or a full formed batch)."""
    from serverbench.load.schedules import make_request_pool

    batch = make_request_pool(replace(cfg, request_pool_size=1))[0]
    rows = cfg.formed_rows if rows is None else rows
    if rows != batch.shape[0]:
        batch = batch.repeat(math.ceil(rows / batch.shape[0]), 1, 1, 1)[:rows]
    return decoded_on_device(cfg, layer, decode, batch)


def allow_recompiles(count: int) -> None:
    """Dynamo compiles a function at most recompile_limit times (8 by default) before it falls back to eager: the
    formed-batch sizes compiled at warm-up must all fit (older torch names the limit cache_size_limit)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), count + 1))


@dataclass
class PreparedModel:
    model: nn.Module  # cast, laid out and compiled as asked
    decode: Decoder  # wire bytes -> model input (compiled with --compile_decode, which follows --compile)
    example: torch.Tensor  # the first pool batch as model input, on the device: what the ceiling runs on
    ready: BackendReady


def prepare_model(cfg: BenchConfig, layer: DeviceLayer) -> PreparedModel:
    if cfg.inject_fault == "oom_build":
        raise torch.OutOfMemoryError("injected: out of memory while building the model")
    precision_flags = set_precision_flags(cfg.precision)
    built = build_model(cfg.model, layer.device, cfg.seed, cfg.checkpoint)
    model = built.module.to(dtype=model_dtype(cfg.precision),
                            memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format)
    decode = Decoder(cfg, layer.device)
    compile_time_s: Optional[float] = None
    start_ns = time.perf_counter_ns()
    # torch.compile is not thread-safe: compile and run once here, on one thread, at the served shape, dtype and
    # layout, before any serving thread exists. Serving threads then only hit the compiled cache.
    sizes = compiled_sizes(cfg)
    if sizes is not None:
        allow_recompiles(len(sizes))
    if cfg.compile_decode:
        decode.compile()  # compiled at its first call, just below
    example = example_input(cfg, layer, decode)
    if cfg.compile:
        model = torch.compile(model, dynamic=False, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    # Compiled at the served shape now, not in a serving thread; with dynamic batching run at every size a formed
    # batch can take (padded to, when compiled).
    for rows in warmup_sizes(cfg, sizes, example.shape[0]):
        # The input is made outside inference mode, as the serving threads make theirs (compile guards on it).
        model_input = example if rows == example.shape[0] else example_input(cfg, layer, decode, rows)
        with torch.inference_mode():
            model(model_input)
    layer.synchronize()  # the example's buffers are freed on the default stream; the pool may get their blocks
    if cfg.compile or cfg.compile_decode:
        compile_time_s = (time.perf_counter_ns() - start_ns) / 1e9
        if hasattr(torch.compiler, "set_stance"):  # torch >= 2.6: a recompile in a serving thread is an error
            torch.compiler.set_stance("fail_on_recompile")
    info = layer.info()
    reference = reference_outputs(cfg, layer, model, decode) if cfg.verify else None
    ready = BackendReady(
        device=info.device, device_name=info.name, device_uuid=info.uuid, timing_source=info.timing_source,
        model_build_s=built.build_s, torch_load_time_s=built.torch_load_time_s, compile_time_s=compile_time_s,
        torch_version=str(torch.__version__), cuda_version=torch.version.cuda, reference_outputs=reference,
        **precision_flags,
    )
    return PreparedModel(model, decode, example, ready)


def reference_outputs(cfg: BenchConfig, layer: DeviceLayer, model: nn.Module, decode: Decoder) -> list:
    """--verify's answers: each pool batch through the same model and decoding, one at a time on the default
    stream, fully synchronised: no thread, no stream, no buffer reuse that could go wrong."""
    from serverbench.load.schedules import make_request_pool

    answers = []
    sizes = compiled_sizes(cfg)
    for batch in make_request_pool(cfg):
        rows = batch.shape[0]
        if sizes is not None:  # only the compiled sizes may run: padded as a lone request is when served
            padded = padded_size(rows, sizes)
            batch = torch.cat([batch, torch.zeros((padded - rows, *batch.shape[1:]), dtype=batch.dtype)])
        model_input = decoded_on_device(cfg, layer, decode, batch)
        with torch.inference_mode():
            output = model(model_input)[:rows]
        layer.synchronize()
        answers.append(output.float().cpu().numpy())
    return answers


def ceiling_concurrencies(cfg: BenchConfig) -> list[int]:
    """How many forwards the design runs at once: one for serial and threaded (one forward thread, one stream);
    1 to num_workers for pipelined (its prediction threads, each on its own stream)."""
    return list(range(1, cfg.num_workers + 1)) if cfg.design == "pipelined" else [1]


MIN_CEILING_FORWARDS = 3  # per thread and timed loop


def busy_window_rate(spans: list[list[tuple[float, float]]], batch_size: int) -> Optional[float]:
    """Samples/s of concurrent forwards, over the window in which every thread was running them: from the last
    thread's first start to the first thread's last end. `spans[i]` holds thread i's forwards as (start_s, end_s),
    in order, on one clock. A forward crossing an edge counts for the fraction of it inside. The loop's own time
    (start signal to the last thread done) would also count the uneven finish, in which the threads done early
    idle: serving's threads never wait for each other, so that loop time made the ceiling lower than serving
    (resnet18 at 64x64, pipelined with 2 workers: efficiency 1.05 to 1.12). None where the window is empty (one
    thread ended before another began) or a forward has no length."""
    if not spans or any(not forwards for forwards in spans):
        return None
    window_start_s = max(forwards[0][0] for forwards in spans)
    window_end_s = min(forwards[-1][1] for forwards in spans)
    if window_end_s <= window_start_s:
        return None
    forwards_done = 0.0
    for forwards in spans:
        for start_s, end_s in forwards:
            if end_s <= start_s:
                return None
            inside_s = min(end_s, window_end_s) - max(start_s, window_start_s)
            forwards_done += max(0.0, inside_s) / (end_s - start_s)
    return forwards_done * batch_size / (window_end_s - window_start_s)


def measure_ceiling(model: nn.Module, example: torch.Tensor, layer: DeviceLayer, batch_size: int,
                    concurrencies: list[int], total_s: float, loops: int = 5,
                    max_iters: int = 10_000, before_loop: Callable[[], None] = lambda: None) -> dict[int, list[float]]:
    """The model alone on inputs already on the device, at each concurrency: `c` threads (made once, as serving's
    are), each on its own stream with its own copy of the input, run forwards back to back; `c` = 1 runs on the
    calling thread. Returns, per `c`, the samples/s of each of `loops` timed loops: at c = 1 on the host clock from
    the first forward to the stream synchronised; at c > 1 over the loop's busy window (busy_window_rate), timed
    by events around every forward, falling back to the start signal to every stream synchronised where the window is
    empty. Each concurrency gets about `total_s` of forwards, so a loop lasts about
    total_s / loops, or longer where MIN_CEILING_FORWARDS per thread need it. `before_loop` runs before every loop,
    the warm ones included (--instances: a barrier, so that every instance's loop k runs at the same time)."""
    layer.bind_thread()
    inputs = [example.clone() for _ in range(max(concurrencies))]
    streams = [layer.new_stream() for _ in inputs]
    layer.synchronize()  # the copies are made on the default stream; the threads read them on their own
    # Threads made once and kept for every loop, as serving keeps its prediction threads: no timed loop includes a
    # thread's start or its first forward's per-thread state (the allocator's, the math library's).
    orders = [queue.SimpleQueue() for _ in inputs]  # per thread: (start signal, forwards, timeout_s)
    done: queue.SimpleQueue = queue.SimpleQueue()  # per finished order: the exception it raised, or None
    finished = threading.Event()

    def run_forwards(i: int, iters: int, marks: Optional[list[Event]] = None) -> None:
        """`marks`: two events per forward, recorded around it on this thread's stream (its start and end)."""
        with layer.use_stream(streams[i]), torch.inference_mode():
            for k in range(iters):
                if marks is not None:
                    marks[2 * k].record(streams[i])
                model(inputs[i])
                if marks is not None:
                    marks[2 * k + 1].record(streams[i])
        streams[i].synchronize()

    def follow_orders(i: int) -> None:
        layer.bind_thread()
        while not finished.is_set():
            try:
                start, iters, timeout_s, marks = orders[i].get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                if not start.wait(timeout=timeout_s):
                    raise TimeoutError("the ceiling's start signal never came")
                run_forwards(i, iters, marks)
                done.put(None)
            except BaseException as exc:  # noqa: BLE001 - raised again on the measuring thread
                done.put(exc)

    def timed_loop(concurrency: int, iters: int, timeout_s: float) -> float:
        """Samples/s of one loop of `iters` forwards per thread."""
        before_loop()
        if concurrency == 1:  # on this thread: serial serving ran here (CUDA graphs are recorded per thread)
            start_ns = time.perf_counter_ns()
            run_forwards(0, iters)
            return iters * batch_size / ((time.perf_counter_ns() - start_ns) / 1e9)
        # Events around every forward (made before the start signal): on a GPU they time the forwards on the device
        # without a synchronisation per forward, on the CPU they are the host clock.
        marks = [[layer.new_event() for _ in range(2 * iters)] for _ in range(concurrency)]
        reference = layer.new_event()
        reference.record(streams[0])  # before any forward, on an idle stream: every mark is later
        start = threading.Event()
        for i in range(concurrency):
            orders[i].put((start, iters, timeout_s, marks[i]))
        start_ns = time.perf_counter_ns()
        start.set()
        deadline = time.monotonic() + timeout_s
        for _ in range(concurrency):
            try:
                error = done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the ceiling's forwards at concurrency {concurrency} did not end in time") from None
            if error is not None:
                raise error
        loop_s = (time.perf_counter_ns() - start_ns) / 1e9
        spans = [[(reference.elapsed_time(own[2 * k]) / 1e3, reference.elapsed_time(own[2 * k + 1]) / 1e3)
                  for k in range(iters)] for own in marks]
        rate = busy_window_rate(spans, batch_size)
        return concurrency * iters * batch_size / loop_s if rate is None else rate

    def timeout_for(concurrency: int, iters_each: int) -> float:
        # Generous, and in proportion to the work: a forward of seconds at several threads must not time out.
        return max(60.0, 20 * total_s, 10 * concurrency * iters_each * one_s)

    one_s = 600.0  # unknown until timed: the first forward may build lazily
    threads = [threading.Thread(target=follow_orders, args=(i,), name=f"ceiling-{i}", daemon=True)
               for i in range(len(inputs))] if len(inputs) > 1 else []
    for thread in threads:
        thread.start()
    try:
        timed_loop(1, 1, timeout_for(1, 1))  # warm: lazy initialisation, allocator, algorithm choice
        one_s = batch_size / timed_loop(1, 1, timeout_for(1, 1))
        timed_loop(max(concurrencies), 2, timeout_for(max(concurrencies), 2))  # warm each thread's stream
        iters = max(1, min(max_iters, math.ceil(total_s / loops / max(one_s, 1e-6))))
        per_concurrency: dict[int, list[float]] = {}
        for concurrency in concurrencies:
            # The same work per loop at every concurrency, and at least MIN_CEILING_FORWARDS per thread: a loop of
            # one or two forwards per thread times its start signal and the threads' uneven finish as much as the
            # model (resnet18 at batch 32 on 2 cores: loops spread by 5-13 % within one run).
            iters_each = max(MIN_CEILING_FORWARDS, iters // concurrency)
            timeout_s = timeout_for(concurrency, iters_each)
            per_concurrency[concurrency] = [timed_loop(concurrency, iters_each, timeout_s) for _ in range(loops)]
    finally:
        finished.set()
        leave_by = time.monotonic() + STOP_JOIN_S  # one deadline for all of them, not one each
        for thread in threads:
            thread.join(timeout=max(0.0, leave_by - time.monotonic()))  # one still in a forward: a daemon, left
    layer.synchronize()
    layer.release_cache()  # the ceiling's per-stream blocks: serving's memory figures must not carry them
    return per_concurrency


def profile_trace_path(cfg: BenchConfig, instance: int = 0) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    rank = "" if cfg.rank is None else f"_rank{cfg.rank.rank}"  # under torchrun the ranks may share a folder
    rank += f"_instance{instance}" if cfg.instances > 1 else ""  # so may the instances, in the same second
    return Path(cfg.results_dir) / f"{Path(cfg.output_file).stem}_{cfg.design}{rank}_{stamp}_trace.json"


@contextlib.contextmanager
def maybe_profile(cfg: BenchConfig, layer: DeviceLayer, report: dict, instance: int = 0) -> Iterator[None]:
    if not cfg.profile:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if layer.is_cuda else [])
    try:  # the profiler is per thread unless told otherwise; the designs' work runs on worker threads
        experimental = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        experimental = None
        log.warning("this torch cannot profile all threads: the trace has the backend's main thread only "
                    "(and every CUDA kernel)")
    with profile(activities=activities, experimental_config=experimental) as prof:
        yield
    path = profile_trace_path(cfg, instance)
    prof.export_chrome_trace(str(path))
    report["profile_trace"] = str(path)


def backend_main(cfg: BenchConfig, requests: RequestChannel, responses: ResponseChannel, report_conn,
                 stop_event, instance: Instance = Instance()) -> None:
    """Entry point of a backend process (`instance` of --instances: each builds its own model and serves from the
    one request transport)."""
    procutil.setup_child("backend" if instance.count == 1 else f"backend{instance.index}", cfg.verbose)
    responses.keep_writing_end()
    threading.current_thread().name = "serve-loop"  # the serial design's only thread, and the reader of all
    failure = Failure(stop_event)
    report: dict = {"role": "backend", "status": "ok"}
    layer: Optional[DeviceLayer] = None
    stages: Optional[Stages] = None
    try:
        # Before the model exists, so that every allocation of serving (and of the ceiling) comes from one heap.
        report["malloc_tuned"] = procutil.tune_malloc() if cfg.tune_malloc else False
        cpus: Optional[list[int]] = None
        if not cfg.is_cuda:  # the CPU is the device: the model's cores, shared out among the instances
            cpus = usable_cpus()
            if cfg.cpu_split:
                cpus = cpu_split(cpus)[1]
                pin_to_cpus(cpus)
            report["backend_cpus"] = ";".join(str(cpu) for cpu in cpus)
        threads = intra_op_threads(cfg.intra_op_threads, instance.count, cpus, cfg.cpu_split,
                                   default_threads=torch.get_num_threads(), env=os.environ)
        if threads is not None:
            torch.set_num_threads(threads)
        report["intra_op_threads"] = torch.get_num_threads()
        layer = make_device_layer(cfg.device, cfg.spin_wait)
        if cfg.inject_fault == "backend_start":
            raise InjectedFault("injected fault while the backend starts")
        prepared = prepare_model(cfg, layer)

        def together() -> None:
            # --instances: every instance's ceiling loop k starts at once; their sum is N models at work together.
            # The others may still be building or compiling, as the frontend's warm-up allows.
            if not instance.wait_together(failure.should_stop, cfg.warmup_timeout_s):
                raise Aborted

        def ceiling() -> dict[int, list[float]]:
            # With dynamic batching, at the largest formed batch: the most the model can do per forward.
            return measure_ceiling(prepared.model, prepared.example, layer, prepared.example.shape[0],
                                   ceiling_concurrencies(cfg), cfg.ceiling_s, before_loop=together)

        if cfg.ceiling:
            # Before serving, while the frontend waits for its first answer; the row's warm-up latency leaves
            # this time out.
            ceiling_start_ns = time.perf_counter_ns()
            report["ceiling_before"] = ceiling()
            report["ceiling_before_ns"] = (ceiling_start_ns, time.perf_counter_ns())
        ready = replace(prepared.ready, instance=instance.index)
        requests.page_lock(layer)  # shm on CUDA: the ring is page-locked once, before the first request
        responses.send(ready)
        log.info("model %s ready on %s (%s) in %.2f s", cfg.model, ready.device, ready.device_name,
                 ready.model_build_s + (ready.compile_time_s or 0.0))
        stages = Stages(cfg, layer, prepared.model, responses, release_slot=requests.release,
                        decode=prepared.decode, should_stop=failure.should_stop, instance=instance.index)
        signal.signal(procutil.PROGRESS_SIGNAL, lambda signum, frame: log.error(
            "progress of each step: %s; backend queues: %s", stages.progress, stages.queue_depths()))
        source = RequestSource(requests, failure, stages)
        start_cpu_s, start_ns = time.process_time(), time.perf_counter_ns()
        with maybe_profile(cfg, layer, report, instance.index):
            if cfg.design == "pipelined":
                PipelinedServer(stages, cfg, failure).serve(source)
            else:
                SERVE[cfg.design](source, stages, cfg)
        # CPU seconds of every backend thread per second of serving: threads that spin on events show here.
        report["backend_cpu_cores"] = (time.process_time() - start_cpu_s) / max(
            (time.perf_counter_ns() - start_ns) / 1e9, 1e-9)
        if cfg.ceiling and not failure.should_stop():
            # After serving, when the frontend is idle too: the same cores or GPU with nothing else to do.
            report["ceiling_after"] = ceiling()
    except BaseException as exc:  # noqa: BLE001 - reported as data, then the process exits non-zero
        if not isinstance(exc, Aborted):
            failure.record(exc)
    if failure.exception is not None:
        status = classify_failure(failure.exception)
        error = procutil.one_line(failure.exception)
        report.update(status=status, error=error, traceback=failure.traceback)
        with contextlib.suppress(Exception):
            responses.send(BackendFailure(status, error, failure.traceback, instance.index))
    elif stop_event.is_set():
        report["status"] = "stopped"
    tear_down(cfg, layer, requests, stages.threads_left if stages is not None else [])
    procutil.finish_child(report_conn, report, [requests, responses])


def release_ring(requests: RequestChannel, layer: Optional[DeviceLayer], threads_left: list[str]) -> None:
    """Unregisters a page-locked ring once no copy from it can still run: every serving thread has ended and the
    device is synchronised. A thread still running may yet queue a copy from it: the ring then stays registered
    until the process exits, which releases it anyway."""
    if layer is None or not requests.is_page_locked:
        return
    if threads_left:
        log.warning("the ring stays page-locked until the process exits: %s may still copy from it",
                    ", ".join(threads_left))
        return
    layer.synchronize()
    requests.page_unlock()


def shutdown_compile_workers() -> None:
    """Stops inductor's compile worker processes, which an exit that skips atexit (os._exit, as every child here
    leaves) would otherwise leave to the resource tracker ('leaked semaphore objects')."""
    module = sys.modules.get("torch._inductor.async_compile")  # importing it would start the pool
    shutdown = getattr(module, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()


def tear_down(cfg: BenchConfig, layer: Optional[DeviceLayer], requests: RequestChannel,
              threads_left: list[str]) -> None:
    """The backend's cleanup, after its report is made and before it is sent. Each step is guarded and logged:
    after a sticky CUDA error (an illegal access, a device-side assert) every CUDA call raises that error again,
    and no cleanup step may keep the report from reaching the server."""
    steps = (("release the page-locked ring", lambda: release_ring(requests, layer, threads_left)),
             ("stop the compile workers", shutdown_compile_workers))
    for name, step in steps:
        try:
            if cfg.inject_fault == "sticky_cuda":
                raise RuntimeError(STICKY_CUDA_ERROR)
            step()
        except Exception as exc:  # noqa: BLE001 - logged; the report still goes out
            log.error("teardown: could not %s: %s", name, procutil.one_line(exc))
