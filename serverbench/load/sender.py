"""The load generator: the frontend's sender thread. It sends `--warmup_iters` warm-up requests one at a time, then
the measured requests in the shape of `--load`:

- burst: every request as fast as the transport takes it;
- closed: `--concurrency` places, each request waiting for a response to free one;
- poisson: on an open-loop schedule drawn from the seed (serverbench.load.schedules), its latency counting from
  the scheduled time so that a late sender cannot hide a backlog (coordinated omission);
- loadgen: MLPerf LoadGen decides what is sent and when (serverbench.load.loadgen);
- trace: the arrival times of a file, as the Poisson schedule's are sent.

Each load's kind (serverbench/config/loads.py) says how it paces its requests; this thread paces them so.

Every request is written into the transport afresh, from the pre-generated pool. What happens between the
warm-up and the measured phase (the gate, the samplers) is the frontend's, called back on this thread."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from serverbench.config.generators import first_request_id
from serverbench.config.load_kind import Pacing
from serverbench.config.loads import load_kind
from serverbench.config.options import BenchConfig
from serverbench.load.loadgen import LoadGenDriver, pending_log_dir
from serverbench.load.state import FrontendState, SendTimes
from serverbench.transport.channels import RequestSender
from serverbench.transport.pool import Inputs

FINAL_SLEEP_S = 0.001  # the last stretch before a scheduled send is a plain sleep (see Sender._sleep_until)

Requests = RequestSender  # the ring, the queue or the door's client: one interface


@dataclass(frozen=True)
class Turn:
    """When the load lets a measured request go."""

    intended_ns: int | None = None  # its slot in the schedule, where its latency counts from (None: the send)
    due_ns: int | None = None  # when the load wanted it sent (None: at once, a burst)


class Sender:
    """Sends the run's requests from the pool. `begin_measured()` runs on this thread between the warm-up and the
    measured phase and returns the phase's start (perf_counter_ns), or None when the run is stopping instead."""

    def __init__(
        self,
        cfg: BenchConfig,
        state: FrontendState,
        requests: Requests,
        pool: Sequence[Inputs],
        begin_measured: Callable[[], int | None],
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.requests = requests
        self.pool = pool
        self.begin_measured = begin_measured
        self.first_id = first_request_id(cfg)  # --generators: this generator's block of ids
        self.kind = load_kind(cfg.load)

    def run(self) -> None:
        cfg, state = self.cfg, self.state
        # One at a time; the first includes model build and compile.
        for request_id in range(self.first_id, self.first_id + cfg.warmup_iters):
            self.send(request_id, self.pool[request_id % len(self.pool)])
            if not state.wait_for(lambda t: state.warmup_answered.acquire(timeout=t), cfg.warmup_timeout_s):
                return
        start_ns = self.begin_measured()
        if start_ns is None:
            return
        if self.kind.pacing is Pacing.DRIVER:
            self._run_loadgen()
        elif not self._run_schedule(start_ns):
            return  # the run stopped while a request waited for its turn
        state.sending_finished()

    def send(self, request_id: int, inputs: Inputs, intended_ns: int | None = None, due_ns: int | None = None) -> None:
        """Sends one request. Its latency counts from `intended_ns` when the schedule gave one (a late sender
        must not hide a backlog: coordinated omission), else from the moment sending began."""
        state = self.state
        start_ns = time.perf_counter_ns()
        times = SendTimes(start_ns if intended_ns is None else intended_ns, start_ns, due_ns=due_ns)
        with state.lock:
            state.sends[request_id] = times
        self.requests.send(request_id, inputs, times.sent_ns, state.should_stop)
        done = SendTimes(times.sent_ns, start_ns, time.perf_counter_ns(), due_ns)
        with state.lock:
            state.sends[request_id] = done

    # -------------------------------------------------------------------------------- burst, closed, Poisson

    def _run_schedule(self, start_ns: int) -> bool:
        """The measured requests of a burst, a closed loop or a Poisson schedule; False when the run stopped while
        one waited for its turn."""
        cfg, state = self.cfg, self.state
        schedule = self._schedule()
        sent = 0
        while self._keep_sending(sent, start_ns):
            request_id = self.first_id + cfg.warmup_iters + sent
            turn = self._await_turn(schedule, start_ns)
            if turn is None:
                return False
            if state.stop_sending.is_set():  # the windows decided while this request waited for its turn
                break
            with state.lock:
                state.sends_begun += 1
            self.send(request_id, self.pool[request_id % len(self.pool)], turn.intended_ns, turn.due_ns)
            sent += 1
            with state.lock:
                state.report.requests_sent = sent
        return True

    def _schedule(self) -> Iterator[float] | None:
        """An open loop's intended send times (seconds after the phase starts); None for the other loads."""
        return self.kind.offsets_s(self.cfg) if self.kind.pacing is Pacing.SCHEDULE else None

    def _await_turn(self, schedule: Iterator[float] | None, start_ns: int) -> Turn | None:
        """Waits until the load lets the next request go: a free place (closed), its scheduled time (Poisson), or
        at once (burst). None when the run stopped meanwhile."""
        state = self.state
        if self.kind.pacing is Pacing.PLACES:
            if not state.wait_for(lambda t: state.places.acquire(timeout=t), self.cfg.timeout_s):
                return None
            # Its place was freed by a response (the first `concurrency` are due when the phase starts).
            return Turn(due_ns=state.freed_ns.popleft() if state.freed_ns else start_ns)
        if schedule is not None:
            intended_ns = start_ns + round(next(schedule) * 1e9)
            return Turn(intended_ns, intended_ns) if self._sleep_until(intended_ns) else None
        return Turn()

    def _sleep_until(self, target_ns: int) -> bool:
        """Sleeps until the absolute target time: on the stop event while more than FINAL_SLEEP_S is left (the
        windows' verdict or a failure wakes it early), then a plain sleep for the rest, which (with the sender's
        timer slack tightened) wakes within microseconds of the target where the event's timed wait wakes tens
        later. False when the run finished meanwhile."""
        delay_s = (target_ns - time.perf_counter_ns()) / 1e9
        if delay_s > FINAL_SLEEP_S and self.state.stop_sending.wait(delay_s - FINAL_SLEEP_S):
            return not self.state.finished.is_set()  # woken early: the windows' verdict (the caller sees it) or the end
        time.sleep(max(0.0, (target_ns - time.perf_counter_ns()) / 1e9))
        return True

    def _keep_sending(self, sent: int, start_ns: int) -> bool:
        """With stability windows, until they say stop; else --num_iters requests and --duration_s seconds."""
        if self.state.should_stop():
            return False
        if self.cfg.stability_pct is not None:
            return not self.state.stop_sending.is_set()
        return sent < self.cfg.num_iters or (time.perf_counter_ns() - start_ns) / 1e9 < self.cfg.duration_s

    # -------------------------------------------------------------------------------- LoadGen

    def _run_loadgen(self) -> None:
        """The measured phase as a LoadGen test: each sample it issues goes as a request with the next id."""
        state = self.state
        driver = LoadGenDriver(
            self.cfg,
            self.pool,
            self._send_issued,
            self.cfg.warmup_iters,
            state.should_stop,
            pending_log_dir(self.cfg.results_dir, os.getpid()),
        )
        state.loadgen = driver
        # The same object run() fills in: a report sent before LoadGen's test ended (a failed run) still says how.
        state.report.loadgen = driver.result
        driver.run()

    def _send_issued(self, request_id: int, inputs: Inputs, issued_ns: int) -> None:
        """A LoadGen sample as a measured request; its latency counts from when LoadGen issued it."""
        state = self.state
        with state.lock:
            state.sends_begun += 1
        self.send(request_id, inputs, issued_ns, issued_ns)
        with state.lock:
            state.report.requests_sent += 1
