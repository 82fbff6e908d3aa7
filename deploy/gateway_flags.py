"""`npuserve gateway`'s flags: one table for `GatewayConfig`, read both ways: `npuserve gateway`
parses them, `npuserve serve` takes the shared ones and writes them for the gateway it starts.

`--scheduler`, `--host`, `--port`, `--ready-file` and `--shutdown-timeout` are the commands' own;
the API keys travel in the environment, never as flags of a child. The parser flags become the
config's `parsers` and the limit flags its `limits` (`RequestLimits`), so a child's flags are
written from the parsed flags (`forward`), not from a config.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuserve.deploy.flag_table import Flag, FlagTable
from npuserve.deploy.flags import add_allow_unauthenticated_flag, add_logging_flags, resolve_api_key
from npuserve.deploy.runtime.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, add_shutdown_timeout_flag
from npuserve.gateway.limits import DEFAULT_MAX_STREAM_BUFFER_BYTES, RequestLimits
from npuserve.gateway.reasoning import REASONING_PARSERS
from npuserve.gateway.tool_parsers import TOOL_PARSERS
from npuserve.proto.auth import API_KEY

if TYPE_CHECKING:
    from npuserve.gateway.chat_output import ParserSettings
    from npuserve.gateway.server import GatewayConfig


def _gateway_config(
    api_key: str | None = None,
    scheduler_api_key: str | None = None,
    scheduler_tls_ca: Path | bytes | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    **fields: Any,
) -> GatewayConfig:
    """The config; the keys fall back to the environment (the scheduler's key is the API key
    unless --scheduler-api-key names another), ``--scheduler-tls-ca`` is read here, the parser
    flags become `ParserSettings` and the limit flags `RequestLimits` (ValueError naming the flag
    that is wrong)."""
    from npuserve.gateway.chat_output import ParserSettings
    from npuserve.gateway.server import GatewayConfig

    key = resolve_api_key(api_key)
    try:
        tls_ca = scheduler_tls_ca.read_bytes() if isinstance(scheduler_tls_ca, Path) else scheduler_tls_ca
    except OSError as exc:
        raise ValueError(f"cannot read --scheduler-tls-ca: {exc}") from exc
    limits = _request_limits(fields)
    return GatewayConfig(
        api_key=key,
        scheduler_api_key=scheduler_api_key or key,
        scheduler_tls_ca=tls_ca,
        limits=limits,
        parsers=ParserSettings.from_flags(enable_auto_tool_choice, tool_call_parser, reasoning_parser),
        **fields,
    )


LIMIT_FIELDS = tuple(field.name for field in dataclasses.fields(RequestLimits))
DEFAULT_LIMITS = RequestLimits()
# The largest request, on every dimension (`RequestLimits`, which holds the defaults): a request
# over one is refused whole, before the work it would cost. Per flag: what it bounds, and why its
# default. A flag not given is not forwarded: the gateway takes the default.
LIMIT_HELP = {
    "max_request_bytes": (
        "largest request body in bytes (then 413); parsing JSON holds the event loop for up to ~0.15 s "
        "a MiB, so this bounds how long one request can stall the others",
        "4 MiB, ~1M tokens of text",
    ),
    "max_prompts": (
        "prompts in one /v1/completions request, each a scheduler request",
        "vLLM's largest default --max-num-seqs",
    ),
    "max_token_ids": (
        "token ids in one request's prompts together, and in /detokenize",
        "the longest contexts served today",
    ),
    "max_messages": ("messages in one chat request", "more than a 128k-token context holds"),
    "max_tools": ("tools in one request, and tool calls in one message", "as OpenAI"),
    "max_tools_bytes": (
        "bytes of one request's tools as JSON, whose schemas are checked at ~10 us a byte",
        "the largest constraint the scheduler compiles",
    ),
    "max_stop": (
        "stop strings, and stop token ids, in one request; each is checked at every token",
        "OpenAI allows 4",
    ),
    "max_stop_chars": (
        "characters in one stop string; a stream holds back as many",
        "stop strings are words and markers",
    ),
    "max_output_tokens": (
        "tokens one request may generate, all its sequences together: prompts x n x max_tokens "
        "(unset: the context length)",
        "OpenAI's n of 128 at 8k tokens each",
    ),
}


def _limit_flag(field: str) -> Flag:
    """The flag of the `RequestLimits` field ``field``, named after it (`flag_name`); its default
    is the dataclass's (the flag's own is None, so an unset one is not forwarded)."""
    what, why = LIMIT_HELP[field]
    default = getattr(DEFAULT_LIMITS, field)
    return Flag(field, {"type": int, "help": f"{what} (default {default}: {why})"})


def _request_limits(fields: dict[str, Any]) -> RequestLimits:
    """The limits that ``fields`` set (taken out of it); those unset (None) keep their defaults."""
    given = {name: fields.pop(name, None) for name in LIMIT_FIELDS}
    return RequestLimits(**{name: value for name, value in given.items() if value is not None})


GATEWAY: FlagTable[GatewayConfig] = FlagTable(
    _gateway_config,
    [
        # NOTE: the keys travel in the environment, not in argv where `ps` shows them.
        Flag(
            "api_key",
            {
                "help": "require `Authorization: Bearer KEY` on /v1/*, and present KEY to the scheduler "
                f"(default: ${API_KEY.env})"
            },
            forward=False,
        ),
        *(_limit_flag(field) for field in LIMIT_FIELDS),
        Flag(
            "request_header_timeout_s",
            {
                "type": float,
                "default": 10.0,
                "help": "seconds a client may take to send a request's headers (then 408 and close)",
            },
            name="--request-header-timeout",
        ),
        Flag(
            "request_body_timeout_s",
            {
                "type": float,
                "default": 30.0,
                "help": "seconds a client may take to send a request's body (then 408 and close)",
            },
            name="--request-body-timeout",
        ),
        Flag(
            "keep_alive_timeout_s",
            {"type": float, "default": 5.0, "help": "seconds an idle keep-alive connection stays open"},
            name="--keep-alive-timeout",
        ),
        Flag(
            "stream_stall_timeout_s",
            {
                "type": float,
                "default": 30.0,
                "help": "seconds a client may take no byte of a response (a stream) the gateway holds for it; "
                "then its connection is closed and its request aborted, so the output of a client that "
                "stopped reading is neither generated nor buffered on (0: never)",
            },
            name="--stream-stall-timeout",
        ),
        Flag(
            "max_stream_buffer_bytes",
            {
                "type": int,
                "default": DEFAULT_MAX_STREAM_BUFFER_BYTES,
                "help": "bytes of a streamed response's output (all its prompts and choices) the gateway may "
                "hold for a client that reads it more slowly than it is generated; past them its request is "
                "aborted and the stream ends with an error event (stream_buffer_full) after what the client "
                "already has (default 4 MiB: seconds of n=128 with logprobs; 0: no bound)",
            },
        ),
        Flag(
            "max_connections",
            {
                "type": int,
                "default": 1000,
                "help": "open connections beyond which new ones get 503 (stalled clients count until timed out)",
            },
        ),
        # vLLM's flags for reading tool calls and reasoning out of chat answers:
        Flag(
            "enable_auto_tool_choice",
            {
                "action": "store_true",
                "help": 'serve tool_choice "auto" (the default with tools): the model may call a tool, '
                "and --tool-call-parser reads its calls from its text",
            },
        ),
        Flag(
            "tool_call_parser",
            {
                "choices": sorted(TOOL_PARSERS),
                "help": "how the model writes tool calls: hermes (<tool_call> JSON, Qwen2.5/Qwen3, Hermes), "
                "llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS] then a JSON array, or name[ARGS]{...})",
            },
        ),
        Flag(
            "reasoning_parser",
            {
                "choices": sorted(REASONING_PARSERS),
                "help": "split a reasoning model's thinking into reasoning_content: qwen3 (<think>...</think>)",
            },
        ),
        # `npuserve gateway`'s alone (`serve` names the model and holds the scheduler):
        Flag("served_model_name", {"help": "default: the scheduler's model name"}),
        Flag(
            "scheduler_api_key",
            {"help": f"the key presented to the scheduler (default: --api-key, ${API_KEY.env})"},
            forward=False,
        ),
        Flag("scheduler_tls_ca", {"type": Path, "help": "PEM CA certificates: reach the scheduler over TLS"}),
    ],
)
STANDALONE_FIELDS = ("served_model_name", "scheduler_api_key", "scheduler_tls_ca")


def add_gateway_command_flags(gateway: argparse.ArgumentParser) -> None:
    """`npuserve gateway`'s flags."""
    gateway.add_argument("--scheduler", required=True, help="the scheduler's gRPC address, HOST:PORT")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--ready-file", type=Path)
    add_allow_unauthenticated_flag(gateway)
    GATEWAY.add(gateway)
    add_shutdown_timeout_flag(gateway)
    add_logging_flags(gateway)


def add_serve_gateway_flags(serve: argparse.ArgumentParser) -> None:
    """The gateway's own flags that `npuserve serve` takes (it has ``--host``/``--port`` of its own)."""
    overrides = {
        "api_key": {
            "help": "require `Authorization: Bearer KEY` on /v1/* and the scheduler's gRPC API "
            f"(default: ${API_KEY.env})"
        },
        "stream_stall_timeout_s": {
            "help": "seconds a client may take no byte of a response (a stream) the gateway holds for it; "
            "then its connection is closed and its request aborted (0: never; the scheduler keeps its "
            "own default for its gRPC clients, the gateway's calls)"
        },
    }
    GATEWAY.add(serve, exclude=STANDALONE_FIELDS, overrides=overrides)


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's own flags as given to `npuserve serve`, for its gateway process (the API key
    goes by the environment)."""
    return GATEWAY.forward(args, exclude=STANDALONE_FIELDS)


def chat_parser_settings(args: argparse.Namespace) -> ParserSettings:
    """The gateway's tool-call and reasoning parsers from its flags; ValueError naming a flag
    that is wrong (`serve` checks them before it starts any process)."""
    from npuserve.gateway.chat_output import ParserSettings

    return ParserSettings.from_flags(
        args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser
    )


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The gateway's settings from `npuserve gateway` flags (see `_gateway_config`)."""
    return GATEWAY.from_args(
        args,
        scheduler=args.scheduler,
        host=args.host,
        port=args.port,
        ready_file=args.ready_file,
        shutdown_timeout_s=getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S),
    )
