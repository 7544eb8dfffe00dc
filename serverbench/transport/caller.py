"""What a protocol's client (serverbench.transport.network's HttpCaller, serverbench.transport.grpc_caller's
GrpcCaller) offers the network client, and the error it raises for a request that was not answered with outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from serverbench.transport.oip import InferResult


class CallError(Exception):
    """A request the server answered with an error, or could not be sent."""

    def __init__(self, status: int | str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class Caller(Protocol):
    """One protocol's client: `encode` on the sender's thread, the rest on the loop."""

    def encode(self, request_id: int, arrays: Sequence[np.ndarray]) -> object: ...

    async def open(self) -> None: ...

    async def call(self, payload: object) -> InferResult: ...

    async def close(self) -> None: ...
