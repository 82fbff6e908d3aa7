"""Command-line flags shared by several `npuserve` commands (kept free of torch imports)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_executor_flags(parser: argparse.ArgumentParser) -> None:
    """The executor's flags (vLLM names), for `python -m npuserve.executor.server` and the CLI."""
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory")
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


def add_gateway_flags(parser: argparse.ArgumentParser, standalone: bool) -> None:
    """The gateway's own flags; ``--host``/``--port`` are added by the command that owns them."""
    parser.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: $NPUSERVE_API_KEY)"
    )
    parser.add_argument("--max-request-bytes", type=int, default=None, help="largest request body accepted")
    if standalone:
        parser.add_argument("--served-model-name", help="default: the scheduler's model name")
