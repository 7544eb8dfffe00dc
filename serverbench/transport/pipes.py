"""Pipe mechanics of the transports: a process-to-process channel of fixed-size int64 records (PipeChannel), on
which the shm ring's headers and free slot numbers travel (serverbench/transport/channels.py); and framed messages
of any size (write_frame, FrameReader), on which the responses travel (serverbench/transport/responses.py)."""

from __future__ import annotations

import collections
import math
import os
import queue
import select
import struct
import sys
import time
from dataclasses import dataclass, field

from serverbench.config.limits import POLL_S


def queue_depth(q) -> int | None:
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

    def reading_fileno(self) -> int:
        return self._reader.fileno()

    def qsize(self) -> int:
        """Records in the pipe, as multiprocessing.Queue.qsize: NotImplementedError where the OS cannot tell."""
        return self._capacity - self._room.get_value()

    def depth(self) -> int | None:
        return queue_depth(self)


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


# -------------------------------------------------------------------------------- framed messages
# A response has any size. Each is framed as its length then its bytes; the reader takes what a pipe holds without
# ever blocking, so a message whose writer stopped half-way (SIGSTOP, a kill) holds up no other pipe's messages.

FRAME_HEADER = struct.Struct("!Q")


def write_frame(fd: int, data: bytes, timeout_s: float) -> None:
    """The whole message on a pipe whose writing end does not block: while the pipe is full (the reader is behind)
    it waits for room, TimeoutError once timeout_s has passed without the message written (the reader has stopped
    reading: the message is then cut short); BrokenPipeError once no reader is left."""
    parts = [memoryview(FRAME_HEADER.pack(len(data))), memoryview(data)]
    poller: select.poll | None = None
    deadline = 0.0
    while parts:
        try:
            written = os.writev(fd, parts)
        except BlockingIOError:
            written = 0
        while parts and written >= len(parts[0]):
            written -= len(parts[0])
            parts.pop(0)
        if not parts:
            return
        parts[0] = parts[0][written:]
        if poller is None:  # the first time the pipe is full
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            deadline = time.monotonic() + timeout_s
        if (left_s := deadline - time.monotonic()) <= 0:
            raise TimeoutError(f"the reader took no answer for {timeout_s:g} s: it has stopped reading")
        poller.poll(math.ceil(left_s * 1000))


@dataclass
class _PartMessage:
    """What a pipe has given of its current message: the header, then the body (`got`: bytes of either)."""

    header: bytearray = field(default_factory=lambda: bytearray(FRAME_HEADER.size))
    body: bytearray | None = None
    got: int = 0


class FrameReader:
    """Whole messages from several pipes, each read without blocking into its own part-message; a pipe whose
    writers have all closed it is dropped (with any part of a message its writer did not finish)."""

    def __init__(self, fds: list[int]) -> None:
        self._poller = select.poll()  # made once: a read of one message registers nothing (64 instances: 64 pipes)
        for fd in fds:
            os.set_blocking(fd, False)
            self._poller.register(fd, select.POLLIN)
        self._parts = {fd: _PartMessage() for fd in fds}
        self._whole: collections.deque[bytearray] = collections.deque()

    def open_fds(self) -> list[int]:
        return list(self._parts)

    def next(self, timeout_s: float) -> bytearray:
        """The next whole message of any pipe, the ready pipes in turn; queue.Empty after timeout_s,
        ConnectionError once every pipe has closed with nothing whole left."""
        deadline = time.monotonic() + timeout_s
        while not self._whole:
            if not self._parts:
                raise ConnectionError("every writer has closed its pipe")
            ready = self._poller.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000)))
            if not ready:
                raise queue.Empty
            for fd, _ in ready:
                self._read_one(fd)
        return self._whole.popleft()

    def _read_one(self, fd: int) -> None:
        """Reads `fd` on to the end of its current message and no further (the ready pipes take turns), or until
        it has nothing more now; drops the pipe at its end."""
        part = self._parts[fd]
        while True:
            target = part.header if part.body is None else part.body
            if part.got < len(target):
                try:
                    got = os.readv(fd, [memoryview(target)[part.got :]])
                except BlockingIOError:
                    return
                if got == 0:  # every writer closed it (a part of a message cut short goes with it)
                    del self._parts[fd]
                    self._poller.unregister(fd)
                    return
                part.got += got
                continue
            if part.body is None:
                (length,) = FRAME_HEADER.unpack(part.header)
                part.body, part.got = bytearray(length), 0
                continue
            self._whole.append(part.body)
            self._parts[fd] = _PartMessage()
            return
