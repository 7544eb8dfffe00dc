"""The frontend's gRPC client (--transport grpc): our load generator's Caller over grpc.aio, to our door or to any
server of Triton's inference.GRPCInferenceService.

One channel (one HTTP/2 connection, every request in flight a stream on it; perf_analyzer shares a connection among
six of its clients by default, and bench.peers makes it use one as we do), created in `open` on the loop that
makes the calls. `encode` builds the ModelInferRequest and serialises it on the
sender's thread, so the loop only hands bytes to grpc (the method is registered without a request serialiser) and
parses the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from serverbench.transport.caller import CallError, auth_headers
from serverbench.transport.oip import TIMINGS_PARAMETER, InferResult
from serverbench.transport.oip_grpc import grpc_infer_request, parse_grpc_result

SERVICE = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name  # inference.GRPCInferenceService
INFER_METHOD = f"/{SERVICE}/ModelInfer"
MAX_MESSAGE_BYTES = 2**31 - 1  # grpc's largest (a C int): big batches pass both ways; the server sets its own limit


def grpc_target(host: str, port: int) -> str:
    """host:port as grpc reads it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcCaller:
    """ModelInfer over one grpc.aio channel, each call with the run's timeout as its deadline."""

    def __init__(
        self,
        host: str,
        port: int,
        model: str,
        names: Sequence[str],
        timings: bool,
        timeout_s: float,
        token: str | None = None,
    ) -> None:
        self.target = grpc_target(host, port)
        self.metadata = tuple(auth_headers(token).items()) or None
        self.model = model
        self.names = tuple(names)
        self.parameters = {TIMINGS_PARAMETER: True} if timings else None
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._infer: grpc.aio.UnaryUnaryMultiCallable | None = None

    def encode(self, request_id: int, arrays: Sequence[np.ndarray]) -> bytes:
        """The request's wire bytes: built and serialised here, on the sender's thread."""
        request = grpc_infer_request(self.model, str(request_id), list(zip(self.names, arrays)), self.parameters)
        return request.SerializeToString()

    async def open(self) -> None:
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self._channel = grpc.aio.insecure_channel(self.target, options=options)
        # No request serialiser: grpc sends the bytes `encode` made as they are
        self._infer = self._channel.unary_unary(
            INFER_METHOD, request_serializer=None, response_deserializer=service_pb2.ModelInferResponse.FromString
        )

    async def call(self, payload: bytes) -> InferResult:
        try:
            # wait_for_ready: a door that is not listening yet (its process still starting) is waited for within
            # the deadline rather than failing the call at once
            response = await self._infer(payload, timeout=self.timeout_s, wait_for_ready=True, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise CallError(exc.code().name, exc.details() or "") from None
        try:
            return parse_grpc_result(response)
        except ValueError as exc:  # a malformed answer fails the request like an error answer
            raise CallError("malformed", str(exc)) from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
