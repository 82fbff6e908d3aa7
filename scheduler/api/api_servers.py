"""The scheduler's public gRPC API: several asyncio gRPC servers on one port.

gRPC's asyncio server takes new calls one at a time, one per turn of the event loop. Under
thousands of streams a turn of the scheduler's loop is long (it writes every stream's tokens), so
one server admits too few calls: they wait in gRPC's queue, and past its pending limit gRPC
cancels them (CANCELLED, before the engine ever sees them). Several servers share the port
(SO_REUSEPORT: the kernel spreads connections over them), each admitting a call per turn, and
the pending limits are raised so a burst waits instead of failing: `--max-queued-requests` is
where npuserve refuses load (RESOURCE_EXHAUSTED), not the transport.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import grpc

from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.auth import API_KEY, AioTokenInterceptor
from npuserve.proto.channel import API_SERVERS, MAX_API_MESSAGE_BYTES, bind_target, message_size_options
from npuserve.scheduler.service_config import ServiceConfig

MAX_PENDING_CALLS = 1 << 16  # calls gRPC may hold before the application takes them
MAX_UNREQUESTED_S = 600  # and how long (the client's deadline still applies)
SERVER_OPTIONS: list[tuple[str, int]] = [
    *message_size_options(MAX_API_MESSAGE_BYTES),
    ("grpc.so_reuseport", 1),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ("grpc.server_max_unrequested_time_in_server", MAX_UNREQUESTED_S),
]


async def start_api_servers(
    add_servicer: Callable[[grpc.aio.Server], None],
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    host: str,
    port: int,
    tls: tuple[bytes, bytes] | None,
) -> tuple[list[grpc.aio.Server], int]:
    """`API_SERVERS` started servers of one servicer on ``host:port`` (0: a free port); returns them
    and the bound port."""
    servers: list[grpc.aio.Server] = []
    bound = port
    for _ in range(API_SERVERS):
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        add_servicer(server)
        target = bind_target(host, bound)
        if tls is not None:
            bound = server.add_secure_port(target, grpc.ssl_server_credentials([tls]))
        else:
            bound = server.add_insecure_port(target)
        await server.start()
        servers.append(server)
    return servers, bound


async def serve_public_api(
    servicer: pb_grpc.SchedulerServicer, config: ServiceConfig, host: str, port: int
) -> tuple[list[grpc.aio.Server], int]:
    """`start_api_servers` of ``servicer``, behind the config's API key and TLS."""
    interceptors = [AioTokenInterceptor(API_KEY, config.api_key)] if config.api_key else []
    add = functools.partial(pb_grpc.add_SchedulerServicer_to_server, servicer)
    return await start_api_servers(add, interceptors, host, port, config.tls)


async def stop_api_servers(servers: Sequence[grpc.aio.Server], grace_s: float | None) -> None:
    for server in servers:
        await server.stop(grace=grace_s)
