"""Command-line flags shared by several `npuserve` commands (kept free of torch imports)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from npuserve.deploy.demo_model import DEMO_MODEL_DIR

CLUSTER_TOKEN_ENV = "NPUSERVE_CLUSTER_TOKEN"
DEVICE_FLAG = re.compile(r"auto|cpu|(cuda|npu)(:\d+)?")


def device_flag(text: str) -> str:
    value = text.strip().lower()
    if DEVICE_FLAG.fullmatch(value) is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose auto, cpu, cuda, npu, or npu:N (N a device index)"
        )
    return value


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
    parser.add_argument(
        "--device",
        default="auto",
        type=device_flag,
        help="auto, cpu, cuda, npu, or npu:N (the Nth visible NPU; NPUSERVE_EMULATE_NPU=1 emulates one)",
    )
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
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve over TLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")


def add_gateway_flags(parser: argparse.ArgumentParser, standalone: bool) -> None:
    """The gateway's own flags; ``--host``/``--port`` are added by the command that owns them."""
    parser.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: $NPUSERVE_API_KEY)"
    )
    parser.add_argument("--max-request-bytes", type=int, default=None, help="largest request body accepted")
    if standalone:
        parser.add_argument("--served-model-name", help="default: the scheduler's model name")
