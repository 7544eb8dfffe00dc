"""The door's gRPC side: Triton's inference.GRPCInferenceService (the Open Inference Protocol's gRPC API) on grpc.aio,
over the same DoorCore as the HTTP side and with its behaviour: the same checks and messages (oip_grpc.py), the same
counts, and the same serverbench_timings request parameter that puts the backend's stamps into the answer.

    ServerLive, ServerReady, ServerMetadata     (the extensions perf_analyzer reads)
    ModelReady, ModelMetadata, ModelConfig      (Triton's model configuration)
    ModelStatistics                             (an empty name: every model, i.e. ours)
    ModelInfer                                  (raw_input_contents or typed contents; answers in raw_output_contents)

Every refusal is a ProtocolError mapped to its gRPC code (400 INVALID_ARGUMENT, 404 NOT_FOUND, 503 UNAVAILABLE, ...)
and counted for the row under its HTTP status; the door serves on. A message over the door's body limit is refused by
grpc itself with RESOURCE_EXHAUSTED before any handler runs, so the door never sees it and cannot count it. The
methods left out (shared memory, repository, trace, log, streaming) are the base class's: UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import NoReturn

import grpc
import orjson
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2, service_pb2_grpc

from serverbench.door.core import DoorCore
from serverbench.door.http_app import SERVER_EXTENSIONS, SERVER_VERSION
from serverbench.transport.grpc_caller import grpc_target
from serverbench.transport.oip import TIMINGS_PARAMETER, ProtocolError
from serverbench.transport.oip_grpc import (
    config_response,
    grpc_infer_response,
    metadata_response,
    parse_grpc_infer,
    statistics_response,
)

MAX_DETAILS_CHARS = 1000  # an error's message in a gRPC status (a header: grpc's limit on them is 8 KiB)
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1  # grpc's channel arguments are C ints
Context = grpc.aio.ServicerContext


class DoorServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The servicer over one DoorCore; every method runs on the door's loop, under the API's own (CamelCase) name."""

    def __init__(self, core: DoorCore) -> None:
        self.core = core
        self.server_metadata = service_pb2.ServerMetadataResponse(
            name="serverbench", version=SERVER_VERSION, extensions=list(SERVER_EXTENSIONS)
        )

    async def _refuse(self, context: Context, exc: ProtocolError) -> NoReturn:
        """Counts the refusal and ends the call with its gRPC code (context.abort raises)."""
        self.core.failed(exc.status)
        # Cut short: a message echoing a request's 100,000-dimension shape passed grpc's metadata limit, and the
        # client got RESOURCE_EXHAUSTED "Stream removed" instead of its INVALID_ARGUMENT
        await context.abort(grpc.StatusCode[exc.grpc_code], exc.message[:MAX_DETAILS_CHARS])

    # -------------------------------------------------------------------------------- the server

    async def ServerLive(
        self, request: service_pb2.ServerLiveRequest, context: Context
    ) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: service_pb2.ServerReadyRequest, context: Context
    ) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self.core.ready)

    async def ServerMetadata(
        self, request: service_pb2.ServerMetadataRequest, context: Context
    ) -> service_pb2.ServerMetadataResponse:
        return self.server_metadata

    # -------------------------------------------------------------------------------- the model

    async def ModelReady(
        self, request: service_pb2.ModelReadyRequest, context: Context
    ) -> service_pb2.ModelReadyResponse:
        try:
            self.core.check_model(request.name, request.version)
        except ProtocolError as exc:
            await self._refuse(context, exc)
        return service_pb2.ModelReadyResponse(ready=self.core.ready)

    async def ModelMetadata(
        self, request: service_pb2.ModelMetadataRequest, context: Context
    ) -> service_pb2.ModelMetadataResponse:
        try:
            self.core.check_model(request.name, request.version)
            return metadata_response(self.core.described_spec())
        except ProtocolError as exc:
            await self._refuse(context, exc)

    async def ModelConfig(
        self, request: service_pb2.ModelConfigRequest, context: Context
    ) -> service_pb2.ModelConfigResponse:
        try:
            self.core.check_model(request.name, request.version)
            return config_response(self.core.described_spec())
        except ProtocolError as exc:
            await self._refuse(context, exc)

    async def ModelStatistics(
        self, request: service_pb2.ModelStatisticsRequest, context: Context
    ) -> service_pb2.ModelStatisticsResponse:
        try:
            if request.name:  # an empty name asks for every model: ours is the only one
                self.core.check_model(request.name, request.version)
            return statistics_response(self.core.spec, self.core.stats)
        except ProtocolError as exc:
            await self._refuse(context, exc)

    async def ModelInfer(
        self, request: service_pb2.ModelInferRequest, context: Context
    ) -> service_pb2.ModelInferResponse:
        # grpc has received and parsed the whole message by now: the arrival is as early as a handler can stamp it
        arrived_ns = time.perf_counter_ns()
        core = self.core
        try:
            core.check_model(request.model_name, request.model_version)
            parsed = parse_grpc_infer(request, core.spec)
            answer = await core.infer(parsed.arrays, arrived_ns)
            parameters = None
            if parsed.parameters.get(TIMINGS_PARAMETER):
                timings = list(answer.response.timings.__dict__.values())
                parameters = {TIMINGS_PARAMETER: orjson.dumps(timings).decode()}
            response = grpc_infer_response(core.spec, parsed.id, answer.response.outputs, parsed.outputs, parameters)
        except ProtocolError as exc:
            await self._refuse(context, exc)
        except asyncio.CancelledError:
            # The client cancelled, its deadline passed, or the server is stopping: gone before its answer
            core.failed(0, disconnected=True)
            raise
        # Counted once the answer is built: grpc writes it after this returns, where no handler can stamp it
        core.answered(answer, time.perf_counter_ns())
        return response


def _unimplemented(name: str) -> Callable:
    """The rest of the API (the model repository, shared memory, tracing, logging, streaming): counted and answered
    UNIMPLEMENTED in one line, where the generated servicer's NotImplementedError printed a traceback each."""

    async def refuse(self: DoorServicer, request: object, context: Context) -> NoReturn:
        await self._refuse(
            context, ProtocolError(501, f"{name} is not served by this door (inference, metadata and statistics are)")
        )

    refuse.__name__ = name
    return refuse


for _name in [n for n in dir(service_pb2_grpc.GRPCInferenceServiceServicer) if not n.startswith("_")]:
    if _name not in vars(DoorServicer):
        setattr(DoorServicer, _name, _unimplemented(_name))


SERVICE = "inference.GRPCInferenceService"


def method_handlers(servicer: DoorServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The service's methods as the generated code registers them, but for a unary call's request, which the door
    parses itself (parsed): grpc's own parse answered bytes that are no such message with UNKNOWN and a traceback."""
    handlers = {}
    for method in service_pb2.DESCRIPTOR.services_by_name[SERVICE.split(".")[1]].methods:
        request_type = getattr(service_pb2, method.input_type.name)
        serialize = getattr(service_pb2, method.output_type.name).SerializeToString
        call = getattr(servicer, method.name)
        if method.client_streaming or method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(call, request_type.FromString, serialize)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                parsed(servicer, call, request_type), None, serialize
            )
    return handlers


def parsed(servicer: DoorServicer, call: Callable, request_type: type) -> Callable:
    """`call` on the request parsed from its bytes; bytes that are no such message are counted and answered
    INVALID_ARGUMENT in one line."""

    checks_token = request_type not in (service_pb2.ServerLiveRequest, service_pb2.ServerReadyRequest)

    async def handle(data: bytes, context: Context) -> object:
        if checks_token:  # a load balancer's health check carries no token
            try:
                servicer.core.check_token(dict(context.invocation_metadata() or ()).get("authorization"))
            except ProtocolError as exc:
                await servicer._refuse(context, exc)
        try:
            request = request_type.FromString(data)
        except DecodeError as exc:
            await servicer._refuse(context, ProtocolError(400, f"not a {request_type.__name__} message: {exc}"))
        return await call(request, context)

    return handle


async def start_grpc_door(core: DoorCore, host: str, port: int) -> grpc.aio.Server:
    """The door's gRPC server, listening on host:port (port 0: one the system picks) and started; the port it bound
    is the server's `bound_port`. OSError when the address cannot be bound."""
    options = [
        # A larger request is refused by grpc itself (RESOURCE_EXHAUSTED), as the HTTP side answers 413
        ("grpc.max_receive_message_length", min(core.limits.max_body_bytes, MAX_GRPC_MESSAGE_BYTES)),
        # Answers are as large as the model makes them (grpc's default, unlimited): the limit guards what comes in
        ("grpc.max_send_message_length", -1),
        # grpc sets SO_REUSEPORT by default: a second door on a busy port would bind and share its connections
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    handlers = grpc.method_handlers_generic_handler(SERVICE, method_handlers(DoorServicer(core)))
    server.add_generic_rpc_handlers((handlers,))
    address = grpc_target(host, port)
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError:  # grpc >= 1.5x raises where older ones returned 0
        bound_port = 0
    if bound_port == 0:
        raise OSError(f"the gRPC door could not bind {address}: the port is taken or the address is not this host's")
    server.bound_port = bound_port  # the port bound, for a caller that asked for port 0
    await server.start()
    return server
