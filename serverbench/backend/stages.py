"""The four steps every design composes (h2d, predict, d2h, respond: `Stages`), the work item that carries one
forward's requests through them (`WorkItem`, `Member`), the backend's reading end of the request transport
(`RequestSource`), and the abort machinery every loop polls (`Failure`, `Aborted`, get_or_abort, acquire_or_abort).

The designs (designs.py) differ only in which thread runs which step and on which stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function  # names each step in --profile traces

from serverbench.backend.batcher import Batcher, BatchRule, padded_size
from serverbench.backend.buffers import BufferPool, BufferSet, Decoder
from serverbench.backend.compiled import ForwardModels
from serverbench.backend.outputs import OutputCheck
from serverbench.backend.prepare import compiled_sizes
from serverbench.config.limits import POLL_S
from serverbench.config.options import BenchConfig
from serverbench.device.layer import NO_CONTEXT, DeviceLayer, Event, Stream
from serverbench.schema.messages import Response
from serverbench.schema.records import BackendTimings
from serverbench.system import process
from serverbench.transport.channels import RequestChannel
from serverbench.transport.responses import ResponseChannel

log = logging.getLogger("backend")


class Aborted(Exception):
    """A loop stopped because another thread failed or the server asked to stop."""


def classify_failure(exc: BaseException) -> str:
    """Status of a run that failed with `exc`: 'oom' lets a sweep move past a batch size that does not fit;
    'aborted' for a pipe the other side closed (the frontend gave up or left first): a consequence, which the run's
    status ranks after its cause (first_failure)."""
    if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
        return "aborted"
    oom_types = tuple(
        t
        for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
        if t is not None
    )
    if isinstance(exc, oom_types) or "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower():
        return "oom"
    return "error"


class Failure:
    """The first failure of any backend thread, and the abort flag every loop polls."""

    def __init__(self, stop_event) -> None:
        self._lock = threading.Lock()
        self._stop_event = stop_event  # set by the server to stop the whole run
        self.aborted = threading.Event()
        self.exception: BaseException | None = None
        self.traceback: str = ""

    def record(self, exc: BaseException) -> None:
        with self._lock:
            if self.exception is None:
                self.exception = exc
                self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.aborted.set()

    def should_stop(self) -> bool:
        return self.aborted.is_set() or self._stop_event.is_set() or process.parent_gone()

    def check(self) -> None:
        if self.should_stop():
            raise Aborted


def get_or_abort(q: queue.SimpleQueue, failure: Failure):
    """queue.get that gives up when the run is aborting, also with items still queued: an item queued before another
    thread failed is not served (the run has ended; serving the rest would only delay the failure's report)."""
    while True:
        try:
            item = q.get(timeout=POLL_S)
        except queue.Empty:
            failure.check()
            continue
        if failure.aborted.is_set():
            raise Aborted
        return item


def acquire_or_abort(semaphore: threading.Semaphore, failure: Failure) -> None:
    """semaphore.acquire that gives up when the run is aborting, also when a permit was free."""
    while not semaphore.acquire(timeout=POLL_S):
        failure.check()
    if failure.aborted.is_set():
        semaphore.release()
        raise Aborted


@dataclass
class Member:
    """One request inside the backend, until its bytes are on the device."""

    request_id: int
    host_inputs: tuple[torch.Tensor, ...] | None  # one tensor per model input
    taken_ns: int  # taken off the transport
    sent_ns: int  # when the frontend sent it (under a schedule, when it was due): the batcher's delay starts here
    slot: int | None = None  # shm transport: the ring slot holding host_inputs until the H2D copy is done


@dataclass
class WorkItem:
    """One forward's worth of requests on its way through the backend: a single request, or a formed batch of
    several (--max_batch_size) whose rows go back as one response each. Owns its buffers until its responses are
    sent."""

    members: list[Member]
    formed_ns: int  # the batcher closed the formed batch (the member's taken_ns without batching)
    padded_images: int  # images the forward runs on: the members' own, plus padding up to a compiled size
    batch_id: int = 0  # the formed batch's number in this backend
    events: dict[str, Event] = field(default_factory=dict)
    buffers: BufferSet | None = None  # from the pool, until the response is sent
    device_inputs: tuple[torch.Tensor, ...] | None = None  # the model's inputs, in buffers
    outputs: tuple[torch.Tensor, ...] | None = None  # the output's leaves
    host_outputs: list[torch.Tensor] | None = None  # where the response reads them (CUDA: in buffers)
    worker: int = -1
    threads: dict[str, str] = field(default_factory=dict)  # step -> name of the thread that ran it
    anchors_ns: dict[str, int] = field(default_factory=dict)  # event -> host time just after synchronize() on it

    @property
    def request_id(self) -> int:
        """The first member's id: the name of the forward in traces and logs."""
        return self.members[0].request_id


EVENT_NAMES = ("h2d_start", "h2d_end", "forward_start", "forward_end", "d2h_start", "d2h_end")
HOST_WAITED_EVENTS = ("h2d_end", "d2h_end")  # the host synchronizes on these: made with blocking sync
# The BackendTimings fields a forward's requests share, in the order Stages.respond gives them (all but taken_ns).
SHARED_TIMINGS = (
    "h2d_done_ns",
    "forward_done_ns",
    "d2h_done_ns",
    "h2d_copy_ms",
    "forward_ms",
    "d2h_copy_ms",
    "worker",
    "h2d_start_ns",
    "forward_start_ns",
    "d2h_start_ns",
    "h2d_thread",
    "predict_thread",
    "d2h_thread",
    "formed_ns",
    "formed_images",
    "padded_images",
    "batch_id",
    "instance",
)


def _unlabelled(step: str, request_id: int) -> AbstractContextManager:
    return NO_CONTEXT


def _labelled(step: str, request_id: int) -> AbstractContextManager:
    return record_function(f"{step} #{request_id}")


_this_thread = threading.local()


def thread_name() -> str:
    """The calling thread's name, looked up once per thread (threading.current_thread().name costs microseconds,
    three times per request)."""
    try:
        return _this_thread.name
    except AttributeError:
        _this_thread.name = threading.current_thread().name
        return _this_thread.name


class Stages:
    """The steps every design runs: h2d, predict, d2h, respond."""

    def __init__(
        self,
        cfg: BenchConfig,  # whole: the steps read a dozen of its fields, and the buffers and decoder build from it
        layer: DeviceLayer,
        model: Callable[..., object] | ForwardModels,  # one model every thread calls, or one per prediction thread
        responses: ResponseChannel,
        release_slot: Callable[[int], None] | None = None,
        decode: Decoder | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        instance: int = 0,
        forward_threads: int = 1,  # forwards the design runs at once: its prediction threads (serial, threaded: 1)
    ) -> None:
        self.cfg = cfg
        self.instance = instance  # --instances: which backend process this is; every response says so
        self.layer = layer
        self.models = ForwardModels.of(model)  # by prediction thread
        self.responses = responses
        self.release_slot = release_slot  # hands a shm ring slot back to the frontend
        self.should_stop = should_stop  # the run is ending: a wait for a buffer set gives up
        self.decode = decode or Decoder(cfg, layer.device)
        # One buffer set per request the backend may hold at once (the designs bound that by max_inflight).
        # With dynamic batching a set holds the largest formed batch, and a forward uses its first rows.
        rows = cfg.formed_rows if cfg.batching else None
        self.buffers = BufferPool(cfg.max_inflight, lambda: self._new_buffer_set(rows), cfg.timeout_s)
        # --compile with dynamic batching: the sizes compiled at warm-up, to which a formed batch is padded.
        self.padded_sizes = compiled_sizes(cfg)
        # Named steps in --profile traces; otherwise nothing: record_function costs microseconds per call even
        # with no profiler running, a tenth of a request's whole cost at one image per request.
        self.label: Callable[[str, int], AbstractContextManager] = _labelled if cfg.profile else _unlabelled
        self.output_check = OutputCheck()  # every forward's output split as the first one's
        self._one_input = len(cfg.model_inputs) == 1
        self._batches_formed = 0
        # Dynamic batching: forwards that may run at once (the design's prediction threads). The batcher forms a
        # batch only once one of them is free; a batch gives its place back once its output is on the host (on a
        # GPU the forward's kernels then have run, not only been queued).
        self.free_forwards = threading.BoundedSemaphore(forward_threads)
        # Requests each step has finished: what a hung run's log shows to tell which step stopped moving.
        self.progress = {"taken": 0, "h2d": 0, "predict": 0, "d2h": 0, "responded": 0}
        self._queue_depths: Callable[[], dict[str, int]] = dict
        # Serving threads a design could not see end (an abort that did not wait for them): copies from the ring
        # may still be queued by them, so the ring stays registered until the process exits.
        self.threads_left: list[str] = []
        if layer.nvtx:  # --nvtx: each step in an NVTX range named with its request, on the thread that runs it
            self._range_steps()

    def show_queues(self, depths: Callable[[], dict[str, int]]) -> None:
        """The design's hand-off queues, by name: `depths()` is their sizes, which a hung run's log shows."""
        self._queue_depths = depths

    def queue_depths(self) -> dict[str, int]:
        return self._queue_depths()

    def note_threads_left(self, names: list[str]) -> None:
        """The serving threads the design saw still running when it returned (see threads_left)."""
        self.threads_left = list(names)

    def _range_steps(self) -> None:
        """Rebinds each step to itself inside an NVTX range (DeviceLayer.nvtx_step); only with --nvtx, so that
        the steps' code and a run without the flag stay untouched."""
        self.form = self.layer.nvtx_step("form", self.form, lambda members: members[0].request_id)
        for step, name in (("h2d", "h2d"), ("predict", "forward"), ("d2h", "d2h"), ("respond", "respond")):
            setattr(self, step, self.layer.nvtx_step(name, getattr(self, step), lambda item: item.request_id))

    def new_events(self) -> dict[str, Event]:
        return {name: self.layer.new_event(host_waits=name in HOST_WAITED_EVENTS) for name in EVENT_NAMES}

    def _new_buffer_set(self, rows: int | None) -> BufferSet:
        """A buffer set with its own timing events: reused with it, recorded again only after the previous
        request's D2H event completed, so no event is made per request."""
        buffers = BufferSet(self.cfg, self.layer.device, pin_host=self.layer.is_cuda, rows=rows)
        buffers.events = self.new_events()
        return buffers

    def take(self, request) -> Member:
        member = Member(request.request_id, request.inputs, time.perf_counter_ns(), request.sent_ns, request.slot)
        self.progress["taken"] += 1
        return member

    def form(self, members: list[Member]) -> WorkItem:
        """One forward's work item from the requests it serves (one, or a formed batch)."""
        images = len(members) * self.cfg.batch_size
        padded = images if self.padded_sizes is None else padded_size(images, self.padded_sizes)
        formed_ns = members[0].taken_ns if not self.cfg.batching else time.perf_counter_ns()
        item = WorkItem(members, formed_ns, padded, batch_id=self._batches_formed)
        self._batches_formed += 1
        return item

    def h2d(self, item: WorkItem, stream: Stream) -> None:
        """Copies the request to the device and decodes it into the model's input (dtype, layout, uint8
        normalisation); hands its shm slot back once the copy has completed."""
        item.threads["h2d"] = thread_name()
        # The set is taken on the copy's stream: a formed batch's set is filled with padding as it is made, and on
        # this stream the fill is ordered before the copies into it (a pool stream is non-blocking: it would not
        # wait for a fill on the default stream, whose padding could then land over the first batch's rows).
        with self.layer.use_stream(stream):
            self.take_buffers(item)
            with self.label("h2d", item.request_id):
                # queue transport: the reference pins every request on arrival (a host copy); shm slots are
                # page-locked once, so this returns them as they are.
                buffers = item.buffers
                if self._one_input and not self.cfg.batching:  # the common case, without the loops' cost
                    pinned_input = self.layer.pin(item.members[0].host_inputs[0])
                    item.events["h2d_start"].record(stream)
                    wires = [self.layer.stage_wire(buffers.wires[0], pinned_input, buffers.decode_copies[0])]
                elif not self.cfg.batching:
                    pinned_inputs = [self.layer.pin(t) for t in item.members[0].host_inputs]
                    item.events["h2d_start"].record(stream)
                    wires = [
                        self.layer.stage_wire(dst, host, copies)
                        for dst, host, copies in zip(buffers.wires, pinned_inputs, buffers.decode_copies)
                    ]
                else:
                    pinned = [[self.layer.pin(t) for t in member.host_inputs] for member in item.members]
                    item.events["h2d_start"].record(stream)
                    wires = [
                        self.gather_wire(dst, [inputs[i] for inputs in pinned], item.padded_images)
                        for i, dst in enumerate(buffers.wires)
                    ]
                item.device_inputs = self.decode(buffers, wires)
                item.events["h2d_end"].record(stream)
        slots = [member.slot for member in item.members if member.slot is not None]
        if slots:
            item.events["h2d_end"].synchronize()  # the slots' bytes are on the device: they may be written again
            item.anchors_ns["h2d_end"] = time.perf_counter_ns()
            for slot in slots:
                self.release_slot(slot)
        for member in item.members:
            member.host_inputs = None  # a queue request's shared-memory segments can go now too
        self.progress["h2d"] += len(item.members)

    def take_buffers(self, item: WorkItem) -> None:
        """The item's buffer set from the pool, and its timing events."""
        item.buffers = self.buffers.take(self.should_stop)
        if item.buffers is None:
            raise Aborted
        item.events = item.buffers.events

    def give_back_buffers(self, buffers: BufferSet) -> None:
        self.buffers.give_back(buffers)

    def gather_wire(self, wire: torch.Tensor, requests: list[torch.Tensor], padded_images: int) -> torch.Tensor:
        """A formed batch's wire bytes of one input: each request's copied straight into its rows of the set's wire
        buffer (the H2D copy itself on a GPU, no host staging copy); rows past the requests are padding (left as
        they are: outputs of padded rows are never sent)."""
        rows = self.cfg.batch_size
        for i, request in enumerate(requests):
            wire[i * rows : (i + 1) * rows].copy_(request, non_blocking=self.layer.is_cuda)
        return wire[:padded_images]

    def predict(self, item: WorkItem, stream: Stream, worker: int) -> None:
        item.threads["predict"] = thread_name()
        stream.wait_event(item.events["h2d_end"])
        with self.layer.use_stream(stream), torch.inference_mode(), self.label("predict", item.request_id):
            item.events["forward_start"].record(stream)
            output = self.models.for_thread(worker)(*item.device_inputs)
            item.outputs = self.output_check.leaves(output, item.padded_images)
            item.events["forward_end"].record(stream)
        item.worker = worker
        self.progress["predict"] += len(item.members)

    def d2h(self, item: WorkItem, stream: Stream) -> int:
        """Copies the output to the set's page-locked host buffer and waits for it; returns the host time it
        was there."""
        item.threads["d2h"] = thread_name()
        stream.wait_event(item.events["forward_end"])
        with self.layer.use_stream(stream), self.label("d2h", item.request_id):
            images = len(item.members) * self.cfg.batch_size
            padded = item.padded_images != images
            layer = self.layer
            if len(item.outputs) == 1:  # the common case, without the loops' cost
                leaf = item.outputs[0]
                layer.keep_alive_on(leaf, stream)  # allocated on the prediction stream, read on this one
                answered = leaf[:images] if padded else leaf  # padded rows stay on the device
                host = layer.host_output_buffer(item.buffers, 0, answered)
                item.events["d2h_start"].record(stream)
                item.host_outputs = [layer.stage_output(host, answered)]
            else:
                leaves = []
                for leaf in item.outputs:
                    layer.keep_alive_on(leaf, stream)
                    leaves.append(leaf[:images] if padded else leaf)
                hosts = [layer.host_output_buffer(item.buffers, i, leaf) for i, leaf in enumerate(leaves)]
                item.events["d2h_start"].record(stream)
                item.host_outputs = [layer.stage_output(host, leaf) for host, leaf in zip(hosts, leaves)]
            item.events["d2h_end"].record(stream)
        item.events["d2h_end"].synchronize()
        if self.cfg.batching:
            # The forward has run (on a GPU, not only been queued): the next formed batch may go now.
            self.free_forwards.release()
        self.progress["d2h"] += len(item.members)
        return time.perf_counter_ns()

    def respond(self, item: WorkItem, d2h_done_ns: int) -> None:
        """One response per request of the item: its own rows of the output, the item's shared timings."""
        ev = item.events
        host_ns = self.layer.host_times(ev, {**item.anchors_ns, "d2h_end": d2h_done_ns})
        # BackendTimings' fields after taken_ns, in its order (SHARED_TIMINGS): passed by position, which costs half
        # of a call by keyword, once a request at one image per request.
        shared = (
            host_ns["h2d_end"],
            host_ns["forward_end"],
            host_ns["d2h_end"],
            ev["h2d_start"].elapsed_time(ev["h2d_end"]),
            ev["forward_start"].elapsed_time(ev["forward_end"]),
            ev["d2h_start"].elapsed_time(ev["d2h_end"]),
            item.worker,
            host_ns["h2d_start"],
            host_ns["forward_start"],
            host_ns["d2h_start"],
            item.threads["h2d"],
            item.threads["predict"],
            item.threads["d2h"],
            item.formed_ns,
            len(item.members) * self.cfg.batch_size,
            item.padded_images,
            item.batch_id,
            self.instance,
        )
        rows = self.cfg.batch_size
        # Copies: the host buffer goes back to the pool before the responses are written, so that a frontend slow to
        # read never holds a buffer set.
        # Sliced and copied in numpy: a tenth of torch's cost per slice.
        if len(item.host_outputs) == 1:
            host = item.host_outputs[0].numpy()
            outputs = [(host[i * rows : (i + 1) * rows].copy(),) for i in range(len(item.members))]
        else:
            hosts = [leaf.numpy() for leaf in item.host_outputs]
            outputs = [
                tuple([leaf[i * rows : (i + 1) * rows].copy() for leaf in hosts]) for i in range(len(item.members))
            ]
        # Every buffer of this item is released only now, after the D2H event completed on the host: all work on
        # all streams that touched them is done.
        self.give_back_buffers(item.buffers)
        item.buffers = item.device_inputs = item.outputs = item.host_outputs = None
        for member, output in zip(item.members, outputs):
            timings = BackendTimings(member.taken_ns, *shared)
            self.responses.send(Response(member.request_id, output, timings))
        self.progress["responded"] += len(item.members)


class RequestSource:
    """The backend's reading end of the request transport, with the abort check built in: yields one work item
    per forward (a request, or with a `rule` a formed batch of them: --max_batch_size)."""

    def __init__(self, requests: RequestChannel, failure: Failure, stages: Stages, rule: BatchRule | None) -> None:
        self.requests = requests
        self.failure = failure
        self.stages = stages
        self.rule = rule  # None: every request is a forward of its own

    def take(self, timeout_s: float) -> Member | None:
        """The next request, None at the end marker; queue.Empty after timeout_s."""
        request = self.requests.receive(timeout_s)
        return None if request is None else self.stages.take(request)

    def __iter__(self) -> Iterator[WorkItem]:
        return self._one_by_one() if self.rule is None else self._batched(self.rule)

    def _batched(self, rule: BatchRule) -> Iterator[WorkItem]:
        room = lambda: acquire_or_abort(self.stages.free_forwards, self.failure)  # noqa: E731
        # sent_ns is on the frontend's perf_counter: the host's one monotonic clock, shared by its processes.
        arrived_s = lambda member: member.sent_ns / 1e9  # noqa: E731
        for members in Batcher(rule, self.take, self.failure.check, time.perf_counter, arrived_s, wait_for_room=room):
            yield self.stages.form(members)

    def _one_by_one(self) -> Iterator[WorkItem]:
        next_check_s = 0.0
        while True:
            # At least every POLL_S, as every wait does; not per request (the stop flags cost microseconds each).
            if (now_s := time.monotonic()) >= next_check_s:
                self.failure.check()
                next_check_s = now_s + POLL_S
            try:
                member = self.take(POLL_S)
            except queue.Empty:
                continue
            if member is None:  # the frontend has sent everything
                return
            yield self.stages.form([member])
