"""--door inline: the door's event loop on a thread of the backend process, sharing its GIL with the H2D, predict and
D2H threads (as a FastAPI app that calls the model does). InlineRequests is the backend's request channel (the
designs read it as they read the ring), InlineResponses its response channel: each response is handed to the loop
with call_soon_threadsafe, and the backend's other messages also go to our frontend's control channel, when there
is one (none with --serve_only)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from serverbench.config.inputs import wire_dtype_of
from serverbench.config.options import BenchConfig
from serverbench.door.core import DoorCore
from serverbench.door.serving import address_of, bind, door_limits, loop_factory, model_spec, run_door
from serverbench.schema.messages import BackendMessage, DoorReport, Request, Response
from serverbench.transport.responses import ControlChannel


class InlineRequests:
    """--door inline: the backend's request channel, fed by the door's loop; the designs read it as the ring."""

    is_page_locked = False

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()

    def put(self, request: Request | None) -> None:
        self._queue.put(request)

    def receive(self, timeout_s: float) -> Request | None:
        """The next request, None at the end; queue.Empty after timeout_s."""
        return self._queue.get(timeout=timeout_s)

    def release(self, slot: int) -> None:
        raise RuntimeError("an inline door's requests hold no ring slot")

    def page_lock(self, layer) -> None:
        return None  # each request is a tensor of its own, made from the body: H2D reads pageable memory

    def depth(self) -> int | None:
        return self._queue.qsize()

    def flush(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None


class InlineLink:
    """--door inline: each request becomes tensors of its own (a copy out of the body, as the ring's one copy) and
    goes on the backend's queue; at most `capacity` are inside the backend at once."""

    def __init__(self, requests: InlineRequests, capacity: int, wire_dtypes: Sequence[str]) -> None:
        self.requests = requests
        self.room = asyncio.Event()
        self.capacity = capacity
        self.inside = 0  # submitted and not yet answered
        # numpy carries bfloat16's bytes as uint16: viewed back as the backend's wire dtype
        self._views = tuple(torch.bfloat16 if dtype == "bfloat16" else None for dtype in wire_dtypes)

    def submit(self, request_id: int, arrays: Sequence[np.ndarray], sent_ns: int) -> bool:
        if self.inside >= self.capacity:
            return False
        self.inside += 1
        tensors = tuple(
            tensor if view is None else tensor.view(view)
            for tensor, view in zip((torch.from_numpy(np.array(array, copy=True)) for array in arrays), self._views)
        )
        self.requests.put(Request(request_id, tensors, sent_ns))
        return True

    def answered(self) -> None:
        self.inside -= 1
        self.room.set()

    def finish(self, instances: int) -> None:
        self.requests.put(None)


class InlineResponses:
    """--door inline: the backend's response channel. Responses go to the door's loop; the other messages also to
    our frontend's control channel (None with --serve_only)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[BackendMessage], None],
        control: ControlChannel | None,
    ) -> None:
        self._loop = loop
        self._deliver = deliver
        self._control = control

    def send(self, message: BackendMessage) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, message)
        except RuntimeError:  # the door has left (its loop is closed): nobody is waiting for this
            pass
        if type(message) is not Response and self._control is not None:
            self._control.send(message)

    def flush(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None


class InlineDoor:
    """--door inline: the door's loop on a thread of the backend process; `requests` and `responses` are the
    backend's channels."""

    START_TIMEOUT_S = 30.0

    def __init__(self, cfg: BenchConfig, control: ControlChannel | None, should_finish: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.requests = InlineRequests()
        self._control = control
        self._should_finish = should_finish
        self._leave = threading.Event()
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core: DoorCore | None = None
        self._link: InlineLink | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="door", daemon=True)

    def start(self) -> InlineResponses:
        """Binds and starts serving; the backend's response channel. Raises what kept the door from starting."""
        self._thread.start()
        if not self._started.wait(self.START_TIMEOUT_S):
            raise TimeoutError(f"the inline door did not start within {self.START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise self._error
        return InlineResponses(self._loop, self._deliver, self._control)

    def _deliver(self, message: BackendMessage) -> None:
        if type(message) is Response:
            self._link.answered()
        self._core.on_message(message)

    def _run(self) -> None:
        cfg = self.cfg
        try:
            sock = bind(cfg.host, cfg.port)
        except OSError as exc:
            self._error = exc
            self._started.set()
            return

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            wire = [wire_dtype_of(spec, cfg.wire_dtype) for spec in cfg.model_inputs]
            self._link = InlineLink(self.requests, cfg.ring_slots + cfg.max_inflight, wire)
            # The control channel gets the backend's messages from InlineResponses itself: no forward here.
            self._core = DoorCore(model_spec(cfg), self._link, door_limits(cfg), None, address_of(sock))
            # Started once it listens: a server that cannot start fails the backend's start, not its stop.
            await run_door(
                cfg, self._core, sock, self._should_finish, self._leave.is_set, lambda: None, self._started.set
            )

        try:
            with asyncio.Runner(loop_factory=loop_factory(cfg.transport)) as runner:
                runner.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by the backend with its own
            self._error = exc
            self._started.set()

    def stop(self, timeout_s: float) -> DoorReport:
        """Leaves (the backend has served), and the door's report."""
        self._leave.set()
        self._thread.join(timeout_s)
        report = self._core.ended_report() if self._core is not None else DoorReport(status="error")
        if self._thread.is_alive():
            report.status, report.error = "error", f"the inline door did not stop within {timeout_s:g} s"
        elif self._error is not None:
            report.status, report.error = "error", str(self._error)
        return report
