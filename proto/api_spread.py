"""Connections spread evenly over the scheduler's API server processes.

With `--api-server-count N` the scheduler's public API is N processes sharing one port: the
kernel hands each new connection to one of them (SO_REUSEPORT, by a hash of its addresses), and
every call on that connection is served there. A client that keeps a few long-lived connections
(the gateway's, a bench's) therefore loads the processes as unevenly as chance placed them: 4
connections over 2 processes miss one of them 1 time in 8 and split 3:1 half the time, and over
8 processes they can never reach more than 4.

Each API server process names itself in the trailing metadata of every `GenerateMany` call,
`API_SERVER_METADATA` ("index/count"). `spread_channels` opens the client's channels, asks each
where it landed (a `GenerateMany` call with no generations, which ends at once), opens one at
least per process, and reconnects channels of the busiest process until no process holds two
more than another (a few reconnections: each lands on a process at random).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Sequence

import grpc

from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.channel import CONNECTION_INDEX_OPTION, aio_client_channel

API_SERVER_METADATA = "npuserve-api-server"  # "index/count" of the process serving the call
PROBE_TIMEOUT_S = 5.0  # for one channel to say where it landed
RECONNECTS_PER_CHANNEL = 8  # at most, on average, before the channels are kept as they are

ApiServer = tuple[int, int]  # (process index, process count)


def api_server_metadata(index: int, count: int) -> tuple[tuple[str, str], ...]:
    """The metadata by which API server process ``index`` of ``count`` names itself."""
    return ((API_SERVER_METADATA, f"{index}/{count}"),)


def parse_api_server(metadata: Sequence[tuple[str, str | bytes]] | None) -> ApiServer | None:
    """(index, count) from a call's metadata; None when it does not say (or says nonsense)."""
    for key, value in metadata or ():
        if key != API_SERVER_METADATA:
            continue
        text = value.decode() if isinstance(value, bytes) else value
        index, _, count = text.partition("/")
        if index.isdigit() and count.isdigit() and int(index) < int(count):
            return int(index), int(count)
    return None


async def probe_api_server(
    channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] = (), timeout_s: float = PROBE_TIMEOUT_S
) -> ApiServer | None:
    """Which API server process serves ``channel``'s connection: a `GenerateMany` call with no
    generations, read for its trailing metadata. None: the scheduler does not say (it predates
    this, or is not reachable in ``timeout_s``)."""
    call = pb_grpc.SchedulerStub(channel).GenerateMany(
        iter(()), metadata=tuple(metadata) or None, timeout=timeout_s
    )
    try:
        # NOTE: the call ends OK at once (it carries no generation), its trailers with it.
        return parse_api_server(await call.trailing_metadata())
    except grpc.aio.AioRpcError:
        return None


async def spread_channels(
    address: str,
    count: int,
    options: Sequence[tuple[str, int]] = (),
    tls_ca: bytes | None = None,
    metadata: Sequence[tuple[str, str]] = (),
    timeout_s: float = PROBE_TIMEOUT_S,
) -> list[grpc.aio.Channel]:
    """``count`` channels to the scheduler's public API at ``address`` (with ``options``, TLS
    verified against ``tls_ca`` when given), at least one per API server process, spread over
    the processes as evenly as reconnecting gets them (no process with two more than another).
    Each has a connection of its own. A scheduler that does not say where a channel landed gets
    the channels as they came."""
    connection_indexes = itertools.count()

    async def opened() -> tuple[grpc.aio.Channel, ApiServer | None]:
        # NOTE: a distinct channel option per channel keeps gRPC from sharing one connection.
        index = (CONNECTION_INDEX_OPTION, next(connection_indexes))
        channel = aio_client_channel(address, [*options, index], tls_ca)
        return channel, await probe_api_server(channel, metadata, timeout_s)

    results = list(await asyncio.gather(*(opened() for _ in range(count))))
    channels = [channel for channel, _ in results]
    if any(placed is None for _, placed in results):
        return channels
    num_processes = max(placed[1] for _, placed in results if placed is not None)
    processes = [placed[0] for _, placed in results if placed is not None]
    for _ in range(max(0, num_processes - count)):
        channel, placed = await opened()
        channels.append(channel)
        if placed is None:
            return channels
        processes.append(placed[0])
    for _ in range(RECONNECTS_PER_CHANNEL * len(channels)):
        load = Counter({index: 0 for index in range(num_processes)})
        load.update(processes)
        (busiest, most), *_ = load.most_common()
        if most - min(load.values()) <= 1:
            break
        moved = processes.index(busiest)
        await channels[moved].close()
        channels[moved], placed = await opened()
        if placed is None:
            break
        processes[moved] = placed[0]
    return channels
