"""Command-line flags shared by several `npuserve` commands (kept free of torch imports).

The tables of the executor's and the scheduler's configs live in `executor_flags` and
`scheduler_flags`; here are the flags beside them: logging, the cluster token, the gateway's.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuserve.deploy.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
from npuserve.proto.auth import API_KEY, CLUSTER_TOKEN

if TYPE_CHECKING:
    from npuserve.gateway.chat_output import ParserSettings
    from npuserve.gateway.server import GatewayConfig

CLUSTER_TOKEN_ENV = CLUSTER_TOKEN.env
CLUSTER_TOKEN_OPTIONS: dict[str, Any] = {
    "help": f"shared secret between the scheduler and its executors (default: ${CLUSTER_TOKEN_ENV})"
}
LOG_LEVELS = ["debug", "info", "warning", "error"]


def add_logging_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, level: str = "info") -> None:
    parser.add_argument("--log-level", default=level, choices=LOG_LEVELS)
    parser.add_argument("--log-format", default="console", choices=["console", "json"])


def logging_flags(args: argparse.Namespace) -> list[str]:
    """``--log-level``/``--log-format`` as given, for a child process."""
    return [f"--log-level={args.log_level}", f"--log-format={args.log_format}"]


def add_cluster_token_flag(parser: argparse.ArgumentParser) -> None:
    """``--cluster-token``: the secret the scheduler presents and executors require."""
    parser.add_argument("--cluster-token", **CLUSTER_TOKEN_OPTIONS)


def cluster_token(args: argparse.Namespace) -> str | None:
    """The cluster token from ``--cluster-token`` or the environment (None: none configured)."""
    return resolve_cluster_token(getattr(args, "cluster_token", None))


def resolve_cluster_token(given: str | None) -> str | None:
    return given or os.environ.get(CLUSTER_TOKEN_ENV) or None


def add_api_key_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """``--api-key``: the key clients present as `Authorization: Bearer KEY`; ``what`` says what
    this command does with it."""
    parser.add_argument("--api-key", help=f"{what} (default: ${API_KEY.env})")


# The scheduler's --api-key (in its flag table).
API_KEY_OPTIONS: dict[str, Any] = {
    "help": f"require `authorization: Bearer KEY` metadata on every call but Health (default: ${API_KEY.env})"
}


def api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key`` or the environment (None: none configured)."""
    return resolve_api_key(getattr(args, "api_key", None))


def resolve_api_key(given: str | None) -> str | None:
    return given or os.environ.get(API_KEY.env) or None


def add_server_tls_flags(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``/``--tls-key``: serve a gRPC port over TLS."""
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve over TLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")


def server_tls(args: argparse.Namespace) -> tuple[bytes, bytes] | None:
    """(private key, certificate chain) in PEM from ``--tls-key``/``--tls-cert``, or None;
    ValueError naming the problem when only one is given or one cannot be read."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    if cert is None or key is None:
        return None
    try:
        return Path(key).read_bytes(), Path(cert).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS key or certificate: {exc}") from exc


def add_allow_unauthenticated_flag(parser: argparse.ArgumentParser) -> None:
    """``--allow-unauthenticated``: bind a non-loopback address without a secret."""
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a non-loopback --host without a secret (only on a trusted network)",
    )


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's own flags as given to `npuserve serve`, for its gateway process (read off
    `add_gateway_flags`, so a new gateway flag is forwarded too; the API key goes by the
    environment)."""
    own = argparse.ArgumentParser(add_help=False)
    add_gateway_flags(own, standalone=False)
    out = []
    for action in own._actions:
        value = getattr(args, action.dest, None)
        if action.dest == "api_key" or value is None or value is False:
            continue
        switch = action.nargs == 0  # store_true: the bare flag
        out.append(action.option_strings[0] if switch else f"{action.option_strings[0]}={value}")
    return out


def add_gateway_flags(parser: argparse.ArgumentParser, standalone: bool) -> None:
    """The gateway's own flags; ``--host``/``--port`` are added by the command that owns them."""
    if standalone:
        add_api_key_flag(
            parser, "require `Authorization: Bearer KEY` on /v1/*, and present KEY to the scheduler"
        )
    else:
        add_api_key_flag(parser, "require `Authorization: Bearer KEY` on /v1/* and the scheduler's gRPC API")
    parser.add_argument("--max-request-bytes", type=int, default=None, help="largest request body accepted")
    parser.add_argument(
        "--request-header-timeout",
        type=float,
        default=10.0,
        help="seconds a client may take to send a request's headers (then 408 and close)",
    )
    parser.add_argument(
        "--request-body-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's body (then 408 and close)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=1000,
        help="open connections beyond which new ones get 503 (stalled clients count until timed out)",
    )
    _add_chat_parser_flags(parser)
    if standalone:
        parser.add_argument("--served-model-name", help="default: the scheduler's model name")
        parser.add_argument(
            "--scheduler-api-key",
            help=f"the key presented to the scheduler (default: --api-key, ${API_KEY.env})",
        )
        parser.add_argument(
            "--scheduler-tls-ca", type=Path, help="PEM CA certificates: reach the scheduler over TLS"
        )


def _add_chat_parser_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for reading tool calls and reasoning out of chat answers."""
    from npuserve.gateway.reasoning import REASONING_PARSERS
    from npuserve.gateway.tool_parsers import TOOL_PARSERS

    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default with tools): the model may call a tool, and '
        "--tool-call-parser reads its calls from its text",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls: hermes (<tool_call> JSON, Qwen2.5/Qwen3, Hermes), "
        "llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS] then a JSON array, or name[ARGS]{...})",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="split a reasoning model's thinking into reasoning_content: qwen3 (<think>...</think>)",
    )


def chat_parser_settings(args: argparse.Namespace) -> ParserSettings:
    """The gateway's tool-call and reasoning parsers from its flags; ValueError naming a flag
    that is wrong (`serve` checks them before it starts any process)."""
    from npuserve.gateway.chat_output import ParserSettings

    return ParserSettings.from_flags(
        args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser
    )


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The gateway's settings from `npuserve gateway` flags; the keys may come from the environment
    (the scheduler's key is the API key unless --scheduler-api-key names another)."""
    from npuserve.gateway.app import DEFAULT_MAX_REQUEST_BYTES
    from npuserve.gateway.server import GatewayConfig

    key = api_key(args)
    try:
        tls_ca = args.scheduler_tls_ca.read_bytes() if getattr(args, "scheduler_tls_ca", None) else None
    except OSError as exc:
        raise ValueError(f"cannot read --scheduler-tls-ca: {exc}") from exc
    parsers = chat_parser_settings(args)
    return GatewayConfig(
        scheduler=args.scheduler,
        host=args.host,
        port=args.port,
        api_key=key,
        scheduler_api_key=getattr(args, "scheduler_api_key", None) or key,
        scheduler_tls_ca=tls_ca,
        served_model_name=getattr(args, "served_model_name", None),
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
        request_header_timeout_s=args.request_header_timeout,
        request_body_timeout_s=args.request_body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        max_connections=args.max_connections,
        ready_file=args.ready_file,
        parsers=parsers,
        shutdown_timeout_s=getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S),
    )
