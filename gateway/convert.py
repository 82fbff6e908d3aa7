"""The OpenAI requests in the scheduler's protobuf terms, and its replies and errors back.

Requests go out as `GenerateRequest`s built from the OpenAI models; generation updates come
back as the small dataclasses below, so the rest of the gateway never sees a protobuf message; a
refused field comes back under the name the client sent it as. The calls themselves are made by
`scheduler_client`, which maps the small calls' replies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
from npuserve.gateway.structured_outputs import constraint_of
from npuserve.gateway.tool_calls import Tool, ToolPlan, constrains_output
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto.structured_outputs import FIELD as STRUCTURED_FIELD

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
    token_strs: list[str] | None = None


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
    constraint = constraint_of(req)
    if constraint is not None:
        msg.structured_outputs.CopyFrom(constraint.message)
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


def chat_request(
    req: ChatCompletionRequest, request_id: str, model: str, tools: ToolPlan
) -> pb.GenerateRequest:
    """The scheduler request of a chat completion; `tools`: its tool plan (the constraint that
    enforces `required` or a named function, and whether its parser needs special tokens)."""
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        msg = pb.GenerateRequest(
            request_id=request_id,
            model=model,
            chat=_chat_prompt(req),
            sampling=_sampling(req, req.completion_limit, logprobs),
            add_special_tokens=req.add_special_tokens,
        )
    except ValueError as exc:
        raise bad_request(f"the request cannot be encoded: {exc}") from None
    if tools.parser is not None and tools.parser.keeps_special_tokens and req.skip_special_tokens is None:
        msg.sampling.skip_special_tokens = False  # the parser reads markers that are special tokens
    if tools.schema is not None:
        if msg.sampling.HasField("structured_outputs"):
            raise bad_request(
                "tool_choice: a required or named tool choice constrains the output already; "
                "leave out response_format, structured_outputs and guided_*",
                "tool_choice",
            )
        msg.sampling.structured_outputs.json_schema = json.dumps(tools.schema)
    return msg


def _chat_prompt(req: ChatCompletionRequest | TokenizeChatRequest) -> pb.ChatPrompt:
    chat = pb.ChatPrompt(
        messages=[_message(m) for m in req.messages],
        add_generation_prompt=req.add_generation_prompt,
        tools=[_tool(t) for t in req.tools or ()],
    )
    if req.chat_template is not None:
        chat.chat_template = req.chat_template
    return chat


def _message(message: ChatMessage) -> pb.ChatMessage:
    msg = pb.ChatMessage(role=message.role, content=message.content)
    if message.name is not None:
        msg.name = message.name
    if message.tool_call_id is not None:
        msg.tool_call_id = message.tool_call_id
    for call in message.tool_calls or ():
        function = pb.FunctionCall(name=call.function.name, arguments=call.function.arguments)
        msg.tool_calls.append(pb.ToolCall(id=call.id, type=call.type, function=function))
    return msg


def _tool(tool: Tool) -> pb.Tool:
    function = pb.FunctionDefinition(
        name=tool.function.name, parameters_json=json.dumps(tool.function.parameters, ensure_ascii=False)
    )
    if tool.function.description is not None:
        function.description = tool.function.description
    return pb.Tool(type=tool.type, function=function)


def tokenize_request(req: TokenizeCompletionRequest | TokenizeChatRequest, model: str) -> pb.TokenizeRequest:
    msg = pb.TokenizeRequest(
        model=model, add_special_tokens=req.add_special_tokens, return_token_strs=req.return_token_strs
    )
    if isinstance(req, TokenizeChatRequest):
        msg.chat.CopyFrom(_chat_prompt(req))
    else:
        msg.text = req.prompt
    return msg


# -- responses -------------------------------------------------------------------------------------


def update_of(msg: pb.GenerateResponse) -> Update:
    choices = []
    for c in msg.completions:
        logprobs = [
            TokenLogprob(lp.token, lp.logprob, [TopLogprob(t.token, t.logprob) for t in lp.top])
            for lp in c.logprobs
        ]
        delta = ChoiceDelta(c.index, c.text, logprobs)
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


# -- errors ----------------------------------------------------------------------------------------


def _params_of_fields(body: BaseModel) -> dict[str, str]:
    """The scheduler's field -> the param `body` sent it as, where the two names differ: the
    inverse of the request mapping above."""
    if isinstance(body, ChatCompletionRequest | CompletionRequest):
        names = _constraint_param(body)
        if isinstance(body, ChatCompletionRequest):
            names |= {
                "prompt": "messages",
                "logprobs": "top_logprobs",
                "max_tokens": body.completion_limit_param,
            }
        return names
    if isinstance(body, TokenizeChatRequest):
        return {"prompt": "messages"}
    if isinstance(body, DetokenizeRequest):
        return {"token_ids": "tokens"}
    return {}


def _constraint_param(body: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    try:
        constraint = constraint_of(body)
    except APIError:
        return {}
    if isinstance(body, ChatCompletionRequest) and constrains_output(body.tool_choice):
        return {STRUCTURED_FIELD: "tools"}  # the tool-call schema built from them
    return {} if constraint is None else {STRUCTURED_FIELD: constraint.param}


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
