"""The frontend process: sends pre-generated requests, receives responses, records every request's life.

Threads: the sender (serverbench.load.sender: `--warmup_iters` warm-up requests one at a time, then the measured
requests in the shape of `--load`), the receiver (serverbench.load.receiver: matches responses to request ids, stamps
their arrival, builds records; serverbench.load.verify checks them under --verify), and the GPU, load and noise
samplers (measured phase only). This module wires them: between the warm-up and the measured phase it waits for
every backend instance and the server's start gate and starts the samplers; the process's main thread supervises
the others and ends the run as soon as the last response arrives.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Protocol

from serverbench.config.limits import POLL_S
from serverbench.config.options import BenchConfig
from serverbench.device.gpu_sampler import GpuSampler
from serverbench.launch import procutil
from serverbench.launch.instances import cpu_split, pin_to_cpus, usable_cpus
from serverbench.load.noise import NoiseMeter
from serverbench.load.receiver import Progress, Receiver
from serverbench.load.sender import Inputs, Requests, Sender
from serverbench.load.state import FrontendState, StopSignal
from serverbench.load.verify import Verifier
from serverbench.schema.messages import FrontendReport
from serverbench.schema.records import LoadSample
from serverbench.system import process
from serverbench.system.sampler import PeriodicSampler
from serverbench.transport.channels import Heartbeat, StartGate, StopRequested
from serverbench.transport.pool import make_request_pool, pool_spec
from serverbench.transport.responses import ResponseChannel

GATE_MARGIN_S = 10.0  # the server gives up on the other ranks after --dist_timeout_s; the frontend waits longer
JOIN_TIMEOUT_S = 5.0  # the sender and receiver see the end within a poll; a send stuck longer is left to the exit


class NetworkClientLike(Protocol):
    """What the frontend asks of our network client beyond the channels' calls (transport/network.py's
    NetworkClient; typed here so that this module never imports the door's packages)."""

    on_answer: Callable[[int], None] | None

    def close(self) -> None: ...


def progress_bar(total: int | None) -> Progress | None:
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
    """Samples requests in flight (sent, not yet answered) and the request queue's depth every period_s; shows a
    latency rise next to the backlog that caused it."""

    def __init__(self, state: FrontendState, requests: Requests, period_s: float) -> None:
        self.state = state
        self.requests = requests
        self.samples: list[LoadSample] = []
        self._periodic = PeriodicSampler("load-sampler", period_s, self._sample)

    def start(self) -> None:
        self._periodic.start()

    def _sample(self) -> None:
        self.samples.append(LoadSample(time.perf_counter_ns(), self.state.inflight(), self.requests.depth()))

    def stop(self) -> list[LoadSample]:
        self._periodic.stop()
        return list(self.samples)


class Frontend:
    """The frontend's threads, wired: a sender and a receiver sharing one FrontendState, the samplers of the
    measured phase, and the main thread's supervision."""

    def __init__(
        self,
        cfg: BenchConfig,
        requests: Requests,
        responses: ResponseChannel,
        stop_event: StopSignal,
        gate: StartGate,
    ) -> None:
        self.cfg = cfg
        self.requests = requests
        self.gate = gate
        self.state = FrontendState(stop_event, cfg.concurrency or 1)
        self.report = self.state.report
        self.noise = NoiseMeter()  # the machine's share in the measured phase
        self.verifier = Verifier(cfg.verify_tolerance) if cfg.verify else None
        self.receiver = Receiver(cfg, self.state, responses, self.verifier)
        self.load_sampler = LoadSampler(self.state, requests, cfg.load_poll_ms / 1000)
        self.gpu_sampler: GpuSampler | None = None
        self.progress: Progress | None = None  # a tqdm bar over the measured responses, on a terminal only

    # -------------------------------------------------------------------------------- between the phases

    def begin_measured(self) -> int | None:
        """On the sender's thread once the warm-up is answered: waits for every instance and the start gate,
        starts the samplers and the windows; the measured phase's start (perf_counter_ns), or None when the run
        is stopping instead."""
        cfg, state = self.cfg, self.state
        if not self._wait_for_instances() or not self._pass_gate():
            return None
        if cfg.inject_fault == "frontend":
            raise RuntimeError("injected fault in the frontend's sender")
        state.warmup_done.set()
        ready = self.report.backend_ready
        self.gpu_sampler = GpuSampler(ready.device_uuid if ready else None, cfg.gpu_poll_ms / 1000).start()
        self.load_sampler.start()
        self.noise.start([ready.pid for ready in self.report.instances_ready if ready.pid is not None])
        # This thread, the sender, after the threads it starts (they would inherit it): it wakes on the schedule.
        procutil.tighten_timer_slack()
        self.progress = progress_bar(None if cfg.stability_pct is not None else cfg.num_iters)
        # Several frontends (generators, ranks) start at the server's one instant: a late one's schedule still
        # counts from it, and its first requests are late, as an open loop's are when its sender falls behind.
        start_ns = self.gate.start_ns() or time.perf_counter_ns()
        time.sleep(max(0.0, (start_ns - time.perf_counter_ns()) / 1e9))
        self.receiver.begin_measured(start_ns, self.noise.window_noise, self.progress)
        return start_ns

    def _wait_for_instances(self) -> bool:
        """--instances: the measured phase starts once every instance has its model ready (built, run once, its
        ceiling timed); before that, fewer instances would serve the first measured requests. At once with one."""
        cfg, state = self.cfg, self.state
        if state.wait_for(state.all_instances_ready.wait, cfg.warmup_timeout_s):
            return True
        if not state.should_stop():
            state.fail(
                "timeout",
                f"{len(self.report.instances_ready)} of {cfg.instances} backend instances "
                f"were ready within {cfg.warmup_timeout_s:g} s of the warm-up",
            )
        return False

    def _pass_gate(self) -> bool:
        """Waits until the server starts the measured phase: at once in a plain run, once every rank has warmed
        up under torchrun, once every generator has with --generators. False when the run is stopping instead."""
        state = self.state
        self.gate.arrive(self.cfg.generator)  # --generators: each arrives as its own party
        if self.gate.wait_open(0):
            return True
        state.waiting_at_gate.set()
        # The other ranks may take --dist_timeout_s; the other generators warm up as this one did.
        others_s = self.cfg.dist_timeout_s if self.cfg.rank is not None else self.cfg.warmup_timeout_s
        timeout_s = others_s + GATE_MARGIN_S
        opened = state.wait_for(self.gate.wait_open, timeout_s)
        state.waiting_at_gate.clear()
        if not opened and not state.should_stop():
            state.fail("timeout", f"the server did not start the measured phase within {timeout_s:g} s of the warm-up")
        return opened

    def answered(self, request_id: int) -> None:
        """Over the network, on the client's loop as an answer is read: LoadGen's sample completes there (the
        receiver's own call later is then a no-op)."""
        loadgen = self.state.loadgen
        if loadgen is not None:
            loadgen.complete(request_id)

    # -------------------------------------------------------------------------------- the run

    def run(self, pool: Sequence[Inputs], heartbeat: Heartbeat) -> FrontendReport:
        state = self.state
        sender = Sender(self.cfg, state, self.requests, pool, self.begin_measured)
        threads = [
            threading.Thread(target=state.guard, args=(sender.run,), name="sender"),
            threading.Thread(target=state.guard, args=(self.receiver.run,), name="receiver"),
        ]
        for thread in threads:
            thread.start()
        while not state.finished.wait(POLL_S):
            heartbeat.beat()  # the server's sign that this process still runs (a frozen one cannot time out)
            if state.stop_event.is_set() or process.parent_gone():
                state.fail("stopped", "stopped by the server")
        self.report.noise = self.noise.stop()  # the phase ends here, before the joins and the samplers' stops
        for thread in threads:
            thread.join(timeout=JOIN_TIMEOUT_S)
        self._collect()
        if self.report.status == "ok":
            self._send_end_markers()
        if self.verifier is not None:
            self.verifier.judge(self.report)
        return self.report

    def _collect(self) -> None:
        """The samplers' and the windows' figures into the report, once the phase has ended."""
        report = self.report
        if self.gpu_sampler is not None:
            report.gpu_samples = self.gpu_sampler.stop()
            report.gpu_util_note = self.gpu_sampler.util_note
        report.load_samples = self.load_sampler.stop()
        report.windows, report.stable = self.receiver.window_verdict()
        if self.progress is not None:
            self.progress.close()

    def _send_end_markers(self) -> None:
        """Everything is answered: tell the backend to finish, one end marker for each instance."""
        try:
            for _ in range(self.cfg.instances):
                self.requests.send_end(lambda: self.state.stop_event.is_set())
        except StopRequested:
            pass


def frontend_main(
    cfg: BenchConfig,
    requests: Requests | None,
    responses: ResponseChannel,
    report_conn,
    stop_event: StopSignal,
    gate: StartGate,
    heartbeat: Heartbeat,
    connect: Callable[[], NetworkClientLike] | None = None,
) -> None:
    """Entry point of the frontend process over shm or queues, and the frontend's run and report for
    network_frontend.py, whose `connect` opens our network client (then both channels, told of each answer, and closed
    at the end; `responses` is then the control channel the client reads the backend's other messages from)."""
    # No beat before the run's loop: until its first, the silence allowed is --warmup_timeout_s, which covers the
    # request pool's making (seconds for large images), not --timeout_s
    process.setup_child("frontend" if cfg.generators == 1 else f"frontend{cfg.generator}", cfg.verbose)
    responses.keep_reading_end()
    if cfg.cpu_split and not cfg.is_cuda:
        pin_to_cpus(cpu_split(usable_cpus())[0])  # a core of its own, away from the model's (--cpu_split)
    client = None
    try:
        if connect is not None:  # --transport http|grpc, --target: our requests go out over the network
            requests = responses = client = connect()
        # The pool's spec and its wire layout, decided once; made as the channel sends it before any clock starts.
        pool = requests.carried(make_request_pool(pool_spec(cfg)))
        frontend = Frontend(cfg, requests, responses, stop_event, gate)
        if client is not None:
            client.on_answer = frontend.answered
        if cfg.target is not None:
            frontend.state.all_instances_ready.set()  # no backend of ours to wait for: the server is someone else's
        report = frontend.run(pool, heartbeat)
    except BaseException as exc:  # noqa: BLE001 - reported as data
        report = FrontendReport(status="error", error=process.one_line(exc), traceback=traceback.format_exc())
    if client is not None:
        client.close()
    procutil.finish_child(report_conn, report, [requests] if requests is not None else [])
