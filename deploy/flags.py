"""Command-line flags shared by several `npuserve` commands (kept free of torch imports)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.proto.auth import API_KEY, CLUSTER_TOKEN

CLUSTER_TOKEN_ENV = CLUSTER_TOKEN.env


def add_executor_flags(parser: argparse.ArgumentParser) -> None:
    """The executor's flags (vLLM names), for `python -m npuserve.executor.server` and the CLI."""
    parser.add_argument(
        "--model",
        default=str(DEMO_MODEL_DIR),
        help="a local Hugging Face model directory (default: the bundled stories260K demo model)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ready-file", type=Path, help="write the address and handshake here as JSON")
    parser.add_argument("--executor-id", help="default: HOSTNAME:PORT")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory", type=float, help="KV cache size in GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="report ready without the warm-up steps (the first requests then run slower)",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="allow POST /start_profile and /stop_profile; traces are written here (off by default)",
    )
    add_tensor_parallel_flags(parser)
    add_cluster_token_flag(parser)


def add_tensor_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """One executor over several devices (`npuserve.executor.parallel`). On one node give only
    ``--tensor-parallel-size``; across nodes start every rank with ``--tp-rank`` and rank 0's
    ``--master-addr``/``--master-port``. HCCL_IF_IP, HCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME,
    HCCL_CONNECT_TIMEOUT, HCCL_BUFFSIZE and ASCEND_RT_VISIBLE_DEVICES pass through."""
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="devices (ranks) one executor spans"
    )
    parser.add_argument(
        "--tp-rank",
        type=int,
        help="this process's rank in a group started node by node (default: $NPUSERVE_TP_RANK; "
        "omit it to start every rank on this node)",
    )
    parser.add_argument("--master-addr", help="rank 0's address for the rendezvous (default: $MASTER_ADDR)")
    parser.add_argument("--master-port", type=int, help="rank 0's rendezvous port (default: $MASTER_PORT)")
    parser.add_argument(
        "--tp-connect-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for every rank to join (and for one collective)",
    )


def add_cluster_token_flag(parser: argparse.ArgumentParser) -> None:
    """``--cluster-token``: the secret the scheduler presents and executors require."""
    parser.add_argument(
        "--cluster-token",
        help=f"shared secret between the scheduler and its executors (default: ${CLUSTER_TOKEN_ENV})",
    )


def cluster_token(args: argparse.Namespace) -> str | None:
    """The cluster token from ``--cluster-token`` or the environment (None: none configured)."""
    return getattr(args, "cluster_token", None) or os.environ.get(CLUSTER_TOKEN_ENV) or None


def add_api_key_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """``--api-key``: the key clients present as `Authorization: Bearer KEY`; ``what`` says what
    this command does with it."""
    parser.add_argument("--api-key", help=f"{what} (default: ${API_KEY.env})")


def api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key`` or the environment (None: none configured)."""
    return getattr(args, "api_key", None) or os.environ.get(API_KEY.env) or None


def add_executor_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of an executor that runs on its own in a cluster: registry and TLS."""
    parser.add_argument("--registry", help="redis://HOST:PORT/DB: register this executor there")
    parser.add_argument("--registry-prefix", default="npuserve", help="prefix of the registry keys")
    parser.add_argument(
        "--registry-ttl", type=float, default=10.0, help="seconds a registration lives without a heartbeat"
    )
    parser.add_argument(
        "--advertise-address", help="HOST:PORT the scheduler connects to (default: the bound address)"
    )
    add_server_tls_flags(parser)
    add_allow_unauthenticated_flag(parser)


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
    if standalone:
        parser.add_argument("--served-model-name", help="default: the scheduler's model name")
        parser.add_argument(
            "--scheduler-api-key",
            help=f"the key presented to the scheduler (default: --api-key, ${API_KEY.env})",
        )
        parser.add_argument(
            "--scheduler-tls-ca", type=Path, help="PEM CA certificates: reach the scheduler over TLS"
        )
