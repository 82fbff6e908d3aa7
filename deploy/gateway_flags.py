"""`npuserve gateway`'s flags: one table for `GatewayConfig`, read both ways: `npuserve gateway`
parses them, `npuserve serve` takes the shared ones and writes them for the gateway it starts.

`--scheduler`, `--host`, `--port`, `--ready-file` and `--shutdown-timeout` are the commands' own;
the API keys travel in the environment, never as flags of a child. The parser flags become the
config's `parsers`, so a child's flags are written from the parsed flags (`forward`), not from a
config.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuserve.deploy.flag_table import Flag, FlagTable
from npuserve.deploy.flags import resolve_api_key
from npuserve.deploy.runtime.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
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
    max_request_bytes: int | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    **fields: Any,
) -> GatewayConfig:
    """The config; the keys fall back to the environment (the scheduler's key is the API key
    unless --scheduler-api-key names another), ``--scheduler-tls-ca`` is read here and the parser
    flags become `ParserSettings` (ValueError naming the flag that is wrong)."""
    from npuserve.gateway.app import DEFAULT_MAX_REQUEST_BYTES
    from npuserve.gateway.chat_output import ParserSettings
    from npuserve.gateway.server import GatewayConfig

    key = resolve_api_key(api_key)
    try:
        tls_ca = scheduler_tls_ca.read_bytes() if isinstance(scheduler_tls_ca, Path) else scheduler_tls_ca
    except OSError as exc:
        raise ValueError(f"cannot read --scheduler-tls-ca: {exc}") from exc
    return GatewayConfig(
        api_key=key,
        scheduler_api_key=scheduler_api_key or key,
        scheduler_tls_ca=tls_ca,
        max_request_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
        parsers=ParserSettings.from_flags(enable_auto_tool_choice, tool_call_parser, reasoning_parser),
        **fields,
    )


GATEWAY: FlagTable[GatewayConfig] = FlagTable(
    _gateway_config,
    [
        # NOTE: the keys travel in the environment, not in argv where `ps` shows them.
        Flag(
            "api_key",
            "--api-key",
            {
                "help": "require `Authorization: Bearer KEY` on /v1/*, and present KEY to the scheduler "
                f"(default: ${API_KEY.env})"
            },
            forward=False,
        ),
        Flag(
            "max_request_bytes",
            "--max-request-bytes",
            {"type": int, "default": None, "help": "largest request body accepted"},
        ),
        Flag(
            "request_header_timeout_s",
            "--request-header-timeout",
            {
                "type": float,
                "default": 10.0,
                "help": "seconds a client may take to send a request's headers (then 408 and close)",
            },
        ),
        Flag(
            "request_body_timeout_s",
            "--request-body-timeout",
            {
                "type": float,
                "default": 30.0,
                "help": "seconds a client may take to send a request's body (then 408 and close)",
            },
        ),
        Flag(
            "keep_alive_timeout_s",
            "--keep-alive-timeout",
            {"type": float, "default": 5.0, "help": "seconds an idle keep-alive connection stays open"},
        ),
        Flag(
            "max_connections",
            "--max-connections",
            {
                "type": int,
                "default": 1000,
                "help": "open connections beyond which new ones get 503 (stalled clients count until timed out)",
            },
        ),
        # vLLM's flags for reading tool calls and reasoning out of chat answers:
        Flag(
            "enable_auto_tool_choice",
            "--enable-auto-tool-choice",
            {
                "action": "store_true",
                "help": 'serve tool_choice "auto" (the default with tools): the model may call a tool, '
                "and --tool-call-parser reads its calls from its text",
            },
        ),
        Flag(
            "tool_call_parser",
            "--tool-call-parser",
            {
                "choices": sorted(TOOL_PARSERS),
                "help": "how the model writes tool calls: hermes (<tool_call> JSON, Qwen2.5/Qwen3, Hermes), "
                "llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS] then a JSON array, or name[ARGS]{...})",
            },
        ),
        Flag(
            "reasoning_parser",
            "--reasoning-parser",
            {
                "choices": sorted(REASONING_PARSERS),
                "help": "split a reasoning model's thinking into reasoning_content: qwen3 (<think>...</think>)",
            },
        ),
        # `npuserve gateway`'s alone (`serve` names the model and holds the scheduler):
        Flag("served_model_name", "--served-model-name", {"help": "default: the scheduler's model name"}),
        Flag(
            "scheduler_api_key",
            "--scheduler-api-key",
            {"help": f"the key presented to the scheduler (default: --api-key, ${API_KEY.env})"},
            forward=False,
        ),
        Flag(
            "scheduler_tls_ca",
            "--scheduler-tls-ca",
            {"type": Path, "help": "PEM CA certificates: reach the scheduler over TLS"},
        ),
    ],
)
STANDALONE_FIELDS = ("served_model_name", "scheduler_api_key", "scheduler_tls_ca")
SERVE_API_KEY_HELP = (
    f"require `Authorization: Bearer KEY` on /v1/* and the scheduler's gRPC API (default: ${API_KEY.env})"
)


def add_gateway_flags(parser: argparse.ArgumentParser, standalone: bool) -> None:
    """The gateway's own flags; ``--host``/``--port`` are added by the command that owns them."""
    if standalone:
        GATEWAY.add(parser)
    else:
        GATEWAY.add(parser, exclude=STANDALONE_FIELDS, overrides={"api_key": {"help": SERVE_API_KEY_HELP}})


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
