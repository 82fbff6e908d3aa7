"""`GenerateManyCall` in process, no model: how its responses end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from npuserve.proto import scheduler_pb2 as pb
from npuserve.scheduler.generate_many import GenerateManyCall
from npuserve.scheduler.outputs import CompletionDelta, GenerateOutput, Usage


class FakeStream:
    request_id = "r1"
    listener: Callable[[GenerateOutput], None] | None = None

    def listen(self, listener: Callable[[GenerateOutput], None], *_: Any) -> None:
        self.listener = listener


class FakeOpened:
    def __init__(self) -> None:
        self.stream = FakeStream()

    def close(self, usage: Usage | None) -> None:
        pass


def test_an_end_gathered_while_a_response_is_written_is_sent_before_the_call_ends() -> None:
    """Draining, the call ends once its last generation has: that generation's end, gathered
    while the call's previous response was being written, is still sent."""

    async def scenario() -> list[tuple[int, bool]]:
        opened = FakeOpened()

        async def open_generation(request: pb.GenerateRequest) -> Any:
            return opened

        call = GenerateManyCall(open_generation, tokenizer=None, draining=lambda: True)  # type: ignore[arg-type]

        async def requests() -> AsyncIterator[pb.GenerateManyRequest]:
            generate = pb.GenerateManyAction(stream_id=1, generate=pb.GenerateRequest(text="x"))
            yield pb.GenerateManyRequest(actions=[generate])
            await asyncio.Event().wait()  # the client does not half-close

        responses = call.responses(requests())
        first = asyncio.ensure_future(responses.__anext__())
        while opened.stream.listener is None:
            await asyncio.sleep(0)
        opened.stream.listener(GenerateOutput("r1", [CompletionDelta(0, "a", [5])]))
        events = [(e.stream_id, e.done) for e in (await first).events]
        # The response above is being written (the generator waits at its yield) as the
        # generation ends.
        last = CompletionDelta(0, "b", [6], finish_reason="length")
        opened.stream.listener(GenerateOutput("r1", [last], usage=Usage(1, 2), finished=True))
        events += [(e.stream_id, e.done) async for response in responses for e in response.events]
        return events

    assert asyncio.run(scenario()) == [(1, False), (1, True)]
