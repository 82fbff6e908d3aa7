"""`npuserve bench-runner`'s flags, kept apart from the bench itself so that building the
command line parser never imports torch (every `npuserve` command builds it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from npuserve.deploy.flag_table import csv
from npuserve.deploy.flags import add_logging_flags


def add_runner_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a local model directory (default: a random-weight preset)")
    parser.add_argument("--preset", default="llama-150m", help="random-weight model preset")
    parser.add_argument("--dtype", type=csv(str), default=("float32", "bfloat16"), help="comma list")
    parser.add_argument("--batch-sizes", type=csv(int), default=(1, 8, 32), help="comma list")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB")
    parser.add_argument("--no-compare", action="store_true", help="skip transformers")
    parser.add_argument(
        "--compare-eager",
        action="store_true",
        help="also run each case with --enforce-eager (decode graphs against eager steps, on npu and cuda)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output-json", type=Path, help="write every case as JSON here (default: ./bench-results/)"
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of tokens/s against batch size")
    add_logging_flags(parser)
