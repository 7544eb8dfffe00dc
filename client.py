"""The frontend process: sends pre-generated requests, receives responses, records every request's life.

Threads: a sender (`--warmup_iters` warm-up requests one at a time, then the measured requests in the shape of
`--load`: burst, closed loop or a Poisson schedule), a receiver (matches responses to request ids, stamps their
arrival, builds records), and the GPU and load samplers (measured phase only). The process's main thread
supervises them and ends the run as soon as the last response arrives.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from serverbench.config.options import BenchConfig
from serverbench.device.gpu_sampler import GpuSampler
from serverbench.launch import procutil
from serverbench.launch.instances import cpu_split, pin_to_cpus, usable_cpus
from serverbench.load.loadgen import LoadGenDriver, pending_log_dir
from serverbench.load.noise import NoiseMeter
from serverbench.load.schedules import arrival_offsets_s
from serverbench.load.windows import WindowRule, WindowTracker
from serverbench.schema.messages import BackendFailure, BackendReady, FrontendReport, Response
from serverbench.schema.records import LoadSample, RequestRecord
from serverbench.system import process
from serverbench.transport.channels import (
    POLL_S,
    Heartbeat,
    RequestChannel,
    ResponseChannel,
    StartGate,
    StopRequested,
)
from serverbench.transport.pool import make_request_pool

log = logging.getLogger("frontend")

FINAL_SLEEP_S = 0.001  # the last stretch before a scheduled send is a plain sleep (see Frontend._sleep_until)
GATE_MARGIN_S = 10.0  # the server gives up on the other ranks after --dist_timeout_s; the frontend waits longer


@dataclass(frozen=True)
class SendTimes:
    sent_ns: int  # latency origin: the intended time under a schedule, else when sending began
    start_ns: int  # when sending began
    done_ns: int | None = None  # when the transport had taken it
    due_ns: int | None = None  # when the load wanted it sent (schedule slot, or the response that freed its place)


def progress_bar(total: int | None):
    """A progress bar over the measured requests (a count without a total under stability windows) when stderr is
    a terminal; None in logs and pipes."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # optional: the GPU machines may not have it
        return None
    return tqdm(total=total, unit="req", desc="requests", leave=False, file=sys.stderr)


class LoadSampler:
    """Samples requests in flight (sent, not yet answered) and the request queue's depth every period_s, in a
    thread that waits on its stop event; shows a latency rise next to the backlog that caused it."""

    def __init__(self, frontend: Frontend, period_s: float) -> None:
        self.frontend = frontend
        self.period_s = period_s
        self.samples: list[LoadSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        frontend = self.frontend
        while True:
            with frontend._lock:
                inflight = frontend.sends_begun - frontend.measured_received
            self.samples.append(LoadSample(time.perf_counter_ns(), inflight, frontend.requests.depth()))
            frontend.noise.sample()
            if self._stop.wait(self.period_s):
                return

    def stop(self) -> list[LoadSample]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        return list(self.samples)


def leaf_errors(got: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...], tolerance: float) -> tuple[float, bool]:
    """--verify of one response: the largest absolute difference over every output leaf from the serial answer,
    and whether any leaf is wrong. Float leaves within `tolerance`; integer and bool leaves (indices, masks) exact;
    a leaf of another shape, a missing leaf or NaN is wrong."""
    if len(got) != len(expected):
        return float("inf"), True
    largest = 0.0
    wrong = False
    for leaf, answer in zip(got, expected):
        if leaf.shape != answer.shape:
            return float("inf"), True
        error = float(np.max(np.abs(leaf.astype(np.float64) - answer), initial=0.0))
        allowed = tolerance if np.issubdtype(answer.dtype, np.floating) else 0.0
        wrong = wrong or not error <= allowed  # NaN counts as wrong
        largest = error if not error <= largest else largest
    return largest, wrong


class Frontend:
    def __init__(
        self, cfg: BenchConfig, requests: RequestChannel, responses: ResponseChannel, stop_event, gate: StartGate
    ) -> None:
        self.cfg = cfg
        self.gate = gate
        self.waiting_at_gate = threading.Event()  # no response is due meanwhile: the no-progress clock pauses
        self.requests = requests
        self.responses = responses
        self.stop_event = stop_event
        self.report = FrontendReport()
        self._lock = threading.Lock()  # guards `sends` and the counters written by several threads
        self.sends: dict[int, SendTimes] = {}
        self.warmup_answered = threading.Semaphore(0)
        self.slots = threading.Semaphore(cfg.concurrency or 1)  # closed loop: free places for requests
        self.freed_ns: collections.deque[int] = collections.deque()  # closed loop: when each place was freed
        self.noise = NoiseMeter()  # the machine's share in the measured phase
        self.sending_done = False
        self.measured_received = 0
        self.sends_begun = 0  # measured requests whose send began: in flight from then on, as their records say
        self.load_sampler = LoadSampler(self, cfg.load_poll_ms / 1000)
        self.received_ids: set[int] = set()
        self.warmup_done = threading.Event()
        self.all_instances_ready = threading.Event()  # every backend instance sent BackendReady (--instances)
        self.finished = threading.Event()  # set once: all responses in, or a failure
        self.sampler: GpuSampler | None = None
        self.progress = None  # a tqdm bar over the measured responses, on a terminal only
        self.windows: WindowTracker | None = None  # --stability_pct: made when the measured phase begins
        self.stop_sending = threading.Event()  # the windows are stable, or there are --max_windows of them
        self.loadgen: LoadGenDriver | None = None  # --load loadgen: completes LoadGen's samples as they arrive

    # -------------------------------------------------------------------------------- failure and stop

    def fail(self, status: str, error: str, tb: str = "") -> None:
        with self._lock:
            if self.report.status == "ok":
                self.report.status, self.report.error, self.report.traceback = status, error, tb
        self.finished.set()
        self.stop_sending.set()  # a sender asleep until its next scheduled request wakes now

    def should_stop(self) -> bool:
        return self.finished.is_set() or self.stop_event.is_set() or process.parent_gone()

    def _guard(self, loop) -> None:
        try:
            loop()
        except StopRequested:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the report
            import traceback

            self.fail("error", process.one_line(exc), traceback.format_exc())

    # -------------------------------------------------------------------------------- sender

    def _send(
        self,
        request_id: int,
        inputs: tuple[torch.Tensor, ...],
        intended_ns: int | None = None,
        due_ns: int | None = None,
    ) -> None:
        """Sends one request. Its latency counts from `intended_ns` when the schedule gave one (a late sender
        must not hide a backlog: coordinated omission), else from the moment sending began."""
        start_ns = time.perf_counter_ns()
        times = SendTimes(start_ns if intended_ns is None else intended_ns, start_ns, due_ns=due_ns)
        with self._lock:
            self.sends[request_id] = times
        self.requests.send(request_id, inputs, times.sent_ns, self.should_stop)
        done = SendTimes(times.sent_ns, start_ns, time.perf_counter_ns(), due_ns)
        with self._lock:
            self.sends[request_id] = done

    def _wait(self, attempt: Callable[[float], bool], timeout_s: float) -> bool:
        """Calls a blocking `attempt(timeout)` (a semaphore's acquire, an event's wait) until it succeeds;
        False once the run is stopping or timeout_s has passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if attempt(POLL_S):
                return True
            if self.should_stop() or time.monotonic() > deadline:
                return False

    def sender(self, pool: list[tuple[torch.Tensor, ...]]) -> None:
        cfg = self.cfg
        for request_id in range(cfg.warmup_iters):  # one at a time; the first includes model build and compile
            self._send(request_id, pool[request_id % len(pool)])
            if not self._wait(lambda t: self.warmup_answered.acquire(timeout=t), cfg.warmup_timeout_s):
                return
        if not self._wait_for_instances() or not self._pass_gate():
            return
        if cfg.inject_fault == "frontend":
            raise RuntimeError("injected fault in the frontend's sender")
        self.warmup_done.set()
        ready = self.report.backend_ready
        self.sampler = GpuSampler(ready.device_uuid if ready else None, cfg.gpu_poll_ms / 1000).start()
        self.load_sampler.start()
        self.noise.start([ready.pid for ready in self.report.instances_ready if ready.pid is not None])
        # This thread, the sender, after the threads it starts (they would inherit it): it wakes on the schedule.
        procutil.tighten_timer_slack()
        windowed = cfg.stability_pct is not None
        self.progress = progress_bar(None if windowed else cfg.num_iters)
        start_ns = time.perf_counter_ns()
        if windowed:
            with self._lock:
                self.windows = WindowTracker(
                    WindowRule(cfg.stability_pct, cfg.window_s, cfg.window_requests, cfg.max_windows),
                    start_ns,
                    noise_of=self.noise.window_noise,
                )
        if cfg.load == "loadgen":  # LoadGen decides what is sent and when (serverbench.load.loadgen)
            self._run_loadgen(pool)
            return
        schedule = None
        if cfg.load == "poisson":  # as many requests as the count or the duration needs, whichever is more
            expected = 0 if windowed else max(cfg.num_iters, math.ceil(cfg.duration_s * cfg.rate_rps))
            schedule = arrival_offsets_s(cfg.rate_rps, cfg.burstiness, cfg.seed, count=expected)
        sent = 0
        while self._keep_sending(sent, start_ns):
            request_id = cfg.warmup_iters + sent
            intended_ns = due_ns = None
            if cfg.load == "closed":
                if not self._wait(lambda t: self.slots.acquire(timeout=t), cfg.timeout_s):
                    return
                # Its place was freed by a response (the first `concurrency` are due when the phase starts).
                due_ns = self.freed_ns.popleft() if self.freed_ns else start_ns
            if schedule is not None:
                intended_ns = due_ns = start_ns + round(next(schedule) * 1e9)
                if not self._sleep_until(intended_ns):
                    return
            if self.stop_sending.is_set():  # the windows decided while this request waited for its turn
                break
            with self._lock:
                self.sends_begun += 1
            self._send(request_id, pool[request_id % len(pool)], intended_ns, due_ns)
            sent += 1
            with self._lock:
                self.report.requests_sent = sent
        with self._lock:
            self.sending_done = True
        self._finish_if_complete()

    def _run_loadgen(self, pool: list) -> None:
        """The measured phase as a LoadGen test: each sample it issues goes as a request with the next id."""
        self.loadgen = LoadGenDriver(
            self.cfg,
            pool,
            self._send_issued,
            self.cfg.warmup_iters,
            self.should_stop,
            pending_log_dir(self.cfg.results_dir, os.getpid()),
        )
        # The same object run() fills in: a report sent before LoadGen's test ended (a failed run) still says how.
        self.report.loadgen = self.loadgen.result
        self.loadgen.run()
        with self._lock:
            self.sending_done = True
        self._finish_if_complete()

    def _send_issued(self, request_id: int, inputs: tuple[torch.Tensor, ...], issued_ns: int) -> None:
        """A LoadGen sample as a measured request; its latency counts from when LoadGen issued it."""
        with self._lock:
            self.sends_begun += 1
        self._send(request_id, inputs, issued_ns, issued_ns)
        with self._lock:
            self.report.requests_sent += 1

    def _sleep_until(self, target_ns: int) -> bool:
        """Sleeps until the absolute target time: on the stop event while more than FINAL_SLEEP_S is left (the
        windows' verdict or a failure wakes it early), then a plain sleep for the rest, which (with the sender's
        timer slack tightened) wakes within microseconds of the target where the event's timed wait wakes tens
        later. False when the run finished meanwhile."""
        delay_s = (target_ns - time.perf_counter_ns()) / 1e9
        if delay_s > FINAL_SLEEP_S and self.stop_sending.wait(delay_s - FINAL_SLEEP_S):
            return not self.finished.is_set()  # woken early: the windows' verdict (the caller sees it) or the end
        time.sleep(max(0.0, (target_ns - time.perf_counter_ns()) / 1e9))
        return True

    def _keep_sending(self, sent: int, start_ns: int) -> bool:
        """With stability windows, until they say stop; else --num_iters requests and --duration_s seconds."""
        if self.should_stop():
            return False
        if self.cfg.stability_pct is not None:
            return not self.stop_sending.is_set()
        return sent < self.cfg.num_iters or (time.perf_counter_ns() - start_ns) / 1e9 < self.cfg.duration_s

    def _wait_for_instances(self) -> bool:
        """--instances: the measured phase starts once every instance has its model ready (built, run once, its
        ceiling timed); before that, fewer instances would serve the first measured requests. At once with one."""
        if self._wait(self.all_instances_ready.wait, self.cfg.warmup_timeout_s):
            return True
        if not self.should_stop():
            self.fail(
                "timeout",
                f"{len(self.report.instances_ready)} of {self.cfg.instances} backend instances "
                f"were ready within {self.cfg.warmup_timeout_s:g} s of the warm-up",
            )
        return False

    def _pass_gate(self) -> bool:
        """Waits until the server starts the measured phase: at once in a plain run, once every rank has warmed
        up under torchrun. False when the run is stopping instead."""
        self.gate.arrive()
        if self.gate.wait_open(0):
            return True
        self.waiting_at_gate.set()
        timeout_s = self.cfg.dist_timeout_s + GATE_MARGIN_S
        opened = self._wait(self.gate.wait_open, timeout_s)
        self.waiting_at_gate.clear()
        if not opened and not self.should_stop():
            self.fail("timeout", f"the server did not start the measured phase within {timeout_s:g} s of the warm-up")
        return opened

    def _finish_if_complete(self) -> None:
        with self._lock:
            complete = self.sending_done and self.measured_received >= self.report.requests_sent
        if complete:
            self.finished.set()  # the last response: no idle tail

    # -------------------------------------------------------------------------------- receiver

    def receiver(self) -> None:
        last_progress = time.monotonic()
        while not self.should_stop():
            try:
                message = self.responses.receive(POLL_S)
            except queue.Empty:
                if self.waiting_at_gate.is_set():
                    last_progress = time.monotonic()
                    continue
                budget_s = self.cfg.timeout_s if self.warmup_done.is_set() else self.cfg.warmup_timeout_s
                if time.monotonic() - last_progress > budget_s:
                    phase = "a response" if self.warmup_done.is_set() else "the warm-up response"
                    self.fail("timeout", f"no progress: waited {budget_s:g} s for {phase}")
                continue
            received_ns = time.perf_counter_ns()
            last_progress = time.monotonic()
            if isinstance(message, Response):
                self._on_response(message, received_ns)
            elif isinstance(message, BackendReady):
                self._on_ready(message)
            elif isinstance(message, BackendFailure):
                who = "backend" if self.cfg.instances == 1 else f"backend instance {message.instance}"
                self.fail(message.status, f"{who}: {message.error}", message.traceback)

    def _on_ready(self, ready: BackendReady) -> None:
        if self.report.backend_ready is None:  # the instances build the same model from one seed: any answers do
            self.report.backend_ready = ready
        self.report.instances_ready.append(replace(ready, reference_outputs=None))
        if len(self.report.instances_ready) >= self.cfg.instances:
            self.all_instances_ready.set()

    def _on_response(self, response: Response, received_ns: int) -> None:
        if self.loadgen is not None:  # first: LoadGen stamps its own clock now, as received_ns was
            self.loadgen.complete(response.request_id)
        with self._lock:
            sent = self.sends.get(response.request_id)
        # Every leaf was split along its first dimension alike (the backend checked them at the probe): the first.
        if sent is None or response.outputs[0].shape[:1] != (self.cfg.batch_size,):
            self.report.responses_unexpected += 1
            return
        if response.request_id in self.received_ids:
            self.report.responses_duplicated += 1
            return
        self.received_ids.add(response.request_id)
        if self.report.response_bytes is None:
            self.report.response_bytes = sum(leaf.nbytes for leaf in response.outputs)
        warmup = response.request_id < self.cfg.warmup_iters
        if self.cfg.verify:
            self._verify(response)
        self.report.records.append(
            RequestRecord(
                **response.timings.__dict__,
                request_id=response.request_id,
                warmup=warmup,
                batch_size=self.cfg.batch_size,
                sent_ns=sent.sent_ns,
                received_ns=received_ns,
                send_done_ns=sent.done_ns,
                send_start_ns=sent.start_ns,
                due_ns=sent.due_ns,
            )
        )
        if warmup:
            if response.request_id == 0:
                log.info(
                    "warm-up response after %.2f s; %d more warm-up request(s), then the measured phase",
                    (received_ns - sent.sent_ns) / 1e9,
                    self.cfg.warmup_iters - 1,
                )
            self.warmup_answered.release()
            return
        with self._lock:
            self.measured_received += 1
            windows = self.windows
        if windows is not None:
            self._add_to_window(windows, received_ns, (received_ns - sent.sent_ns) / 1e9)
        if self.cfg.load == "closed":
            self.freed_ns.append(received_ns)  # before the release: the sender that takes the place reads it
        self.slots.release()
        if self.progress is not None:
            self.progress.update(1)
        self._finish_if_complete()

    def _add_to_window(self, windows: WindowTracker, received_ns: int, latency_s: float) -> None:
        window = windows.add(received_ns, latency_s, self.cfg.batch_size)
        if window is None:
            return
        log.info(
            "window %d: %.1f samples/s, p99 %.1f ms, %d requests in %.2f s%s",
            len(windows.windows),
            window.throughput,
            window.p99_latency_s * 1e3,
            window.requests,
            (window.end_ns - window.start_ns) / 1e9,
            f"; noisy, not counted: {window.noise}" if window.noise else "",
        )
        if windows.stop is not None:
            log.info(
                "measured phase ends: %s",
                "the last windows agree"
                if windows.stable
                else f"not stable after {len(windows.windows)} windows (--max_windows)",
            )
            self.stop_sending.set()

    def _verify(self, response: Response) -> None:
        ready = self.report.backend_ready
        if ready is None or ready.reference_outputs is None:
            raise RuntimeError("--verify: the backend sent no reference answers")
        expected = ready.reference_outputs[response.request_id % len(ready.reference_outputs)]
        error, wrong = leaf_errors(response.outputs, expected, self.cfg.verify_tolerance)
        if wrong:
            self.report.wrong_outputs += 1
        if self.report.max_abs_error is None or not error <= self.report.max_abs_error:
            self.report.max_abs_error = error

    # -------------------------------------------------------------------------------- the run

    def run(self, pool: list[tuple[torch.Tensor, ...]], heartbeat: Heartbeat) -> FrontendReport:
        threads = [
            threading.Thread(target=self._guard, args=(lambda: self.sender(pool),), name="sender"),
            threading.Thread(target=self._guard, args=(self.receiver,), name="receiver"),
        ]
        for thread in threads:
            thread.start()
        while not self.finished.wait(POLL_S):
            heartbeat.beat()  # the server's sign that this process still runs (a frozen one cannot time out)
            if self.stop_event.is_set() or process.parent_gone():
                self.fail("stopped", "stopped by the server")
        self.report.noise = self.noise.stop()  # the phase ends here, before the joins and the samplers' stops
        for thread in threads:
            thread.join(timeout=5.0)
        if self.sampler is not None:
            self.report.gpu_samples = self.sampler.stop()
            self.report.gpu_util_note = self.sampler.util_note
        self.report.load_samples = self.load_sampler.stop()
        if self.windows is not None:
            # No verdict (the run failed or was stopped first): neither stable nor unstable.
            self.report.windows = list(self.windows.windows)
            self.report.stable = self.windows.stable if self.windows.stop is not None else None
        if self.progress is not None:
            self.progress.close()
        if self.report.status == "ok":
            # Everything is answered: tell the backend to finish, one end marker for each instance.
            try:
                for _ in range(self.cfg.instances):
                    self.requests.send_end(lambda: self.stop_event.is_set())
            except StopRequested:
                pass
        if self.report.wrong_outputs and self.report.status == "ok":
            self.report.status = "wrong_output"
            self.report.error = (
                f"{self.report.wrong_outputs} response(s) differ from the serial reference "
                f"(max abs error {self.report.max_abs_error:.3g}, tolerance "
                f"{self.cfg.verify_tolerance:g})"
            )
        return self.report


def frontend_main(
    cfg: BenchConfig,
    requests: RequestChannel,
    responses: ResponseChannel,
    report_conn,
    stop_event,
    gate: StartGate,
    heartbeat: Heartbeat,
) -> None:
    """Entry point of the frontend process."""
    process.setup_child("frontend", cfg.verbose)
    heartbeat.beat()
    responses.keep_reading_end()
    # The frontend stands in for clients on other machines: it only writes requests (memcpy) and reads
    # responses, so one intra-op thread; more would only compete with the backend for the same cores.
    torch.set_num_threads(1)
    if cfg.cpu_split and not cfg.is_cuda:
        pin_to_cpus(cpu_split(usable_cpus())[0])  # a core of its own, away from the model's (--cpu_split)
    try:
        pool = make_request_pool(cfg)
        report = Frontend(cfg, requests, responses, stop_event, gate).run(pool, heartbeat)
    except BaseException as exc:  # noqa: BLE001 - reported as data
        import traceback

        report = FrontendReport(status="error", error=process.one_line(exc), traceback=traceback.format_exc())
    procutil.finish_child(report_conn, report, [requests])
