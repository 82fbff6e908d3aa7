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
from npuserve.proto.auth import bearer_metadata
from npuserve.proto.channel import (
    API_SERVERS,
    CONNECTION_INDEX_OPTION,
    MAX_API_MESSAGE_BYTES,
    aio_client_channel,
    message_size_options,
)
from npuserve.proto.error_details import error_field

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
    """One streaming Generate call; `next()` gives updates until None, `cancel()` aborts it."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def next(self) -> Update | None:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        if msg is grpc.aio.EOF:
            return None
        return convert.update_of(msg)

    def cancel(self) -> None:
        """Cancels the call; the scheduler then aborts the request and frees its blocks."""
        self._call.cancel()


class SchedulerClient:
    """gRPC channels to the scheduler, opened inside the event loop that uses them: Generate
    calls take turns over `API_SERVERS` connections (the scheduler admits calls per connection's
    server), other calls use the first. Every call presents the API key when one is given."""

    def __init__(self, address: str, api_key: str | None = None, tls_ca: bytes | None = None) -> None:
        self.address = address
        self._metadata = bearer_metadata(api_key)
        self._tls_ca = tls_ca
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.SchedulerStub] = []
        self._turn = itertools.count()

    async def open(self) -> None:
        options = [*message_size_options(MAX_API_MESSAGE_BYTES), *RECONNECT_OPTIONS]
        self._channels = [
            aio_client_channel(self.address, [*options, (CONNECTION_INDEX_OPTION, i)], self._tls_ca)
            for i in range(API_SERVERS)
        ]
        self._stubs = [pb_grpc.SchedulerStub(channel) for channel in self._channels]

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], []
        for channel in channels:
            await channel.close(grace=None)

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        assert self._stubs, "SchedulerClient.open() was not awaited"
        return self._stubs[0]

    def generate(self, request: pb.GenerateRequest) -> GenerateCall:
        assert self._stubs, "SchedulerClient.open() was not awaited"
        stub = self._stubs[next(self._turn) % len(self._stubs)]
        # NOTE: no deadline: a generation lasts as long as it needs; a gone client cancels it.
        return GenerateCall(stub.Generate(request, metadata=self._metadata))

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
