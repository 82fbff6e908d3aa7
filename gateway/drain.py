"""The gateway's drain: once SIGTERM comes, new requests get 503 with Retry-After (and /health
503, so readiness fails) while the responses in flight, streams included, run to their end.

`DrainMiddleware` counts the requests in flight and refuses new ones while draining; the server
(`gateway.server`) waits for `Drain.idle` (or its ``--shutdown-timeout``) before it stops.
`/version` and `/metrics` still answer: liveness and monitoring see a process that is up.
Each time the last request in flight ends, the gateway's heap is released if no other comes
meanwhile (`IdleHeapRelease`): a large body's memory goes back to the system.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from npuserve.deploy.runtime.gc_heap import IdleHeapRelease
from npuserve.gateway.errors import send_error, unavailable

ANSWERED_WHILE_DRAINING = frozenset({"/version", "/metrics"})


@dataclass
class Drain:
    draining: bool = False
    in_flight: int = 0

    @property
    def idle(self) -> bool:
        return self.in_flight == 0


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain
        self.heap = IdleHeapRelease(lambda: drain.idle)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] not in ANSWERED_WHILE_DRAINING:
            error = unavailable("the gateway is shutting down; retry the request")
            error.headers["Connection"] = "close"
            await send_error(send, error)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
            self.heap.work_ended()
