"""The frontend's transport over the network (--transport http|grpc, --target): our load generator as a client of
an Open Inference Protocol server, ours or anyone's.

NetworkClient has the request channel's `send` and the response channel's `receive`, so the sender and receiver
threads drive it as they drive the shm ring: `send` encodes the request on the sender's thread and hands it to an
asyncio loop on a thread of its own, where one task per request sends it (http_caller.py's HttpCaller, grpc_caller.py's
GrpcCaller) and puts its Response on the queue `receive` reads. The backend's other messages (BackendReady,
BackendFailure) come over the control channel from the door; the loop watches its pipe and queues them in the
same order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
import orjson
import uvloop

from serverbench.config.inputs import numpy_carrier, wire_dtype_of
from serverbench.config.transport_kinds import HTTP
from serverbench.schema.messages import BackendFailure, BackendMessage, Response
from serverbench.schema.records import BackendTimings
from serverbench.transport.caller import Caller, CallError
from serverbench.transport.grpc_caller import GrpcCaller
from serverbench.transport.http_caller import HttpCaller
from serverbench.transport.oip import TIMINGS_PARAMETER, InferResult
from serverbench.transport.pool import Inputs
from serverbench.transport.responses import LoopReader, ResponseChannel

HEADER_LENGTH = "Inference-Header-Content-Length"
START_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 5.0


def timings_of(result: InferResult) -> BackendTimings:
    """The backend's stamps our door sent back, or a record with none (a server that is not ours)."""
    values = result.parameters.get(TIMINGS_PARAMETER)
    if not values:
        return no_timings()
    return BackendTimings(*orjson.loads(values))


def no_timings() -> BackendTimings:
    """A response from a server that is not ours: no backend stamps (the row's stage columns stay empty)."""
    return BackendTimings(None, None, None, None, None, None, None, None)


def wire_arrays(inputs: Sequence[np.ndarray], dtypes: Sequence[str]) -> tuple[np.ndarray, ...]:
    """A pool request's arrays as the codec sends them, without copying: bfloat16's uint16 words (numpy lacks it)
    viewed as ml_dtypes' bfloat16, the type the codec and tritonclient send as BF16."""
    return tuple(
        array.view(ml_dtypes.bfloat16) if numpy_carrier(dtype) != dtype else array
        for array, dtype in zip(inputs, dtypes)
    )


class NetworkClient:
    """The frontend's request and response channel over the network."""

    def __init__(
        self,
        caller: Caller,
        wire_dtypes: Sequence[str],
        control: ResponseChannel | None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
    ) -> None:
        self.caller = caller
        self.wire_dtypes = tuple(wire_dtypes)
        self.control = control
        self._completions: queue.SimpleQueue[BackendMessage] = queue.SimpleQueue()
        self._loop = loop_factory()
        self._tasks: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="network", daemon=True)
        # Called on the loop's thread with each answered request's id, as soon as it is read (LoadGen's completion:
        # its clock then stops where ours does, not after the hop to the receiver thread).
        self.on_answer: Callable[[int], None] | None = None

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.caller.open(), self._loop).result(START_TIMEOUT_S)
        if self.control is not None:
            asyncio.run_coroutine_threadsafe(self._watch_control(), self._loop).result(START_TIMEOUT_S)

    async def _watch_control(self) -> None:
        # On the loop's thread (add_reader is not thread-safe). The door gone: the server sees why.
        self._control_reader = LoopReader(self.control, self._loop, self._completions.put)

    # -------------------------------------------------------------------------------- the sender's side

    def carried(self, pool: list[Inputs]) -> list[tuple[np.ndarray, ...]]:
        return [wire_arrays(arrays, self.wire_dtypes) for arrays in pool]  # once, not per request

    def send(
        self, request_id: int, inputs: tuple[np.ndarray, ...], sent_ns: int, should_stop: Callable[[], bool]
    ) -> None:
        payload = self.caller.encode(request_id, inputs)
        self._loop.call_soon_threadsafe(self._start_call, request_id, payload)

    def send_end(self, should_stop: Callable[[], bool]) -> None:
        return None  # the server finishes the door (and it the backend) once the frontend has reported

    def depth(self) -> int | None:
        return None  # the requests waiting are the server's to count (its statistics endpoint)

    def flush(self, timeout_s: float) -> None:
        return None

    # -------------------------------------------------------------------------------- the loop's side

    def _start_call(self, request_id: int, payload: object) -> None:
        task = self._loop.create_task(self._call(request_id, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, request_id: int, payload: object) -> None:
        try:
            result = await self.caller.call(payload)
            received_ns = time.perf_counter_ns()  # the answer is read whole; the receiver thread wakes later
            if self.on_answer is not None:
                self.on_answer(request_id)
            outputs = tuple(array for _, array in result.outputs)
            response = Response(request_id, outputs, timings_of(result), received_ns)
        except CallError as exc:
            self._completions.put(BackendFailure("error", exc.described(request_id), ""))
            return
        except Exception as exc:  # noqa: BLE001 - a task that dies unseen would leave its request waiting
            self._completions.put(BackendFailure("error", f"request {request_id}: {type(exc).__name__}: {exc}", ""))
            return
        self._completions.put(response)

    # -------------------------------------------------------------------------------- the receiver's side

    def receive(self, timeout_s: float) -> BackendMessage:
        """The next response or control message; queue.Empty after timeout_s."""
        return self._completions.get(timeout=timeout_s)

    def close(self) -> None:
        """Cancels the calls still out and stops the loop."""
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.caller.close()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - leaving anyway: the process exits next
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)


def network_client(cfg, control: ResponseChannel | None) -> NetworkClient:
    """Our frontend's client of the door (or of --target) for this run's configuration."""
    host = cfg.host if cfg.target is not None or cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
    names = [spec.name for spec in cfg.model_inputs]
    wire = [wire_dtype_of(spec, cfg.wire_dtype) for spec in cfg.model_inputs]
    ours = cfg.target is None  # our door sends the backend's stamps back when asked; another server would not
    # A call may wait out the warm-up (the model's build and compile) before its answer.
    timeout_s = cfg.warmup_timeout_s + cfg.timeout_s
    if cfg.transport == HTTP.name:
        # uvloop, as the door's HTTP side runs on; grpc.aio supports asyncio's own loop only
        caller = HttpCaller(host, cfg.port, cfg.model_name, names, cfg.binary_data, ours, timeout_s, cfg.auth_token)
        return NetworkClient(caller, wire, control, uvloop.new_event_loop)
    caller = GrpcCaller(host, cfg.port, cfg.model_name, names, ours, timeout_s, cfg.auth_token)
    return NetworkClient(caller, wire, control)
