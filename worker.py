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
import queue
import signal
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.profiler import record_function  # names each step in --profile traces

from config import BenchConfig
from device import DeviceLayer, Event, Stream, make_device_layer
from models import build_model
from transport import POLL_S, BackendFailure, BackendReady, RequestChannel, Response, ResponseChannel
import procutil

log = logging.getLogger("backend")


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


def get_or_abort(q: queue.Queue, failure: Failure):
    """queue.get that gives up when the run is aborting."""
    while True:
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            failure.check()


def put_or_abort(q: queue.Queue, item: object, failure: Failure) -> None:
    while True:
        try:
            q.put(item, timeout=POLL_S)
            return
        except queue.Full:
            failure.check()


def acquire_or_abort(semaphore: threading.Semaphore, failure: Failure) -> None:
    while not semaphore.acquire(timeout=POLL_S):
        failure.check()


@dataclass
class WorkItem:
    """One request on its way through the backend; owns its buffers until the response is sent."""

    request_id: int
    host_batch: Optional[torch.Tensor]
    taken_ns: int
    events: dict[str, Event] = field(default_factory=dict)
    device_batch: Optional[torch.Tensor] = None
    output: Optional[torch.Tensor] = None
    host_output: Optional[torch.Tensor] = None
    worker: int = -1
    threads: dict[str, str] = field(default_factory=dict)  # step -> name of the thread that ran it


EVENT_NAMES = ("h2d_start", "h2d_end", "forward_start", "forward_end", "d2h_start", "d2h_end")


class Stages:
    """The steps every design runs: h2d, predict, d2h, respond."""

    def __init__(self, cfg: BenchConfig, layer: DeviceLayer, model: nn.Module, responses: ResponseChannel) -> None:
        self.cfg = cfg
        self.layer = layer
        self.model = model
        self.responses = responses
        self._shared_input: Optional[torch.Tensor] = None  # only for the planted early_reuse bug
        # Requests each step has finished: what a hung run's log shows to tell which step stopped moving.
        self.progress = {"taken": 0, "h2d": 0, "predict": 0, "d2h": 0, "responded": 0}
        self.queue_depths: Callable[[], dict[str, int]] = dict

    def _maybe_fault(self, stage: str, item: WorkItem) -> None:
        """Test-only faults, all on the first measured request."""
        fault = self.cfg.inject_fault
        if fault is None or item.request_id != self.cfg.warmup_iters:
            return
        if fault == stage:
            raise InjectedFault(f"injected fault in the {stage} step of request {item.request_id}")
        if stage == "predict" and fault == "oom":
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 96.00 GiB")
        if stage == "predict" and fault == "hang":
            time.sleep(3600)  # stuck like a kernel that never ends: deaf to every stop signal

    def take(self, request) -> WorkItem:
        item = WorkItem(request.request_id, request.batch, time.perf_counter_ns())
        self.progress["taken"] += 1
        item.events = {name: self.layer.new_event() for name in EVENT_NAMES}
        return item

    def h2d(self, item: WorkItem, stream: Stream) -> None:
        self._maybe_fault("h2d", item)
        item.threads["h2d"] = threading.current_thread().name
        with self.layer.use_stream(stream), record_function(f"h2d #{item.request_id}"):
            pinned = self.layer.pin(item.host_batch)  # the reference pins every request on arrival (a host copy)
            item.host_batch = None  # the shared-memory segment can go as soon as its bytes are copied
            item.events["h2d_start"].record(stream)
            if self.cfg.inject_fault == "early_reuse":  # planted bug: one buffer for all, nobody waits for readers
                if self._shared_input is None:
                    self._shared_input = torch.empty(pinned.shape, dtype=pinned.dtype, device=self.layer.device)
                item.device_batch = self._shared_input.copy_(pinned, non_blocking=True)
            else:
                item.device_batch = self.layer.to_device(pinned)
            item.events["h2d_end"].record(stream)
        self.progress["h2d"] += 1

    def predict(self, item: WorkItem, stream: Stream, worker: int) -> None:
        self._maybe_fault("predict", item)
        item.threads["predict"] = threading.current_thread().name
        stream.wait_event(item.events["h2d_end"])
        with self.layer.use_stream(stream), torch.inference_mode(), record_function(f"predict #{item.request_id}"):
            # The input was allocated on the H2D stream and is read here: keep it from being reused early.
            self.layer.keep_alive_on(item.device_batch, stream)
            item.events["forward_start"].record(stream)
            item.output = self.model(item.device_batch)
            if self.cfg.inject_delay_ms:
                time.sleep(self.cfg.inject_delay_ms / 1e3)  # test-only: a slower model
            item.events["forward_end"].record(stream)
        item.worker = worker
        self.progress["predict"] += 1

    def d2h(self, item: WorkItem, stream: Stream) -> int:
        """Copies the output to pinned host memory and waits for it; returns the host time it was there."""
        self._maybe_fault("d2h", item)
        item.threads["d2h"] = threading.current_thread().name
        stream.wait_event(item.events["forward_end"])
        with self.layer.use_stream(stream), record_function(f"d2h #{item.request_id}"):
            self.layer.keep_alive_on(item.output, stream)
            item.host_output = self.layer.empty_host(item.output)
            item.events["d2h_start"].record(stream)
            item.host_output.copy_(item.output, non_blocking=True)
            item.events["d2h_end"].record(stream)
        item.events["d2h_end"].synchronize()
        self.progress["d2h"] += 1
        return time.perf_counter_ns()

    def respond(self, item: WorkItem, d2h_done_ns: int) -> None:
        ev = item.events
        end = ev["d2h_end"]

        def host_ns(event: Event) -> int:
            # Events are placed on the host clock by their distance to d2h_end, whose host time we know.
            return d2h_done_ns - round(event.elapsed_time(end) * 1e6)

        response = Response(
            request_id=item.request_id,
            output=item.host_output.numpy(),  # a fresh buffer per response: nothing overwrites it before pickling
            taken_ns=item.taken_ns,
            h2d_done_ns=host_ns(ev["h2d_end"]),
            compute_done_ns=host_ns(ev["forward_end"]),
            d2h_done_ns=d2h_done_ns,
            h2d_copy_ms=ev["h2d_start"].elapsed_time(ev["h2d_end"]),
            forward_ms=ev["forward_start"].elapsed_time(ev["forward_end"]),
            d2h_copy_ms=ev["d2h_start"].elapsed_time(ev["d2h_end"]),
            worker=item.worker,
            h2d_start_ns=host_ns(ev["h2d_start"]),
            forward_start_ns=host_ns(ev["forward_start"]),
            d2h_start_ns=host_ns(ev["d2h_start"]),
            threads=(item.threads["h2d"], item.threads["predict"], item.threads["d2h"]),
        )
        # Every buffer of this request is released only now, after the D2H event completed on the host:
        # all work on all streams that touched them is done.
        item.device_batch = item.output = item.host_output = None
        self.responses.send(response)
        self.progress["responded"] += 1


class RequestSource:
    """The backend's reading end of the request queue, with the abort check built in."""

    def __init__(self, requests: RequestChannel, failure: Failure, stages: Stages) -> None:
        self.requests = requests
        self.failure = failure
        self.stages = stages

    def __iter__(self) -> Iterator[WorkItem]:
        while True:
            self.failure.check()
            try:
                request = self.requests.receive(POLL_S)
            except queue.Empty:
                continue
            if request is None:  # the frontend has sent everything
                return
            yield self.stages.take(request)


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


class PipelinedServer:
    """H2D thread -> num_workers prediction threads -> D2H thread, each on its own stream."""

    def __init__(self, stages: Stages, cfg: BenchConfig, failure: Failure) -> None:
        self.stages = stages
        self.cfg = cfg
        self.failure = failure
        self.inflight = threading.BoundedSemaphore(cfg.max_inflight)
        # Each queue can hold every in-flight item, so a put never waits while the semaphore is held.
        self.to_h2d: queue.Queue = queue.Queue(maxsize=cfg.max_inflight + 1)
        self.to_predict: queue.Queue = queue.Queue(maxsize=cfg.max_inflight + cfg.num_workers)
        self.to_d2h: queue.Queue = queue.Queue(maxsize=cfg.max_inflight + cfg.num_workers)
        self.threads = [threading.Thread(target=self._guard, args=(self.h2d_worker,), name="h2d")]
        self.threads += [threading.Thread(target=self._guard, args=(self.predict_worker, i), name=f"predict-{i}")
                         for i in range(cfg.num_workers)]
        self.threads.append(threading.Thread(target=self._guard, args=(self.d2h_worker,), name="d2h"))
        stages.queue_depths = lambda: {"to_h2d": self.to_h2d.qsize(), "to_predict": self.to_predict.qsize(),
                                       "to_d2h": self.to_d2h.qsize()}

    def _guard(self, loop: Callable, *args) -> None:
        try:
            self.stages.layer.bind_thread()
            loop(*args)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the report
            self.failure.record(exc)

    def h2d_worker(self) -> None:
        stream = self.stages.layer.new_stream()
        while (item := get_or_abort(self.to_h2d, self.failure)) is not None:
            self.stages.h2d(item, stream)
            put_or_abort(self.to_predict, item, self.failure)
        for _ in range(self.cfg.num_workers):  # one end marker per prediction worker
            put_or_abort(self.to_predict, None, self.failure)

    def predict_worker(self, worker: int) -> None:
        stream = self.stages.layer.new_stream()
        while (item := get_or_abort(self.to_predict, self.failure)) is not None:
            self.stages.predict(item, stream, worker)
            put_or_abort(self.to_d2h, item, self.failure)
        put_or_abort(self.to_d2h, None, self.failure)

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

    def serve(self, source: RequestSource) -> None:
        for thread in self.threads:
            thread.start()
        try:
            for item in source:
                acquire_or_abort(self.inflight, self.failure)
                put_or_abort(self.to_h2d, item, self.failure)
            put_or_abort(self.to_h2d, None, self.failure)
        finally:
            if not self.failure.should_stop():
                deadline = time.monotonic() + self.cfg.timeout_s
                for thread in self.threads:
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))
            else:
                self.failure.aborted.set()  # make every stage loop leave at its next poll
                for thread in self.threads:
                    thread.join(timeout=5.0)
        alive = [t.name for t in self.threads if t.is_alive()]
        self.failure.check()
        if alive:
            raise TimeoutError(f"backend threads still running after the last request: {', '.join(alive)}")


SERVE = {"serial": serve_serial, "threaded": serve_threaded}


def prepare_model(cfg: BenchConfig, layer: DeviceLayer) -> tuple[nn.Module, BackendReady]:
    if cfg.inject_fault == "oom_build":
        raise torch.OutOfMemoryError("injected: out of memory while building the model")
    built = build_model(cfg.model, layer.device, cfg.seed, cfg.checkpoint)
    model = built.module
    compile_time_s: Optional[float] = None
    if cfg.compile:
        # torch.compile is not thread-safe: compile and run once here, on one thread, at the served shape,
        # before any serving thread exists. Serving threads then only hit the compiled cache.
        start_ns = time.perf_counter_ns()
        model = torch.compile(model, dynamic=False)
        example = torch.zeros(cfg.input_shape, device=layer.device)
        with torch.inference_mode():
            model(example)
        layer.synchronize()
        compile_time_s = (time.perf_counter_ns() - start_ns) / 1e9
        if hasattr(torch.compiler, "set_stance"):  # torch >= 2.6: a recompile in a serving thread is an error
            torch.compiler.set_stance("fail_on_recompile")
    info = layer.info()
    reference = reference_outputs(cfg, layer, model) if cfg.verify else None
    ready = BackendReady(
        device=info.device, device_name=info.name, device_uuid=info.uuid, timing_source=info.timing_source,
        model_build_s=built.build_s, torch_load_time_s=built.torch_load_time_s, compile_time_s=compile_time_s,
        torch_version=torch.__version__, cuda_version=torch.version.cuda, reference_outputs=reference,
    )
    return model, ready


def reference_outputs(cfg: BenchConfig, layer: DeviceLayer, model: nn.Module) -> list:
    """--verify's answers: each pool batch through the same model, one at a time on the default stream, fully
    synchronised: no thread, no stream, no buffer reuse that could go wrong."""
    from load import make_request_pool

    answers = []
    with torch.inference_mode():
        for batch in make_request_pool(cfg):
            output = model(batch.to(layer.device))
            layer.synchronize()
            answers.append(output.cpu().numpy())
    return answers


def profile_trace_path(cfg: BenchConfig) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return Path(cfg.results_dir) / f"{Path(cfg.output_file).stem}_{cfg.design}_{stamp}_trace.json"


@contextlib.contextmanager
def maybe_profile(cfg: BenchConfig, layer: DeviceLayer, report: dict) -> Iterator[None]:
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
    path = profile_trace_path(cfg)
    prof.export_chrome_trace(str(path))
    report["profile_trace"] = str(path)


def backend_main(cfg: BenchConfig, requests: RequestChannel, responses: ResponseChannel, report_conn,
                 stop_event) -> None:
    """Entry point of the backend process."""
    procutil.setup_child("backend")
    threading.current_thread().name = "serve-loop"  # the serial design's only thread, and the reader of all
    failure = Failure(stop_event)
    report: dict = {"role": "backend", "status": "ok"}
    try:
        layer = make_device_layer(cfg.device)
        if cfg.inject_fault == "backend_start":
            raise InjectedFault("injected fault while the backend starts")
        model, ready = prepare_model(cfg, layer)
        responses.send(ready)
        log.info("model %s ready on %s (%s) in %.2f s", cfg.model, ready.device, ready.device_name,
                 ready.model_build_s + (ready.compile_time_s or 0.0))
        stages = Stages(cfg, layer, model, responses)
        signal.signal(procutil.PROGRESS_SIGNAL, lambda signum, frame: log.error(
            "progress of each step: %s; backend queues: %s", stages.progress, stages.queue_depths()))
        source = RequestSource(requests, failure, stages)
        with maybe_profile(cfg, layer, report):
            if cfg.design == "pipelined":
                PipelinedServer(stages, cfg, failure).serve(source)
            else:
                SERVE[cfg.design](source, stages, cfg)
    except BaseException as exc:  # noqa: BLE001 - reported as data, then the process exits non-zero
        if not isinstance(exc, Aborted):
            failure.record(exc)
    if failure.exception is not None:
        status = classify_failure(failure.exception)
        error = procutil.one_line(failure.exception)
        report.update(status=status, error=error, traceback=failure.traceback)
        with contextlib.suppress(Exception):
            responses.send(BackendFailure(status, error, failure.traceback))
    elif stop_event.is_set():
        report["status"] = "stopped"
    procutil.finish_child(report_conn, report, [requests, responses])
