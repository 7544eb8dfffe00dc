"""The frontend's receiver thread: takes every message off the response channel, stamps each response's arrival,
matches it to its request and builds one RequestRecord per request; counts the duplicated and unexpected ones,
lets the next warm-up request or closed-loop request go, feeds the stability windows, and fails the run when the
backend fails, a response is of the wrong shape, or nothing arrives within the timeout."""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from serverbench.config.generators import first_request_id
from serverbench.config.limits import POLL_S
from serverbench.config.load_kind import Pacing
from serverbench.config.loads import load_kind
from serverbench.config.options import BenchConfig
from serverbench.load.state import FrontendState, SendTimes
from serverbench.load.verify import Verifier
from serverbench.load.windows import WindowRule, WindowTracker
from serverbench.schema.messages import BackendFailure, BackendReady, Response
from serverbench.schema.records import RequestRecord, Window
from serverbench.transport.responses import ResponseChannel

log = logging.getLogger("frontend")


class Progress(Protocol):
    """A progress bar over the measured responses (tqdm's): the receiver counts, the frontend closes it."""

    def update(self, n: int) -> object: ...

    def close(self) -> None: ...


class Receiver:
    def __init__(
        self, cfg: BenchConfig, state: FrontendState, responses: ResponseChannel, verifier: Verifier | None
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.responses = responses
        self.verifier = verifier
        self.received_ids: set[int] = set()
        self.rows = (cfg.batch_size,)  # a response leaf's first dimension
        self.first_id = first_request_id(cfg)  # --generators: this generator's block of ids; its warm-up first
        self.windows: WindowTracker | None = None  # --stability_pct: made when the measured phase begins
        self.progress: Progress | None = None

    @functools.cached_property
    def closed_loop(self) -> bool:
        """A response frees a place in a closed loop: the sender that takes it reads when."""
        return load_kind(self.cfg.load).pacing is Pacing.PLACES

    def begin_measured(self, start_ns: int, window_noise: Callable[[float], str], progress: Progress | None) -> None:
        """The measured phase began sending at start_ns: its windows (--stability_pct) count from there, each
        asking `window_noise(p99_latency_s)` whether the machine made it; `progress` counts its responses."""
        cfg = self.cfg
        with self.state.lock:  # the sender's thread calls this, the receiver's reads them
            self.progress = progress
            if cfg.stability_pct is not None:
                rule = WindowRule(cfg.stability_pct, cfg.window_s, cfg.window_requests, cfg.max_windows)
                self.windows = WindowTracker(rule, start_ns, noise_of=window_noise)

    def window_verdict(self) -> tuple[list[Window], bool | None]:
        """The windows so far and whether the last ones agreed; None without a verdict (no windows asked, or the
        run failed or was stopped first): neither stable nor unstable."""
        if self.windows is None:
            return [], None
        return list(self.windows.windows), self.windows.stable if self.windows.stop is not None else None

    def run(self) -> None:
        state, cfg = self.state, self.cfg
        last_progress = time.monotonic()
        while not state.should_stop():
            try:
                message = self.responses.receive(POLL_S)
            except queue.Empty:
                # Nothing is asked of the backend at the start gate, nor in an open loop's gap with every request
                # answered: waiting then is no hang, however long the gap.
                if state.waiting_at_gate.is_set() or (state.warmup_done.is_set() and state.inflight() == 0):
                    last_progress = time.monotonic()
                    continue
                budget_s = cfg.timeout_s if state.warmup_done.is_set() else cfg.warmup_timeout_s
                if time.monotonic() - last_progress > budget_s:
                    phase = "a response" if state.warmup_done.is_set() else "the warm-up response"
                    state.fail("timeout", f"no progress: waited {budget_s:g} s for {phase}")
                continue
            received_ns = time.perf_counter_ns()
            last_progress = time.monotonic()
            if isinstance(message, Response):
                self._on_response(message, message.received_ns or received_ns)
            elif isinstance(message, BackendReady):
                self._on_ready(message)
            elif isinstance(message, BackendFailure):
                who = "backend" if cfg.instances == 1 else f"backend instance {message.instance}"
                state.fail(message.status, f"{who}: {message.error}", message.traceback)

    def _on_ready(self, ready: BackendReady) -> None:
        report = self.state.report
        if report.backend_ready is None:  # the instances build the same model from one seed: any answers do
            report.backend_ready = ready
        report.instances_ready.append(replace(ready, reference_outputs=None))
        if len(report.instances_ready) >= self.cfg.instances:
            self.state.all_instances_ready.set()

    def _on_response(self, response: Response, received_ns: int) -> None:
        state, report = self.state, self.state.report
        if state.loadgen is not None:  # first: LoadGen stamps its own clock now, as received_ns was
            state.loadgen.complete(response.request_id)
        sent = self._accept(response)
        if sent is None:
            return
        if report.response_bytes is None:
            report.response_bytes = sum(leaf.nbytes for leaf in response.outputs)
        warmup = response.request_id - self.first_id < self.cfg.warmup_iters
        if self.verifier is not None:
            self.verifier.check(report, response)
        report.records.append(
            RequestRecord(
                *response.timings.__dict__.values(),  # by position: half the cost of by keyword
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
            self._on_warmup(response.request_id, received_ns - sent.sent_ns)
        else:
            self._on_measured(received_ns, (received_ns - sent.sent_ns) / 1e9)

    def _accept(self, response: Response) -> SendTimes | None:
        """Its request's send times, or None for a response counted as unexpected (an id never sent) or
        duplicated, or one of the wrong shape, which fails the run: its request would never be answered."""
        report = self.state.report
        with self.state.lock:
            sent = self.state.sends.get(response.request_id)
        if sent is None:
            report.responses_unexpected += 1
            return None
        outputs = response.outputs
        # One leaf of the request's rows: the common case, without a call.
        wrong = (
            None
            if len(outputs) == 1 and outputs[0].shape[:1] == self.rows
            else wrong_shape(outputs, self.cfg.batch_size)
        )
        if wrong is not None:
            self.state.fail("error", f"the response to request {response.request_id} {wrong}")
            return None
        if response.request_id in self.received_ids:
            report.responses_duplicated += 1
            return None
        self.received_ids.add(response.request_id)
        return sent

    def _on_warmup(self, request_id: int, latency_ns: int) -> None:
        if request_id == self.first_id:
            log.info(
                "warm-up response after %.2f s%s; %d more warm-up request(s), then the measured phase",
                latency_ns / 1e9,
                " (the model-alone timing before serving included)" if self.cfg.ceiling else "",
                self.cfg.warmup_iters - 1,
            )
        self.state.warmup_answered.release()

    def _on_measured(self, received_ns: int, latency_s: float) -> None:
        state = self.state
        with state.lock:
            state.measured_received += 1
            windows, progress = self.windows, self.progress
        if windows is not None:
            self._add_to_window(windows, received_ns, latency_s)
        if self.closed_loop:
            state.freed_ns.append(received_ns)  # before the release: the sender that takes the place reads it
        state.places.release()
        if progress is not None:
            progress.update(1)
        state.finish_if_complete()

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
            self.state.stop_sending.set()


def wrong_shape(outputs: tuple[np.ndarray, ...], batch_size: int) -> str | None:
    """Why a response's outputs are not one request's answer, or None: every leaf must have the request's rows
    first (the backend splits a forward's output along its first dimension; the probe before the run checked one
    forward, not every one)."""
    if not outputs:
        return "holds no output"
    rows = (batch_size,)
    for index, leaf in enumerate(outputs):
        if leaf.shape[:1] != rows:
            shape = "x".join(map(str, leaf.shape)) or "a scalar"
            return (
                f"has output leaf {index} (of {len(outputs)}, in pytree order) of shape {shape}, where its first "
                f"dimension must be the request's batch of {batch_size}: the model's output changed its batch "
                "dimension mid-run"
            )
    return None
