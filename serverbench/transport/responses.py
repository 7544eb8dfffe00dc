"""Response transport (backend -> frontend): the backend's answers and its other messages (BackendReady,
BackendFailure), a pipe for each backend instance; and the control channels that carry the other messages alone to
each load generator of ours when the answers go out over the network."""

from __future__ import annotations

import os
import pickle
import queue
import threading
from asyncio import AbstractEventLoop
from collections.abc import Callable, Sequence

from serverbench.schema.messages import BackendMessage, Response
from serverbench.transport.pipes import FrameReader, write_frame


class ResponseChannel:
    """Backend -> frontend: BackendReady, then Responses, or a BackendFailure.

    A pipe for each writing process (each backend instance, `writers`), all read by the one reader: no lock is
    shared between processes, so an instance frozen or killed while it writes (SIGSTOP, the OOM killer) holds up
    no other's answers, as a shared pipe's lock, kept by its stopped holder, would. The sending thread writes
    each message itself (under its process's lock): no feeder thread to wake per response, as a
    multiprocessing.Queue has. A write waits only while its pipe is full (the reader is behind), and for
    lock_timeout_s at most (a reader alive that stopped reading: the answer fails). Each process keeps only the
    ends it uses, so once the reader is gone a write fails at once, and once every writer is gone the reader's
    read says so."""

    def __init__(self, mp_context, lock_timeout_s: float = 120.0, writers: int = 1) -> None:
        self._pipes = [mp_context.Pipe(duplex=False) for _ in range(writers)]  # (reading end, writing end)
        for _, writing in self._pipes:  # a full pipe is waited on with a deadline (a flag every copy shares)
            os.set_blocking(writing.fileno(), False)
        self._writer = 0  # the pipe this process writes
        # How long a write may wait for the reader (a full pipe), and a thread for another's write
        self._lock_timeout_s = lock_timeout_s
        self._write_lock = threading.Lock()
        self._frames: FrameReader | None = None  # made at the first read, in the reading process

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_write_lock"], state["_frames"] = None, None  # a lock does not pickle; the reader is made anew
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._write_lock = threading.Lock()

    def send(self, message: BackendMessage) -> None:
        # A response as a plain tuple (Response.to_wire), anything else as itself.
        data = pickle.dumps(
            message.to_wire() if type(message) is Response else message, protocol=pickle.HIGHEST_PROTOCOL
        )
        if not self._write_lock.acquire(timeout=self._lock_timeout_s):
            raise TimeoutError(
                f"could not send a response for {self._lock_timeout_s:g} s: another thread is still writing "
                "(the frontend has stopped reading?)"
            )
        writing = self._pipes[self._writer][1]
        try:
            write_frame(writing.fileno(), data, self._lock_timeout_s)
        except (BrokenPipeError, ConnectionResetError):
            raise  # the reader is gone: each later send says so too (a generator that finished its share)
        except BaseException:
            # A message cut short (the reader stopped reading, a signal's handler raised mid-write) leaves the pipe
            # out of step: closed, so the reader drops it at its end instead of reading the rest as a length.
            writing.close()
            raise
        finally:
            self._write_lock.release()

    def receive(self, timeout_s: float) -> BackendMessage:
        """Raises queue.Empty after timeout_s, ConnectionError once no backend can write any more."""
        if self._frames is None:
            self._frames = FrameReader([reader.fileno() for reader, _ in self._pipes])
        try:
            message = pickle.loads(self._frames.next(timeout_s))
        except ConnectionError:
            raise ConnectionError("the response channel is closed: every backend process has gone") from None
        return Response.from_wire(message) if type(message) is tuple else message

    def reading_filenos(self) -> list[int]:
        """The reading ends still open, for an event loop to watch (the door): each readable until its writer
        has gone."""
        return self._frames.open_fds() if self._frames is not None else [r.fileno() for r, _ in self._pipes]

    def keep_writing_end(self, writer: int = 0) -> None:
        """A writing process, at start: `writer`, its own pipe (a backend instance's index)."""
        self._writer = writer
        for index, (reader, writing) in enumerate(self._pipes):
            reader.close()
            if index != writer:
                writing.close()

    def keep_reading_end(self) -> None:
        """The reader, at start."""
        for _, writing in self._pipes:
            writing.close()

    def close(self) -> None:
        """Server, once every child has started with its own copies."""
        for reader, writing in self._pipes:
            reader.close()
            writing.close()

    def flush(self, timeout_s: float) -> None:
        return None  # written at once: nothing is left in a feeder thread


class ControlFanout:
    """The backend's messages other than responses (BackendReady, BackendFailure) on to every load generator of
    ours (--generators): each reads a control channel of its own, and each must hear that the backend is ready, or
    that it failed. The writing side of a ResponseChannel, for the door or the backend that writes it."""

    def __init__(self, channels: Sequence[ResponseChannel]) -> None:
        self.channels = list(channels)

    def send(self, message: BackendMessage) -> None:
        """To every generator still reading, each written on its own: one that finished its share has closed its
        end (the write fails with BrokenPipeError) and needs no message. Any other failure is raised once the
        others have theirs: no channel keeps the message from the rest."""
        failed: OSError | None = None
        for channel in self.channels:
            try:
                channel.send(message)
            except (BrokenPipeError, ConnectionResetError):
                continue
            except OSError as exc:  # a generator that stopped reading (TimeoutError): after the others
                failed = failed or exc
        if failed is not None:
            raise failed

    def keep_writing_end(self, writer: int = 0) -> None:
        for channel in self.channels:
            channel.keep_writing_end(writer)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def flush(self, timeout_s: float) -> None:
        return None  # written at once, as each channel is


ControlChannel = ResponseChannel | ControlFanout  # where the backend's other messages go to our frontend(s)


class LoopReader:
    """A ResponseChannel read on an event loop (the door's, our network client's): each pipe watched (add_reader),
    every whole message waiting handed to `deliver` on the loop; `gone(why)` once every writer has gone."""

    def __init__(
        self,
        responses: ResponseChannel,
        loop: AbstractEventLoop,
        deliver: Callable[[BackendMessage], None],
        gone: Callable[[str], None] | None = None,
    ) -> None:
        self.responses = responses
        self._loop = loop
        self._deliver = deliver
        self._gone = gone
        self._watched = set(responses.reading_filenos())
        for fd in self._watched:
            loop.add_reader(fd, self._drain)  # the channel reads without blocking: a part-message waits its rest

    def _drain(self) -> None:
        while True:
            try:
                message = self.responses.receive(0)
            except queue.Empty:
                self._unwatch(set(self.responses.reading_filenos()))  # an instance gone: its pipe, at its end
                return
            except ConnectionError as exc:
                self._unwatch(set())
                if self._gone is not None:
                    self._gone(str(exc))
                return
            self._deliver(message)

    def _unwatch(self, still_open: set[int]) -> None:
        """Stops watching the pipes that have closed (a closed pipe is always readable: the loop would spin)."""
        for fd in self._watched - still_open:
            self._loop.remove_reader(fd)
        self._watched &= still_open
