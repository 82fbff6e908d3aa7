"""Maps the scheduler's public protobuf API to engine types and back (the only place that does)."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import TYPE_CHECKING, Any

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto.sampling_ranges import FieldValueError
from npuserve.proto.step_plan import TokenLogprobs
from npuserve.proto.structured_outputs import FIELD as STRUCTURED_FIELD
from npuserve.proto.structured_outputs import StructuredOutputs
from npuserve.scheduler.core.request import InvalidRequestError, SamplingParams
from npuserve.scheduler.engine.continuation import Continuation
from npuserve.scheduler.engine.engine_probes import PoolState
from npuserve.scheduler.engine.outputs import CompletionDelta, GenerateOutput
from npuserve.scheduler.text.prompts import PromptInput
from npuserve.scheduler.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

_OPTIONAL_FIELDS = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
)


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    params = SamplingParams(
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        ignore_eos=msg.ignore_eos,
    )
    for name in _OPTIONAL_FIELDS:
        if msg.HasField(name):
            setattr(params, name, getattr(msg, name))
    if msg.HasField("structured_outputs"):
        params.structured_outputs = structured_outputs_from_proto(msg.structured_outputs)
    return params


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """The constraint a request asks for; InvalidRequestError naming `structured_outputs`."""
    kind = msg.WhichOneof("kind")
    compact = msg.compact_whitespace if msg.HasField("compact_whitespace") else True
    try:
        if kind is None or (kind == "json_object" and not msg.json_object):
            raise FieldValueError("structured_outputs sets no constraint", STRUCTURED_FIELD)
        if kind == "choice":
            return StructuredOutputs("choice", choices=tuple(msg.choice.choices), compact_whitespace=compact)
        spec = "" if kind == "json_object" else getattr(msg, kind)
        return StructuredOutputs(kind, spec, compact_whitespace=compact)
    except FieldValueError as exc:
        raise InvalidRequestError(str(exc), STRUCTURED_FIELD) from None


def prompt_from_proto(msg: pb.GenerateRequest | pb.TokenizeRequest) -> PromptInput:
    which = msg.WhichOneof("prompt" if isinstance(msg, pb.GenerateRequest) else "input")
    add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else None
    if which == "text":
        return PromptInput(text=msg.text, add_special_tokens=add_special)
    if which == "token_ids" and isinstance(msg, pb.GenerateRequest):  # a TokenizeRequest has none
        # NOTE: a slice, not list(): upb copies it in one call, not an item at a time.
        return PromptInput(token_ids=msg.token_ids.ids[:])
    if which == "chat":
        chat = msg.chat
        return PromptInput(
            messages=[_message_from_proto(m) for m in chat.messages],
            add_generation_prompt=not chat.HasField("add_generation_prompt") or chat.add_generation_prompt,
            chat_template=chat.chat_template if chat.HasField("chat_template") else None,
            add_special_tokens=add_special,
            tools=[_tool_from_proto(i, t) for i, t in enumerate(chat.tools)] or None,
        )
    raise InvalidRequestError("the request has no prompt: set text, token_ids or chat", "prompt")


def _message_from_proto(msg: pb.ChatMessage) -> dict[str, object]:
    """A chat message as templates read it (transformers' keys; only the fields that are set)."""
    message: dict[str, object] = {"role": msg.role, "content": msg.content}
    if msg.HasField("name"):
        message["name"] = msg.name
    if msg.HasField("tool_call_id"):
        message["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type or "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in msg.tool_calls
        ]
    return message


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them: the object their JSON text encodes (as
    transformers and vLLM pass them), else the text as given."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _tool_from_proto(index: int, tool: pb.Tool) -> dict[str, object]:
    function: dict[str, object] = {"name": tool.function.name}
    if tool.function.HasField("description"):
        function["description"] = tool.function.description
    if tool.function.parameters_json:
        field = f"tools[{index}].function.parameters"
        try:
            parameters = json.loads(tool.function.parameters_json)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"{field} is not valid JSON: {exc}", field) from None
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{field} must be a JSON object (a JSON schema)", field)
        function["parameters"] = parameters
    return {"type": tool.type or "function", "function": function}


def continuation_from_proto(msg: pb.GenerateRequest) -> Continuation | None:
    """The output a resumed generation's choices already have; None for a new generation."""
    if not msg.continuations:
        return None
    return Continuation(tuple(list(choice.token_ids) for choice in msg.continuations))


def output_to_proto(output: GenerateOutput, tokenizer: Tokenizer, return_prompt: bool) -> pb.GenerateResponse:
    msg = pb.GenerateResponse()
    fill_response(msg, output, tokenizer, return_prompt)
    return msg


def fill_response(
    msg: pb.GenerateResponse, output: GenerateOutput, tokenizer: Tokenizer, return_prompt: bool
) -> None:
    """Writes ``output`` into the empty ``msg`` (a response, or a GenerateMany event's)."""
    # NOTE: runs for every token of every stream. Sub-messages are filled in place (`add`) rather
    # than built and copied in, and a mid-stream token sets only its index, text and id: about
    # 1.5x cheaper.
    msg.request_id = output.request_id
    completions = msg.completions
    for delta in output.completions:
        _add_completion(completions, delta, tokenizer, output.error)
    if return_prompt and output.prompt_token_ids is not None:
        msg.prompt.token_ids.extend(output.prompt_token_ids)
        msg.prompt.text = tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
    if output.resumed_tokens:
        msg.resumed_tokens = output.resumed_tokens
    if output.usage is not None:
        usage, usage_msg = output.usage, msg.usage
        usage_msg.prompt_tokens = usage.prompt_tokens
        usage_msg.completion_tokens = usage.completion_tokens
        usage_msg.cached_prompt_tokens = usage.cached_prompt_tokens


def fill_text(
    msg: pb.GenerateResponse, request_id: str, choice: int, text: str, token_ids: list[int]
) -> None:
    """Writes an output of one sequence's new text and ids only (the usual one: no prompt,
    logprobs, end or usage) into the empty ``msg``, as `fill_response` would, from those alone
    (`RequestStream.listen`'s ``on_text``)."""
    msg.request_id = request_id
    msg.completions.add(index=choice, text=text, token_ids=token_ids)


def _add_completion(
    completions: RepeatedCompositeFieldContainer[pb.Completion],
    delta: CompletionDelta,
    tokenizer: Tokenizer,
    error: str | None,
) -> None:
    token_ids = delta.token_ids
    msg = completions.add(index=delta.index, text=delta.text, token_ids=token_ids)
    if delta.finish_reason:
        msg.finish_reason = delta.finish_reason
        if delta.finish_reason == "error" and error:
            msg.error_message = error
    if isinstance(delta.stop_reason, str):
        msg.stop_string = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        msg.stop_token_id = delta.stop_reason
    if delta.logprobs:
        logprobs = msg.logprobs
        for token_id, lp in zip(token_ids, delta.logprobs, strict=False):
            _add_logprob(logprobs, token_id, lp, tokenizer)


def _add_logprob(
    logprobs: RepeatedCompositeFieldContainer[pb.TokenLogprob],
    token_id: int,
    lp: TokenLogprobs,
    tokenizer: Tokenizer,
) -> None:
    msg = logprobs.add(
        token_id=token_id, logprob=lp.logprob, rank=lp.rank, token=_token_text(tokenizer, token_id)
    )
    top = msg.top
    for top_id, top_lp in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
        top.add(token_id=top_id, logprob=top_lp, token=_token_text(tokenizer, top_id))


@functools.lru_cache(maxsize=1 << 16)
def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text as it reads inside a stream, leading space included: decoded after an
    anchor token and cut after it, as decoding a lone token drops the space that sentencepiece
    tokenizers put at a word's start, and OpenAI clients join these texts."""
    anchor = _anchor(tokenizer)
    prefix = tokenizer.decode(anchor, skip_special_tokens=False)
    return tokenizer.decode([*anchor, token_id], skip_special_tokens=False)[len(prefix) :]


@functools.lru_cache(maxsize=8)
def _anchor(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("a", add_special_tokens=False)[-1:]


def pool_state_to_proto(state: PoolState) -> pb.ExecutorPoolState:
    return pb.ExecutorPoolState(**dataclasses.asdict(state))  # NOTE: the same fields, by name
