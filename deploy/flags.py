"""Command-line flags shared by several `npuserve` commands (kept free of torch imports).

The tables of the executor's and the scheduler's configs live in `executor_flags` and
`scheduler_flags` (the gateway's in `gateway_flags`); here are the flags several commands share:
logging, the cluster token, the API key, TLS.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from npuserve.proto.auth import API_KEY, CLUSTER_TOKEN

CLUSTER_TOKEN_ENV = CLUSTER_TOKEN.env
CLUSTER_TOKEN_OPTIONS: dict[str, Any] = {
    "help": f"shared secret between the scheduler and its executors (default: ${CLUSTER_TOKEN_ENV})"
}
LOG_LEVELS = ["debug", "info", "warning", "error"]


def command_error(command: str, message: object, code: int = 2) -> int:
    """Says what is wrong on stderr as ``npuserve COMMAND: error: MESSAGE``; returns ``code``, the
    command's exit status (2: a usage error)."""
    print(f"npuserve {command}: error: {message}", file=sys.stderr)
    return code


def add_logging_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, level: str = "info") -> None:
    parser.add_argument("--log-level", default=level, choices=LOG_LEVELS)
    parser.add_argument("--log-format", default="console", choices=["console", "json"])


def logging_flags(args: argparse.Namespace) -> list[str]:
    """``--log-level``/``--log-format`` as given, for a child process."""
    return [f"--log-level={args.log_level}", f"--log-format={args.log_format}"]


def resolve_cluster_token(given: str | None) -> str | None:
    """The cluster token as given (``--cluster-token``: the secret the scheduler presents and
    executors require), else from the environment (None: none configured)."""
    return given or os.environ.get(CLUSTER_TOKEN_ENV) or None


# The scheduler's --api-key (in its flag table).
API_KEY_OPTIONS: dict[str, Any] = {
    "help": f"require `authorization: Bearer KEY` metadata on every call but Health (default: ${API_KEY.env})"
}


def resolve_api_key(given: str | None) -> str | None:
    """The API key as given (``--api-key``), else from the environment (None: none configured)."""
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
