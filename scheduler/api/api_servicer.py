"""The public gRPC API's calls that any process serving it answers itself: `Generate` and
`GenerateMany` (given a front that queues requests and streams their outputs), `Tokenize` and
`Detokenize`.

The engine's own process serves them over the engine (`server.SchedulerServicer`); an API server
process (`--api-server-count`) over its link to the engine (`api_process`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

import grpc
import structlog

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.api_spread import ApiServer, api_server_metadata
from npuserve.proto.channel import DEFAULT_STREAM_STALL_TIMEOUT_S
from npuserve.scheduler.api import api_codec
from npuserve.scheduler.api.api_status import ShuttingDown, abort_with, guarded
from npuserve.scheduler.api.generate_many import GenerateManyCall
from npuserve.scheduler.api.stall_watch import StreamStalled, WriteWatch
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.engine.continuation import Continuation
from npuserve.scheduler.engine.outputs import OpenStream, client_outputs
from npuserve.scheduler.text.prompts import PromptInput, PromptProcessor


class GenerateFront(Protocol):
    async def open(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None,
        model: str | None,
        continuation: Continuation | None = None,
    ) -> OpenStream: ...


class PublicApiServicer(pb_grpc.SchedulerServicer):
    """``api_server``: this process's index among the processes serving the API, and their
    number; every `GenerateMany` call names it in its trailing metadata (`api_spread`).
    ``stream_stall_timeout_s``: how long a client may leave a stream's response unread before
    the stream's requests are aborted (`stall_watch`; 0: for ever)."""

    def __init__(
        self,
        front: GenerateFront,
        prompts: PromptProcessor,
        api_server: ApiServer = (0, 1),
        stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S,
    ) -> None:
        self.front = front
        self.prompts = prompts
        self._api_server_metadata = api_server_metadata(*api_server)
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.draining = False  # new generations are refused (UNAVAILABLE); see `drain`
        self._many_calls: set[GenerateManyCall] = set()

    def drain(self) -> None:
        """Refuses new generations from now on; a GenerateMany call ends once its own have."""
        self.draining = True
        for call in self._many_calls:
            call.wake()

    async def open(self, request: pb.GenerateRequest) -> OpenStream:
        """Checks, tokenizes and queues ``request`` (raises what refuses it; all is refused while
        draining)."""
        if self.draining:
            raise ShuttingDown("the scheduler is shutting down; retry on another")
        return await self.front.open(
            api_codec.prompt_from_proto(request),
            api_codec.sampling_from_proto(request.sampling),
            request.request_id or None,
            request.model or None,
            api_codec.continuation_from_proto(request),
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        structlog.contextvars.bind_contextvars(request_id=request.request_id or None)
        try:
            # NOTE: opening and every output are awaited inside the guard, so refusals become a
            # status rather than a broken stream; a cancelled client cancels this coroutine,
            # and leaving `client_outputs` aborts the request.
            opened = await self.open(request)
            tokenizer, return_prompt = self.prompts.tokenizer, request.sampling.return_prompt
            with WriteWatch(self.stream_stall_timeout_s, lambda: opened.close(None)) as watch:
                async with aclosing(client_outputs(opened)) as outputs:
                    async for output in outputs:
                        watch.writing()
                        yield api_codec.output_to_proto(output, tokenizer, return_prompt)
                        watch.written()
        except Exception as exc:
            await abort_with(context, exc)

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        # NOTE: trailing, not initial: API processes lost the initial metadata of about 1 call
        # in 20 that ended at once (a probe's); trailers come with the status, always.
        context.set_trailing_metadata(self._api_server_metadata)
        call = GenerateManyCall(self.open, self.prompts.tokenizer, lambda: self.draining)
        self._many_calls.add(call)
        try:
            with WriteWatch(self.stream_stall_timeout_s, call.abandon) as watch:
                async with aclosing(call.responses(request_iterator)) as responses:
                    async for response in responses:
                        watch.writing()
                        yield response
                        watch.written()
        except StreamStalled as exc:
            await abort_with(context, exc)
        finally:
            self._many_calls.discard(call)

    @guarded
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        prompts = self.prompts
        prompts.check_model(request.model or None)
        ids = await prompts.prompt_token_ids(api_codec.prompt_from_proto(request))
        response = pb.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=prompts.limits.max_model_len
        )
        if request.return_token_strs:
            tokenizer = prompts.tokenizer
            response.token_strs.extend(await prompts.off_loop(lambda: tokenizer.convert_ids_to_tokens(ids)))
        return response

    @guarded
    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        self.prompts.check_model(request.model or None)
        text = await self.prompts.decode(list(request.token_ids), skip_special_tokens=False)
        return pb.DetokenizeResponse(text=text)
