"""`api_spread`: channels spread evenly over the processes serving the public API.

Several real `PublicApiServicer`s stand for the API server processes, each naming itself (its
index among them) and served, like a process's, by `start_api_servers` on one shared port
(SO_REUSEPORT: the kernel places each connection). `spread_channels` ends with every process
reached and none holding two channels more than another, however the kernel placed the first
connections; a scheduler that does not name its processes gets its channels as they came.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from harness.cluster import free_port

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.api_spread import (
    API_SERVER_METADATA,
    parse_api_server,
    probe_api_server,
    spread_channels,
)
from npuserve.scheduler.api.api_servers import start_api_servers, stop_api_servers
from npuserve.scheduler.api.api_servicer import PublicApiServicer
from npuserve.scheduler.text.prompts import ModelLimits, PromptProcessor
from npuserve.scheduler.text.tokenizer import Tokenizer


class NotOpening:
    """A front no generation reaches: spreading opens calls without generations."""

    async def open(self, *args: object) -> object:
        raise AssertionError("spreading opened a generation")


class UnnamedServicer(pb_grpc.SchedulerServicer):
    """A scheduler from before processes named themselves: GenerateMany says nothing first."""

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        async for _ in request_iterator:
            pass
        return
        yield


def test_metadata_names_a_process() -> None:
    assert parse_api_server([(API_SERVER_METADATA, "1/3")]) == (1, 3)
    assert parse_api_server([("other", "x"), (API_SERVER_METADATA, b"0/1")]) == (0, 1)
    for nonsense in ("3/3", "x/2", "1", "-1/2", ""):
        assert parse_api_server([(API_SERVER_METADATA, nonsense)]) is None
    assert parse_api_server(None) is None


def run_with_servers(
    stories_dir: Path,
    num_processes: int,
    scenario: Callable[[str], Awaitable[None]],
    named: bool = True,
) -> None:
    async def main() -> None:
        tokenizer = Tokenizer.from_pretrained(stories_dir)
        prompts = PromptProcessor(tokenizer, ModelLimits("stories", 512, tokenizer.vocab_size), False)
        every: list[grpc.aio.Server] = []
        port = 0
        try:
            for index in range(num_processes):
                servicer: pb_grpc.SchedulerServicer = (
                    PublicApiServicer(NotOpening(), prompts, (index, num_processes))  # type: ignore[arg-type]
                    if named
                    else UnnamedServicer()
                )
                servers, port = await start_api_servers(
                    lambda server, s=servicer: pb_grpc.add_SchedulerServicer_to_server(s, server),
                    (),
                    "127.0.0.1",
                    port,
                    None,
                )
                every += servers
            await scenario(f"127.0.0.1:{port}")
        finally:
            await stop_api_servers(every, None)
            prompts.close()

    asyncio.run(main())


async def placements(channels: list[grpc.aio.Channel]) -> list[tuple[int, int] | None]:
    return list(await asyncio.gather(*(probe_api_server(channel) for channel in channels)))


@pytest.mark.parametrize(("num_processes", "count"), [(2, 4), (3, 4), (4, 2)])
def test_channels_reach_every_process_evenly(stories_dir: Path, num_processes: int, count: int) -> None:
    async def scenario(address: str) -> None:
        for _ in range(3):  # the kernel places the first connections differently each time
            channels = await spread_channels(address, count)
            try:
                placed = await placements(channels)
                assert all(p is not None and p[1] == num_processes for p in placed)
                load = Counter(p[0] for p in placed if p is not None)
                assert len(channels) == max(count, num_processes)
                assert set(load) == set(range(num_processes))  # every process reached
                assert max(load.values()) - min(load.values()) <= 1
                # A channel keeps its connection: asked again, it names the same process.
                assert await placements(channels) == placed
            finally:
                for channel in channels:
                    await channel.close()

    run_with_servers(stories_dir, num_processes, scenario)


def test_a_scheduler_that_names_no_process_gets_its_channels_as_they_came(stories_dir: Path) -> None:
    async def scenario(address: str) -> None:
        channels = await spread_channels(address, 4)
        try:
            assert len(channels) == 4
            assert await placements(channels) == [None] * 4
        finally:
            for channel in channels:
                await channel.close()

    run_with_servers(stories_dir, 2, scenario, named=False)


def test_an_unreachable_scheduler_gets_its_channels_as_they_came() -> None:
    async def scenario() -> None:
        channels = await spread_channels(f"127.0.0.1:{free_port()}", 2, timeout_s=2.0)
        assert len(channels) == 2
        for channel in channels:
            await channel.close()

    asyncio.run(scenario())
