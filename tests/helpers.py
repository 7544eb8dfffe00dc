"""Builders the tests share (a test module never imports another test module's helpers): request records, the
backend's designs served in-process on the CPU stand-ins, server.main's exit status, a pickle that would run code."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, ServerRun, communicate_or_fail, kill_session, make_config, read_rows, run_server
from torch import nn

import server
from serverbench.backend import designs
from serverbench.backend.batcher import batch_rule
from serverbench.backend.planted import stages_class
from serverbench.backend.stages import Failure, RequestSource, Stages
from serverbench.config.options import BenchConfig
from serverbench.device.layer import DeviceLayer, make_device_layer
from serverbench.launch.session import Session
from serverbench.schema.messages import Request
from serverbench.schema.records import RequestRecord

# ------------------------------------------------------------------------------------------------ request records


def timed_record(
    request_id: int,
    stamps_ns: tuple[int, int, int, int, int, int],
    *,
    warmup: bool = False,
    batch_size: int = 1,
    copy_ms: tuple[float, float, float] = (0.0, 0.0, 0.0),
    worker: int = 0,
    **more,
) -> RequestRecord:
    """A request's record from its six stamps in order: sent, taken, on the device, forward done, on the host,
    received; copy_ms is (h2d copy, forward, d2h copy); `more` sets any other field."""
    sent, taken, h2d_done, forward_done, d2h_done, received = stamps_ns
    h2d_copy_ms, forward_ms, d2h_copy_ms = copy_ms
    return RequestRecord(
        request_id=request_id,
        warmup=warmup,
        batch_size=batch_size,
        sent_ns=sent,
        taken_ns=taken,
        h2d_done_ns=h2d_done,
        forward_done_ns=forward_done,
        d2h_done_ns=d2h_done,
        received_ns=received,
        h2d_copy_ms=h2d_copy_ms,
        forward_ms=forward_ms,
        d2h_copy_ms=d2h_copy_ms,
        worker=worker,
        **more,
    )


def spread_record(request_id: int, sent_ns: int, received_ns: int, **fields) -> RequestRecord:
    """A request's record from when it was sent and answered, its four steps' stamps spread evenly in between;
    `fields` as timed_record's keywords."""
    step = (received_ns - sent_ns) // 5
    stamps = (sent_ns, sent_ns + step, sent_ns + 2 * step, sent_ns + 3 * step, sent_ns + 4 * step, received_ns)
    return timed_record(request_id, stamps, **fields)


# --------------------------------------------------------------------- the backend's designs, served in-process


class FakeRequests:
    """The request transport's reading end: the batches in order, then the end marker."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self._queue: queue.Queue = queue.Queue()
        for i, batch in enumerate(batches):
            self._queue.put(Request(i, (batch,), time.perf_counter_ns()))
        self._queue.put(None)

    def receive(self, timeout_s: float):
        return self._queue.get(timeout=timeout_s)


class CollectResponses:
    """The response transport's writing end: every message kept, from any thread."""

    def __init__(self) -> None:
        self.messages: list = []
        self._lock = threading.Lock()

    def send(self, message) -> None:
        with self._lock:
            self.messages.append(message)


class ConcurrencyProbe(nn.Module):
    """A model that notes how many threads run it at once (the sleep releases the GIL, as kernels do), how many
    calls began, and when the failing one (`fail_on_call`, counted from 1) raised."""

    FORWARD_S = 0.02

    def __init__(self, fail_on_call: int = -1) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.active = self.max_active = self.calls = 0
        self.fail_on_call = fail_on_call
        self.failed_at_s: float | None = None  # time.monotonic() of the failing call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.calls += 1
            if self.calls == self.fail_on_call:
                self.failed_at_s = time.monotonic()
                raise RuntimeError("model failed")
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(self.FORWARD_S)
        with self.lock:
            self.active -= 1
        return x.sum(dim=(1, 2, 3)).unsqueeze(1) * 2


# (design, prediction workers): each design once, and pipelined with several workers.
IN_PROCESS_DESIGNS = [("serial", 1), ("threaded", 1), ("pipelined", 1), ("pipelined", 3)]


def worker_config(tmp_path: Path, design: str, workers: int = 1, **overrides) -> BenchConfig:
    """A CPU backend's config for `design`: 8x8 images, 3 a request, at most 4 requests inside."""
    argv = ["--device", "cpu", "--design", design, "--num_workers", str(workers), "--image_size", "8"]
    argv += ["--batch_size", "3", "--results_dir", str(tmp_path), "--max_inflight", "4"]
    return replace(make_config(argv), **overrides)


def design_stages(cfg: BenchConfig, layer: DeviceLayer, model, responses, **kwargs) -> Stages:
    """The steps as the backend makes them for cfg's design."""
    forward_threads = designs.DESIGNS[cfg.design].forward_threads(cfg.num_workers)
    return stages_class(cfg)(cfg, layer, model, responses, forward_threads=forward_threads, **kwargs)


def run_design(cfg: BenchConfig, stages: Stages, failure: Failure, requests: FakeRequests) -> None:
    """Serves `requests` with cfg's design from the table, as the backend process does."""
    source = RequestSource(requests, failure, stages, batch_rule(cfg))
    designs.DESIGNS[cfg.design](stages, designs.DesignSpec.of(cfg), failure).serve(source)


def serve_in_process(
    cfg: BenchConfig, model: nn.Module, batches: list[torch.Tensor], responses: CollectResponses | None = None
) -> tuple[CollectResponses, Failure]:
    """`batches` served by cfg's design on the CPU layer; the responses (into `responses` when given, so that
    they can be read after a raise) and the run's failure."""
    responses = CollectResponses() if responses is None else responses
    failure = Failure(threading.Event())
    run_design(cfg, design_stages(cfg, make_device_layer("cpu"), model, responses), failure, FakeRequests(batches))
    return responses, failure


# ------------------------------------------------------------------------------------- server.py, end to end

# A quick verified run: 10 measured requests of 8x8 images, no ceiling.
QUICK = ["--device", "cpu", "--image_size", "8", "--batch_size", "2", "--num_iters", "10", "--warmup_iters", "1"]
QUICK += ["--no-ceiling"]


def serve(args: list[str], results_dir: Path, cwd: Path = ROOT, timeout_s: float = 240) -> ServerRun:
    """server.py from `cwd` (where a factory is imported from), as a user runs it, its row in output.csv."""
    return run_server(args, results_dir, timeout_s=timeout_s, output_file="output.csv", cwd=cwd)


def ok_row(run: ServerRun, rows: int = 1) -> dict[str, str]:
    """The run's row (the last of `rows` in its results folder): served, every response in and right (QUICK's
    10 requests, --verify)."""
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.rows) == rows, run.stderr[-3000:]
    row = run.rows[-1]
    assert row["status"] == "ok", row["error"]
    assert int(row["responses_received"]) == 10 and row["verify"] == "True" and row["wrong_outputs"] == "0"
    return row


def exit_code(argv: list[str]) -> int:
    """server.main's status, whether it returns it or argparse exits with it."""
    try:
        return server.main(argv)
    except SystemExit as exc:
        return exc.code


class RunsCode:
    """Pickled into a checkpoint, it would call print when loaded: what a weights-only load must refuse."""

    def __reduce__(self):
        return (print, ("this pickle runs code",))


def start_first(request: pytest.FixtureRequest, fixture_names: Sequence[str]) -> None:
    """Starts the named module fixtures (their Background runs) before the module's first test, where a test
    selected in the module needs them: the runs then go on while the tests before theirs run."""
    here = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    for name in fixture_names:
        if any(name in item.fixturenames for item in here):
            request.getfixturevalue(name)


class Background:
    """server.py runs to their end, one after another on a thread of their own, started before the tests that read
    them: a run that waits (a compile on one core, a refusal's slow start) goes on while the module's other tests
    run. Their servers are not registered with conftest (its kill at the end of each test would reach them): stop()
    kills what still runs at the module's end."""

    def __init__(self, name: str, threads: int = 1) -> None:
        self._running: list[subprocess.Popen] = []
        self._stopped = False
        self._futures: list[Future] = []
        self._thread = ThreadPoolExecutor(threads, thread_name_prefix=name)

    def submit(
        self,
        args: list[str] | Callable[[], list[str]],
        results: Path,
        cwd: Path = ROOT,
        after: Callable[[ServerRun], object] | None = None,
    ) -> Future:
        """A future of after(the run) (the ServerRun itself without `after`, its rows from results/output.csv);
        `args` may be a function, called on the thread when the run's turn comes (it may wait for a file)."""
        future = self._thread.submit(self._serve, args, results, cwd, after)
        self._futures.append(future)
        return future

    def command(
        self, cmd: Sequence[str], timeout_s: float, cwd: Path = ROOT, env: Mapping[str, str] | None = None
    ) -> Future:
        """A future of the command's CompletedProcess (a bench tool, a sweep, a pytest run), its output captured."""

        def finish() -> subprocess.CompletedProcess:
            proc, stdout, stderr = self._communicate(list(cmd), cwd, env, timeout_s)
            return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

        future = self._thread.submit(finish)
        self._futures.append(future)
        return future

    def _communicate(
        self, cmd: list[str], cwd: Path, env: Mapping[str, str] | None, timeout_s: float
    ) -> tuple[subprocess.Popen, str, str]:
        """cmd to its end in a session of its own (killed past timeout_s, and the test fails with its output)."""
        proc = Session.piped(cmd, cwd, env=None if env is None else {**os.environ, **env}).proc
        self._running.append(proc)  # this thread lives until stop(): the runs end before it
        if self._stopped:  # stop() came while this one started
            kill_session(proc.pid)
        stdout, stderr = communicate_or_fail(proc, timeout_s, " ".join(cmd[:2]))
        return proc, stdout, stderr

    def _serve(
        self,
        args: list[str] | Callable[[], list[str]],
        results: Path,
        cwd: Path,
        after: Callable[[ServerRun], object] | None,
    ) -> object:
        args = args() if callable(args) else args
        cmd = [sys.executable, str(ROOT / "server.py"), "--results_dir", str(results), "--output_file", "output.csv"]
        proc, stdout, stderr = self._communicate([*cmd, *args], cwd, None, 240)
        run = ServerRun(proc.returncode, stdout, stderr, read_rows(results / "output.csv"), proc.pid)
        return run if after is None else after(run)

    def stop(self) -> None:
        self._stopped = True
        for future in self._futures:
            future.cancel()  # those not begun
        for proc in self._running:
            if proc.poll() is None:
                kill_session(proc.pid)
        self._thread.shutdown(wait=True)
