"""The OpenAI requests in the scheduler's protobuf terms, and its replies and errors back.

Requests go out as `GenerateRequest`s built from the OpenAI models; replies come back as the
small dataclasses below, so the rest of the gateway never sees a protobuf message; a refused
field comes back under the name the client sent it as. The calls themselves are made by
`scheduler_client`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from npuserve.gateway.errors import APIError, bad_request
from npuserve.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from npuserve.proto import scheduler_pb2 as pb

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
    degraded: bool = False  # serving on fewer executors than the scheduler knows of


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


def tokenize_request(req: TokenizeCompletionRequest | TokenizeChatRequest, model: str) -> pb.TokenizeRequest:
    msg = pb.TokenizeRequest(
        model=model, add_special_tokens=req.add_special_tokens, return_token_strs=req.return_token_strs
    )
    if isinstance(req, TokenizeChatRequest):
        msg.chat.CopyFrom(_chat_prompt(req.messages, req.add_generation_prompt, req.chat_template))
    else:
        msg.text = req.prompt
    return msg


# -- responses -------------------------------------------------------------------------------------


def update_of(msg: pb.GenerateResponse) -> Update:
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


def tokenize_result(reply: pb.TokenizeResponse, return_token_strs: bool) -> TokenizeResult:
    strs = list(reply.token_strs) if return_token_strs else None
    return TokenizeResult(list(reply.token_ids), reply.max_model_len, strs)


def model_infos(reply: pb.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(m.id, m.max_model_len, m.root, m.created) for m in reply.models]


def health_info(reply: pb.HealthResponse) -> HealthInfo:
    return HealthInfo(reply.serving, reply.ready_executors, reply.total_executors, reply.message, reply.degraded)


# -- errors ----------------------------------------------------------------------------------------


def _params_of_fields(body: BaseModel) -> dict[str, str]:
    """The scheduler's field -> the param `body` sent it as, where the two names differ: the
    inverse of the request mapping above."""
    if isinstance(body, ChatCompletionRequest):
        max_tokens = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_tokens}
    if isinstance(body, TokenizeChatRequest):
        return {"prompt": "messages"}
    if isinstance(body, DetokenizeRequest):
        return {"token_ids": "tokens"}
    return {}


def in_request_terms(error: APIError, body: BaseModel) -> APIError:
    """`error` naming the param the client sent (`top_logprobs`) where the scheduler named its
    own field (`logprobs`), in `param` and at the head of the message."""
    field = error.param
    if field is None or (param := _params_of_fields(body).get(field)) is None:
        return error
    message = error.message
    if message.startswith(f"{field} "):
        message = param + message[len(field) :]
    return APIError(error.status, message, error.type, param, error.code, error.headers)
