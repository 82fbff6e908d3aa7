"""The scheduler's gRPC API in gateway terms: the only gateway module that touches protobuf.

Requests go out as `GenerateRequest`s built from the OpenAI models; responses come back as the
small dataclasses below, so the rest of the gateway never sees a protobuf message. Every failed
call surfaces as an `APIError` carrying the HTTP status its gRPC status maps to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from npuserve.gateway.errors import bad_request, from_status
from npuserve.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.channel import MAX_API_MESSAGE_BYTES, message_size_options

SMALL_CALL_TIMEOUT_S = 10.0


# -- what the gateway sees of the scheduler's replies -----------------------------------------------


@dataclass(slots=True)
class TopLogprob:
    token: str
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    token: str  # the token decoded on its own
    logprob: float
    top: list[TopLogprob]  # best first


@dataclass(slots=True)
class ChoiceDelta:
    """The new part of one choice (index within its prompt's n choices)."""

    index: int
    text: str
    num_tokens: int
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None
    error: str = ""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(slots=True)
class Update:
    choices: list[ChoiceDelta]
    prompt_text: str | None = None  # on the first update, when the prompt was asked back
    usage: Usage | None = None  # on the last update


@dataclass(slots=True)
class ModelInfo:
    id: str
    max_model_len: int
    root: str
    created: int


@dataclass(slots=True)
class HealthInfo:
    serving: bool
    ready_executors: int
    total_executors: int
    message: str = ""


@dataclass(slots=True)
class TokenizeResult:
    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None = field(default=None)


# -- requests --------------------------------------------------------------------------------------


def _sampling(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None
) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        n=req.n,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
    )
    optional = {
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(msg, name, value)
    return msg


def completion_requests(req: CompletionRequest, request_id: str, model: str) -> list[pb.GenerateRequest]:
    """One scheduler request per prompt of a (possibly batched) completion request."""
    try:
        sampling = _sampling(req, req.max_tokens, req.logprobs)
        requests = []
        for i, prompt in enumerate(req.prompt):
            rid = request_id if len(req.prompt) == 1 else f"{request_id}-{i}"
            if isinstance(prompt, str):
                msg = pb.GenerateRequest(
                    request_id=rid, model=model, text=prompt, add_special_tokens=req.add_special_tokens
                )
            else:
                msg = pb.GenerateRequest(request_id=rid, model=model, token_ids=pb.TokenIds(ids=prompt))
            msg.sampling.CopyFrom(sampling)
            # NOTE: a text prompt is echoed as the client wrote it; token ids need the scheduler's text.
            msg.sampling.return_prompt = req.echo and not isinstance(prompt, str)
            requests.append(msg)
        return requests
    except ValueError as exc:  # text protobuf cannot carry (lone surrogates), ints out of range
        raise bad_request(f"the request cannot be encoded: {exc}") from None


def chat_request(req: ChatCompletionRequest, request_id: str, model: str) -> pb.GenerateRequest:
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        msg = pb.GenerateRequest(
            request_id=request_id,
            model=model,
            chat=_chat_prompt(req.messages, req.add_generation_prompt, req.chat_template),
            sampling=_sampling(req, req.completion_limit, logprobs),
            add_special_tokens=req.add_special_tokens,
        )
    except ValueError as exc:
        raise bad_request(f"the request cannot be encoded: {exc}") from None
    return msg


def _chat_prompt(
    messages: list[ChatMessage], add_generation_prompt: bool, template: str | None
) -> pb.ChatPrompt:
    chat = pb.ChatPrompt(
        messages=[pb.ChatMessage(role=m.role, content=m.content) for m in messages],
        add_generation_prompt=add_generation_prompt,
    )
    if template is not None:
        chat.chat_template = template
    return chat


def _tokenize_request(req: TokenizeCompletionRequest | TokenizeChatRequest, model: str) -> pb.TokenizeRequest:
    msg = pb.TokenizeRequest(
        model=model, add_special_tokens=req.add_special_tokens, return_token_strs=req.return_token_strs
    )
    if isinstance(req, TokenizeChatRequest):
        msg.chat.CopyFrom(_chat_prompt(req.messages, req.add_generation_prompt, req.chat_template))
    else:
        msg.text = req.prompt
    return msg


# -- responses -------------------------------------------------------------------------------------


def _update_of(msg: pb.GenerateResponse) -> Update:
    choices = []
    for c in msg.completions:
        delta = ChoiceDelta(c.index, c.text, len(c.token_ids), [])
        if c.logprobs:
            delta.logprobs = [
                TokenLogprob(lp.token, lp.logprob, [TopLogprob(t.token, t.logprob) for t in lp.top])
                for lp in c.logprobs
            ]
        if c.finish_reason:
            which = c.WhichOneof("stop_reason")
            delta.finish_reason, delta.error = c.finish_reason, c.error_message
            delta.stop_reason = None if which is None else getattr(c, which)
        choices.append(delta)
    update = Update(choices)
    if msg.HasField("prompt"):
        update.prompt_text = msg.prompt.text
    if msg.HasField("usage"):
        u = msg.usage
        update.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    return update


# -- the client ------------------------------------------------------------------------------------


class GenerateCall:
    """One streaming Generate call; `next()` gives updates until None, `cancel()` aborts it."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def next(self) -> Update | None:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc.code(), exc.details()) from None
        if msg is grpc.aio.EOF:
            return None
        return _update_of(msg)

    def cancel(self) -> None:
        """Cancels the call; the scheduler then aborts the request and frees its blocks."""
        self._call.cancel()


class SchedulerClient:
    """One gRPC channel to the scheduler, opened inside the event loop that uses it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SchedulerStub | None = None

    async def open(self) -> None:
        self._channel = grpc.aio.insecure_channel(
            self.address,
            options=message_size_options(MAX_API_MESSAGE_BYTES),
        )
        self._stub = pb_grpc.SchedulerStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = self._stub = None

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        assert self._stub is not None, "SchedulerClient.open() was not awaited"
        return self._stub

    def generate(self, request: pb.GenerateRequest) -> GenerateCall:
        # NOTE: no deadline: a generation lasts as long as it needs; a gone client cancels it.
        return GenerateCall(self.stub.Generate(request))

    async def _unary(self, method: grpc.aio.UnaryUnaryMultiCallable, request: object) -> Any:
        try:
            return await method(request, timeout=SMALL_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc.code(), exc.details()) from None

    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest, model: str
    ) -> TokenizeResult:
        try:
            request = _tokenize_request(req, model)
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
        try:
            reply = await self.stub.Health(pb.HealthRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_status(exc.code(), exc.details()) from None
        return HealthInfo(reply.serving, reply.ready_executors, reply.total_executors, reply.message)

    async def metrics_text(self) -> str:
        reply = await self._unary(self.stub.GetMetrics, pb.GetMetricsRequest())
        return reply.text
