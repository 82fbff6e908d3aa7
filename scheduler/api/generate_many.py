"""One `GenerateMany` call: many generations over one stream, each under its caller's handle.

A generation opens as a `Generate` call's request does (checked, tokenized and queued), at once
(`eager_start`: in a task of its own only from where it must wait); from then on its stream hands
each output straight to the call (`listen`), which writes it as an event into the response being
gathered: no task switch per output. The call sends that response when the event loop gets to it:
one message for every generation that moved in the meantime (and for every turn a write was in
flight), at most `MAX_EVENTS_PER_RESPONSE` events each. A generation the client gives up (cancel,
or cancelling the call) is closed as a cancelled `Generate` call's: what is left of its request is
aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import structlog

from npuserve.proto import scheduler_pb2 as pb
from npuserve.scheduler.api import api_codec
from npuserve.scheduler.api.api_status import client_status
from npuserve.scheduler.api.eager_start import start_eagerly
from npuserve.scheduler.core.request import InvalidRequestError
from npuserve.scheduler.engine.outputs import GenerateOutput, OpenStream, Usage
from npuserve.scheduler.text.tokenizer import Tokenizer

MAX_EVENTS_PER_RESPONSE = 1024  # scheduler.proto promises this bound

# Checks, tokenizes and queues a GenerateRequest, as `Generate` does (raises what refuses it).
OpenGeneration = Callable[[pb.GenerateRequest], Awaitable[OpenStream]]


@dataclass(slots=True)
class _Generation:
    stream_id: int
    return_prompt: bool
    opening: asyncio.Task[None] | None = None  # until its request is queued, where that waits
    opened: OpenStream | None = None  # from then on
    usage: Usage | None = None  # the last the client was sent

    def close(self) -> None:
        """The client is done with it (whether or not it ended)."""
        if self.opening is not None:
            self.opening.cancel()  # nothing is queued before the task ends
        if self.opened is not None:
            # NOTE: let go of it: its stream's listener holds this generation, a reference cycle
            # that only the garbage collector would free.
            opened, self.opened = self.opened, None
            opened.close(self.usage)


class GenerateManyCall:
    """The generations of one call and the responses that carry their events."""

    def __init__(
        self, open_generation: OpenGeneration, tokenizer: Tokenizer, draining: Callable[[], bool]
    ) -> None:
        self._open_generation = open_generation
        self._tokenizer = tokenizer
        self._draining = draining
        self._generations: dict[int, _Generation] = {}  # the open ones, by stream_id
        self._full: deque[pb.GenerateManyResponse] = deque()  # gathered, not sent, oldest first
        self._gathering = pb.GenerateManyResponse()
        self._moved = asyncio.Event()  # an event was gathered, or the call may end
        self._reading = True  # the client has not half-closed
        self._reader: asyncio.Task[None] | None = None  # the client's actions, while `responses` runs

    def wake(self) -> None:
        """Looks again at whether the call can end (the scheduler began to drain)."""
        self._moved.set()

    def abandon(self) -> None:
        """The client stopped reading the call (`stall_watch`): it takes no more actions, every
        generation on it is closed (what is left of its request aborted, its blocks freed), and
        what was gathered for them, unsent, is dropped."""
        if self._reader is not None:
            self._reader.cancel()
        self._close_generations()
        self._full.clear()
        self._gathering = pb.GenerateManyResponse()

    async def responses(
        self, requests: AsyncIterator[pb.GenerateManyRequest]
    ) -> AsyncGenerator[pb.GenerateManyResponse, None]:
        reader = self._reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._moved.wait()
                self._moved.clear()
                while self._full:
                    yield self._full.popleft()
                if len(self._gathering.events):
                    response, self._gathering = self._gathering, pb.GenerateManyResponse()
                    yield response
                # NOTE: what was gathered while a response was being written (the last
                # generation's end, say) is sent before the call ends.
                if (
                    not self._generations
                    and not self._full
                    and not len(self._gathering.events)
                    and (not self._reading or self._draining())
                ):
                    return
        finally:
            reader.cancel()
            self._close_generations()

    def _close_generations(self) -> None:
        generations, self._generations = self._generations, {}
        for generation in generations.values():
            generation.close()

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
                for action in request.actions:
                    self._apply(action)
        finally:
            self._reading = False
            self._moved.set()

    def _apply(self, action: pb.GenerateManyAction) -> None:
        kind, stream_id = action.WhichOneof("action"), action.stream_id
        if kind == "generate":
            if stream_id in self._generations:
                self._fail(stream_id, InvalidRequestError(f"stream_id {stream_id} is already open"))
                return
            generate = action.generate
            generation = _Generation(stream_id, generate.sampling.return_prompt)
            self._generations[stream_id] = generation
            # NOTE: opened now, up to its first wait (most never wait): no task of its own.
            generation.opening = start_eagerly(self._open(generation, generate))
        elif kind == "cancel":
            cancelled = self._generations.pop(stream_id, None)
            if cancelled is not None:
                cancelled.close()
        else:
            self._fail(stream_id, InvalidRequestError("a GenerateManyAction needs generate or cancel"))

    async def _open(self, generation: _Generation, request: pb.GenerateRequest) -> None:
        structlog.contextvars.bind_contextvars(request_id=request.request_id or None)
        try:
            opened = await self._open_generation(request)
        except Exception as exc:
            self._fail(generation.stream_id, exc)
            self._forget(generation)
            return
        generation.opening, generation.opened = None, opened
        opened.stream.listen(
            functools.partial(self._on_output, generation),
            functools.partial(self._on_text, generation, opened.stream.request_id),
        )

    def _on_output(self, generation: _Generation, output: GenerateOutput) -> None:
        """Runs where the stream makes its outputs (the relay from the core, the engine's step
        reports): a failure here ends this generation only."""
        if self._generations.get(generation.stream_id) is not generation:
            return  # closed already
        stream_id = generation.stream_id
        try:
            if output.refusal is not None:
                self._fail(stream_id, output.refusal)
            else:
                event = self._event(stream_id)
                api_codec.fill_response(event.response, output, self._tokenizer, generation.return_prompt)
                if not output.finished:
                    return  # NOTE: the usual output: nothing more to set
                generation.usage = output.usage or generation.usage
                event.done = True
        except Exception as exc:
            self._fail(stream_id, exc)
        self._forget(generation)
        # NOTE: closed once the caller is done with this output: a stop string that ended the
        # stream here is reported to the core (by the caller) before the stream's close.
        asyncio.get_running_loop().call_soon(generation.close)

    def _on_text(
        self, generation: _Generation, request_id: str, choice: int, text: str, token_ids: list[int]
    ) -> None:
        """An output of new text and ids only (the usual one): the event `_on_output` would
        write for it, written straight away."""
        stream_id = generation.stream_id
        if self._generations.get(stream_id) is not generation:
            return  # closed already
        api_codec.fill_text(self._event(stream_id).response, request_id, choice, text, token_ids)

    def _forget(self, generation: _Generation) -> None:
        if self._generations.get(generation.stream_id) is generation:
            del self._generations[generation.stream_id]
            self._moved.set()

    def _fail(self, stream_id: int, exc: Exception) -> None:
        code, message, field = client_status(exc)
        error = self._event(stream_id).error
        error.code, error.message, error.field = code.name, message, field or ""
