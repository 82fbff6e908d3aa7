"""How long a client may leave a response stream unread: `WriteWatch` times the writes of one of
the public API's streams (`Generate`, `GenerateMany`), and a write that waits the stall timeout
(`--stream-stall-timeout`) ends the stream.

A write waits while its client does not read: gRPC's flow control holds it until the client takes
what was sent before, while the engine would go on making the stream's tokens, kept until
written. The watch cannot take a message back from gRPC, so at the stall it calls the stream's
``on_stall``, which aborts its requests: their blocks are freed and nothing more is made for them.
Once the write goes through (the client read again) the stream ends with `StreamStalled`
(ABORTED); a client that never reads again holds its call, and the one message, until it goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

import structlog

log = structlog.get_logger(__name__)


class StreamStalled(Exception):
    """The stream's client left a response unread for the stall timeout (gRPC ABORTED)."""


class WriteWatch:
    """The writes of one stream: between `writing` and `written`, one waits. A write that waits
    ``timeout_s`` (0: never too long) calls ``on_stall`` once, at once, and `written` then raises
    `StreamStalled`. Used as a context manager: leaving it stops the watch."""

    def __init__(self, timeout_s: float, on_stall: Callable[[], None]) -> None:
        self._timeout_s = timeout_s
        self._on_stall = on_stall
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None  # when the write that waits began
        self.stalled = False

    def __enter__(self) -> WriteWatch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def writing(self) -> None:
        """A response is being written (the stream's generator yields it)."""
        if self._timeout_s <= 0:
            return
        self._waiting_since = now = self._loop.time()
        # NOTE: one timer for many writes: it looks at the write waiting when it fires, and is
        # set again for that write's deadline (a write per token costs no timer of its own).
        if self._timer is None:
            self._timer = self._loop.call_at(now + self._timeout_s, self._check)

    def written(self) -> None:
        """The response went through; raises `StreamStalled` if it waited past the timeout."""
        self._waiting_since = None
        if self.stalled:
            raise StreamStalled(
                f"the client did not read the stream for {self._timeout_s:g} s "
                "(--stream-stall-timeout); its requests were aborted"
            )

    def _check(self) -> None:
        self._timer = None
        since = self._waiting_since
        if since is None or self.stalled:
            return  # no write waits: the next one sets the timer again
        if self._loop.time() - since < self._timeout_s:
            self._timer = self._loop.call_at(since + self._timeout_s, self._check)
            return
        self.stalled = True
        log.warning("client stopped reading its stream; aborting its requests", timeout_s=self._timeout_s)
        self._on_stall()
