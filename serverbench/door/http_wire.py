"""What reaches the HTTP door below its application: uvicorn's httptools protocol, with a bound on a request's head
(its request line and headers) and every request refused at that level counted as the door's error answers, in
place of uvicorn's own plain-text 400 and the warning line it prints for each. A client that sends bytes no HTTP
parser takes (a bad Content-Length, a bad chunk, HTTP/2's preface, a CONNECT or an upgrade) gets a 400, one whose
head passes HEAD_LIMIT_BYTES a 431, each with a JSON error body as the door's other answers, and its connection
closed; the door serves on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

# A request's line and headers together (a Triton client sends a few hundred bytes; a browser's cookies a few KiB):
# past this, before the head has ended, the request is refused and its bytes are not kept. A chunk read from the
# socket may hold the end of the previous body too, so the bound is exact to within one read (256 KiB).
HEAD_LIMIT_BYTES = 1 << 20
LINGER_S = 0.2
MAX_LINGER_S = 5.0
UNPARSEABLE = "the request is not HTTP/1.1 this server can parse"
UPGRADE = "protocol upgrades (WebSocket, HTTP/2, CONNECT) are not served"
HEAD_TOO_LARGE = f"the request's line and headers pass {HEAD_LIMIT_BYTES // 1024} KiB"
# The scope's key of a function that says whether the request's client has gone: uvicorn's send() to a closed
# connection returns as if it had written, and an answer nobody received is no answer.
CLIENT_GONE = "serverbench.client_gone"
# The scope's key set when this protocol answered the request itself: its application counts nothing for it.
REFUSED = "serverbench.refused"
# uvicorn's one line when its graceful shutdown cancels a request still in the application: the door has counted
# that request already (its client gone before its answer), so the line says nothing the row does not.
CANCELLED_AT_CLOSE = "Cancel %s running task(s), timeout graceful shutdown exceeded"


def refusing_protocol(refused: Callable[[int], None]) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol that calls `refused(status)` for each request it refuses itself."""

    class RefusingProtocol(HttpToolsProtocol):
        head_bytes = 0  # bytes read since this connection's current request began, while its head had not ended
        in_head = True  # a connection's first bytes are a request's head
        closing: asyncio.TimerHandle | None = None  # refused: the connection's close, due once the client is quiet
        discard_until_s = 0.0
        deferred: tuple[int, str, object] | None = None  # a refusal held back: (status, why, the request after which)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.in_head = True

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.deferred is not None and (self.deferred[2] is None or self.deferred[2].response_complete):
                status, why, _ = self.deferred
                self.deferred = None
                self.refuse(status, why)

        def on_headers_complete(self) -> None:
            self.in_head, self.head_bytes = False, 0
            if self.parser.should_upgrade():  # CONNECT, an Upgrade: refused as the parser then stops (no app run)
                return
            super().on_headers_complete()
            cycle = self.cycle  # this request's, not the next one's on a kept-alive connection
            self.scope[CLIENT_GONE] = lambda: cycle.disconnected

        def data_received(self, data: bytes) -> None:
            if self.deferred is not None:  # a refusal waits for earlier answers: nothing after it is read
                return
            if self.closing is not None:  # refused: what still comes is read and dropped (see refuse)
                if self.loop.time() < self.discard_until_s:
                    self.closing.cancel()
                    self.closing = self.loop.call_later(LINGER_S, self.transport.close)
                return
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self.refuse(400, UPGRADE)
                return
            except httptools.HttpParserError:
                self.refuse(400, UNPARSEABLE)
                return
            if self.in_head:  # the read ended inside a head: the parser holds all of it so far
                self.head_bytes += len(data)
                if self.head_bytes > HEAD_LIMIT_BYTES:
                    self.refuse(431, HEAD_TOO_LARGE)

        def refuse(self, status: int, why: str) -> None:
            """The answer, then the connection closed once the client has been quiet for LINGER_S (at most
            MAX_LINGER_S): closed at once, a client still sending would get a reset, which loses the answer. A
            request whose body was being read (a bad chunk) is this answer's: its application sees the close and
            counts nothing more. After requests still being answered (pipelined), it waits for their answers, in
            the order HTTP/1.1 owes them."""
            cycle = self.cycle  # the last request whose head was read
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                # Bytes after a whole request (pipelined) that is still being served: its answer goes first
                self.deferred = (status, why, cycle)
                return
            queued = next((entry for entry in self.pipeline if entry[0] is cycle), None)
            if cycle is not None and queued is not None:
                # Its own body was bad, its head read behind requests still being answered: it never runs, and its
                # refusal follows the answer of the last one before it
                self.pipeline.remove(queued)
                self.deferred = (status, why, self.pipeline[0][0] if self.pipeline else None)
                return
            if cycle is not None and cycle.more_body and not self.in_head:  # its own body was being read
                cycle.scope[REFUSED] = True
            refused(status)
            body = orjson.dumps({"error": why})
            head = b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
            self.transport.write(STATUS_LINE[status] + head + body)
            self.discard_until_s = self.loop.time() + MAX_LINGER_S
            self.closing = self.loop.call_later(LINGER_S, self.transport.close)

    return RefusingProtocol


class DropCancelledAtClose(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != CANCELLED_AT_CLOSE


def quiet_cancel_at_close() -> None:
    """uvicorn's logger without its line for requests its shutdown cancels (see CANCELLED_AT_CLOSE)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DropCancelledAtClose) for f in logger.filters):
        logger.addFilter(DropCancelledAtClose())
