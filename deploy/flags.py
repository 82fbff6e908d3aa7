"""Command-line flags shared by several `npuserve` commands (kept free of torch imports).

The tables of the executor's and the scheduler's configs live in `executor_flags` and
`scheduler_flags`; here are the flags beside them: logging, the cluster token, the gateway's.
"""

from __future__ import annotations

import argparse
import os

CLUSTER_TOKEN_ENV = "NPUSERVE_CLUSTER_TOKEN"
CLUSTER_TOKEN_OPTIONS = {
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


def add_gateway_flags(parser: argparse.ArgumentParser, standalone: bool) -> None:
    """The gateway's own flags; ``--host``/``--port`` are added by the command that owns them."""
    parser.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: $NPUSERVE_API_KEY)"
    )
    parser.add_argument("--max-request-bytes", type=int, default=None, help="largest request body accepted")
    if standalone:
        parser.add_argument("--served-model-name", help="default: the scheduler's model name")
