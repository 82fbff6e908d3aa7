"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol with slow-client limits.

A client gets `header_timeout_s` from the moment it connects (or starts its next request on a
kept-alive connection) to finish the request's headers; a client that stalls gets a 408 and the
connection is closed, so stalled sockets cannot pile up. Beyond `max_connections` open
connections a new one gets a 503 with Retry-After at once and is closed. A client that takes no
byte of its response for `stall_timeout_s` while the gateway holds bytes for it (it stopped
reading a stream) has its connection closed, which cancels its request's scheduler calls, so
its output is neither generated nor buffered on. (The body's deadline is the app's:
`app.read_body`; idle keep-alive connections close after uvicorn's keep-alive timeout; a client
that reads, but more slowly than its output is made, is held to what its stream may keep:
`scheduler_client.SchedulerClient`.)
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from npuserve.gateway.errors import APIError, request_timeout, unavailable
from npuserve.proto.channel import DEFAULT_STREAM_STALL_TIMEOUT_S

log = structlog.get_logger(__name__)

REFUSAL_LOG_INTERVAL_S = 10.0
# How often, within the stall timeout, a connection whose writes wait looks for bytes its client
# took: a client is cut off at most a quarter of the timeout after it stopped reading for as long.
STALL_CHECKS_PER_TIMEOUT = 4


class GuardedHttpProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with a deadline on request headers, a cap on open connections and a
    deadline on a client that stops reading; `guarded_protocol` makes one with the limits set."""

    header_timeout_s: float = 10.0
    max_connections: int = 1000
    stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S  # 0: a client may stop reading for ever
    _last_logged = 0.0  # shared by every connection: one log line per interval

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._unsent_bytes = 0  # what the transport held at the last check of a paused write
        self._last_taken = 0.0  # when the client last took a byte (loop time) while writes wait

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
        self._stop_stall_watch()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport holds more than its high-water mark: the response's writes wait for
        the client to take bytes, and from now on it has `stall_timeout_s` to take one."""
        super().pause_writing()
        if self.stall_timeout_s > 0 and self._stall_timer is None:
            self._unsent_bytes = self.transport.get_write_buffer_size()
            self._last_taken = self.loop.time()
            self._arm_stall_check()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_stall_watch()

    def _arm_stall_check(self) -> None:
        interval = self.stall_timeout_s / STALL_CHECKS_PER_TIMEOUT
        self._stall_timer = self.loop.call_later(interval, self._check_stall)

    def _stop_stall_watch(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _check_stall(self) -> None:
        """Closes the connection of a client that took no byte for `stall_timeout_s`; the bytes
        the transport holds only go down as the client takes them (the response's writes wait)."""
        self._stall_timer = None
        unsent, now = self.transport.get_write_buffer_size(), self.loop.time()
        if unsent < self._unsent_bytes:
            self._unsent_bytes, self._last_taken = unsent, now
        if now - self._last_taken < self.stall_timeout_s:
            self._arm_stall_check()
            return
        self._log_refusal(
            "client stopped reading its response", timeout_s=self.stall_timeout_s, unsent_bytes=unsent
        )
        # NOTE: abort, not close: close would wait to flush what the client does not take.
        self.transport.abort()

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
        """Answers ``error`` as a whole HTTP/1.1 response, and closes the connection."""
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
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        self.transport.close()

    def _log_refusal(self, event: str, **fields: object) -> None:
        now = self.loop.time()
        if now - GuardedHttpProtocol._last_logged >= REFUSAL_LOG_INTERVAL_S:  # a flood logs once
            GuardedHttpProtocol._last_logged = now
            log.warning(event, **fields)


def guarded_protocol(
    header_timeout_s: float, max_connections: int, stall_timeout_s: float
) -> type[GuardedHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these limits."""
    limits = {
        "header_timeout_s": header_timeout_s,
        "max_connections": max_connections,
        "stall_timeout_s": stall_timeout_s,
    }
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), limits)
