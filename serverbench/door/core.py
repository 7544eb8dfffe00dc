"""The network front door's core, shared by both protocols: the model's description, readiness, the counts for the
statistics endpoint and the row, and each inference request's way to the backend and back.

Everything here runs on the door's one event loop thread: no locks. A request gets the door's own id (the ring's
request id: the backend's warm-up is the first --warmup_iters requests to arrive, whoever sends them), goes to the
backend through a BackendLink (the shm ring from a door process, an in-process queue inline), and its Response
comes back through `on_message`, which also sees the backend's BackendReady and BackendFailure and forwards them
to the frontend of ours, when there is one (its control channel).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from serverbench.schema.messages import BackendFailure, BackendMessage, BackendReady, DoorReport, Response
from serverbench.schema.records import RecordSample, RequestRecord
from serverbench.transport.oip import ModelSpec, ProtocolError, TensorSpec, oip_datatype
from serverbench.transport.oip_stats import ModelStats

# --serve_only: measured records kept (about 75 MB); past it, a uniform sample of them with exact totals
SERVED_SAMPLE = 100_000
RECENT_FORWARDS = 4096  # forwards remembered to count each formed batch once: far more than can be in flight


class BackendLink(Protocol):
    """The door's way into the backend. `submit` never blocks the loop: False means no room now, and `room` is set
    (by the link, on the loop) when there may be some."""

    room: asyncio.Event

    def submit(self, request_id: int, arrays: Sequence[np.ndarray], sent_ns: int) -> bool: ...

    def finish(self, instances: int) -> None: ...


class Forward(Protocol):
    """Where the backend's messages other than responses go: the frontend's control channel."""

    def send(self, message: BackendMessage) -> None: ...


@dataclass
class DoorLimits:
    timeout_s: float  # the longest a request waits for room in the backend, and then for its answer
    warmup_timeout_s: float  # the same for a warm-up request, whose answer may wait for the model's build
    max_body_bytes: int
    warmup_requests: int  # the first requests to arrive are the warm-up (the backend's view of them too)
    keep_records: bool  # --serve_only: the door's records are the run's
    instances: int  # backend instances: each must say it is ready, and each gets an end marker
    auth_token: str | None = None  # every request but health's must carry it (--auth_token)


@dataclass
class Answer:
    """A served request: its outputs and the backend's stamps, and when the door received it."""

    response: Response
    arrived_ns: int


class DoorCore:
    def __init__(
        self, spec: ModelSpec, link: BackendLink, limits: DoorLimits, forward: Forward | None, address: str
    ) -> None:
        self.spec = spec  # its outputs are filled in once the backend is ready
        self.link = link
        self.limits = limits
        self.forward = forward
        self.stats = ModelStats()
        self.report = DoorReport(address=address)
        self.served = RecordSample(SERVED_SAMPLE)  # --serve_only's records, in bounded memory
        self.ready_instances = 0
        self.failure: str | None = None  # the backend failed: every request is answered 503 from then on
        self.accepting = True  # False once the run is finishing: later requests are answered 503
        self._pending: dict[int, asyncio.Future[Response]] = {}
        self._next_id = 0
        self._forwards_seen: set[tuple[int, int]] = set()  # (instance, batch id) of recent answers
        self._forwards_order: collections.deque[tuple[int, int]] = collections.deque()

    # -------------------------------------------------------------------------------- readiness

    @property
    def ready(self) -> bool:
        return self.ready_instances >= self.limits.instances and self.failure is None

    def ended_report(self) -> DoorReport:
        """The report as the door hands it over when it ends: with its records (a --serve_only door's sample)."""
        self.report.records = self.served.records()
        self.report.totals = self.served.totals()
        return self.report

    def check_token(self, authorization: str | bytes | None) -> None:
        """A request's Authorization value against --auth_token (where one is set): 401, counted, when it is not
        `Bearer <token>`. Compared in constant time, so that the answer's timing tells nothing of the token."""
        expected = self.limits.auth_token
        if expected is None:
            return
        given = authorization.encode() if isinstance(authorization, str) else authorization or b""
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), expected.encode()):
            raise ProtocolError(401, "this door serves requests that carry its token: Authorization: Bearer <token>")

    def check_model(self, name: str, version: str | None) -> None:
        # A name or version echoed in the answer is cut short: a 20,000-character one made gRPC's status too large
        # to send (RESOURCE_EXHAUSTED instead of NOT_FOUND) and a 60 KB 404 over HTTP.
        if name != self.spec.name:
            raise ProtocolError(404, f"unknown model {_shown(name)}: this server serves {self.spec.name!r}")
        if version not in (None, "", self.spec.version):
            raise ProtocolError(
                404, f"unknown version {_shown(version)} of model {name!r}: it has {self.spec.version!r}"
            )

    def described_spec(self) -> ModelSpec:
        """The model's full description: 503 until the backend has said what its outputs are."""
        if not self.spec.outputs:
            raise ProtocolError(503, f"model {self.spec.name!r} is not ready yet: the backend is still building it")
        return self.spec

    # -------------------------------------------------------------------------------- inference

    async def infer(self, arrays: Sequence[np.ndarray], arrived_ns: int) -> Answer:
        """Sends one request's arrays (checked against the spec by the protocol) to the backend and waits for its
        response; ProtocolError(503) when the run is ending, the backend failed, or it takes longer than the
        timeout."""
        self._check_open()
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._submit(request_id, arrays, arrived_ns)
            # A timer that fails the future, not asyncio.wait_for: that wraps every request's wait in more machinery
            # (py-spy: 6 % of the door's samples at concurrency 1), for a timeout that almost never fires.
            timer = asyncio.get_running_loop().call_later(self._answer_within_s(request_id), _expire, future)
            try:
                response = await future
            finally:
                timer.cancel()
        except asyncio.TimeoutError:
            limit_s = self._answer_within_s(request_id)
            raise ProtocolError(503, f"no answer from the backend within {limit_s:g} s") from None
        finally:
            self._pending.pop(request_id, None)
        return Answer(response, arrived_ns)

    def _answer_within_s(self, request_id: int) -> float:
        limits = self.limits
        return limits.warmup_timeout_s if request_id < limits.warmup_requests else limits.timeout_s

    def _check_open(self) -> None:
        if self.failure is not None:
            raise ProtocolError(503, f"the backend failed: {self.failure}")
        if not self.accepting:
            raise ProtocolError(503, "the run has ended: this server no longer takes requests")

    async def _submit(self, request_id: int, arrays: Sequence[np.ndarray], arrived_ns: int) -> None:
        deadline_s = time.monotonic() + self.limits.timeout_s
        while not self.link.submit(request_id, arrays, arrived_ns):
            self.link.room.clear()
            if self.link.submit(request_id, arrays, arrived_ns):  # room came between the try and the clear
                return
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                raise asyncio.TimeoutError
            try:
                await asyncio.wait_for(self.link.room.wait(), left_s)
            except asyncio.TimeoutError:
                raise ProtocolError(
                    503, f"the backend took no request for {self.limits.timeout_s:g} s: it is full"
                ) from None
            self._check_open()

    def answered(self, answer: Answer, written_ns: int) -> None:
        """The answer was written to the client: counted, timed for the statistics endpoint, and recorded."""
        response, timings = answer.response, answer.response.timings
        self.report.answered += 1
        stats, rows = self.stats, self.spec.batch_size
        stats.inference_count += rows
        stats.last_inference_ms = time.time_ns() // 1_000_000
        # Triton's counters only grow (perf_analyzer subtracts them as unsigned numbers): never a negative span.
        formed_ns = timings.formed_ns or timings.taken_ns
        spans = {
            "success": written_ns - answer.arrived_ns,
            "queue": formed_ns - answer.arrived_ns,
            "compute_input": timings.h2d_done_ns - formed_ns,
            "compute_infer": timings.forward_done_ns - timings.h2d_done_ns,
            "compute_output": timings.d2h_done_ns - timings.forward_done_ns,
        }
        for name, span_ns in spans.items():
            stats.add(name, max(0, span_ns))
        if self._new_forward(timings.instance, timings.batch_id):
            stats.execution_count += 1  # a formed batch of several requests is one execution
        if self.limits.keep_records:
            self.served.add(
                RequestRecord(
                    **timings.__dict__,
                    request_id=response.request_id,
                    warmup=response.request_id < self.limits.warmup_requests,
                    batch_size=rows,
                    sent_ns=answer.arrived_ns,
                    received_ns=written_ns,
                )
            )

    def _new_forward(self, instance: int, batch_id: int | None) -> bool:
        """Whether this answer is the first seen of its forward; only recent forwards can have answers to come."""
        if batch_id is None:
            return True
        key = (instance, batch_id)
        if key in self._forwards_seen:
            return False
        self._forwards_seen.add(key)
        self._forwards_order.append(key)
        if len(self._forwards_order) > RECENT_FORWARDS:
            self._forwards_seen.discard(self._forwards_order.popleft())
        return True

    def failed(self, status: int, disconnected: bool = False) -> None:
        """An error answer (or a client gone before its answer), counted for the row."""
        if disconnected:
            self.report.disconnects += 1
            return
        self.report.errors[status] = self.report.errors.get(status, 0) + 1
        self.stats.add("fail", 0)

    # -------------------------------------------------------------------------------- the backend's messages

    def on_message(self, message: BackendMessage) -> None:
        """On the loop: a response to its waiting request; readiness and failures noted and passed on."""
        if type(message) is Response:
            future = self._pending.get(message.request_id)
            if future is not None and not future.done():
                future.set_result(message)
            return
        if isinstance(message, BackendReady):
            self.ready_instances += 1
            self.report.instances_ready.append(replace(message, reference_outputs=None))
            if not self.spec.outputs:
                try:
                    self.spec = replace(self.spec, outputs=output_specs(message.output_leaves))
                except (ProtocolError, ValueError) as exc:  # an output dtype the protocol has no datatype for
                    self.failure = f"the model's outputs cannot be served over the protocol: {exc}"
        elif isinstance(message, BackendFailure):
            self.failure = message.error
            self._fail_pending(ProtocolError(503, f"the backend failed: {message.error}"))
        if self.forward is not None:
            self.forward.send(message)

    def backend_gone(self, why: str) -> None:
        self.failure = why
        self._fail_pending(ProtocolError(503, why))

    def _fail_pending(self, error: ProtocolError) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    def finish(self) -> None:
        """The run is ending: no request is taken any more, and the backend gets its end markers."""
        if self.accepting:
            self.accepting = False
            self.link.finish(self.limits.instances)

    @property
    def pending(self) -> int:
        return len(self._pending)


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(asyncio.TimeoutError())


def output_specs(leaves: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[TensorSpec, ...]:
    """The model's outputs as the protocol names them: output0, output1, ... in pytree order."""
    return tuple(TensorSpec(f"output{i}", oip_datatype(dtype), shape) for i, (dtype, shape) in enumerate(leaves))


ECHOED_CHARS = 64  # of a name the client sent, quoted back in an error


def _shown(value: str) -> str:
    """A client's name as an error quotes it: at most ECHOED_CHARS characters, with how long it was."""
    return repr(value) if len(value) <= ECHOED_CHARS else f"{value[:ECHOED_CHARS]!r}... ({len(value)} characters)"
