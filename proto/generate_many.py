"""A client's side of `GenerateMany` (scheduler.proto): many generations over one call.

`GenerateManyClient(stub).generate(request)` starts a generation and returns its
`GenerateStream`: `read()` gives its responses in order, then None once it is done, or raises
`GenerateFailed` with the status a `Generate` call would have ended with; `cancel()` aborts it.
The client keeps one call open: the first generation opens it, and one started after the call
ended opens another. A call that breaks (its connection lost, the scheduler stopped) fails every
generation still open on it with the call's status, as each of their `Generate` calls would.
That status can be lost, though (`GenerateFailed.status_lost`): see `LOST_STATUS_DETAILS`.

The call is read as fast as it comes, for every generation on it, so a generation whose reader
is slower than its output keeps what it has not read: an `UnreadBudget` bounds that, for one
generation or a group (`generate(request, budget)`); past it the generation is cancelled and
fails `StreamOverrun`, while the others on the call go on.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Sequence

import grpc

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.error_details import error_field

__all__ = [
    "LOST_STATUS_DETAILS",
    "GenerateFailed",
    "GenerateManyClient",
    "GenerateStream",
    "StreamOverrun",
    "UnreadBudget",
]

# NOTE: grpc's asyncio client loses the status of a call that ends while one of its requests is
# being written: the write fails, and the call ends INTERNAL with these details instead of the
# status the server sent (an older scheduler's UNIMPLEMENTED, one stopping's UNAVAILABLE). A call
# to a server without GenerateMany, its first request written as the server refuses the call,
# ended so 6 times in 2,000 (the others UNIMPLEMENTED).
LOST_STATUS_DETAILS = "Internal error from Core"


class GenerateFailed(Exception):
    """A generation's end in error: its status code, message and the request field it names.
    ``status_lost``: the call ended with a status that grpc's client lost (`LOST_STATUS_DETAILS`);
    a `Generate` call for the same request says what the scheduler answers. ``call_ended``: the
    whole call ended (the scheduler went away, say), not the scheduler's answer to this one."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        field: str | None = None,
        status_lost: bool = False,
        call_ended: bool = False,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.field = code, details, field
        self.status_lost = status_lost
        self.call_ended = call_ended

    @classmethod
    def of_event(cls, error: pb.GenerateError) -> GenerateFailed:
        code = grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.UNKNOWN)
        return cls(code, error.message, error.field or None)

    @classmethod
    def of_call(cls, exc: grpc.aio.AioRpcError) -> GenerateFailed:
        lost = exc.code() == grpc.StatusCode.INTERNAL and exc.details() == LOST_STATUS_DETAILS
        details = exc.details() or exc.code().name
        return cls(exc.code(), details, error_field(exc), status_lost=lost, call_ended=True)


class StreamOverrun(GenerateFailed):
    """More than ``limit_bytes`` of output went unread (the generation's `UnreadBudget`), so the
    generation was cancelled (its blocks freed) and what it kept was dropped."""

    def __init__(self, limit_bytes: int) -> None:
        message = f"more than {limit_bytes} bytes of output went unread; the generation was cancelled"
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.limit_bytes = limit_bytes


class UnreadBudget:
    """The bytes of output that the generations sharing it (those of one client's response, say)
    may keep unread together, from `start` on; a limit of 0: no bound. What they kept before
    `start` waited for something else than their reader (the response's other generations, say):
    it is not counted, and its allowance goes as it is read."""

    __slots__ = ("_forgiven_bytes", "_kept_bytes", "_started", "limit_bytes")

    def __init__(self, limit_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes
        self._kept_bytes = 0
        self._forgiven_bytes = 0  # of those kept, what was kept before `start`
        self._started = False

    def start(self) -> None:
        """The limit holds from now on (once started, a no-op)."""
        if not self._started:
            self._started = True
            self._forgiven_bytes = self._kept_bytes

    def add(self, size: int) -> bool:
        """Counts ``size`` more bytes kept; whether that takes them past the limit."""
        self._kept_bytes += size
        return self._started and 0 < self.limit_bytes < self._kept_bytes - self._forgiven_bytes

    def remove(self, size: int) -> None:
        """``size`` of the bytes kept were read, or dropped."""
        self._kept_bytes -= size
        self._forgiven_bytes = min(self._forgiven_bytes, self._kept_bytes)


# A response (as its bytes when it waited behind others), the end (None) or the failure.
_Item = pb.GenerateResponse | bytes | GenerateFailed | None


class GenerateStream:
    """One generation: its responses as they arrive, kept until read.

    A response that no reader waits for is kept as its serialized bytes: a parsed one takes 6 to
    35 times its size in memory, and holds the whole call message it came in (every generation's
    events) until it is read. Those bytes count against its ``budget``: the response that takes
    it past its limit cancels the generation, what it kept is dropped, and `read` raises
    `StreamOverrun`. So readers slower than their output hold at most the budget's limit
    (beyond what was kept before it started)."""

    def __init__(self, call: _OpenCall, stream_id: int, budget: UnreadBudget) -> None:
        self.stream_id = stream_id
        self._call = call
        self._budget = budget
        self._kept_bytes = 0  # of the responses kept as bytes: its part of the budget's use
        self._items: deque[_Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    async def read(self) -> pb.GenerateResponse | None:
        """The next response; None once done (and after). Raises `GenerateFailed` (again after)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items[0]
        if isinstance(item, GenerateFailed):
            raise item
        if item is None:
            return None  # the end stays: read again, it is read again
        self._items.popleft()
        if isinstance(item, bytes):
            self._kept_bytes -= len(item)
            self._budget.remove(len(item))
            return pb.GenerateResponse.FromString(item)
        return item

    def cancel(self) -> None:
        """Aborts the generation (its blocks are freed); nothing more arrives for it."""
        self._call.cancel(self)

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        response = await self.read()
        if response is None:
            raise StopAsyncIteration
        return response

    def _put_response(self, response: pb.GenerateResponse) -> bool:
        """Keeps ``response`` until read; False if that overran the bound: the generation was
        cancelled and ends in `StreamOverrun` (what follows for it is not wanted)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():  # a reader takes it at once
            self._put(response)
            return True
        data = response.SerializeToString()
        self._kept_bytes += len(data)
        if self._budget.add(len(data)):
            self._budget.remove(self._kept_bytes)
            self._kept_bytes = 0
            self._items.clear()
            self._call.cancel(self)
            self._put(StreamOverrun(self._budget.limit_bytes))
            return False
        self._put(data)
        return True

    def _put(self, item: _Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _OpenCall:
    """One GenerateMany call: the requests to write, the generations open on it, and the task
    that hands each event to its generation."""

    def __init__(
        self, client: GenerateManyClient, stub: pb_grpc.SchedulerStub, metadata: Sequence[tuple[str, str]]
    ) -> None:
        self.client = client
        self.streams: dict[int, GenerateStream] = {}
        self._actions: deque[pb.GenerateManyAction] = deque()  # not written yet
        self._writable = asyncio.Event()  # set: actions to write, or the call is over
        self._over = False
        self._call = stub.GenerateMany(self._requests_to_write(), metadata=metadata or None)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def send(self, action: pb.GenerateManyAction) -> None:
        self._actions.append(action)
        self._writable.set()

    def cancel(self, stream: GenerateStream) -> None:
        if self.streams.pop(stream.stream_id, None) is not None:
            self.send(pb.GenerateManyAction(stream_id=stream.stream_id, cancel=True))

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _requests_to_write(self) -> AsyncIterator[pb.GenerateManyRequest]:
        """What was sent since the last write, as one request each time (a write is in flight
        while more are sent: they go together in the next)."""
        while True:
            await self._writable.wait()
            self._writable.clear()
            if self._over:
                return
            # NOTE: no local keeps the batch: it would hold the requests until the next write.
            yield pb.GenerateManyRequest(actions=self._take_actions())

    def _take_actions(self) -> deque[pb.GenerateManyAction]:
        actions, self._actions = self._actions, deque()
        return actions

    async def _read(self) -> None:
        failure = GenerateFailed(
            grpc.StatusCode.UNAVAILABLE, "the GenerateMany call ended first", call_ended=True
        )
        streams = self.streams
        try:
            async for response in self._call:
                for event in response.events:
                    stream = streams.get(event.stream_id)
                    if stream is None:  # cancelled
                        continue
                    if event.HasField("response") and not stream._put_response(event.response):
                        continue  # it overran its bound: cancelled
                    if event.HasField("error"):
                        del streams[event.stream_id]
                        stream._put(GenerateFailed.of_event(event.error))
                    elif event.done:
                        del streams[event.stream_id]
                        stream._put(None)
        except grpc.aio.AioRpcError as exc:
            failure = GenerateFailed.of_call(exc)
        except asyncio.CancelledError:
            failure = GenerateFailed(grpc.StatusCode.CANCELLED, "the client was closed")
        finally:
            self.client._ended(self)
            self._over = True
            self._writable.set()
            for stream in streams.values():
                stream._put(failure)
            streams.clear()


class GenerateManyClient:
    """Generations over one `GenerateMany` call at a time on ``stub``'s channel; use it on one
    event loop. ``metadata`` goes with each call (the API key's, for one)."""

    def __init__(self, stub: pb_grpc.SchedulerStub, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self._stub = stub
        self._metadata = metadata
        self._stream_ids = itertools.count(1)
        self._open: _OpenCall | None = None

    def generate(self, request: pb.GenerateRequest, budget: UnreadBudget | None = None) -> GenerateStream:
        """Starts a generation; what it keeps unread counts against ``budget`` (none: no bound)."""
        call = self._open
        if call is None:
            call = self._open = _OpenCall(self, self._stub, self._metadata)
        stream = GenerateStream(call, next(self._stream_ids), budget or UnreadBudget())
        call.streams[stream.stream_id] = stream
        call.send(pb.GenerateManyAction(stream_id=stream.stream_id, generate=request))
        return stream

    async def close(self) -> None:
        """Cancels the open call: its generations fail with CANCELLED and are aborted."""
        call, self._open = self._open, None
        if call is not None:
            await call.close()

    def _ended(self, call: _OpenCall) -> None:
        if self._open is call:
            self._open = None
