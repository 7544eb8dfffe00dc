"""Request transport (frontend -> backend) and response transport (backend -> frontend); the messages they carry
are in serverbench/messages.py.

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
import math
import os
import pickle
import queue
import select
import struct
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, NamedTuple

from serverbench.config.inputs import wire_dtype_of
from serverbench.config.limits import POLL_S
from serverbench.schema.messages import BackendMessage, Request, Response
from serverbench.system import process

if TYPE_CHECKING:
    import torch


class StopRequested(Exception):
    """A blocking transport call gave up because the run is being stopped."""


class StartGate:
    """Where the frontend pauses between its warm-up and its measured phase until the server opens it: at once
    in a plain run; under torchrun once every rank has warmed up, so that the ranks' measured windows overlap."""

    def __init__(self, ctx, open_now: bool) -> None:
        self._reached = ctx.Event()
        self._open = ctx.Event()
        if open_now:
            self._open.set()

    def arrive(self) -> None:
        """Frontend: the warm-up is done."""
        self._reached.set()

    def is_reached(self) -> bool:
        return self._reached.is_set()

    def open(self) -> None:
        """Server: start measuring."""
        self._open.set()

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


def frozen_frontend(
    silent_s: float, beaten: bool, timeout_s: float, warmup_timeout_s: float, role: str = "frontend"
) -> str | None:
    """Why the server declares the frontend (or the backend `role`) frozen, or None: no beat for --timeout_s once it
    has beaten (its loop, or a backend's heartbeat thread, beats every POLL_S whatever the run does), or none at
    all within --warmup_timeout_s of its start (it is importing torch and making its request pool meanwhile)."""
    limit_s = timeout_s if beaten else warmup_timeout_s
    if silent_s <= limit_s:
        return None
    return (
        f"the {role} stopped running: no sign of life for {silent_s:.1f} s "
        f"(limit {'--timeout_s' if beaten else '--warmup_timeout_s'} {limit_s:g} s); frozen or starved of CPU"
    )


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


def _queue_depth(q) -> int | None:
    """Items waiting in a multiprocessing queue; None where the OS cannot tell (qsize needs sem_getvalue, which
    macOS lacks): the load sampler then records the depth as unknown rather than zero."""
    try:
        return q.qsize()
    except NotImplementedError:
        return None


PIPE_PAGE_BYTES = 4096  # a pipe's buffer is a ring of pages (Linux)


class PipeChannel:
    """A process-to-process channel for fixed-size records of `fields` int64s (the shm ring's headers and free slot
    numbers): each put is one os.write of a packed record to a pipe, each get one os.read, with no pickling, no
    length prefix and no feeder thread to wake (as a multiprocessing.Queue has, a thread switch per message).
    A write of at most PIPE_BUF bytes is atomic, so writers need no lock; a bounded semaphore keeps at most
    `capacity` records in the pipe, whose buffer holds that many, so a write never blocks. A second semaphore
    counts the records written: a reader waits on it, holding no lock, and takes the lock only for a read that
    cannot wait (the records it counted are in the pipe), so a reader frozen while it waits (SIGSTOP, a debugger)
    stops no other reader. Every wait has a timeout; several readers and writers may share it."""

    DEFAULT_PIPE_BYTES = 65536

    def __init__(self, mp_context, capacity: int, fields: int) -> None:
        self._reader, self._writer = mp_context.Pipe(duplex=False)
        self._format = f"<{fields}q"  # a format string, not a Struct: the channel is pickled to the children
        self._size = struct.calcsize(self._format)
        self._read_lock = mp_context.Lock()
        self._room = mp_context.BoundedSemaphore(capacity)
        self._written = mp_context.Semaphore(0)  # records in the pipe that no reader has counted yet
        self._capacity = capacity
        # Twice the records' bytes and a page: a pipe holds whole pages, and a write that does not fit the last
        # page's free space (put_many's full-page writes never do) starts a new one, so pages can be half empty.
        _ensure_pipe_buffer(self._writer, 2 * capacity * self._size + PIPE_PAGE_BYTES)
        # Reads that find the pipe empty return at once instead of blocking (a flag of the pipe's reading end, which
        # every process holding it shares): a record already waiting is then read without polling first, one
        # system call instead of two, and each releases the GIL, a thread switch where serving threads contend.
        os.set_blocking(self._reader.fileno(), False)

    def put(self, values: tuple[int, ...], timeout: float) -> None:
        """Raises queue.Full when `capacity` records are unread after `timeout` seconds (named as
        multiprocessing.Queue.put's, so that one helper puts on either); struct.error for a value that is not a
        64-bit int, before anything is written."""
        self.put_many([values], timeout)

    def put_many(self, records: list[tuple[int, ...]], timeout: float) -> None:
        """Several records in as few writes as atomicity allows (PIPE_BUF bytes each): one wake-up of a waiting
        reader for all of them instead of one each. Room for all of them is taken first: queue.Full (as put
        raises it) means none was written."""
        data = b"".join(struct.pack(self._format, *values) for values in records)
        for taken in range(len(records)):
            if not self._room.acquire(timeout=timeout):
                for _ in range(taken):
                    self._room.release()
                raise queue.Full
        per_write = max(1, select.PIPE_BUF // self._size) * self._size
        for start in range(0, len(data), per_write):
            os.write(self._writer.fileno(), data[start : start + per_write])
        for _ in records:  # after the write: a reader that counts a record finds it in the pipe
            self._written.release()

    def get(self, timeout_s: float) -> tuple[int, ...]:
        """The next record; raises queue.Empty after timeout_s."""
        return self.get_many(timeout_s, most=1)[0]

    def get_many(self, timeout_s: float, most: int) -> list[tuple[int, ...]]:
        """Every record waiting, up to `most`, in one read (at least one: raises queue.Empty after timeout_s as
        get does). Whole records only: every write is a whole number of them, and atomic."""
        # The wait for data holds no lock (a frozen reader must not stall the others), the read no wait.
        if not self._written.acquire(timeout=timeout_s):
            raise queue.Empty
        count = 1
        while count < most and self._written.acquire(block=False):
            count += 1
        if not self._read_lock.acquire(timeout=max(timeout_s, POLL_S)):  # held only for reads that cannot wait
            for _ in range(count):
                self._written.release()
            raise queue.Empty
        try:
            data = self._read(self._size * count)
        finally:
            self._read_lock.release()
        got, torn = divmod(len(data), self._size)
        for _ in range(got):
            self._room.release()
        if torn or got != count:
            raise ConnectionError(f"the channel returned {len(data)} bytes, not the {count} records it counted")
        return [struct.unpack_from(self._format, data, i * self._size) for i in range(count)]

    def _read(self, n_bytes: int) -> bytes:
        """Under the read lock: n_bytes that the written semaphore says are in the pipe (a pipe read returns all
        it holds up to the size asked); b"" where they are not after all."""
        try:
            return os.read(self._reader.fileno(), n_bytes)
        except BlockingIOError:
            return b""

    def qsize(self) -> int:
        """Records in the pipe, as multiprocessing.Queue.qsize: NotImplementedError where the OS cannot tell."""
        return self._capacity - self._room.get_value()

    def depth(self) -> int | None:
        return _queue_depth(self)


def _readable(connection, timeout_s: float) -> bool:
    """Whether the connection has data within timeout_s. A poll object made per call (about a microsecond) instead
    of Connection.poll, whose selector costs several per call; poll, unlike select, takes any fd number."""
    poller = select.poll()
    poller.register(connection.fileno(), select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def _ensure_pipe_buffer(connection, needed_bytes: int) -> None:
    """Grows the pipe's kernel buffer (Linux: F_SETPIPE_SZ) to hold `needed_bytes`; raises when it cannot."""
    if needed_bytes <= PipeChannel.DEFAULT_PIPE_BYTES:
        return
    import fcntl

    set_size = getattr(fcntl, "F_SETPIPE_SZ", 1031 if sys.platform.startswith("linux") else None)
    got = 0
    if set_size is not None:
        try:
            got = fcntl.fcntl(connection.fileno(), set_size, needed_bytes)
        except OSError:
            got = 0
    if got < needed_bytes:
        raise ValueError(
            f"a pipe of {needed_bytes} bytes is needed for this many ring slots and the OS allows "
            f"less (Linux: /proc/sys/fs/pipe-max-size); lower --ring_slots"
        )


class RequestChannel:
    """Frontend -> backend. Bounded: requests in transit hold shared memory."""

    def __init__(self, mp_context, max_queued: int) -> None:
        self._queue = mp_context.Queue(maxsize=max_queued)

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
        return _queue_depth(self._queue)

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

        from serverbench.transport.pool import torch_dtype

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
        state["_ring"], state["_slots"] = None, []  # each process views the segment itself (it maps it anew)
        state["_released"], state["_released_lock"] = [], None  # a lock does not pickle
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._released_lock = threading.Lock()

    def send(
        self, request_id: int, inputs: tuple[torch.Tensor, ...], sent_ns: int, should_stop: Callable[[], bool]
    ) -> None:
        slot = self._unused.pop() if self._unused else self._free_slot(should_stop)
        if self._ring is None:
            self._map()  # at the first request, in the frontend's process
        views = self._slots[slot]
        if len(views) == 1:
            views[0].copy_(inputs[0])  # the request's one copy into the transport
        else:
            for view, tensor in zip(views, inputs):
                view.copy_(tensor)  # input after input
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
        export, so an unmap would leave the ring's views pointing at nothing."""
        if self._ring is None and self._locked_by is None:
            self._segment.close()
        with contextlib.suppress(FileNotFoundError):
            self._segment.unlink()


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


def make_request_channel(mp_context, cfg) -> RequestChannel | ShmRequestChannel:
    if cfg.transport == "shm":
        return ShmRequestChannel(mp_context, cfg)
    return RequestChannel(mp_context, cfg.max_queued_requests)


class ResponseChannel:
    """Backend -> frontend: BackendReady, then Responses, or a BackendFailure.

    The sending thread writes each message to a pipe itself, under a lock: no feeder thread to wake per response,
    as a multiprocessing.Queue has, which on a busy core costs a thread switch per request. A write waits only
    while the pipe is full, i.e. while the frontend is behind. Each process keeps only the end it uses (the
    backends `keep_writing_end`, the frontend `keep_reading_end`, the server closes both once the children have
    theirs), so once the frontend is gone a write fails at once instead of waiting forever, and once every
    backend is gone the frontend's read says so."""

    def __init__(self, mp_context, lock_timeout_s: float = 120.0) -> None:
        self._reader, self._writer = mp_context.Pipe(duplex=False)
        self._write_lock = mp_context.Lock()
        self._lock_timeout_s = lock_timeout_s  # another writer may hold the lock while the frontend catches up

    def send(self, message: BackendMessage) -> None:
        # A response as a plain tuple (Response.to_wire), anything else as itself.
        data = pickle.dumps(
            message.to_wire() if type(message) is Response else message, protocol=pickle.HIGHEST_PROTOCOL
        )
        if not self._write_lock.acquire(timeout=self._lock_timeout_s):
            raise TimeoutError(
                f"could not send a response for {self._lock_timeout_s:g} s: another writer holds the "
                "channel (the frontend has stopped reading?)"
            )
        try:
            self._writer.send_bytes(data)
        finally:
            self._write_lock.release()

    def receive(self, timeout_s: float) -> BackendMessage:
        """Raises queue.Empty after timeout_s, ConnectionError once no backend can write any more."""
        if not _readable(self._reader, timeout_s):
            raise queue.Empty
        try:
            message = pickle.loads(self._reader.recv_bytes())
        except EOFError:
            raise ConnectionError("the response channel is closed: every backend process has gone") from None
        return Response.from_wire(message) if type(message) is tuple else message

    def keep_writing_end(self) -> None:
        """Backend, at start."""
        self._reader.close()

    def keep_reading_end(self) -> None:
        """Frontend, at start."""
        self._writer.close()

    def close(self) -> None:
        """Server, once every child has started with its own copies."""
        self._reader.close()
        self._writer.close()

    def flush(self, timeout_s: float) -> None:
        return None  # written at once: nothing is left in a feeder thread
