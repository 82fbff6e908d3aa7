"""`GenerateManyClient`'s bound on the output generations keep unread (`UnreadBudget`), in
process against a fake scheduler that answers two generations on one call as fast as it can.

The generation nobody reads fails `StreamOverrun` once more than its budget's limit waits for it,
and the scheduler is told to cancel it; the one read as it comes gets all of its output, many
times the limit, whether it shares the budget or not; with no bound, a limit above the whole
output, or a budget started only once all of it was kept, the unread one keeps all of its output.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.generate_many import GenerateManyClient, GenerateStream, StreamOverrun, UnreadBudget

RESPONSES = 200  # per generation
TEXT = "x" * 1000  # a response of about 1 KB
LIMIT_BYTES = 16 << 10  # a small part of a generation's 200 KB


def response(index: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(completions=[pb.Completion(index=0, text=TEXT, token_ids=[index])])


class FakeScheduler(pb_grpc.SchedulerServicer):
    """GenerateMany: `RESPONSES` responses for each of the first two generations, together, and
    no more for one once it is cancelled (the cancels are kept)."""

    def __init__(self) -> None:
        self.cancelled: set[int] = set()

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        opened: asyncio.Queue[int] = asyncio.Queue()

        async def read_actions() -> None:
            async for request in request_iterator:
                for action in request.actions:
                    if action.cancel:
                        self.cancelled.add(action.stream_id)
                    else:
                        opened.put_nowait(action.stream_id)

        reader = asyncio.create_task(read_actions())
        streams = [await opened.get(), await opened.get()]
        for i in range(RESPONSES):
            last = i == RESPONSES - 1
            events = [
                pb.GenerateManyEvent(stream_id=s, response=response(i), done=last)
                for s in streams
                if s not in self.cancelled
            ]
            yield pb.GenerateManyResponse(events=events)
        await reader  # until the client half-closes or cancels the call


async def read_all(stream: GenerateStream) -> list[int]:
    return [c.token_ids[0] async for r in stream for c in r.completions]


async def scenario(
    limit_bytes: int, shared: bool, start_late: bool = False
) -> tuple[list[int], list[int] | StreamOverrun, set[int]]:
    """(what the generation read as it comes got, what the unread one then gets or how it
    failed, the stream ids the scheduler was told to cancel). Their budgets have ``limit_bytes``
    each, or they share one, started before the generations (``start_late``: once the one read
    as it comes has ended, every response of the unread one kept by then)."""
    server = grpc.aio.server()
    scheduler = FakeScheduler()
    pb_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = GenerateManyClient(pb_grpc.SchedulerStub(channel))
            budget = UnreadBudget(limit_bytes)
            other = budget if shared else UnreadBudget(limit_bytes)
            if not start_late:
                budget.start()
                other.start()
            unread = client.generate(pb.GenerateRequest(text="unread"), budget)
            read = await read_all(client.generate(pb.GenerateRequest(text="read"), other))
            budget.start()
            try:
                late: list[int] | StreamOverrun = await read_all(unread)
            except StreamOverrun as exc:
                late = exc
            await client.close()
        return read, late, scheduler.cancelled
    finally:
        await server.stop(None)


@pytest.mark.parametrize("shared", [False, True])
def test_an_unread_generation_fails_past_the_limit_and_is_cancelled(shared: bool) -> None:
    read, late, cancelled = asyncio.run(scenario(LIMIT_BYTES, shared))
    assert read == list(range(RESPONSES))  # read as it came: never near the limit
    assert isinstance(late, StreamOverrun) and late.limit_bytes == LIMIT_BYTES
    assert late.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not late.call_ended
    assert cancelled == {1}  # the unread one, the first opened


@pytest.mark.parametrize(
    ("limit_bytes", "start_late"), [(0, False), (RESPONSES * len(TEXT) * 2, False), (LIMIT_BYTES, True)]
)
def test_an_unread_generation_within_the_limit_keeps_its_whole_output(
    limit_bytes: int, start_late: bool
) -> None:
    read, late, cancelled = asyncio.run(scenario(limit_bytes, shared=True, start_late=start_late))
    assert read == late == list(range(RESPONSES)) and not cancelled
