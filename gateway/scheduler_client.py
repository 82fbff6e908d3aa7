"""The gateway's gRPC client for the scheduler: one channel, one method per scheduler call.

Requests and generation updates are mapped by `convert`; the small calls' replies, here, into
its dataclasses. Every failed call surfaces as an `APIError` carrying the HTTP status its gRPC
status maps to and, for a refused field, the field the scheduler named (in the scheduler API's
terms: `convert` puts it in the client's).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog

from npuserve.gateway import convert
from npuserve.gateway.convert import HealthInfo, ModelInfo, TokenizeResult, Update
from npuserve.gateway.delivered import DeliveredOutput
from npuserve.gateway.errors import APIError, bad_request, from_status, unavailable
from npuserve.gateway.limits import DEFAULT_MAX_STREAM_BUFFER_BYTES
from npuserve.gateway.protocol import TokenizeChatRequest, TokenizeCompletionRequest
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.api_spread import spread_channels
from npuserve.proto.auth import bearer_metadata
from npuserve.proto.channel import (
    API_SERVERS,
    MAX_API_MESSAGE_BYTES,
    message_size_options,
)
from npuserve.proto.error_details import error_field
from npuserve.proto.generate_many import (
    GenerateFailed,
    GenerateManyClient,
    GenerateStream,
    StreamOverrun,
    UnreadBudget,
)

log = structlog.get_logger(__name__)

SMALL_CALL_TIMEOUT_S = 10.0
# How long a generation that got nothing waits for a scheduler that went away to come back (one
# that `npuserve serve` or Kubernetes restarts is back in seconds) before it fails with 503; a
# scheduler that has not answered for longer than this is down, and its generations fail at once.
SCHEDULER_RETURN_WAIT_S = 15.0
RESEND_PAUSE_S = 0.25
# NOTE: gRPC waits up to 120 s between reconnection attempts by default; a scheduler that
# `npuserve serve` restarted is back within seconds, and the gateway should notice at once.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]
PROFILE_TIMEOUT_S = 600.0  # stopping exports every executor's trace
# Profiling answers: executors without --profile-dir, and a start/stop out of turn.
_PROFILE_ERRORS = {
    grpc.StatusCode.UNIMPLEMENTED: (400, "profiling_disabled"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "profiler_state"),
}


def from_rpc_error(exc: grpc.aio.AioRpcError) -> APIError:
    """The HTTP error for a failed scheduler call, with the field it names."""
    return from_status(exc.code(), exc.details(), error_field(exc))


class GenerateCall:
    """One generation; `next()` gives updates until None, `cancel()` aborts it.

    It goes over the channel's `GenerateMany` call; a scheduler that does not know that call
    (an older one, mid-upgrade) gets a `Generate` call instead, and so does every later one. So
    does a generation whose call ended, before it got anything, with a status grpc's client lost
    (`GenerateFailed.status_lost`): its own call gets the scheduler's answer (an older one's,
    otherwise seen as an internal error), or its tokens.

    A generation whose call broke (ended UNAVAILABLE) is sent again once its scheduler is there
    again, within `SCHEDULER_RETURN_WAIT_S`: once the scheduler is back where it then answers no
    health check (it died, or was restarting when it was sent), at once where it answers and the
    call was a `GenerateMany` (which refuses a generation with an event, never by ending: the
    call broke, an API server process died, say). A `Generate` call that ended UNAVAILABLE while
    the scheduler answers is its refusal. The wait counts from the first break of a generation
    that had nothing yet (and only if the scheduler answered within that long before: one not
    seen for longer is down, not restarting, 503 at once), and from the break for one that had
    tokens, which is resumed: sent again as a continuation of what it received (`delivered`).
    Either way its client sees only a pause.

    A generation in flight when its call broke (answered, or sent over a connected channel: it
    reached a scheduler that then died, or the API server process serving the call did) is sent
    again once only: if that call breaks too, it fails (500, `scheduler_lost_twice`), so a
    request that brings its scheduler down cannot do so more than twice. One with n > 1 that has
    a finished choice cannot be resumed, and fails as before (503)."""

    def __init__(
        self, client: SchedulerClient, request: pb.GenerateRequest, stub_index: int, budget: UnreadBudget
    ) -> None:
        self._client = client
        self._request = self._first_request = request
        self._stub_index = stub_index
        self._budget = budget  # what it may keep unread, with the other calls of its response
        self._stream: GenerateStream | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._answered = False  # a response came
        self._call_answered = False  # ... over the current call
        self._sent_connected = False  # the current call went over a connected channel
        self._lost_in_flight = False  # a call of it broke while it was in flight
        self._resend_until: float | None = None  # set at the first call that ended unanswered
        self._delivered = DeliveredOutput(request)
        self._send()

    def _send(self) -> None:
        self._call_answered = False
        self._sent_connected = self._client.connected(self._stub_index)
        if self._client.multiplexed:
            generator = self._client.generators[self._stub_index]
            self._stream, self._call = generator.generate(self._request, self._budget), None
        else:
            self._stream, self._call = None, self._client.generate_call(self._request, self._stub_index)

    async def _sent_again(self, code: grpc.StatusCode, call_ended: bool, refusable: bool) -> bool:
        """Whether the generation was sent again after its call ended with ``code``: only one
        whose call broke (``refusable``: such an end can be the scheduler's refusal, a `Generate`
        call's) and whose scheduler is there again in time. Raises for one that must not or
        cannot go on."""
        if not call_ended or code != grpc.StatusCode.UNAVAILABLE:
            return False
        until = self._send_again_until()
        if until is None:
            return False
        answers = await self._client.answers(self._stub_index)
        if answers and refusable:  # the scheduler's own answer: it is there
            return False
        if self._call_answered or self._sent_connected:
            if self._lost_in_flight:
                log.warning("generation lost in flight twice", request_id=self._request.request_id or None)
                raise APIError(
                    500,
                    "the scheduler went down twice while generating this request; it is not sent a third time",
                    "server_error",
                    code="scheduler_lost_twice",
                )
            self._lost_in_flight = True
        request = self._request if not self._answered else self._delivered.resuming(self._first_request)
        if request is None:
            raise unavailable(
                "the scheduler went down while generating this request, and a request with a "
                "finished choice (n > 1) cannot be resumed; retry"
            )
        if not await self._back(answers, until):
            return False
        request_id = request.request_id or None
        if self._answered:
            log.info(
                "generation resumed",
                request_id=request_id,
                output_tokens=self._delivered.num_tokens,
                scheduler_answered=answers,
            )
            self._client.on_resume()
        else:
            log.info("generation sent again", request_id=request_id, scheduler_answered=answers)
            self._client.on_resend()
        self._request = request
        self._send()
        return True

    async def _back(self, answers: bool, until: float) -> bool:
        """Whether the scheduler is there by ``until``: it ``answers`` a health check over the
        channel (where the channel connects, the process there may be one of a scheduler that
        died, still stopping: an API server process, which takes calls it cannot serve)."""
        while True:
            # NOTE: a pause, so that one going down (which refuses calls, then stops) is asked a
            # few times a second, not in a loop.
            await asyncio.sleep(RESEND_PAUSE_S)
            if answers:
                return True
            if not await self._client.wait_ready(self._stub_index, until - time.monotonic()):
                return False
            answers = await self._client.answers(self._stub_index)

    def _send_again_until(self) -> float | None:
        """Until when the generation waits for its scheduler to send it again; None: it does not."""
        now = time.monotonic()
        if self._answered:
            return now + SCHEDULER_RETURN_WAIT_S
        if self._resend_until is None:
            seen_at = self._client.scheduler_seen_at
            if seen_at is None or now - seen_at > SCHEDULER_RETURN_WAIT_S:
                return None
            self._resend_until = now + SCHEDULER_RETURN_WAIT_S
        return self._resend_until if now < self._resend_until else None

    async def next(self) -> Update | None:
        if self._stream is not None:
            try:
                msg = await self._stream.read()
            except StreamOverrun as exc:
                raise APIError(
                    400,
                    f"the client read this stream more slowly than it was generated: more than "
                    f"{exc.limit_bytes} bytes of its output waited in the gateway "
                    "(--max-stream-buffer-bytes), so the request was aborted; read faster, or ask "
                    "for less output at once (n, logprobs)",
                    code="stream_buffer_full",
                ) from None
            except GenerateFailed as exc:
                if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                    self._client.multiplexed = False
                elif await self._sent_again(exc.code, exc.call_ended, refusable=False):
                    return await self.next()
                elif not exc.status_lost or self._call_answered:
                    raise from_status(exc.code, exc.details, exc.field) from None
                self._stream, self._call = None, self._client.generate_call(self._request, self._stub_index)
                return await self.next()
        else:
            assert self._call is not None
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                if await self._sent_again(exc.code(), call_ended=True, refusable=True):
                    return await self.next()
                raise from_rpc_error(exc) from None
            if msg is grpc.aio.EOF:
                msg = None
        if msg is None:
            return None
        if not self._call_answered:  # the current call's first response
            self._answered = self._call_answered = True
            self._client.scheduler_seen_at = time.monotonic()
            # NOTE: a continuation the scheduler did not go on from (one that predates
            # continuations starts over) would repeat or skip text: it fails.
            resumed = self._request is not self._first_request
            if resumed and msg.resumed_tokens != self._delivered.num_tokens:
                self.cancel()
                raise APIError(
                    500,
                    "the scheduler restarted while generating this request, and the one now serving cannot resume it",
                    "server_error",
                    code="generation_not_resumed",
                )
        self._delivered.add(msg)
        return convert.update_of(msg)

    def streaming(self) -> None:
        """What the generation keeps unread from now on waits for the client, being streamed
        the response: it counts against the response's bound (what it kept before waited for
        the response's other generations, `UnreadBudget.start`)."""
        self._budget.start()

    def cancel(self) -> None:
        """Cancels the generation; the scheduler then aborts the request and frees its blocks."""
        if self._stream is not None:
            self._stream.cancel()
        if self._call is not None:
            self._call.cancel()


class SchedulerClient:
    """gRPC channels to the scheduler, opened inside the event loop that uses them: generations
    take turns over `API_SERVERS` connections, each carrying its share over one `GenerateMany`
    call (a message per turn for all of them, not one per token per stream); other calls use the
    first. Every call presents the API key when one is given.

    A `GenerateMany` call is read as fast as the scheduler writes, so a client slower than its
    output does not hold back the others on the call: the generations of its response keep what
    it has not read, once they are `GenerateCall.streaming`, up to ``max_stream_buffer_bytes``
    together (0: no bound), past which they are aborted and the response ends in a 400
    (`stream_buffer_full`). (A `Generate` call of its own is held back by gRPC's flow control instead; a response that
    is not streamed is held whole anyway, bounded by the request's limits.)"""

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        tls_ca: bytes | None = None,
        on_resend: Callable[[], None] = lambda: None,
        on_resume: Callable[[], None] = lambda: None,
        max_stream_buffer_bytes: int = DEFAULT_MAX_STREAM_BUFFER_BYTES,
    ) -> None:
        """``on_resend``, ``on_resume``: called for each generation sent again with nothing
        yet, and for each resumed with what it had (metrics count them)."""
        self.address = address
        self.max_stream_buffer_bytes = max_stream_buffer_bytes
        self.on_resend = on_resend
        self.on_resume = on_resume
        self._metadata = bearer_metadata(api_key)
        self._tls_ca = tls_ca
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.SchedulerStub] = []
        self.generators: list[GenerateManyClient] = []  # one per stub
        self.multiplexed = True  # False once the scheduler did not know GenerateMany
        # When the scheduler last answered (a generation's first response, a health check).
        self.scheduler_seen_at: float | None = None
        self._probes: dict[int, asyncio.Future[bool]] = {}  # health checks under way, by channel
        self._turn = itertools.count()

    async def open(self) -> None:
        """Opens the channels, spread evenly over the scheduler's API server processes (one
        each at least) when it says where each landed (`api_spread`)."""
        options = [*message_size_options(MAX_API_MESSAGE_BYTES), *RECONNECT_OPTIONS]
        self._channels = await spread_channels(
            self.address, API_SERVERS, options, self._tls_ca, self._metadata or ()
        )
        self._stubs = [pb_grpc.SchedulerStub(channel) for channel in self._channels]
        self.generators = [GenerateManyClient(stub, self._metadata or ()) for stub in self._stubs]

    async def answers(self, stub_index: int) -> bool:
        """Whether the scheduler answers a health check over channel ``stub_index`` now (one
        that answers, serving or not, is there). Generations that ask at once share one check:
        a scheduler's death ends every generation of a call together."""
        probe = self._probes.get(stub_index)
        if probe is None:
            probe = self._probes[stub_index] = asyncio.ensure_future(self._answers(stub_index))
            probe.add_done_callback(lambda _: self._probes.pop(stub_index, None))
        return await asyncio.shield(probe)  # NOTE: one asker that is cancelled cancels no other's

    async def _answers(self, stub_index: int) -> bool:
        if stub_index >= len(self._stubs):
            return False
        try:
            await self._stubs[stub_index].Health(
                pb.HealthRequest(), timeout=SMALL_CALL_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:  # any status but these two came from the scheduler
            return exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        except grpc.aio.UsageError:  # the client was closed (the gateway stops)
            return False
        return True

    def connected(self, stub_index: int) -> bool:
        """Whether channel ``stub_index`` is connected to the scheduler now."""
        channels = self._channels
        return stub_index < len(channels) and (
            channels[stub_index].get_state() == grpc.ChannelConnectivity.READY
        )

    async def wait_ready(self, stub_index: int, timeout_s: float) -> bool:
        """Whether channel ``stub_index`` is connected to the scheduler within ``timeout_s``."""
        if timeout_s <= 0 or stub_index >= len(self._channels):
            return False
        try:
            await asyncio.wait_for(self._channels[stub_index].channel_ready(), timeout_s)
        except (asyncio.TimeoutError, grpc.aio.UsageError):  # the second: the client was closed
            return False
        return True

    async def close(self) -> None:
        generators, self.generators = self.generators, []
        for generator in generators:
            await generator.close()
        channels, self._channels, self._stubs = self._channels, [], []
        for channel in channels:
            await channel.close(grace=None)

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        assert self._stubs, "SchedulerClient.open() was not awaited"
        return self._stubs[0]

    def generate(self, requests: Sequence[pb.GenerateRequest]) -> list[GenerateCall]:
        """The generations of one client response, one per request, taking turns over the
        channels; what they keep unread for it counts against one bound."""
        assert self._stubs, "SchedulerClient.open() was not awaited"
        budget = UnreadBudget(self.max_stream_buffer_bytes)
        return [
            GenerateCall(self, request, next(self._turn) % len(self._stubs), budget) for request in requests
        ]

    def generate_call(self, request: pb.GenerateRequest, stub_index: int) -> grpc.aio.UnaryStreamCall:
        """A `Generate` call of its own for ``request``."""
        # NOTE: no deadline: a generation lasts as long as it needs; a gone client cancels it.
        return self._stubs[stub_index].Generate(request, metadata=self._metadata)

    async def _unary(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable,
        request: object,
        timeout_s: float = SMALL_CALL_TIMEOUT_S,
        errors: dict[grpc.StatusCode, tuple[int, str]] | None = None,
    ) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            status = (errors or {}).get(exc.code())
            if status is None:
                raise from_rpc_error(exc) from None
            raise APIError(status[0], exc.details() or exc.code().name, code=status[1]) from None

    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest, model: str
    ) -> TokenizeResult:
        try:
            request = convert.tokenize_request(req, model)
        except ValueError as exc:
            raise bad_request(f"the request cannot be encoded: {exc}") from None
        reply = await self._unary(self.stub.Tokenize, request)
        strs = list(reply.token_strs) if req.return_token_strs else None
        return TokenizeResult(list(reply.token_ids), reply.max_model_len, strs)

    async def detokenize(self, tokens: list[int], model: str) -> str:
        reply = await self._unary(self.stub.Detokenize, pb.DetokenizeRequest(model=model, token_ids=tokens))
        return reply.text

    async def list_models(self) -> list[ModelInfo]:
        reply = await self._unary(self.stub.ListModels, pb.ListModelsRequest())
        return [ModelInfo(m.id, m.max_model_len, m.root, m.created) for m in reply.models]

    async def health(self, timeout_s: float = SMALL_CALL_TIMEOUT_S) -> HealthInfo:
        reply = await self._unary(self.stub.Health, pb.HealthRequest(), timeout_s)
        self.scheduler_seen_at = time.monotonic()
        return HealthInfo(
            reply.serving, reply.ready_executors, reply.total_executors, reply.message, reply.degraded
        )

    async def metrics_text(self) -> str:
        reply = await self._unary(self.stub.GetMetrics, pb.GetMetricsRequest())
        return reply.text

    async def start_profile(self) -> list[str]:
        """Starts the profiler on every executor; the ids of those profiling."""
        reply = await self._unary(
            self.stub.StartProfile, pb.StartProfileRequest(), PROFILE_TIMEOUT_S, _PROFILE_ERRORS
        )
        return list(reply.executor_ids)

    async def stop_profile(self) -> dict[str, list[str]]:
        """Stops the profilers; the trace files each executor wrote, by executor id."""
        reply = await self._unary(
            self.stub.StopProfile, pb.StopProfileRequest(), PROFILE_TIMEOUT_S, _PROFILE_ERRORS
        )
        return {e.executor_id: list(e.trace_files) for e in reply.executors}
