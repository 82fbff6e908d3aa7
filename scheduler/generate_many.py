"""One `GenerateMany` call: many generations over one stream, each under its caller's handle.

A generation runs as a task over the same outputs a `Generate` call streams; each of its outputs
becomes an event written in place into the response being gathered, and the call sends that
response when the event loop gets to it: one message for every generation that moved in the
meantime (and for every turn a write was in flight), at most `MAX_EVENTS_PER_RESPONSE` events
each. What a client gives up (cancel, or cancelling the call) aborts the request as a cancelled
`Generate` call does: leaving the outputs' iterator aborts it and frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

import structlog

from npuserve.proto import scheduler_pb2 as pb
from npuserve.scheduler import api_codec
from npuserve.scheduler.api_status import client_status
from npuserve.scheduler.outputs import GenerateOutput
from npuserve.scheduler.request import InvalidRequestError
from npuserve.scheduler.tokenizer import Tokenizer

MAX_EVENTS_PER_RESPONSE = 1024  # scheduler.proto promises this bound

# The outputs of one GenerateRequest, as `Generate` streams them (raises what refuses it).
StartGeneration = Callable[[pb.GenerateRequest], AsyncIterator[GenerateOutput]]


class GenerateManyCall:
    """The generations of one call and the responses that carry their events."""

    def __init__(self, start: StartGeneration, tokenizer: Tokenizer, draining: Callable[[], bool]) -> None:
        self._start = start
        self._tokenizer = tokenizer
        self._draining = draining
        self._generations: dict[int, asyncio.Task[None]] = {}  # by stream_id
        self._full: deque[pb.GenerateManyResponse] = deque()  # gathered, not sent, oldest first
        self._gathering = pb.GenerateManyResponse()
        self._moved = asyncio.Event()  # an event was gathered, or the call may end
        self._reading = True  # the client has not half-closed

    @property
    def num_generations(self) -> int:
        return len(self._generations)

    def wake(self) -> None:
        """Looks again at whether the call can end (the scheduler began to drain)."""
        self._moved.set()

    async def responses(
        self, requests: AsyncIterator[pb.GenerateManyRequest]
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._moved.wait()
                self._moved.clear()
                while self._full:
                    yield self._full.popleft()
                if len(self._gathering.events):
                    response, self._gathering = self._gathering, pb.GenerateManyResponse()
                    yield response
                if not self._generations and (not self._reading or self._draining()):
                    return
        finally:
            reader.cancel()
            for task in self._generations.values():
                task.cancel()  # leaving its outputs aborts the request

    def _event(self, stream_id: int) -> pb.GenerateManyEvent:
        events = self._gathering.events
        if len(events) >= MAX_EVENTS_PER_RESPONSE:
            self._full.append(self._gathering)
            self._gathering = pb.GenerateManyResponse()
            events = self._gathering.events
        if not self._moved.is_set():
            self._moved.set()
        return events.add(stream_id=stream_id)

    async def _read(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> None:
        try:
            async for request in requests:
                action, stream_id = request.WhichOneof("action"), request.stream_id
                if action == "generate":
                    if stream_id in self._generations:
                        self._fail(stream_id, InvalidRequestError(f"stream_id {stream_id} is already open"))
                    else:
                        self._generations[stream_id] = asyncio.create_task(
                            self._run(stream_id, request.generate)
                        )
                elif action == "cancel":
                    cancelled = self._generations.pop(stream_id, None)
                    if cancelled is not None:
                        cancelled.cancel()
                else:
                    self._fail(
                        stream_id, InvalidRequestError("a GenerateManyRequest needs generate or cancel")
                    )
        finally:
            self._reading = False
            self._moved.set()

    async def _run(self, stream_id: int, request: pb.GenerateRequest) -> None:
        structlog.contextvars.bind_contextvars(request_id=request.request_id or None)
        tokenizer, return_prompt = self._tokenizer, request.sampling.return_prompt
        try:
            async for output in self._start(request):
                api_codec.fill_response(self._event(stream_id).response, output, tokenizer, return_prompt)
            self._event(stream_id).done = True
        except Exception as exc:
            self._fail(stream_id, exc)
        finally:
            if self._generations.get(stream_id) is asyncio.current_task():
                del self._generations[stream_id]
            self._moved.set()

    def _fail(self, stream_id: int, exc: Exception) -> None:
        code, message, field = client_status(exc)
        error = self._event(stream_id).error
        error.code, error.message, error.field = code.name, message, field or ""
