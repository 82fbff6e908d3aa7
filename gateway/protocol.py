"""The OpenAI wire format: request models (with vLLM's extras) and response builders.

Requests are pydantic models parsed from the raw body, so every refusal names its field the way
vLLM does (`messages[0].content`, `max_tokens`). Range checks that the scheduler makes (n,
temperature, top_p, penalties, logprobs, lengths against the context) stay with the scheduler,
the one place that knows the limits; here only types, the protobuf integer widths, and what the
gateway itself cannot translate are checked. Responses are plain dicts built by small functions:
they are written once per token on the streaming path, where pydantic would cost more than it
checks.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from npuserve.gateway.errors import bad_request, from_validation_error
from npuserve.gateway.tool_calls import MessageToolCall, ToolChoice, Tools, parse_tool_choice

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
_JINJA = re.compile(r"\{\{|\{%")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def _refuse_a_value(value: T, info: ValidationInfo) -> T:
    if value:
        raise ValueError(f"{info.field_name} is not supported")
    return value


# NOTE: a parameter the gateway refuses unless it is unset or empty.
Unsupported = Annotated[T | None, AfterValidator(_refuse_a_value)]


class _Request(BaseModel):
    # NOTE: unknown fields are kept (and logged by the app), as vLLM does: clients send fields
    # of newer API versions, and refusing them would break working clients.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`"n": null` and the like mean the default, as in OpenAI's API."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM; accepted, usage comes once at the end


class _SamplingRequest(_Request):
    """The parameters completions and chat completions share."""

    model: str | None = None
    n: Int32 = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: Unsupported[dict[str, float]] = None
    # vLLM's extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int32 | None = None
    stop_token_ids: list[Int32] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    # Structured outputs (at most one; see gateway/structured_outputs.py): OpenAI's, then vLLM's
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: one engine enforces all

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`. ``prompt`` is normalised to a list of texts and token-id lists."""

    prompt: list[str | list[int]]
    max_tokens: Int32 | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: Int32 | None = None
    echo: bool = False
    best_of: Int32 | None = None
    suffix: Unsupported[str] = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_as_list(cls, value: Any) -> list[str | list[int]]:
        """A prompt given as a string, token ids, or a batch of either, as a list of prompts."""
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of either")
        if _are_token_ids(value):
            return [value]
        for i, item in enumerate(value):
            if not (isinstance(item, str) or (isinstance(item, list) and _are_token_ids(item))):
                raise ValueError(f"prompt[{i}] must be a string or a non-empty list of token ids")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of is not supported (it must be unset or equal to n)")
        return value


def _are_token_ids(values: list[Any]) -> bool:
    """Whether ``values`` is a non-empty list of int32s (bools are not ids). Builtins walk the
    list, not a Python loop: a prompt may hold `--max-token-ids` of them."""
    return (
        bool(values)
        and set(map(type, values)) == {int}
        and min(values) >= INT32_MIN
        and max(values) <= INT32_MAX
    )


class ChatMessage(_Request):
    """One message; a content given as text parts is joined into one string."""

    role: Literal["system", "user", "assistant", "tool", "developer"]  # as the scheduler accepts
    content: str = ""
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, validate_default=True)
    tool_call_id: str | None = Field(default=None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(
        cls, value: list[MessageToolCall] | None, info: ValidationInfo
    ) -> list[MessageToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_results_name_their_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _content_as_text(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content[{i}] has type {kind!r}; only 'text' parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content[{i}].text must be a string")
            texts.append(part["text"])
        return "\n".join(texts)


def _check_chat_template(value: str | None) -> str | None:
    # NOTE: the scheduler reads a template override that looks like a path from its own disk;
    # a client must not name server files, so the gateway forwards only template source.
    if value is not None and not _JINJA.search(value):
        raise ValueError("chat_template must be the Jinja source of a template")
    return value


ChatTemplate = Annotated[str | None, AfterValidator(_check_chat_template)]


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    chat_template: ChatTemplate = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: Tools = None
    tool_choice: Annotated[ToolChoice | None, BeforeValidator(parse_tool_choice)] = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def completion_limit_param(self) -> str:
        """The parameter `completion_limit` comes from, as the client named it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeCompletionRequest(_Request):
    """`POST /tokenize` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """`POST /tokenize` with chat messages (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template: ChatTemplate = None
    return_token_strs: bool = False
    tools: Tools = None


class DetokenizeRequest(_Request):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[Int32]


# -- parsing ---------------------------------------------------------------------------------------


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for bytes that are not UTF-8 JSON of an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    return value


def validate(value: dict[str, Any], model: type[M]) -> M:
    """A request model from the parsed body; 400 naming the first invalid field."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise from_validation_error(exc.errors(include_url=False, include_context=False)) from None


# -- responses -------------------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def model_card(model_id: str, created: int, root: str, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "npuserve",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }


# NOTE: one encoder for every event; json.dumps with options builds a new encoder per call.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event, `data: {...}` and a blank line."""
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


class ChunkEvents:
    """The SSE events of one streamed response. Every chunk repeats the same id, object, created
    and model, so that head is encoded once and each event encodes only its choice."""

    def __init__(self, head: dict[str, Any]) -> None:
        self._prefix = b"data: " + _JSON.encode(head)[:-1].encode() + b',"choices":['

    def choice(self, choice: dict[str, Any]) -> bytes:
        return self._prefix + _JSON.encode(choice).encode() + b"]}\n\n"

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self._prefix + b'],"usage":' + _JSON.encode(usage).encode() + b"}\n\n"


SSE_DONE = b"data: [DONE]\n\n"
