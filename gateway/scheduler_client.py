"""The gateway's gRPC client for the scheduler: one channel, one method per scheduler call.

Requests and replies are mapped by `convert`; this module only makes the calls. Every failed
call surfaces as an `APIError` carrying the HTTP status its gRPC status maps to and, for a
refused field, the field the scheduler named (in the scheduler API's terms: `convert` puts it
in the client's).
"""

from __future__ import annotations

import itertools
from typing import Any

import grpc

from npuserve.gateway import convert
from npuserve.gateway.convert import HealthInfo, ModelInfo, TokenizeResult, Update
from npuserve.gateway.errors import APIError, bad_request, from_status
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
from npuserve.proto.generate_many import GenerateFailed, GenerateManyClient, GenerateStream

SMALL_CALL_TIMEOUT_S = 10.0
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
    otherwise seen as an internal error), or its tokens."""

    def __init__(self, client: SchedulerClient, request: pb.GenerateRequest, stub_index: int) -> None:
        self._client = client
        self._request = request
        self._stub_index = stub_index
        self._stream: GenerateStream | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._answered = False  # a response came
        if client.multiplexed:
            self._stream = client.generators[stub_index].generate(request)
        else:
            self._call = client.generate_call(request, stub_index)

    async def next(self) -> Update | None:
        if self._stream is not None:
            try:
                msg = await self._stream.read()
            except GenerateFailed as exc:
                if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                    self._client.multiplexed = False
                elif not exc.status_lost or self._answered:
                    raise from_status(exc.code, exc.details, exc.field) from None
                self._stream, self._call = None, self._client.generate_call(self._request, self._stub_index)
                return await self.next()
        else:
            assert self._call is not None
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
            if msg is grpc.aio.EOF:
                msg = None
        if msg is None:
            return None
        self._answered = True
        return convert.update_of(msg)

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
    first. Every call presents the API key when one is given."""

    def __init__(self, address: str, api_key: str | None = None, tls_ca: bytes | None = None) -> None:
        self.address = address
        self._metadata = bearer_metadata(api_key)
        self._tls_ca = tls_ca
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.SchedulerStub] = []
        self.generators: list[GenerateManyClient] = []  # one per stub
        self.multiplexed = True  # False once the scheduler did not know GenerateMany
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

    def generate(self, request: pb.GenerateRequest) -> GenerateCall:
        assert self._stubs, "SchedulerClient.open() was not awaited"
        return GenerateCall(self, request, next(self._turn) % len(self._stubs))

    def generate_call(self, request: pb.GenerateRequest, stub_index: int) -> grpc.aio.UnaryStreamCall:
        """A `Generate` call of its own for ``request``."""
        # NOTE: no deadline: a generation lasts as long as it needs; a gone client cancels it.
        return self._stubs[stub_index].Generate(request, metadata=self._metadata)

    async def _unary(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable,
        request: object,
        timeout_s: float = SMALL_CALL_TIMEOUT_S,
    ) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest, model: str
    ) -> TokenizeResult:
        try:
            request = convert.tokenize_request(req, model)
        except ValueError as exc:
            raise bad_request(f"the request cannot be encoded: {exc}") from None
        reply = await self._unary(self.stub.Tokenize, request)
        return convert.tokenize_result(reply, req.return_token_strs)

    async def detokenize(self, tokens: list[int], model: str) -> str:
        reply = await self._unary(self.stub.Detokenize, pb.DetokenizeRequest(model=model, token_ids=tokens))
        return reply.text

    async def list_models(self) -> list[ModelInfo]:
        return convert.model_infos(await self._unary(self.stub.ListModels, pb.ListModelsRequest()))

    async def health(self, timeout_s: float = SMALL_CALL_TIMEOUT_S) -> HealthInfo:
        return convert.health_info(await self._unary(self.stub.Health, pb.HealthRequest(), timeout_s))

    async def metrics_text(self) -> str:
        reply = await self._unary(self.stub.GetMetrics, pb.GetMetricsRequest())
        return reply.text

    async def start_profile(self) -> list[str]:
        """Starts the profiler on every executor; the ids of those profiling."""
        reply = await self._profile_call(self.stub.StartProfile, pb.StartProfileRequest())
        return list(reply.executor_ids)

    async def stop_profile(self) -> dict[str, list[str]]:
        """Stops the profilers; the trace files each executor wrote, by executor id."""
        reply = await self._profile_call(self.stub.StopProfile, pb.StopProfileRequest())
        return {e.executor_id: list(e.trace_files) for e in reply.executors}

    async def _profile_call(self, method: grpc.aio.UnaryUnaryMultiCallable, request: object) -> Any:
        try:
            return await method(request, timeout=PROFILE_TIMEOUT_S, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            status = _PROFILE_ERRORS.get(exc.code())
            if status is None:
                raise from_rpc_error(exc) from None
            raise APIError(status[0], exc.details() or exc.code().name, code=status[1]) from None
