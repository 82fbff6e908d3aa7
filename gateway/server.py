"""`npuserve gateway`: the REST gateway as a process (uvicorn), in front of a running scheduler.

Start-up: bind the port (0 picks a free one), serve HTTP, wait until the scheduler answers
Health with a ready executor (until then /health is 503 and generation requests get 503), then
write the ready file `{"url", "pid", "scheduler"}` atomically; a scheduler that refuses the
gateway's key ends the start with exit 2. SIGTERM or SIGINT drains (`drain`): new requests get 503
with Retry-After and /health 503 while the responses in flight run to their end, for up to
``--shutdown-timeout``; then the gateway stops and exits 0. A second signal stops it at once.
Slow clients and connection floods meet the limits of `http_protocol` and the app's body deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import uvicorn

from npuserve.deploy.runtime.gc_heap import settle_heap_for_serving
from npuserve.deploy.runtime.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, Shutdown
from npuserve.gateway.app import DEFAULT_BODY_TIMEOUT_S, create_app
from npuserve.gateway.chat_output import ParserSettings
from npuserve.gateway.drain import Drain
from npuserve.gateway.errors import APIError
from npuserve.gateway.http_protocol import guarded_protocol
from npuserve.gateway.limits import DEFAULT_MAX_STREAM_BUFFER_BYTES, RequestLimits
from npuserve.gateway.scheduler_client import SchedulerClient
from npuserve.proto.channel import DEFAULT_STREAM_STALL_TIMEOUT_S, bind_target
from npuserve.proto.ready_file import write_ready_file

log = structlog.get_logger(__name__)

SCHEDULER_WAIT_S = 60.0
GRACEFUL_SHUTDOWN_S = 3


@dataclass(slots=True)
class GatewayConfig:
    scheduler: str  # the scheduler's gRPC address
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port
    api_key: str | None = None  # required of REST clients
    scheduler_api_key: str | None = None  # presented to the scheduler
    scheduler_tls_ca: bytes | None = None  # PEM roots: reach the scheduler over TLS
    served_model_name: str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)  # the largest request, on every dimension
    request_header_timeout_s: float = 10.0
    request_body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_timeout_s: float = 5.0
    stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S  # 0: never
    max_stream_buffer_bytes: int = DEFAULT_MAX_STREAM_BUFFER_BYTES  # 0: no bound
    max_connections: int = 1000
    ready_file: Path | None = None
    scheduler_wait_s: float = SCHEDULER_WAIT_S
    parsers: ParserSettings = field(default_factory=ParserSettings)  # tool calls, reasoning
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S

    def __post_init__(self) -> None:
        positive = {
            "--max-connections": self.max_connections,
            "--request-header-timeout": self.request_header_timeout_s,
            "--request-body-timeout": self.request_body_timeout_s,
            "--keep-alive-timeout": self.keep_alive_timeout_s,
        }
        for flag, value in positive.items():
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if not self.stream_stall_timeout_s >= 0:
            raise ValueError(f"--stream-stall-timeout must be 0 or more, got {self.stream_stall_timeout_s}")
        if self.max_stream_buffer_bytes < 0:
            raise ValueError(
                f"--max-stream-buffer-bytes must be 0 or more, got {self.max_stream_buffer_bytes}"
            )


def run_gateway(config: GatewayConfig) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit code."""
    from npuserve.deploy.runtime import event_loop

    return event_loop.run(serve_gateway(config))


class _Server(uvicorn.Server):
    # NOTE: uvicorn re-raises a captured SIGTERM after shutting down, which would end the process
    # with -15; the gateway installs its own handlers and exits 0 after a graceful stop.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_gateway(config: GatewayConfig) -> int:
    app = create_app(
        config.scheduler,
        config.api_key,
        config.served_model_name,
        limits=config.limits,
        scheduler_api_key=config.scheduler_api_key,
        scheduler_tls_ca=config.scheduler_tls_ca,
        body_timeout_s=config.request_body_timeout_s,
        parsers=config.parsers,
        max_stream_buffer_bytes=config.max_stream_buffer_bytes,
    )
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.set_inheritable(True)
    except OSError as exc:
        log.error("cannot listen", host=config.host, port=config.port, error=str(exc))
        return 1
    server = _Server(
        uvicorn.Config(
            app,
            http=guarded_protocol(
                config.request_header_timeout_s, config.max_connections, config.stream_stall_timeout_s
            ),
            timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]
            ws="none",
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    shutdown = Shutdown()
    shutdown.install_on_loop(asyncio.get_running_loop())
    stopping = asyncio.create_task(
        _stop_on_signals(server, shutdown, app.state.drain, config.shutdown_timeout_s)
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            log.error("the gateway did not start")
            return 1
        await asyncio.sleep(0.01)
    host, port = config.host or "0.0.0.0", sock.getsockname()[1]  # as bound, as vLLM prints it
    url = f"http://{bind_target(host, port)}"
    log.info("gateway serving", url=url, scheduler=config.scheduler, api_key=bool(config.api_key))
    client = app.state.gateway.client
    await _wait_for_scheduler(client, server, config.scheduler_wait_s)
    refused = None
    if not server.should_exit:
        try:
            await client.list_models()  # NOTE: not Health, which is open: it says nothing of the key
        except APIError as exc:
            refused = exc.message if exc.code == "unauthenticated" else None
    if refused is not None:
        log.error("the scheduler refuses this gateway's key", reason=refused)
        print(
            f"npuserve gateway: error: the scheduler at {config.scheduler} refuses this gateway: "
            f"{refused}; give the gateway the scheduler's key (--api-key, --scheduler-api-key or "
            "$NPUSERVE_API_KEY)",
            file=sys.stderr,
        )
        server.should_exit = True
        await serving
        return 2
    settle_heap_for_serving()
    if config.ready_file is not None and not server.should_exit:
        write_ready_file(config.ready_file, {"url": url, "pid": os.getpid(), "scheduler": config.scheduler})
    await serving
    stopping.cancel()
    log.info("gateway stopped")
    return 0


async def _stop_on_signals(
    server: uvicorn.Server, shutdown: Shutdown, drain: Drain, timeout_s: float
) -> None:
    """At the first signal drains, then stops the server; a second signal stops it at once."""
    shutdown.on_each_signal(lambda: _stop_now(server) if shutdown.now.is_set() else None)
    await shutdown.wait_drain_async()
    drain.draining = True
    log.info("gateway draining", requests=drain.in_flight, timeout_s=timeout_s)
    drained = await shutdown.drain_until_async(lambda: drain.idle, timeout_s)
    log.info("gateway stopping", drained=drained, requests_left=drain.in_flight)
    server.should_exit = True


def _stop_now(server: uvicorn.Server) -> None:
    log.info("gateway stopping at once (second signal)")
    server.should_exit = server.force_exit = True


async def _wait_for_scheduler(client: SchedulerClient, server: uvicorn.Server, timeout_s: float) -> None:
    """Polls Health until an executor is ready; after `timeout_s`, serves on (503s) with a warning."""
    deadline = time.monotonic() + timeout_s
    reason = ""
    while not server.should_exit:
        try:
            health = await client.health(timeout_s=2.0)
            if health.serving:
                return
            reason = health.message
        except APIError as exc:
            reason = exc.message
        if time.monotonic() > deadline:
            log.warning("the scheduler is not ready; serving 503 until it is", reason=reason)
            return
        await asyncio.sleep(0.25)
