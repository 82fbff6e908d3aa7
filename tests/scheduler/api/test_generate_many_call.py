"""`GenerateManyCall` in process, no model: how its responses end, and that nothing of a
finished generation waits for the garbage collector."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator

from npuserve.proto import scheduler_pb2 as pb
from npuserve.scheduler.api.generate_many import GenerateManyCall
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.engine.outputs import OpenStream, RequestStream, SequenceUpdate
from npuserve.scheduler.text.tokenizer import Tokenizer


def test_an_end_gathered_while_a_response_is_written_is_sent_before_the_call_ends(
    tokenizer: Tokenizer,
) -> None:
    """Draining, the call ends once its last generation has: that generation's end, gathered
    while the call's previous response was being written, is still sent."""

    async def scenario() -> list[tuple[int, bool]]:
        stream = RequestStream("r1", tokenizer, SamplingParams(max_tokens=2), [1])
        opened = OpenStream(stream, lambda: None)

        async def open_generation(request: pb.GenerateRequest) -> OpenStream:
            return opened

        call = GenerateManyCall(open_generation, tokenizer, draining=lambda: True)

        async def requests() -> AsyncIterator[pb.GenerateManyRequest]:
            generate = pb.GenerateManyAction(stream_id=1, generate=pb.GenerateRequest(text="x"))
            yield pb.GenerateManyRequest(actions=[generate])
            await asyncio.Event().wait()  # the client does not half-close

        stream.add(SequenceUpdate(0, [403], [None], None, None, None, 1, 0))  # heard once it opens
        responses = call.responses(requests())
        events = [(e.stream_id, e.done) for e in (await anext(responses)).events]
        # The response above is being written (the generator waits at its yield) as the
        # generation ends.
        stream.add(SequenceUpdate(0, [407], [None], "length", None, None, 2, 0))
        events += [(e.stream_id, e.done) async for response in responses for e in response.events]
        return events

    assert asyncio.run(scenario()) == [(1, False), (1, True)]


def test_a_finished_generation_is_freed_by_reference_counting_alone(tokenizer: Tokenizer) -> None:
    """Neither the stream nor the call's record of the generation is a reference cycle: once
    the generation ends and is closed, nothing is left for the garbage collector, whose full
    collections stop the event loop (see `deploy/gc_heap`)."""

    async def scenario() -> weakref.ref[RequestStream]:
        stream = RequestStream("r1", tokenizer, SamplingParams(max_tokens=2), [1])
        closed = asyncio.Event()
        to_open = [OpenStream(stream, closed.set)]

        async def open_generation(request: pb.GenerateRequest) -> OpenStream:
            return to_open.pop()

        call = GenerateManyCall(open_generation, tokenizer, draining=lambda: False)
        finish = asyncio.Event()

        async def requests() -> AsyncIterator[pb.GenerateManyRequest]:
            generate = pb.GenerateManyAction(stream_id=1, generate=pb.GenerateRequest(text="x"))
            yield pb.GenerateManyRequest(actions=[generate])
            await finish.wait()

        responses = call.responses(requests())
        stream.add(SequenceUpdate(0, [403], [None], None, None, None, 1, 0))
        await anext(responses)
        stream.add(SequenceUpdate(0, [407], [None], None, None, None, 2, 0))
        stream.add(SequenceUpdate(0, [409], [None], "length", None, None, 3, 0))
        await anext(responses)
        await closed.wait()
        finish.set()
        async for _ in responses:
            pass
        return weakref.ref(stream)

    gc.disable()
    try:
        watch = asyncio.run(scenario())
        assert watch() is None
    finally:
        gc.enable()


def test_a_queued_stream_read_to_its_end_is_freed_by_reference_counting_alone(tokenizer: Tokenizer) -> None:
    """A `Generate` call's stream (outputs queued, read with `outputs`)."""

    async def scenario() -> weakref.ref[RequestStream]:
        stream = RequestStream("r1", tokenizer, SamplingParams(max_tokens=2), [1])
        stream.add(SequenceUpdate(0, [403], [None], None, None, None, 1, 0))
        stream.add(SequenceUpdate(0, [407], [None], "length", None, None, 2, 0))
        assert [len(o.completions) async for o in stream.outputs()] == [1]
        return weakref.ref(stream)

    gc.disable()
    try:
        assert asyncio.run(scenario())() is None
    finally:
        gc.enable()
