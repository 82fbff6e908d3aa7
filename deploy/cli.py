"""The `npuserve` command line. Flag names follow vLLM's where they mean the same thing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from npuserve.deploy.logs import configure_logging


def _csv(kind: type) -> object:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(",") if part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _add_logging_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="console", choices=["console", "json"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npuserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser(
        "bench-runner",
        help="decode throughput of the ModelRunner, against transformers on the same weights",
    )
    bench.add_argument("--model", help="a local model directory (default: a random-weight preset)")
    bench.add_argument("--preset", default="llama-150m", help="random-weight model preset")
    bench.add_argument("--dtype", type=_csv(str), default=("float32", "bfloat16"), help="comma list")
    bench.add_argument("--batch-sizes", type=_csv(int), default=(1, 8, 32), help="comma list")
    bench.add_argument("--prompt-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB")
    bench.add_argument("--no-compare", action="store_true", help="skip transformers")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--output-json", type=Path, help="write every case as JSON here")
    bench.add_argument("--plot", type=Path, help="write a PNG of tokens/s against batch size")
    _add_logging_flags(bench)
    return parser


def run_bench_runner(args: argparse.Namespace) -> int:
    from npuserve.executor import benchmark

    config = benchmark.BenchmarkConfig(
        preset=args.preset,
        model=args.model,
        dtypes=args.dtype,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        compare_transformers=not args.no_compare,
        seed=args.seed,
        kv_cache_memory_gib=args.kv_cache_memory,
    )
    results = benchmark.run_benchmark(config)
    print(benchmark.report_table(results))
    if args.output_json:
        args.output_json.write_text(json.dumps([r.row() for r in results], indent=2))
    if args.plot:
        benchmark.plot(results, args.plot)
    return 0


COMMANDS = {"bench-runner": run_bench_runner}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format == "json")
    from npuserve.executor.config import ConfigError
    from npuserve.executor.platform import PlatformError

    try:
        sys.exit(COMMANDS[args.command](args))
    except (ConfigError, PlatformError) as exc:
        print(f"npuserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
