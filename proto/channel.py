"""gRPC message-size limits, one per link, used by both ends of each link, and client channels
(plaintext, or TLS verified against given roots)."""

from __future__ import annotations

import grpc

# Scheduler <-> executor: a step plan carries whole prompts for every new request of a batch.
MAX_STEP_MESSAGE_BYTES = 256 * 1024 * 1024
# Executor <-> executor (`ReadBlocks`): the KV bytes of one message's blocks (a single block of
# one layer may be more), far below the step link's limit, which that link shares.
KV_CHUNK_BYTES = 4 << 20
# Clients <-> the scheduler's public API: one request or one stream message.
MAX_API_MESSAGE_BYTES = 64 * 1024 * 1024
# Seconds a client may leave a response stream untaken before it is cut off and its requests
# aborted (`--stream-stall-timeout`): the gateway's HTTP clients, the public API's gRPC clients.
DEFAULT_STREAM_STALL_TIMEOUT_S = 30.0


# The scheduler's public API is served by this many gRPC servers sharing one port (each admits
# one new call per turn of the event loop); a busy client spreads its calls over as many
# connections (a distinct channel option keeps gRPC from sharing one connection between them).
API_SERVERS = 4
CONNECTION_INDEX_OPTION = "npuserve.connection_index"


def bind_target(host: str, port: int) -> str:
    """What a gRPC server binds for ``host`` and ``port`` (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def message_size_options(max_bytes: int) -> list[tuple[str, int]]:
    """Channel and server options that allow messages up to ``max_bytes`` each way."""
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
    ]


def client_channel(address: str, options: list[tuple[str, int]], tls_ca: bytes | None = None) -> grpc.Channel:
    """A blocking channel to ``address``: TLS verified against ``tls_ca`` (PEM roots) when given."""
    if tls_ca is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca), options=options)


def aio_client_channel(
    address: str, options: list[tuple[str, int]], tls_ca: bytes | None = None
) -> grpc.aio.Channel:
    """`client_channel` for asyncio code."""
    if tls_ca is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(tls_ca), options=options)
