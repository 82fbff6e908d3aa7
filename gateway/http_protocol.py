"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol with slow-client limits.

A client gets `header_timeout_s` from the moment it connects (or starts its next request on a
kept-alive connection) to finish the request's headers; a client that stalls gets a 408 and the
connection is closed, so stalled sockets cannot pile up. Beyond `max_connections` open
connections a new one gets a 503 with Retry-After at once and is closed. (The body's deadline is
the app's: `app.read_body`; idle keep-alive connections close after uvicorn's keep-alive timeout.)
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from npuserve.gateway.errors import APIError, request_timeout, unavailable

log = structlog.get_logger(__name__)

REFUSAL_LOG_INTERVAL_S = 10.0


def raw_response(error: APIError) -> bytes:
    """``error`` as a whole HTTP/1.1 response that closes the connection."""
    body = error.json_bytes()
    lines = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        *(
            f"{name.lower()}: {value}"
            for name, value in error.headers.items()
            if name.lower() != "connection"
        ),
        "connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with a deadline on request headers and a cap on open connections;
    `guarded_protocol` makes one with the limits set."""

    header_timeout_s: float = 10.0
    max_connections: int = 1000
    _last_logged = 0.0  # shared by every connection: one log line per interval

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._log_refusal("too many connections", connections=len(self.connections))
            self._refuse(unavailable(f"the gateway holds its --max-connections={self.max_connections}"))
            return
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.cycle is None or self.cycle.response_complete:  # not behind a pipelined response
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        self._log_refusal("request headers too slow", timeout_s=self.header_timeout_s)
        self._refuse(
            request_timeout(f"the request headers did not arrive within {self.header_timeout_s:g} s")
        )

    def _refuse(self, error: APIError) -> None:
        self.transport.write(raw_response(error))
        self.transport.close()

    def _log_refusal(self, event: str, **fields: object) -> None:
        now = self.loop.time()
        if now - GuardedHttpProtocol._last_logged >= REFUSAL_LOG_INTERVAL_S:  # a flood logs once
            GuardedHttpProtocol._last_logged = now
            log.warning(event, **fields)


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[GuardedHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these limits."""
    limits = {"header_timeout_s": header_timeout_s, "max_connections": max_connections}
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), limits)
