"""The backend process: builds the model, then serves requests with one of three designs.

Every design composes the same four steps of `Stages` (h2d, predict, d2h, respond: serverbench/backend/stages.py);
they differ only in which thread runs which step and on which stream:

- serial: one loop does get -> H2D -> forward -> D2H -> put on one stream (the original baseline);
- threaded (PR 115286): the loop only polls the queue; a one-worker ThreadPoolExecutor runs the rest;
- pipelined (PRs 116189, 116190): an H2D thread, `num_workers` prediction threads and a D2H thread, each on its
  own stream. A step records an event on its stream *before* handing the item to the next thread through a
  queue, so the next thread never waits on an event that was not yet recorded (what the reference's semaphores
  were for). A semaphore bounds the requests inside the pipeline, and with them the device memory.

Any exception in any thread ends the run: it is recorded once (`Failure`), every loop sees it within POLL_S, and
the backend reports it to the frontend and to the server as data (status and traceback) before exiting non-zero.
The model's preparation is in serverbench/backend/prepare.py, the model-alone ceiling in
serverbench/backend/ceiling.py, --profile in serverbench/backend/profiling.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import replace

import torch

from serverbench.backend.ceiling import STOP_JOIN_S, ceiling_concurrencies, measure_ceiling
from serverbench.backend.prepare import prepare_model
from serverbench.backend.profiling import maybe_profile
from serverbench.backend.stages import (
    STICKY_CUDA_ERROR,
    Aborted,
    Failure,
    InjectedFault,
    RequestSource,
    Stages,
    WorkItem,
    acquire_or_abort,
    classify_failure,
    get_or_abort,
)
from serverbench.config.options import BenchConfig
from serverbench.device.layer import DeviceLayer, make_device_layer
from serverbench.launch import procutil
from serverbench.launch.instances import Instance, cpu_split, intra_op_threads, pin_to_cpus, usable_cpus
from serverbench.schema.messages import BackendFailure, BackendReport
from serverbench.system import process
from serverbench.transport.channels import POLL_S, RequestChannel, ResponseChannel

log = logging.getLogger("backend")


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
        self.threads = [
            threading.Thread(target=self._guard, args=(self.predict_worker, i), name=f"predict-{i}")
            for i in range(cfg.num_workers)
        ]
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

    def h2d_worker(self, source: RequestSource) -> None:
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

    def serve(self, source: RequestSource) -> None:
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


def backend_main(
    cfg: BenchConfig,
    requests: RequestChannel,
    responses: ResponseChannel,
    report_conn,
    stop_event,
    instance: Instance | None = None,
) -> None:
    """Entry point of a backend process (`instance` of --instances: each builds its own model and serves from the
    one request transport; None: the only one)."""
    instance = instance or Instance()
    process.setup_child("backend" if instance.count == 1 else f"backend{instance.index}", cfg.verbose)
    instance.keep_beating()  # the server's sign that this process still runs
    responses.keep_writing_end()
    threading.current_thread().name = "serve-loop"  # the serial design's only thread, and the reader of all
    failure = Failure(stop_event)
    report = BackendReport()
    layer: DeviceLayer | None = None
    stages: Stages | None = None
    try:
        # Before the model exists, so that every allocation of serving (and of the ceiling) comes from one heap.
        report.malloc_tuned = procutil.tune_malloc() if cfg.tune_malloc else False
        cpus: list[int] | None = None
        if not cfg.is_cuda:  # the CPU is the device: the model's cores, shared out among the instances
            cpus = usable_cpus()
            if cfg.cpu_split:
                cpus = cpu_split(cpus)[1]
                pin_to_cpus(cpus)
            report.backend_cpus = ";".join(str(cpu) for cpu in cpus)
        threads = intra_op_threads(
            cfg.intra_op_threads,
            instance.count,
            cpus,
            cfg.num_workers,  # the forwards this backend runs at once (serial and threaded have exactly one)
            default_threads=torch.get_num_threads(),
            env=os.environ,
        )
        if threads is not None:
            torch.set_num_threads(threads)
        report.intra_op_threads = torch.get_num_threads()
        layer = make_device_layer(cfg.device, cfg.spin_wait, cfg.nvtx)
        if cfg.inject_fault == "backend_start":
            raise InjectedFault("injected fault while the backend starts")
        with layer.nvtx_range("model build and warm-up"):
            prepared = prepare_model(cfg, layer)

        def together() -> None:
            # --instances: every instance's ceiling loop k starts at once; their sum is N models at work together.
            # The others may still be building or compiling, as the frontend's warm-up allows.
            if not instance.wait_together(failure.should_stop, cfg.warmup_timeout_s):
                raise Aborted

        def ceiling() -> dict[int, list[float]]:
            # With dynamic batching, at the largest formed batch: the most the model can do per forward.
            return measure_ceiling(
                prepared.models,
                prepared.example,
                layer,
                prepared.example[0].shape[0],
                ceiling_concurrencies(cfg),
                cfg.ceiling_s,
                before_loop=together,
            )

        if cfg.ceiling:
            # Before serving, while the frontend waits for its first answer; the row's warm-up latency leaves
            # this time out.
            ceiling_start_ns = time.perf_counter_ns()
            with layer.nvtx_range("ceiling before serving"):
                report.ceiling_before = ceiling()
            report.ceiling_before_ns = (ceiling_start_ns, time.perf_counter_ns())
        ready = replace(prepared.ready, instance=instance.index, pid=os.getpid())
        requests.page_lock(layer)  # shm on CUDA: the ring is page-locked once, before the first request
        responses.send(ready)
        log.info(
            "model %s ready on %s (%s) in %.2f s",
            cfg.model,
            ready.device,
            ready.device_name,
            ready.model_build_s + (ready.compile_time_s or 0.0),
        )
        stages = Stages(
            cfg,
            layer,
            prepared.models,
            responses,
            release_slot=requests.release,
            decode=prepared.decode,
            should_stop=failure.should_stop,
            instance=instance.index,
        )
        signal.signal(
            process.PROGRESS_SIGNAL,
            lambda signum, frame: log.error(
                "progress of each step: %s; backend queues: %s", stages.progress, stages.queue_depths()
            ),
        )
        source = RequestSource(requests, failure, stages)
        start_cpu_s, start_ns = time.process_time(), time.perf_counter_ns()
        with maybe_profile(cfg, layer, report, instance.index):
            if cfg.design == "pipelined":
                PipelinedServer(stages, cfg, failure).serve(source)
            else:
                SERVE[cfg.design](source, stages, cfg)
        # CPU seconds of every backend thread per second of serving: threads that spin on events show here.
        report.backend_cpu_cores = (time.process_time() - start_cpu_s) / max(
            (time.perf_counter_ns() - start_ns) / 1e9, 1e-9
        )
        if cfg.ceiling and not failure.should_stop():
            # After serving, when the frontend is idle too: the same cores or GPU with nothing else to do.
            with layer.nvtx_range("ceiling after serving"):
                report.ceiling_after = ceiling()
    except BaseException as exc:  # noqa: BLE001 - reported as data, then the process exits non-zero
        if not isinstance(exc, Aborted):
            failure.record(exc)
    if failure.exception is not None:
        status = classify_failure(failure.exception)
        error = process.one_line(failure.exception)
        report.status, report.error, report.traceback = status, error, failure.traceback
        with contextlib.suppress(Exception):
            responses.send(BackendFailure(status, error, failure.traceback, instance.index))
    elif stop_event.is_set():
        report.status = "stopped"
    tear_down(cfg, layer, requests, stages.threads_left if stages is not None else [])
    procutil.finish_child(report_conn, report, [requests, responses])


def release_ring(requests: RequestChannel, layer: DeviceLayer | None, threads_left: list[str]) -> None:
    """Unregisters a page-locked ring once no copy from it can still run: every serving thread has ended and the
    device is synchronised. A thread still running may yet queue a copy from it: the ring then stays registered
    until the process exits, which releases it anyway."""
    if layer is None or not requests.is_page_locked:
        return
    if threads_left:
        log.warning(
            "the ring stays page-locked until the process exits: %s may still copy from it", ", ".join(threads_left)
        )
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


def tear_down(cfg: BenchConfig, layer: DeviceLayer | None, requests: RequestChannel, threads_left: list[str]) -> None:
    """The backend's cleanup, after its report is made and before it is sent. Each step is guarded and logged:
    after a sticky CUDA error (an illegal access, a device-side assert) every CUDA call raises that error again,
    and no cleanup step may keep the report from reaching the server."""
    steps = (
        ("release the page-locked ring", lambda: release_ring(requests, layer, threads_left)),
        ("stop the compile workers", shutdown_compile_workers),
    )
    for name, step in steps:
        try:
            if cfg.inject_fault == "sticky_cuda":
                raise RuntimeError(STICKY_CUDA_ERROR)
            step()
        except Exception as exc:  # noqa: BLE001 - logged; the report still goes out
            log.error("teardown: could not %s: %s", name, process.one_line(exc))
