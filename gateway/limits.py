"""How large a request may be, on every dimension: `RequestLimits`, set by the gateway's flags.

Each limit is checked before the work it bounds, and a request over one is refused whole:

- the body's bytes as it arrives, before anything parses it (413, `app.read_body`);
- the counts and sizes that the parsed JSON shows (`check`: prompts, token ids, messages, tools
  and their schemas' bytes, stop strings), before pydantic builds a model per element, a tool's
  schema is checked, or anything reaches the scheduler (400 naming the parameter);
- the tokens a request asks to generate, prompts x n x max_tokens (`check_output_tokens`), once
  the request is validated.

Parsing the JSON holds the event loop, and a thread would not free it (CPython's parser holds
the GIL): about 30 ms a MiB for text, up to 100-150 ms a MiB for the costliest shapes (nested
arrays, floats) on a slow core. So `max_request_bytes` also bounds how long any one body can stall
the requests beside it.

A response has one bound of its own, checked as it streams: the output the gateway may hold for
a client that reads it more slowly than it is generated (`DEFAULT_MAX_STREAM_BUFFER_BYTES`, held
where the scheduler's output is read: `scheduler_client`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from npuserve.gateway.errors import APIError

# The output a response (all its prompts and choices) may hold for a client that reads it more
# slowly than it is generated (--max-stream-buffer-bytes): seconds of n=128 with logprobs; a single
# sequence of text never comes near it. Kept as the scheduler sent it, it costs about as much memory.
DEFAULT_MAX_STREAM_BUFFER_BYTES = 4 << 20


def flag_name(field: str) -> str:
    """The gateway flag that sets the `RequestLimits` field ``field``."""
    return "--" + field.replace("_", "-")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The largest request the gateway accepts; each field is the flag of the same name (the
    defaults, and why, are in `deploy/gateway_flags.py`)."""

    max_request_bytes: int = 4 << 20
    max_prompts: int = 1024  # prompts in one completions request
    max_token_ids: int = 1 << 20  # token ids in one request's prompts together
    max_messages: int = 4096  # messages in one chat request
    max_tools: int = 128  # tools in one request, and tool calls in one message
    max_tools_bytes: int = 128 << 10  # the tools' JSON, together
    max_stop: int = 64  # stop strings, and stop token ids
    max_stop_chars: int = 1024  # characters in one stop string
    max_output_tokens: int = 1 << 20  # prompts x n x max_tokens

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ValueError(f"{flag_name(field.name)} must be positive, got {value}")

    def check(self, raw: Mapping[str, Any]) -> None:
        """400 naming the first parameter of a parsed request body (any route's) that is over a
        limit. Values of the wrong type pass: validation refuses them after."""
        prompt = raw.get("prompt")
        if isinstance(prompt, list) and prompt:
            if type(prompt[0]) is int:  # one prompt of token ids (a bool is no id)
                num_ids = len(prompt)
            else:
                self._check_length(prompt, "max_prompts", "prompt", "prompts")
                num_ids = sum(len(item) for item in prompt if isinstance(item, list))
            self._check_size(num_ids, "max_token_ids", "prompt", "token ids")
        messages = raw.get("messages")
        self._check_length(messages, "max_messages", "messages", "messages")
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            self._check_length(calls, "max_tools", f"messages[{i}].tool_calls", "tool calls", "message")
        tools = raw.get("tools")
        self._check_length(tools, "max_tools", "tools", "tools")
        if isinstance(tools, list):
            size = len(json.dumps(tools, ensure_ascii=False, separators=(",", ":")).encode())
            self._check_size(size, "max_tools_bytes", "tools", "bytes of JSON")
        stops = [raw["stop"]] if isinstance(raw.get("stop"), str) else raw.get("stop")
        self._check_length(stops, "max_stop", "stop", "stop strings")
        if isinstance(stops, list):
            longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
            self._check_size(
                longest, "max_stop_chars", "stop", "characters", "stop string", "string_above_max_length"
            )
        self._check_length(raw.get("stop_token_ids"), "max_stop", "stop_token_ids", "stop token ids")
        self._check_length(raw.get("tokens"), "max_token_ids", "tokens", "token ids")

    def check_output_tokens(
        self, sequences: int, n: int, max_tokens: int | None, max_tokens_param: str, context_len: int
    ) -> None:
        """400 for a request whose ``sequences`` (prompts x n) may generate more tokens together
        than allowed, each up to ``max_tokens`` (None: up to ``context_len``). One sequence is
        bounded by the context already, and is not checked. Names ``n`` when n > 1, else the
        max_tokens parameter the client sent, ``max_tokens_param``."""
        if sequences <= 1:
            return
        each = context_len if max_tokens is None else max_tokens
        param = "n" if n > 1 else max_tokens_param
        what = f"tokens to generate ({sequences} sequences of up to {each}; lower n or {max_tokens_param})"
        self._check_size(sequences * each, "max_output_tokens", param, what)

    def _check_length(self, values: Any, limit: str, param: str, what: str, per: str = "request") -> None:
        """A JSON array ``values`` (anything else passes) of at most ``limit`` items."""
        if isinstance(values, list):
            self._check_size(len(values), limit, param, what, per, "array_above_max_length")

    def _check_size(
        self, size: int, limit: str, param: str, what: str, per: str = "request", code: str | None = None
    ) -> None:
        allowed = getattr(self, limit)
        if size > allowed:
            message = (
                f"{param}: {size} {what}, more than the {allowed} per {per} allowed ({flag_name(limit)})"
            )
            raise APIError(400, message, param=param, code=code)
