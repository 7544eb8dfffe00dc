"""The model-alone micro-benchmark (--ceiling): forwards back to back on inputs already on the device, at each
concurrency the design runs forwards at (designs.ceiling_concurrencies); what serving's throughput is compared with."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable

import torch

from serverbench.backend.compiled import ForwardModels
from serverbench.config.limits import POLL_S
from serverbench.device.layer import DeviceLayer, Event

STOP_JOIN_S = 5.0  # how long stopping threads get to leave: the ceiling's here, an aborting design's in designs.py
MIN_CEILING_FORWARDS = 3  # per thread and timed loop


def busy_window_rate(spans: list[list[tuple[float, float]]], batch_size: int) -> float | None:
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


class CeilingBench:
    """The model alone on inputs already on the device: `threads` threads (made once, as serving's are, and kept
    for every loop: no timed loop includes a thread's start or its first forward's per-thread state, the
    allocator's or the math library's), each on its own stream with its own copy of the input. A context manager:
    the threads start on entry and leave on exit. `before_loop` runs before every loop, the warm ones included."""

    def __init__(
        self,
        model: Callable[..., object] | ForwardModels,
        example: tuple[torch.Tensor, ...],
        layer: DeviceLayer,
        batch_size: int,
        threads: int,
        total_s: float,
        before_loop: Callable[[], None],
    ) -> None:
        layer.bind_thread()
        self.layer = layer
        self.models = ForwardModels.of(model)  # thread i runs models.for_thread(i); c = 1 runs thread 0's here
        self.batch_size = batch_size
        self.total_s = total_s  # seconds of forwards per concurrency
        self.before_loop = before_loop
        self.one_forward_s = 600.0  # unknown until timed: the first forward may build lazily
        self.inputs = [tuple(t.clone() for t in example) for _ in range(threads)]
        self.streams = [layer.new_stream() for _ in self.inputs]
        layer.synchronize()  # the copies are made on the default stream; the threads read them on their own
        self.orders = [queue.SimpleQueue() for _ in self.inputs]  # per thread: (start, forwards, timeout_s, marks)
        self.done: queue.SimpleQueue = queue.SimpleQueue()  # per finished order: the exception it raised, or None
        self.finished = threading.Event()
        self.threads = [
            threading.Thread(target=self.follow_orders, args=(i,), name=f"ceiling-{i}", daemon=True)
            for i in range(threads if threads > 1 else 0)
        ]

    def __enter__(self) -> CeilingBench:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finished.set()
        leave_by = time.monotonic() + STOP_JOIN_S  # one deadline for all of them, not one each
        for thread in self.threads:
            thread.join(timeout=max(0.0, leave_by - time.monotonic()))  # one still in a forward: a daemon, left

    def run_forwards(self, i: int, iters: int, marks: list[Event] | None = None) -> None:
        """`iters` forwards on thread i's stream; `marks`: two events per forward, recorded around it."""
        stream = self.streams[i]
        with self.layer.use_stream(stream), torch.inference_mode():
            for k in range(iters):
                if marks is not None:
                    marks[2 * k].record(stream)
                self.models.for_thread(i)(*self.inputs[i])
                if marks is not None:
                    marks[2 * k + 1].record(stream)
        stream.synchronize()

    def follow_orders(self, i: int) -> None:
        """Thread i's loop: runs each order once its start signal comes, and says how it went."""
        self.layer.bind_thread()
        while not self.finished.is_set():
            try:
                start, iters, timeout_s, marks = self.orders[i].get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                if not start.wait(timeout=timeout_s):
                    raise TimeoutError("the ceiling's start signal never came")
                self.run_forwards(i, iters, marks)
                self.done.put(None)
            except BaseException as exc:  # noqa: BLE001 - raised again on the measuring thread
                self.done.put(exc)

    def timed_loop(self, concurrency: int, iters: int, timeout_s: float) -> float:
        """Samples/s of one loop of `iters` forwards per thread."""
        self.before_loop()
        if concurrency == 1:  # on this thread: serial serving ran here (CUDA graphs are recorded per thread)
            start_ns = time.perf_counter_ns()
            self.run_forwards(0, iters)
            return iters * self.batch_size / ((time.perf_counter_ns() - start_ns) / 1e9)
        return self._loop_on_threads(concurrency, iters, timeout_s)

    def _loop_on_threads(self, concurrency: int, iters: int, timeout_s: float) -> float:
        # Events around every forward (made before the start signal): on a GPU they time the forwards on the device
        # without a synchronisation per forward, on the CPU they are the host clock.
        marks = [[self.layer.new_event() for _ in range(2 * iters)] for _ in range(concurrency)]
        reference = self.layer.new_event()
        reference.record(self.streams[0])  # before any forward, on an idle stream: every mark is later
        start = threading.Event()
        for i in range(concurrency):
            self.orders[i].put((start, iters, timeout_s, marks[i]))
        start_ns = time.perf_counter_ns()
        start.set()
        self._wait_for_threads(concurrency, timeout_s)
        loop_s = (time.perf_counter_ns() - start_ns) / 1e9
        spans = [
            [
                (reference.elapsed_time(own[2 * k]) / 1e3, reference.elapsed_time(own[2 * k + 1]) / 1e3)
                for k in range(iters)
            ]
            for own in marks
        ]
        rate = busy_window_rate(spans, self.batch_size)
        return concurrency * iters * self.batch_size / loop_s if rate is None else rate

    def _wait_for_threads(self, concurrency: int, timeout_s: float) -> None:
        """Until each of the first `concurrency` threads has done its order; raises the first one's failure."""
        deadline = time.monotonic() + timeout_s
        for _ in range(concurrency):
            try:
                error = self.done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the ceiling's forwards at concurrency {concurrency} did not end in time") from None
            if error is not None:
                raise error

    def timeout_for(self, concurrency: int, iters_each: int) -> float:
        """Generous, and in proportion to the work: a forward of seconds at several threads must not time out."""
        return max(60.0, 20 * self.total_s, 10 * concurrency * iters_each * self.one_forward_s)

    def measure(self, concurrencies: list[int], loops: int, max_iters: int) -> dict[int, list[float]]:
        """Per concurrency, the samples/s of each of `loops` timed loops, after warm loops (see measure_ceiling)."""
        self.timed_loop(1, 1, self.timeout_for(1, 1))  # warm: lazy initialisation, allocator, algorithm choice
        self.one_forward_s = self.batch_size / self.timed_loop(1, 1, self.timeout_for(1, 1))
        most_threads = max(concurrencies)
        self.timed_loop(most_threads, 2, self.timeout_for(most_threads, 2))  # warm each thread's stream
        iters = max(1, min(max_iters, math.ceil(self.total_s / loops / max(self.one_forward_s, 1e-6))))
        per_concurrency: dict[int, list[float]] = {}
        for concurrency in concurrencies:
            # The same work per loop at every concurrency, and at least MIN_CEILING_FORWARDS per thread: a loop of
            # one or two forwards per thread times its start signal and the threads' uneven finish as much as the
            # model (resnet18 at batch 32 on 2 cores: loops spread by 5-13 % within one run).
            iters_each = max(MIN_CEILING_FORWARDS, iters // concurrency)
            timeout_s = self.timeout_for(concurrency, iters_each)
            per_concurrency[concurrency] = [self.timed_loop(concurrency, iters_each, timeout_s) for _ in range(loops)]
        return per_concurrency


def measure_ceiling(
    model: Callable[..., object] | ForwardModels,
    example: tuple[torch.Tensor, ...],
    layer: DeviceLayer,
    batch_size: int,
    concurrencies: list[int],
    total_s: float,
    loops: int = 5,
    max_iters: int = 10_000,
    before_loop: Callable[[], None] = lambda: None,
) -> dict[int, list[float]]:
    """The model alone on inputs already on the device, at each concurrency: `c` threads (made once, as serving's
    are), each on its own stream with its own copy of the input, run forwards back to back; `c` = 1 runs on the
    calling thread. Returns, per `c`, the samples/s of each of `loops` timed loops: at c = 1 on the host clock from
    the first forward to the stream synchronised; at c > 1 over the loop's busy window (busy_window_rate), timed
    by events around every forward, falling back to the start signal to every stream synchronised where the window is
    empty. Each concurrency gets about `total_s` of forwards, so a loop lasts about
    total_s / loops, or longer where MIN_CEILING_FORWARDS per thread need it. `before_loop` runs before every loop,
    the warm ones included (--instances: a barrier, so that every instance's loop k runs at the same time)."""
    with CeilingBench(model, example, layer, batch_size, max(concurrencies), total_s, before_loop) as bench:
        per_concurrency = bench.measure(concurrencies, loops, max_iters)
    layer.synchronize()
    # The allocator's cache is kept (no empty_cache): the ceiling before serving ends just before the warm-up
    # request, and emptied blocks would make the measured phase's first forwards allocate (cudaMalloc) inside the
    # timed window. The ceiling's cached blocks stay reserved; an allocation that fails frees them and retries.
    return per_concurrency
