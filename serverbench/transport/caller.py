"""What a protocol's client (serverbench.transport.network's HttpCaller, serverbench.transport.grpc_caller's
GrpcCaller) offers the network client, and the error it raises for a request that was not answered with outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from serverbench.transport.oip import InferResult


def auth_headers(token: str | None) -> dict[str, str]:
    """What a request carries to a door that asks for a token (--auth_token): an HTTP header, or gRPC metadata of
    the same (lower-case) name."""
    return {} if token is None else {"authorization": f"Bearer {token}"}


class CallError(Exception):
    """A request the server answered with an error, or could not be sent."""

    def __init__(self, status: int | str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message

    def described(self, request_id: int) -> str:
        """What befell the request, in words: an answer (an HTTP status, a gRPC code, one we cannot read), or none
        (no connection: the server gone, or this process out of open files; no answer in time)."""
        if self.status in ("unreachable", "timeout"):
            return f"request {request_id} got no answer: {self.message}"
        return f"the server answered request {request_id} with {self.status}: {self.message}"


class Caller(Protocol):
    """One protocol's client: `encode` on the sender's thread, the rest on the loop."""

    def encode(self, request_id: int, arrays: Sequence[np.ndarray]) -> object: ...

    async def open(self) -> None: ...

    async def call(self, payload: object) -> InferResult: ...

    async def close(self) -> None: ...
