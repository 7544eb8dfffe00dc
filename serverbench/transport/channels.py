"""Request transport (frontend -> backend); the response transport is serverbench/transport/responses.py, the
messages both carry serverbench/schema/messages.py.

Two request transports with one interface (send, send_end, receive, release, depth, flush):

- queue, the reference's: a request's batch travels as a tensor through a torch.multiprocessing queue, which
  moves it into a fresh shared-memory segment on the way (and the backend pins it again on arrival);
- shm: a ring of shared-memory slots made once, before the processes start. The frontend writes a request into
  a free slot and sends only a small header; the backend hands the slot back once the slot's bytes are on the
  device (its H2D event has completed). On CUDA the backend page-locks the whole ring once
  (cudaHostRegister), so the H2D copy reads the slot directly.

Either way every request is written afresh from the frontend's pre-generated pool (one copy per request, as
data arriving from a network would be): no request rides for free on bytes an earlier request left behind.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import queue
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from serverbench.config.inputs import numpy_carrier, wire_dtype_of
from serverbench.config.limits import POLL_S
from serverbench.config.transport_kinds import Hop, request_hop
from serverbench.schema.messages import Request
from serverbench.system import process
from serverbench.transport.pipes import PipeChannel, queue_depth
from serverbench.transport.pool import Inputs

if TYPE_CHECKING:
    import torch


class StopRequested(Exception):
    """A blocking transport call gave up because the run is being stopped."""


# From the gate's opening to the measured phase's common start: long enough for every frontend, woken by the open
# gate, to start its samplers and be ready to send (a few ms), short against any run.
GATE_LEAD_S = 0.05


class StartGate:
    """Where the frontend pauses between its warm-up and its measured phase until the server opens it: at once
    in a plain run; under torchrun once every rank has warmed up, so that the ranks' measured windows overlap; with
    --generators once every generator (each a party, with its own arrival) has warmed up, so that they start
    together. The server opens it for one common instant a little ahead (`start_ns`), so that every frontend's
    schedule counts from the same moment, not from whenever each woke and started its samplers (0.5-8 ms apart:
    a trace shared by generators was replayed that far out of its order)."""

    def __init__(self, ctx, open_now: bool, parties: int = 1) -> None:
        self._reached = [ctx.Event() for _ in range(parties)]
        self._open = ctx.Event()
        # perf_counter_ns (CLOCK_MONOTONIC on Linux: one clock for every process of the machine); 0 until opened
        self._start_ns = ctx.RawValue("q", 0)
        if open_now:
            self._open.set()

    def arrive(self, party: int = 0) -> None:
        """Frontend (generator `party`): the warm-up is done."""
        self._reached[party].set()

    def is_reached(self) -> bool:
        return all(reached.is_set() for reached in self._reached)

    def is_open(self) -> bool:
        return self._open.is_set()

    def open(self, lead_s: float = GATE_LEAD_S) -> None:
        """Server: start measuring, at `lead_s` from now for every frontend alike."""
        self._start_ns.value = time.perf_counter_ns() + round(lead_s * 1e9)
        self._open.set()  # after the write: a frontend reads the instant only once it sees the gate open

    def start_ns(self) -> int | None:
        """The common instant the measured phase starts at, once the server opened the gate; None when it was open
        from the start (one frontend: it starts when it is ready)."""
        return self._start_ns.value or None

    def wait_open(self, timeout_s: float) -> bool:
        return self._open.wait(timeout_s)


class Heartbeat:
    """The frontend's sign of life: its supervising loop writes the monotonic clock (shared by every process of the
    machine) every POLL_S, and the server reads how long ago that was. A frozen frontend (SIGSTOP, a debugger, a
    machine that stopped scheduling it) cannot report its own timeout: the server's deadline on this fires instead.
    One 64-bit word in shared memory, written by one process: no lock, nothing to wait on."""

    def __init__(self, ctx) -> None:
        self._last_ns = ctx.RawValue("q", 0)

    def beat(self) -> None:
        self._last_ns.value = time.monotonic_ns()

    @property
    def beaten(self) -> bool:
        return self._last_ns.value != 0

    def silent_for_s(self, now_ns: int, started_ns: int) -> float:
        """Seconds since the last beat, or since `started_ns` (the process's start) when none came yet."""
        last_ns = self._last_ns.value or started_ns
        return (now_ns - last_ns) / 1e9


SILENCE_LEAST_S = 10 * POLL_S  # the beats' period ten times: a scheduler's hiccup is no freeze


def frozen_frontend(
    silent_s: float, beaten: bool, timeout_s: float, warmup_timeout_s: float, role: str = "frontend"
) -> str | None:
    """Why the server declares the frontend (or the backend `role`) frozen, or None: no beat for --timeout_s once it
    has beaten (its loop, or a backend's heartbeat thread, beats every POLL_S whatever the run does), or none at
    all within --warmup_timeout_s of its start (it is importing torch and making its request pool meanwhile). A
    silence is judged over SILENCE_LEAST_S at least: a --timeout_s near the beat's own period would call a process
    that runs frozen."""
    limit_s = max(timeout_s, SILENCE_LEAST_S) if beaten else warmup_timeout_s
    if silent_s <= limit_s:
        return None
    flag = f"--timeout_s {timeout_s:g} s" if beaten else f"--warmup_timeout_s {warmup_timeout_s:g} s"
    least = f", at least {SILENCE_LEAST_S:g} s" if beaten and timeout_s < SILENCE_LEAST_S else ""
    silence = f"no sign of life for {silent_s:.1f} s (limit {flag}{least})"
    return f"the {role} stopped running: {silence}; frozen or starved of CPU"


class SlotHeader(NamedTuple):
    """What crosses the header pipe for a request of the shm transport (three int64 fields); the bytes are in the
    ring slot. request_id END_OF_REQUESTS is the end marker."""

    request_id: int
    slot: int
    sent_ns: int


END_OF_REQUESTS = -1  # a header with this request id: the frontend has sent everything


def _put(q, item: object, should_stop: Callable[[], bool]) -> None:
    """Puts on a multiprocessing.Queue or a PipeChannel, giving up once the run is stopping."""
    while True:
        try:
            q.put(item, timeout=POLL_S)
            return
        except queue.Full:
            if should_stop():
                raise StopRequested from None


class RequestSender(Protocol):
    """What the frontend's sender writes requests to: the shm ring (ShmRequestChannel), the reference's queue
    (RequestChannel), or the network door's client (serverbench/transport/network.py's NetworkClient). Each call
    waits at most as long as `should_stop` lets it; `send_end` marks the last request; `depth` is the requests
    waiting for the backend where the channel can count them (None where not); `flush` and `close` end it.
    `carried` is the request pool as `send` takes it, made once before any clock starts."""

    def carried(self, pool: list[Inputs]) -> list[tuple]: ...

    def send(self, request_id: int, inputs: tuple, sent_ns: int, should_stop: Callable[[], bool]) -> None: ...

    def send_end(self, should_stop: Callable[[], bool]) -> None: ...

    def depth(self) -> int | None: ...

    def flush(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...


class RequestChannel:
    """Frontend -> backend, the reference's way (a RequestSender). Bounded: requests in transit hold shared
    memory."""

    def __init__(self, mp_context, max_queued: int, wire_dtypes: tuple[str, ...]) -> None:
        self._queue = mp_context.Queue(maxsize=max_queued)
        self._wire_dtypes = wire_dtypes

    def carried(self, pool: list[Inputs]) -> list[tuple[torch.Tensor, ...]]:
        """The pool as tensors: the reference's queue carries torch tensors, so with this transport alone the
        frontend imports torch (here, once, not at its start)."""
        from serverbench.transport.tensors import as_tensors

        return [as_tensors(arrays, self._wire_dtypes) for arrays in pool]

    def send(
        self, request_id: int, inputs: tuple[torch.Tensor, ...], sent_ns: int, should_stop: Callable[[], bool]
    ) -> None:
        # One fresh copy per request, every input together; the queue then moves each into its own shared-memory
        # segment.
        _put(self._queue, Request(request_id, tuple(t.clone() for t in inputs), sent_ns), should_stop)

    def send_end(self, should_stop: Callable[[], bool]) -> None:
        _put(self._queue, None, should_stop)

    def receive(self, timeout_s: float) -> Request | None:
        """The next request, or None when the frontend has no more; raises queue.Empty after timeout_s."""
        return self._queue.get(timeout=timeout_s)

    def release(self, slot: int) -> None:
        raise RuntimeError("the queue transport has no slots to release")

    def page_lock(self, layer) -> None:
        return None  # each request arrives in a fresh segment: the backend pins it on arrival, as the reference

    is_page_locked = False

    def depth(self) -> int | None:
        return queue_depth(self._queue)

    def flush(self, timeout_s: float) -> None:
        process.flush_queue(self._queue, timeout_s)

    def close(self) -> None:
        return None  # each request's segment went with its tensor


MAX_READ_AHEAD = 64  # headers one read may take: enough to make reads rare, a small buffer to allocate per read


class ShmRequestChannel:
    """Frontend -> backend through a ring of preallocated shared-memory slots; headers through a pipe.

    Made in the server before the processes start and handed to both: the ring is a shared-memory segment that each
    child maps and views as a tensor (the server itself never imports torch for it); headers go frontend ->
    backend, free slot numbers go back. A slot is written only after the backend handed it back, so the backend
    never reads bytes that are being overwritten, and every request is written into its slot afresh. With
    --instances N, every instance takes headers from the one pipe and hands slots back to the other, and each
    page-locks the ring in its own process. The server unlinks the segment when the run ends (`close`); if the
    server is killed, multiprocessing's resource tracker unlinks it once every process is gone."""

    def __init__(self, mp_context, cfg) -> None:
        self._layout = slot_layout(cfg)
        self._slot_bytes = slot_bytes(self._layout)
        self._slot_count = cfg.ring_slots
        self._segment = shared_memory.SharedMemory(create=True, size=cfg.ring_slots * self._slot_bytes)
        # Every slot's header, plus an end marker per backend instance; free slot numbers going back.
        self._headers = PipeChannel(mp_context, cfg.ring_slots + cfg.instances, fields=len(SlotHeader._fields))
        self._free = PipeChannel(mp_context, cfg.ring_slots, fields=1)
        self._ring = None  # the segment as a uint8 tensor, made in each process that uses it
        # Per slot, a view per input, made with it: indexing the ring costs microseconds per request.
        self._slots: list[tuple] = []
        self._slot_arrays: list[tuple[np.ndarray, ...]] = []  # the door's numpy views (try_send_arrays)
        self._unused = list(range(cfg.ring_slots))  # the frontend's copy: slots it may write now
        self._locked_by = None  # the backend's device layer once the ring is page-locked
        # Backend: slots on the device and not yet handed back, written back together (release_group at a time,
        # or before the backend would wait for a request): each write wakes the frontend's sender when it waits
        # for a slot, a cross-core wake-up (py-spy: 14 % of the backend's samples at 4,758 requests/s, about 30 us
        # a request), once per group instead of once per request.
        # HTTP/2 hands its flow-control window back the same way (WINDOW_UPDATE once half of it is used).
        self._release_group = max(1, cfg.ring_slots // 4)
        self._released: list[tuple[int]] = []
        self._released_lock = threading.Lock()  # any serving thread may release; made anew in each process
        self._waiting = False  # the reading thread waits for a header: a release goes back at once
        # Backend: headers read and not yet taken. One backend reads every header waiting in one read (a system
        # call per request less, and each releases the GIL the serving threads contend for); several --instances
        # read one at a time, so that none holds requests another could be serving.
        self._read_ahead: collections.deque[tuple[int, ...]] = collections.deque()
        self._read_ahead_most = min(cfg.ring_slots + 1, MAX_READ_AHEAD) if cfg.instances == 1 else 1
        self._read_ahead_count = mp_context.RawValue("i", 0)  # shared: depth() counts them as waiting, as they are

    @property
    def slot_count(self) -> int:
        return self._slot_count

    @property
    def ring(self) -> torch.Tensor:
        if self._ring is None:
            self._map()
        return self._ring

    def _map(self) -> None:
        """Views the segment as the ring and each slot's inputs, in this process (the first use here)."""
        import torch

        from serverbench.transport.tensors import torch_dtype

        self._ring = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=self._slot_count * self._slot_bytes)
        self._slots = [
            tuple(
                self._ring[slot * self._slot_bytes + offset : slot * self._slot_bytes + offset + size]
                .view(torch_dtype(dtype))
                .view(shape)
                for offset, size, dtype, shape in self._layout
            )
            for slot in range(self._slot_count)
        ]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_ring"], state["_slots"], state["_slot_arrays"] = None, [], []  # each process maps the segment anew
        state["_released"], state["_released_lock"] = [], None  # a lock does not pickle
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._released_lock = threading.Lock()

    def carried(self, pool: list[Inputs]) -> list[Inputs]:
        return pool  # written into the ring's numpy views as they are

    def send(self, request_id: int, inputs: Inputs, sent_ns: int, should_stop: Callable[[], bool]) -> None:
        slot = self._unused.pop() if self._unused else self._free_slot(should_stop)
        if not self._slot_arrays:
            self._map_arrays()  # at the first request, in the frontend's process
        views = self._slot_arrays[slot]
        if len(views) == 1:
            np.copyto(views[0], inputs[0], casting="no")  # the request's one copy into the transport
        else:
            for view, array in zip(views, inputs):
                np.copyto(view, array, casting="no")  # input after input
        _put(self._headers, SlotHeader(request_id, slot, sent_ns), should_stop)

    def _free_slot(self, should_stop: Callable[[], bool]) -> int:
        while True:  # every slot holds a request not yet on the device: wait (it counts in latency)
            try:
                self._unused.extend(slot for (slot,) in self._free.get_many(POLL_S, most=self._slot_count))
                return self._unused.pop()
            except queue.Empty:
                if should_stop():
                    raise StopRequested from None

    def send_end(self, should_stop: Callable[[], bool]) -> None:
        _put(self._headers, SlotHeader(END_OF_REQUESTS, 0, 0), should_stop)

    # -------------------------------------------------------------------------------- the network door's side
    # The door (serverbench/door) writes the ring from an event loop, which must never block: it writes numpy
    # arrays (no torch in the door's process), takes a free slot only when one is there, and learns that slots
    # came back from the free pipe's descriptor (asyncio's add_reader) instead of waiting on it.

    def try_send_arrays(self, request_id: int, arrays: Sequence[np.ndarray], sent_ns: int) -> bool:
        """Writes one request from arrays of the slot's shapes and wire dtypes (bfloat16 carried as uint16); False,
        with nothing written, when no slot is free now."""
        if not self._unused:
            self.take_free_slots()
            if not self._unused:
                return False
        slot = self._unused.pop()
        if not self._slot_arrays:
            self._map_arrays()
        for view, array in zip(self._slot_arrays[slot], arrays):
            np.copyto(view, array, casting="no")  # the request's one copy into the transport
        self._headers.put((request_id, slot, sent_ns), timeout=POLL_S)  # never waits: a header per slot fits
        return True

    def take_free_slots(self) -> int:
        """Every slot number the backend has handed back, without waiting; how many there are now."""
        with contextlib.suppress(queue.Empty):
            self._unused.extend(slot for (slot,) in self._free.get_many(0, most=self._slot_count))
        return len(self._unused)

    def free_fileno(self) -> int:
        """The free-slot pipe's reading descriptor: readable when slots came back."""
        return self._free.reading_fileno()

    def _map_arrays(self) -> None:
        """Views the segment as numpy arrays, one per input of each slot, in this process."""
        ring = _raw_bytes(self._segment.buf, self._slot_count * self._slot_bytes)
        self._slot_arrays = [
            tuple(
                ring[slot * self._slot_bytes + offset : slot * self._slot_bytes + offset + size]
                .view(numpy_carrier(dtype))
                .reshape(shape)
                for offset, size, dtype, shape in self._layout
            )
            for slot in range(self._slot_count)
        ]

    def receive(self, timeout_s: float) -> Request | None:
        if not self._read_ahead:
            self._read_ahead.extend(self._next_headers(timeout_s))
        request_id, slot, sent_ns = self._read_ahead.popleft()
        self._read_ahead_count.value = len(self._read_ahead)
        if request_id == END_OF_REQUESTS:
            self.flush_released()
            return None
        if self._ring is None:
            self._map()  # at the first request, in the backend's process
        return Request(request_id, self._slots[slot], sent_ns, slot=slot)

    def _next_headers(self, timeout_s: float) -> list[tuple[int, ...]]:
        """Headers already waiting, with any held slots kept for their group; else every held slot handed back and
        the next headers within timeout_s (queue.Empty)."""
        if self._released:
            try:
                return self._headers.get_many(0, self._read_ahead_most)
            except queue.Empty:
                pass
        # While this thread waits, a slot another serving thread releases goes back at once (threaded: the H2D step
        # runs beside the reading thread); set before the flush, so none is left between.
        self._waiting = True
        try:
            self.flush_released()
            return self._headers.get_many(timeout_s, self._read_ahead_most)
        finally:
            self._waiting = False

    def release(self, slot: int) -> None:
        """Backend: the slot's bytes are on the device; the frontend may write it again once its group goes back
        (at most release_group slots wait, and none while the backend waits for a request). Never waits: at most
        ring_slots numbers are ever out. Any serving thread may call it."""
        with self._released_lock:
            self._released.append((slot,))
            if len(self._released) >= self._release_group or self._waiting:
                self._write_released()

    def flush_released(self) -> None:
        """Backend: hands every slot waiting for its group back now."""
        with self._released_lock:
            if self._released:
                self._write_released()

    def _write_released(self) -> None:
        """Under the lock. On queue.Full nothing was written, and the slots stay held for the next try."""
        self._free.put_many(self._released, timeout=POLL_S)
        self._released = []

    def page_lock(self, layer) -> None:
        """Backend, once: registers the ring as page-locked memory on CUDA (nothing on the CPU)."""
        layer.register_host(self.ring)
        self._locked_by = layer

    @property
    def is_page_locked(self) -> bool:
        return self._locked_by is not None

    def page_unlock(self) -> None:
        """Backend, once no copy from the ring can still run (worker.release_ring decides when)."""
        if self._locked_by is not None:
            self._locked_by.unregister_host(self.ring)
            self._locked_by = None

    def depth(self) -> int | None:
        """Requests sent and not yet taken by a backend: in the header pipe, or read ahead by the backend."""
        in_pipe = self._headers.depth()
        return None if in_pipe is None else in_pipe + self._read_ahead_count.value

    def flush(self, timeout_s: float) -> None:
        return None  # the pipes are written at once: nothing is left in a feeder thread

    def close(self) -> None:
        """Server, once the children are gone: the segment is unlinked (the memory goes with the last mapping). It is
        unmapped here only where no tensor views it (the server never maps it): torch.frombuffer keeps no buffer
        export, nor do the numpy views (_raw_bytes), so an unmap would leave the ring's views pointing at nothing."""
        if self._ring is None and self._locked_by is None and not self._slot_arrays:
            self._segment.close()
        with contextlib.suppress(FileNotFoundError):
            self._segment.unlink()


def _raw_bytes(buf: memoryview, count: int) -> np.ndarray:
    """The first `count` bytes of `buf` as a uint8 array that holds no export of it, as torch.frombuffer's tensors
    hold none: the segment can then be closed (by its own __del__ at the end of a process that both wrote and read
    the ring) without a BufferError; `close` unmaps it only where no view is left to read it."""
    address = np.frombuffer(buf, dtype=np.uint8, count=count).ctypes.data  # the export ends with this temporary
    return np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(address))


def shm_need_bytes(cfg) -> int:
    """/dev/shm a run needs for its requests: the ring's slots (shm, a door in its own process), every request in
    transit as a fresh segment (queue: those queued and those the backend holds), or none (an inline door,
    --target)."""
    hop = request_hop(cfg)
    if hop is Hop.RING:
        return slot_bytes(slot_layout(cfg)) * cfg.ring_slots
    if hop is Hop.QUEUE:
        return cfg.request_bytes * (cfg.max_queued_requests + cfg.max_inflight)
    return 0


SLOT_ALIGN_BYTES = 64  # each input of a slot starts on a cache line (and on any dtype's element size)


def slot_layout(cfg) -> list[tuple[int, int, str, tuple[int, ...]]]:
    """Where each input of a request lies in its ring slot: (offset, bytes, wire dtype, batch shape), one after
    another, each aligned to SLOT_ALIGN_BYTES."""
    layout = []
    offset = 0
    for spec in cfg.model_inputs:
        wire = wire_dtype_of(spec, cfg.wire_dtype)
        size = cfg.batch_size * spec.sample_bytes(wire)
        layout.append((offset, size, wire, (cfg.batch_size, *spec.shape)))
        offset += -(-size // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
    return layout


def slot_bytes(layout: list[tuple[int, int, str, tuple[int, ...]]]) -> int:
    offset, size, _, _ = layout[-1]
    return max(SLOT_ALIGN_BYTES, -(-(offset + size) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES)


def make_request_channel(mp_context, cfg) -> RequestChannel | ShmRequestChannel | None:
    """The transport into the backend, as the transport's kind declares it: the ring for shm and for a door in its
    own process, the queue for the reference's; None where there is no such process boundary (an inline door, a
    --target)."""
    hop = request_hop(cfg)
    if hop is Hop.NONE:
        return None
    if hop is Hop.RING:
        return ShmRequestChannel(mp_context, cfg)
    wire_dtypes = tuple(wire_dtype_of(spec, cfg.wire_dtype) for spec in cfg.model_inputs)
    return RequestChannel(mp_context, cfg.max_queued_requests, wire_dtypes)
