"""The backend process: builds the model, times the model alone (the ceiling), then serves requests with the design
--design names, taken from the table of designs (`DESIGNS`, serverbench/backend/designs.py).

Any exception in any thread ends the run: it is recorded once (`Failure`), every loop sees it within POLL_S, and
the backend reports it to the frontend and to the server as data (status and traceback) before exiting non-zero.
The designs are in serverbench/backend/designs.py, the steps they compose in serverbench/backend/stages.py, the
model's preparation in serverbench/backend/prepare.py, the model-alone ceiling in serverbench/backend/ceiling.py,
--profile in serverbench/backend/profiling.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as ProcessEvent
from types import FrameType

import torch

from serverbench.backend.batcher import batch_rule
from serverbench.backend.ceiling import measure_ceiling
from serverbench.backend.designs import DESIGNS, Design, DesignSpec, ceiling_concurrencies
from serverbench.backend.planted import STICKY_CUDA_ERROR, InjectedFault, stages_class
from serverbench.backend.prepare import PreparedModel, prepare_model
from serverbench.backend.profiling import maybe_profile
from serverbench.backend.stages import Aborted, Failure, RequestSource, Stages, classify_failure
from serverbench.config.options import BenchConfig
from serverbench.device.layer import DeviceLayer, make_device_layer
from serverbench.launch import procutil
from serverbench.launch.instances import Instance, cpu_split, intra_op_threads, pin_to_cpus, usable_cpus
from serverbench.schema.messages import BackendFailure, BackendReport, DoorReport
from serverbench.system import process
from serverbench.system.speed import machine_speed
from serverbench.transport.channels import RequestChannel
from serverbench.transport.responses import ResponseChannel

log = logging.getLogger("backend")


def backend_main(
    cfg: BenchConfig,
    requests: RequestChannel,
    responses: ResponseChannel,
    report_conn: Connection,
    stop_event: ProcessEvent,
    instance: Instance | None = None,
) -> None:
    """Entry point of a backend process (`instance` of --instances: each builds its own model and serves from the
    one request transport; None: the only one)."""
    instance = instance or Instance()
    process.setup_child("backend" if instance.count == 1 else f"backend{instance.index}", cfg.verbose)
    instance.keep_beating()  # the server's sign that this process still runs
    responses.keep_writing_end(instance.index)
    backend = Backend(cfg, requests, responses, instance, stop_event)
    serve_and_report(backend, report_conn)


def serve_and_report(
    backend: Backend, report_conn: Connection, stop_door: Callable[[float], DoorReport] | None = None
) -> None:
    """The backend's run, its cleanup and its report (with the inline door's, once `stop_door` has sent it away:
    network_roles.py passes it, so that this module never imports the door's packages)."""
    cfg = backend.cfg
    threading.current_thread().name = "serve-loop"  # the serial design's only thread, and the reader of all
    try:
        backend.run()
    except BaseException as exc:  # noqa: BLE001 - reported as data, then the process exits non-zero
        if not isinstance(exc, Aborted):
            backend.failure.record(exc)
    backend.settle_status()
    if stop_door is not None:
        backend.report.door = stop_door(cfg.timeout_s)
    requests = backend.requests
    tear_down(backend.layer, requests, backend.threads_left(), sticky_fault=cfg.inject_fault == "sticky_cuda")
    procutil.finish_child(report_conn, backend.report, [requests, backend.responses])


class Backend:
    """One backend process's run, part by part: the CPU's threads, the device, the model, the ceiling before and
    after, serving with the design. What it learns goes into `report`; `layer` and `stages` exist once made."""

    def __init__(
        self,
        cfg: BenchConfig,  # whole: the backend process is where the flags are spent
        requests: RequestChannel,
        responses: ResponseChannel,
        instance: Instance,
        stop_event: ProcessEvent,
    ) -> None:
        self.cfg = cfg
        self.requests = requests
        self.responses = responses
        self.instance = instance
        self.stop_event = stop_event  # set by the server to stop the whole run
        self.failure = Failure(stop_event)
        self.report = BackendReport()
        self.layer: DeviceLayer | None = None
        self.stages: Stages | None = None

    @property
    def design(self) -> type[Design]:
        # Looked up when used, inside run(): a failure there is reported like any other.
        return DESIGNS[self.cfg.design]

    @property
    def forward_threads(self) -> int:
        return self.design.forward_threads(self.cfg.num_workers)

    def threads_left(self) -> list[str]:
        return self.stages.threads_left if self.stages is not None else []

    def run(self) -> None:
        cfg = self.cfg
        # Before the model exists, so that every allocation of serving (and of the ceiling) comes from one heap.
        self.report.malloc_tuned = procutil.tune_malloc() if cfg.tune_malloc else False
        self.set_cpu_threads()
        layer = self.layer = make_device_layer(cfg.device, cfg.spin_wait, cfg.nvtx)
        if cfg.inject_fault == "backend_start":
            raise InjectedFault("injected fault while the backend starts")
        with layer.nvtx_range("model build and warm-up"):
            prepared = prepare_model(cfg, layer, self.forward_threads)
        if cfg.ceiling:
            # Before serving, while the frontend waits for its first answer; the row's warm-up latency leaves
            # this time out.
            ceiling_start_ns = time.perf_counter_ns()
            with layer.nvtx_range("ceiling before serving"):
                self.report.ceiling_before = self.ceiling(prepared)
            self.report.ceiling_before_ns = (ceiling_start_ns, time.perf_counter_ns())
        # Last before the first request may come, first after the last answer: the machine as the run found it.
        self.report.machine_speed_before = machine_speed()
        self.announce_ready(prepared)
        self.serve(self.make_stages(prepared))
        if not self.failure.should_stop():
            self.report.machine_speed_after = machine_speed()
        if cfg.ceiling and not self.failure.should_stop():
            # After serving, when the frontend is idle too: the same cores or GPU with nothing else to do.
            with layer.nvtx_range("ceiling after serving"):
                self.report.ceiling_after = self.ceiling(prepared)

    def set_cpu_threads(self) -> None:
        """On the CPU device, the model's cores (shared out among the instances, pinned with --cpu_split); then
        torch's intra-op threads, for the forwards this backend runs at once."""
        cfg = self.cfg
        cpus: list[int] | None = None
        if not cfg.is_cuda:
            cpus = usable_cpus()
            if cfg.cpu_split:
                cpus = cpu_split(cpus)[1]
                pin_to_cpus(cpus)
            self.report.backend_cpus = ";".join(str(cpu) for cpu in cpus)
        threads = intra_op_threads(
            cfg.intra_op_threads,
            self.instance.count,
            cpus,
            self.forward_threads,
            default_threads=torch.get_num_threads(),
            env=os.environ,
        )
        if threads is not None:
            torch.set_num_threads(threads)
        self.report.intra_op_threads = torch.get_num_threads()

    def together(self) -> None:
        """--instances: every instance's ceiling loop k starts at once; their sum is N models at work together.
        The others may still be building or compiling, as the frontend's warm-up allows."""
        if not self.instance.wait_together(self.failure.should_stop, self.cfg.warmup_timeout_s):
            raise Aborted

    def ceiling(self, prepared: PreparedModel) -> dict[int, list[float]]:
        """The model alone at the design's concurrencies; with dynamic batching at the largest formed batch: the
        most the model can do per forward."""
        return measure_ceiling(
            prepared.models,
            prepared.example,
            self.layer,
            prepared.example[0].shape[0],
            ceiling_concurrencies(self.cfg.design, self.cfg.num_workers),
            self.cfg.ceiling_s,
            before_loop=self.together,
        )

    def announce_ready(self, prepared: PreparedModel) -> None:
        """Tells the frontend the model is ready: its first request may come now."""
        ready = replace(prepared.ready, instance=self.instance.index, pid=os.getpid())
        self.requests.page_lock(self.layer)  # shm on CUDA: the ring is page-locked once, before the first request
        self.responses.send(ready)
        log.info(
            "model %s ready on %s (%s) in %.2f s",
            self.cfg.model,
            ready.device,
            ready.device_name,
            ready.model_build_s + (ready.compile_time_s or 0.0),
        )

    def make_stages(self, prepared: PreparedModel) -> Stages:
        self.stages = stages_class(self.cfg)(
            self.cfg,
            self.layer,
            prepared.models,
            self.responses,
            release_slot=self.requests.release,
            decode=prepared.decode,
            should_stop=self.failure.should_stop,
            instance=self.instance.index,
            forward_threads=self.forward_threads,
        )
        signal.signal(process.PROGRESS_SIGNAL, self.log_progress)
        return self.stages

    def log_progress(self, signum: int, frame: FrameType | None) -> None:
        """PROGRESS_SIGNAL: what a hung run's log shows to tell which step stopped moving."""
        if self.stages is not None:
            log.error("progress of each step: %s; backend queues: %s", self.stages.progress, self.stages.queue_depths())

    def serve(self, stages: Stages) -> None:
        """Every request, with the design; the backend's CPU cores per second of it go into the report."""
        source = RequestSource(self.requests, self.failure, stages, batch_rule(self.cfg))
        design = self.design(stages, DesignSpec.of(self.cfg), self.failure)
        start_cpu_s, start_ns = time.process_time(), time.perf_counter_ns()
        with maybe_profile(self.cfg, self.layer, self.report, self.instance.index):
            design.serve(source)
        # CPU seconds of every backend thread per second of serving: threads that spin on events show here.
        self.report.backend_cpu_cores = (time.process_time() - start_cpu_s) / max(
            (time.perf_counter_ns() - start_ns) / 1e9, 1e-9
        )

    def settle_status(self) -> None:
        """The run's status in the report; a failure also goes to the frontend, as data."""
        failure = self.failure
        if failure.exception is not None:
            status = classify_failure(failure.exception)
            error = process.one_line(failure.exception)
            self.report.status, self.report.error, self.report.traceback = status, error, failure.traceback
            with contextlib.suppress(Exception):
                self.responses.send(BackendFailure(status, error, failure.traceback, self.instance.index))
        elif self.stop_event.is_set():
            self.report.status = "stopped"


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


def tear_down(
    layer: DeviceLayer | None, requests: RequestChannel, threads_left: list[str], sticky_fault: bool = False
) -> None:
    """The backend's cleanup, after its report is made and before it is sent. Each step is guarded and logged:
    after a sticky CUDA error (an illegal access, a device-side assert) every CUDA call raises that error again,
    and no cleanup step may keep the report from reaching the server (`sticky_fault`: the test-only
    --inject_fault sticky_cuda makes every step fail so)."""
    steps = (
        ("release the page-locked ring", lambda: release_ring(requests, layer, threads_left)),
        ("stop the compile workers", shutdown_compile_workers),
    )
    for name, step in steps:
        try:
            if sticky_fault:
                raise RuntimeError(STICKY_CUDA_ERROR)
            step()
        except Exception as exc:  # noqa: BLE001 - logged; the report still goes out
            log.error("teardown: could not %s: %s", name, process.one_line(exc))
