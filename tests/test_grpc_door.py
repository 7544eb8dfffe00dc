"""The door's gRPC side over a fake echo backend: tritonclient's own gRPC client reads it (a client nobody here
wrote), our GrpcCaller round-trips outputs and the serverbench_timings stamps, and every bad request is refused
with its gRPC code and message, counted, and followed by a good answer. No model, no torch: the door runs on an
event loop of its own thread, as it does in its process."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import grpc
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from serverbench.door import core as core_module
from serverbench.door.core import DoorCore, DoorLimits
from serverbench.door.grpc_service import start_grpc_door
from serverbench.records.row import serve_only_columns
from serverbench.records.summary import summarize
from serverbench.schema.messages import BackendReady, Response, served_as_frontend
from serverbench.schema.records import BackendTimings
from serverbench.transport.caller import CallError
from serverbench.transport.grpc_caller import TIMINGS_PARAMETER, GrpcCaller
from serverbench.transport.oip import InferResult, ModelSpec, TensorSpec
from serverbench.transport.oip_grpc import grpc_infer_request, parse_grpc_result

MODEL = "echo"
BATCH = 2
ROW_SHAPE = (3, 4, 4)
MAX_BODY_BYTES = 64 * 1024  # a good request is 384 bytes of tensor
WAIT_S = 10.0  # the longest any call or wait here may take: a hang fails instead of stalling the suite
SPEC = ModelSpec(MODEL, (TensorSpec("input0", "FP32", ROW_SHAPE),), (), batch_size=BATCH, max_batch_size=BATCH)
READY = BackendReady(
    device="cpu",
    device_name="fake",
    device_uuid=None,
    timing_source="host",
    model_build_s=0.0,
    torch_load_time_s=None,
    compile_time_s=None,
    torch_version="none",
    cuda_version=None,
    output_leaves=(("float32", ROW_SHAPE),),
)


def batch(offset: float = 0.0, dtype: str = "float32", shape: tuple[int, ...] = (BATCH, *ROW_SHAPE)) -> np.ndarray:
    return (np.arange(np.prod(shape)).reshape(shape) + offset).astype(dtype)


class EchoLink:
    """The backend as a fake: each request's first input comes back as its one output, on the loop, with stamps
    placed after the request's arrival (the statistics count durations from them). Before it is ready it holds the
    requests, as a backend still building its model does; `hold`: no answer at all."""

    def __init__(self) -> None:
        self.room = asyncio.Event()
        self.core: DoorCore | None = None
        self.hold = False
        self.timings: dict[int, BackendTimings] = {}
        self._waiting: list[tuple[int, np.ndarray, int]] = []

    def submit(self, request_id: int, arrays: list[np.ndarray], sent_ns: int) -> bool:
        if not self.core.ready:
            self._waiting.append((request_id, arrays[0], sent_ns))
        elif not self.hold:
            asyncio.get_running_loop().call_soon(self._answer, request_id, arrays[0], sent_ns)
        return True

    def _answer(self, request_id: int, array: np.ndarray, sent_ns: int) -> None:
        timings = BackendTimings(sent_ns + 1000, sent_ns + 2000, sent_ns + 3000, sent_ns + 4000, 0.5, 1.25, 0.25, 0)
        self.timings[request_id] = timings
        self.core.on_message(Response(request_id, (array * 1,), timings))

    def ready(self) -> None:
        """On the loop: the backend says it is ready (its outputs), then answers what came before."""
        self.core.on_message(READY)
        for waiting in self._waiting:
            self._answer(*waiting)
        self._waiting.clear()

    def finish(self, instances: int) -> None:
        return None


class Door:
    """A gRPC door on 127.0.0.1 (a port the system picked) over an EchoLink, its loop on a thread of its own."""

    def __init__(self, token: str | None = None) -> None:
        self.link = EchoLink()
        limits = DoorLimits(
            timeout_s=5.0,
            warmup_timeout_s=5.0,
            max_body_bytes=MAX_BODY_BYTES,
            warmup_requests=0,
            keep_records=True,
            instances=1,
            auth_token=token,
        )
        self.core = DoorCore(SPEC, self.link, limits, None, "127.0.0.1")
        self.link.core = self.core
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="door", daemon=True)
        self._thread.start()
        self.server = self.run(start_grpc_door(self.core, "127.0.0.1", 0))
        self.port: int = self.server.bound_port

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(WAIT_S)

    def make_ready(self) -> None:
        self.loop.call_soon_threadsafe(self.link.ready)
        wait_until(lambda: self.core.ready)

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT_S)
        self.loop.close()


def wait_until(condition: Callable[[], bool]) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline_s, "the door never got there"
        time.sleep(0.005)


@pytest.fixture
def unready_door() -> Iterator[Door]:
    door = Door()
    yield door
    door.stop()


@pytest.fixture
def door(unready_door: Door) -> Door:
    unready_door.make_ready()
    return unready_door


@pytest.fixture
def stub(unready_door: Door) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{unready_door.port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def good_request(request_id: str = "good") -> service_pb2.ModelInferRequest:
    return grpc_infer_request(MODEL, request_id, [("input0", batch())])


def assert_serves(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    result = parse_grpc_result(stub.ModelInfer(good_request(), timeout=WAIT_S))
    assert result.id == "good"
    np.testing.assert_array_equal(result.outputs[0][1], batch())


# ------------------------------------------------------------------------------------ (a) tritonclient's own client


def test_tritonclient_reads_the_door(door: Door) -> None:
    client = triton.InferenceServerClient(f"127.0.0.1:{door.port}")
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        server = client.get_server_metadata()
        assert server.name == "serverbench" and "statistics" in server.extensions
        metadata = client.get_model_metadata(MODEL)
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("input0", "FP32", [-1, 3, 4, 4])]
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("output0", "FP32", [-1, 3, 4, 4])]
        config = client.get_model_config(MODEL).config
        assert config.max_batch_size == BATCH and list(config.input[0].dims) == list(ROW_SHAPE)
        assert config.output[0].data_type == model_config_pb2.TYPE_FP32

        tensor = triton.InferInput("input0", [BATCH, *ROW_SHAPE], "FP32")
        tensor.set_data_from_numpy(batch(1.5))
        result = client.infer(MODEL, [tensor], request_id="r1", outputs=[triton.InferRequestedOutput("output0")])
        np.testing.assert_array_equal(result.as_numpy("output0"), batch(1.5))
        assert result.get_response().id == "r1"

        for name in (MODEL, ""):  # the model's statistics, and every model's (ours alone)
            (model,) = client.get_inference_statistics(name).model_stats
            assert (model.name, model.inference_count, model.execution_count) == (MODEL, BATCH, 1)
            assert model.inference_stats.success.count == 1 and model.inference_stats.queue.ns > 0
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
            client.get_model_metadata("nope")
        # A 20,000-character name: NOT_FOUND with the name cut short (its echo made the status too large to send).
        with pytest.raises(InferenceServerException, match=r"\(20000 characters\)") as caught:
            client.get_model_metadata("m" * 20_000)
        assert caught.value.status() == "StatusCode.NOT_FOUND" and len(caught.value.message()) < 300
    finally:
        client.close()
    assert door.core.report.answered == 1 and door.core.report.errors == {404: 2}
    assert len(door.core.ended_report().records) == 1


# ------------------------------------------------------------------------------------ (b) our GrpcCaller


async def caller_calls(port: int) -> tuple[list[InferResult], CallError]:
    """Three requests asking for the stamps and one not, at once, then one to an unknown model."""
    ours = GrpcCaller("127.0.0.1", port, MODEL, ["input0"], True, WAIT_S)
    plain = GrpcCaller("127.0.0.1", port, MODEL, ["input0"], False, WAIT_S)
    lost = GrpcCaller("127.0.0.1", port, "nope", ["input0"], True, WAIT_S)
    callers = [ours, ours, ours, plain]
    payloads = [caller.encode(i, [batch(i)]) for i, caller in enumerate(callers)]  # the sender thread's part
    for caller in (ours, plain, lost):
        await caller.open()
    try:
        results = await asyncio.gather(*(caller.call(payload) for caller, payload in zip(callers, payloads)))
        with pytest.raises(CallError) as unknown:
            await lost.call(lost.encode(9, [batch()]))
    finally:
        for caller in (ours, plain, lost):
            await caller.close()
    return list(results), unknown.value


def test_our_caller_round_trips_outputs_and_timings(door: Door) -> None:
    results, unknown = asyncio.run(caller_calls(door.port))
    for i, result in enumerate(results):
        assert result.id == str(i) and result.outputs[0][0] == "output0"
        np.testing.assert_array_equal(result.outputs[0][1], batch(i))
    # What network.timings_of reads: the stamps the backend put on each request, field for field
    stamps = [BackendTimings(*orjson.loads(result.parameters[TIMINGS_PARAMETER])) for result in results[:3]]
    backend_stamps = list(door.link.timings.values())  # by the door's ids, which are not the client's
    assert len(backend_stamps) == 4 and all(stamp in backend_stamps for stamp in stamps)
    assert len({stamp.taken_ns for stamp in stamps}) == 3  # each answer its own request's
    assert TIMINGS_PARAMETER not in results[3].parameters  # not asked: a plain answer
    assert (unknown.status, "unknown model 'nope'" in unknown.message) == ("NOT_FOUND", True)
    assert door.core.report.answered == 4 and door.core.report.errors == {404: 1}


def test_our_caller_waits_for_a_server_within_its_deadline_then_reports_it() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def call() -> None:
        # wait_for_ready: a door still starting is waited for, up to the call's deadline (here short)
        caller = GrpcCaller("127.0.0.1", port, MODEL, ["input0"], False, 0.5)
        await caller.open()
        try:
            await caller.call(caller.encode(0, [batch()]))
        finally:
            await caller.close()

    started = time.monotonic()
    with pytest.raises(CallError) as caught:
        asyncio.run(call())
    assert caught.value.status == "DEADLINE_EXCEEDED" and 0.4 < time.monotonic() - started < 5


# ------------------------------------------------------------------------------------ (c) bad requests


def infer_with(
    name: str = "input0", array: np.ndarray | None = None, model: str = MODEL
) -> service_pb2.ModelInferRequest:
    return grpc_infer_request(model, "bad", [(name, batch() if array is None else array)])


OVER_LIMIT = batch(shape=(BATCH, 3, 64, 64))  # 96 KiB of tensor, over the door's 64 KiB
BAD_REQUESTS = [
    # method, request, ready first, code, phrase of its message, the status counted (None: not counted)
    pytest.param(
        "ModelInfer", infer_with(model="nope"), True, grpc.StatusCode.NOT_FOUND, "unknown model 'nope'", 404,
        id="unknown-model",
    ),
    pytest.param(
        "ModelInfer", infer_with(array=batch(shape=(1, *ROW_SHAPE))), True, grpc.StatusCode.INVALID_ARGUMENT,
        "has shape [1, 3, 4, 4], expected [2, 3, 4, 4]", 400, id="wrong-shape",
    ),
    pytest.param(
        "ModelInfer", infer_with(array=batch(dtype="float64")), True, grpc.StatusCode.INVALID_ARGUMENT,
        "is FP64, but model 'echo' takes FP32", 400, id="wrong-dtype",
    ),
    pytest.param(
        "ModelInfer", infer_with(name="image"), True, grpc.StatusCode.INVALID_ARGUMENT, "unknown input 'image'", 400,
        id="wrong-input-name",
    ),
    # grpc refuses it before any handler runs: the door never sees it, so it is not counted
    pytest.param(
        "ModelInfer", infer_with(array=OVER_LIMIT), True, grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"larger than max ({infer_with(array=OVER_LIMIT).ByteSize()} vs. {MAX_BODY_BYTES})", None, id="over-the-limit",
    ),
    pytest.param(
        "ModelMetadata", service_pb2.ModelMetadataRequest(name=MODEL), False, grpc.StatusCode.UNAVAILABLE,
        "is not ready yet", 503, id="metadata-before-ready",
    ),
]  # fmt: skip


@pytest.mark.parametrize("method, request_message, ready, code, phrase, status", BAD_REQUESTS)
def test_bad_request_is_refused_and_the_door_serves_on(
    unready_door: Door,
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
    method: str,
    request_message: Any,
    ready: bool,
    code: grpc.StatusCode,
    phrase: str,
    status: int | None,
) -> None:
    if ready:
        unready_door.make_ready()
    with pytest.raises(grpc.RpcError) as caught:
        getattr(stub, method)(request_message, timeout=WAIT_S)
    assert caught.value.code() == code
    assert phrase in caught.value.details()
    if not ready:
        unready_door.make_ready()
    assert_serves(stub)
    assert unready_door.core.report.errors == ({} if status is None else {status: 1})
    assert unready_door.core.report.answered == 1


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_client_gone_mid_request_is_a_disconnect(
    door: Door, stub: service_pb2_grpc.GRPCInferenceServiceStub, how: str
) -> None:
    door.link.hold = True  # the backend never answers: the client leaves first
    if how == "cancel":
        call = stub.ModelInfer.future(good_request(), timeout=WAIT_S)
        wait_until(lambda: door.core.pending == 1)
        call.cancel()
    else:
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(good_request(), timeout=0.2)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: door.core.report.disconnects == 1 and door.core.pending == 0)
    door.link.hold = False
    assert_serves(stub)
    assert door.core.report.errors == {} and door.core.report.answered == 1


def test_the_rest_of_the_api_is_unimplemented(
    door: Door, stub: service_pb2_grpc.GRPCInferenceServiceStub, capfd: pytest.CaptureFixture
) -> None:
    """Answered UNIMPLEMENTED in one line and counted, with no traceback (the generated servicer's
    NotImplementedError printed 13 lines each)."""
    for method, message in (
        ("RepositoryIndex", service_pb2.RepositoryIndexRequest()),
        ("SystemSharedMemoryStatus", service_pb2.SystemSharedMemoryStatusRequest()),
        ("TraceSetting", service_pb2.TraceSettingRequest()),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            getattr(stub, method)(message, timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert caught.value.details().startswith(f"{method} is not served by this door")
    with pytest.raises(grpc.RpcError) as streamed:
        list(stub.ModelStreamInfer(iter([service_pb2.ModelInferRequest(model_name=MODEL)]), timeout=WAIT_S))
    assert streamed.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert door.core.report.errors == {501: 4}
    assert_serves(stub)
    assert "Traceback" not in capfd.readouterr().err


def test_bytes_that_are_no_request_message_are_invalid_argument_and_counted(
    door: Door, stub: service_pb2_grpc.GRPCInferenceServiceStub, capfd: pytest.CaptureFixture
) -> None:
    """Garbage where a ModelInfer or ModelReady request should be: INVALID_ARGUMENT in one line, counted as a 400,
    and the door serves on (grpc's own parse answered UNKNOWN and printed a traceback)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{door.port}")
    for method in ("ModelInfer", "ModelReady"):
        raw = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff\xff garbage", timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert caught.value.details().startswith(f"not a {method}Request message")
    # A shape of 30,000 dimensions: its message echoed them all, past grpc's limit on a status (the client read
    # RESOURCE_EXHAUSTED "Stream removed")
    request = good_request()
    request.inputs[0].shape.extend([1] * 30_000)  # within the door's 64 KiB body limit
    with pytest.raises(grpc.RpcError) as caught:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(caught.value.details()) <= 1000
    channel.close()
    assert door.core.report.errors == {400: 3}
    assert_serves(stub)
    assert "Traceback" not in capfd.readouterr().err


def test_a_door_with_a_token_serves_only_calls_that_carry_it_and_health_checks() -> None:
    door = Door(token="s3cret.token")
    try:
        door.make_ready()
        with grpc.insecure_channel(f"127.0.0.1:{door.port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=WAIT_S).live  # health: no token
            for metadata in ((), (("authorization", "Bearer wrong.token"),), (("authorization", "s3cret.token"),)):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ModelInfer(good_request(), timeout=WAIT_S, metadata=metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "Authorization: Bearer <token>" in caught.value.details()
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=MODEL), timeout=WAIT_S)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for carried in ((("authorization", "Bearer s3cret.token"),), (("authorization", "bearer s3cret.token"),)):
                answer = stub.ModelInfer(good_request(), timeout=WAIT_S, metadata=carried)  # the scheme, any case
                np.testing.assert_array_equal(parse_grpc_result(answer).outputs[0][1], batch())
        assert door.core.report.errors == {401: 4} and door.core.report.answered == 2
    finally:
        door.stop()


def test_a_serve_only_doors_records_stay_within_its_sample_and_the_row_counts_them_all(monkeypatch) -> None:
    """--serve_only's door grew about 1 KB a request for as long as it served: past its sample's size it keeps a
    uniform sample of the records, and the row's counts come from the exact totals."""
    monkeypatch.setattr(core_module, "SERVED_SAMPLE", 20)
    door = Door()
    try:
        door.make_ready()
        with grpc.insecure_channel(f"127.0.0.1:{door.port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(60):
                assert_serves(stub)
        report = door.core.ended_report()
    finally:
        door.stop()
    assert len(report.records) == 20 and report.totals.count == 60 and report.totals.kept == 20
    served = served_as_frontend(report)
    assert served.requests_sent == 60 and served.totals == report.totals
    summary = summarize(served.records, served.requests_sent, totals=served.totals)
    assert summary.responses_received == 60 and summary.responses_missing == 0
    note = serve_only_columns(report.totals)["noise_note"]
    assert note.endswith(
        "latency, stage and per-instance figures from a uniform sample of 20 of the 60 requests (counts and "
        "throughput from all; no busy fraction)"
    )


def test_a_taken_port_is_an_os_error(door: Door) -> None:
    # grpc sets SO_REUSEPORT unless told not to: a second door would bind the first's port and share its clients
    with pytest.raises(OSError, match=f"could not bind 127.0.0.1:{door.port}"):
        door.run(start_grpc_door(door.core, "127.0.0.1", door.port))


def test_a_request_before_the_backend_is_ready_waits_for_it(
    unready_door: Door, stub: service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    assert not stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=WAIT_S).ready
    assert not stub.ModelReady(service_pb2.ModelReadyRequest(name=MODEL), timeout=WAIT_S).ready
    call = stub.ModelInfer.future(good_request(), timeout=WAIT_S)  # the backend's warm-up: the door holds it
    wait_until(lambda: unready_door.core.pending == 1)
    unready_door.make_ready()
    np.testing.assert_array_equal(parse_grpc_result(call.result()).outputs[0][1], batch())
    assert stub.ModelReady(service_pb2.ModelReadyRequest(name=MODEL), timeout=WAIT_S).ready
    assert unready_door.core.report.answered == 1 and unready_door.core.report.errors == {}
