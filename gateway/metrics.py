"""The gateway's own HTTP metrics and access log; `/metrics` appends the scheduler's text to them.

Serving numbers (time to first token, running requests, KV-cache use, prefix-cache hits) are the
scheduler's, exported under vLLM's names; the gateway only counts what happens over HTTP.
"""

from __future__ import annotations

import re
import time
import uuid

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger(__name__)

# NOTE: the Prometheus text format the scheduler writes too (generate_latest), so the two bodies
# concatenate into one valid exposition.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/version",
        "/metrics",
    }
)
_SAFE_ID = re.compile(r"[^A-Za-z0-9._:-]")  # a client's X-Request-Id, reduced to what logs can hold
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    """Requests by route and status, their durations, how many are in flight, and the
    generations sent again or resumed after their scheduler went away
    (`scheduler_client.GenerateCall`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "npuserve:gateway_requests",
            "HTTP requests the gateway answered, by route and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "npuserve:gateway_request_duration_seconds",
            "Time from a request's arrival to the end of its response (the whole stream).",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.generations_resent = Counter(
            "npuserve:gateway_generations_resent",
            "Generations sent to the scheduler again, having had no token when their call ended "
            "(the scheduler restarted, or an API server process died).",
            registry=self.registry,
        )
        self.generations_resumed = Counter(
            "npuserve:gateway_generations_resumed",
            "Generations resumed from the tokens they had, their call having ended mid-stream "
            "(the scheduler restarted, or an API server process died).",
            registry=self.registry,
        )
        self.in_progress = Gauge(
            "npuserve:gateway_requests_in_progress",
            "HTTP requests being answered, by route.",
            ["route"],
            registry=self.registry,
        )

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class ObservabilityMiddleware:
    """Gives each request an id (`X-Request-Id`, echoed back), binds it to the log context,
    counts and times the request, and logs one line when its response ends."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # NOTE: the id is always ours (unique, so it can name the scheduler's requests too); a
        # client's X-Request-Id is logged next to it and echoed back.
        request_id = uuid.uuid4().hex
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        client_id = _SAFE_ID.sub("", given.decode("latin-1"))[:128] or None
        scope.setdefault("state", {})["request_id"] = request_id
        # The path if it is one of ours, else "other" (unknown paths must not grow the label set).
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = 500  # what a response that never started counts as
        start = time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                echoed = (client_id or request_id).encode()
                message["headers"] = [*message.get("headers", []), (b"x-request-id", echoed)]
            await send(message)

        in_progress = self.metrics.in_progress.labels(route)
        in_progress.inc()
        context = {"request_id": request_id} | ({"client_request_id": client_id} if client_id else {})
        with structlog.contextvars.bound_contextvars(**context):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                seconds = time.monotonic() - start
                in_progress.dec()
                self.metrics.requests.labels(route, str(status)).inc()
                self.metrics.duration.labels(route).observe(seconds)
                log.info(
                    "http request",
                    method=scope["method"],
                    path=scope["path"],
                    status=status,
                    seconds=round(seconds, 4),
                )
