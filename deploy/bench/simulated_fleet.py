"""Many simulated executors in one process: one gRPC server each, on its own port, to measure
the scheduler against 16-64 executors on a small machine (`npuserve bench-scale` starts it).

    python -m npuserve.deploy.bench.simulated_fleet --port 0 --count 16 --ready-file ready.json

Each is a `SimulatedRunner` (`npuserve.executor.simulated`, the one fake executor) behind the
real `start_executor_server` (its StepStreams pipelined: see `start_simulated`). With
``--prefill-executors P`` the first P take the prefill role and the others decode, as under
`npuserve serve --prefill-executors`; each pulls its blocks over the real `ReadBlocks` client
(`kv_transfer.ReadBlocksClient`), and each serves `ReadBlocks`. The ready
file holds what the real executor writes (`address`, `pid`, `executor_id`, `version`, `info`)
for one server, and `addresses` (and `executor_ids`) for any count; ``--stats-file`` is
rewritten with every runner's step totals.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from npuserve.deploy.executor_flags import serve_executor_roles
from npuserve.deploy.flag_table import csv, same_named
from npuserve.deploy.flags import add_logging_flags, command_error
from npuserve.deploy.runtime.shutdown import Shutdown
from npuserve.executor.kv_transfer import ReadBlocksClient
from npuserve.executor.server import STOP_GRACE_S, RunningExecutor, start_executor_server
from npuserve.executor.simulated import LatencyModel, SimulatedConfig, SimulatedRunner
from npuserve.proto.ready_file import write_ready_file

log = structlog.get_logger(__name__)


def start_simulated(
    config: SimulatedConfig,
    host: str,
    port: int,
    count: int,
    executor_id: str | None = None,
    num_prefill: int = 0,
) -> list[tuple[RunningExecutor, SimulatedRunner]]:
    """``count`` servers, one runner each, on ports ``port, port+1, ...`` (port 0: free ones);
    the first ``num_prefill`` prefill and the others decode (0: every one is ``config.role``)."""
    roles = serve_executor_roles(count, num_prefill) if num_prefill else [config.role] * count
    started = []
    try:
        for index, role in enumerate(roles):
            runner = SimulatedRunner(dataclasses.replace(config, role=role), ReadBlocksClient().read)
            name = executor_id if count == 1 else (f"{executor_id}-{index}" if executor_id else None)
            # NOTE: pipelined streams, as a real executor's: a step that joins a multi-pass one
            # (`StepPlan.joins_running`) is read while that one runs. They cost this process
            # two threads per stream: at 64 executors x 4,096 streams on 2 cores the fleet took
            # 0.5 cores against 0.3-0.4 when each stream ran its steps on its own handler.
            running = start_executor_server(runner, host, port + index if port else 0, name)
            started.append((running, runner))
    except Exception:
        stop_all([r for r, _ in started])
        raise
    return started


def stop_all(servers: list[RunningExecutor], grace_s: float = STOP_GRACE_S) -> None:
    """Stops every server at once (`RunningExecutor.stop`, in parallel rather than in turn)."""
    events = [running.server.stop(grace_s) for running in servers]
    for running in servers:
        running.servicer.shut_down()
    for event in events:
        event.wait()


def ready_payload(servers: list[RunningExecutor]) -> dict[str, Any]:
    """The ready file: the real executor's fields for one server, plus every address."""
    first = servers[0]
    payload: dict[str, Any] = {
        "addresses": [s.address for s in servers],
        "executor_ids": [s.executor_id for s in servers],
        "pid": os.getpid(),
        "version": first.version,
        "info": dataclasses.asdict(first.info),
    }
    if len(servers) == 1:
        payload.update(address=first.address, executor_id=first.executor_id)
    return payload


def stats_payload(started: list[tuple[RunningExecutor, SimulatedRunner]]) -> dict[str, Any]:
    """Every runner's totals, stamped with the system-wide monotonic clock (comparable across
    processes on one machine)."""
    return {
        "time": time.monotonic(),
        "pid": os.getpid(),
        "executors": [
            {"executor_id": r.executor_id, **dataclasses.asdict(runner.stats)} for r, runner in started
        ],
    }


def serve_simulated(config: SimulatedConfig, args: argparse.Namespace) -> None:
    """Serves ``--count`` simulated executors (the first ``--prefill-executors`` prefill ones) until
    SIGTERM/SIGINT (main thread only); rewrites ``--stats-file`` every ``--stats-interval`` seconds
    and once more at the end."""
    count, num_prefill, stats_file = args.count, args.prefill_executors, args.stats_file
    started = start_simulated(config, args.host, args.port, count, args.executor_id, num_prefill)
    servers = [running for running, _ in started]
    stop = Shutdown()
    restore_signals = stop.install()
    try:
        if args.ready_file is not None:
            write_ready_file(args.ready_file, ready_payload(servers))
        log.info(
            "simulated executors serving",
            count=count,
            prefill_executors=num_prefill,
            addresses=[s.address for s in servers] if count <= 4 else f"{servers[0].address} ...",
            latency=dataclasses.asdict(config.latency),
            num_blocks=config.num_blocks,
        )
        while not stop.drain.wait(args.stats_interval if stats_file is not None else None):
            if stats_file is not None:
                write_ready_file(stats_file, stats_payload(started))
    finally:
        stop_all(servers)
        if stats_file is not None:
            write_ready_file(stats_file, stats_payload(started))
        restore_signals()
    log.info("simulated executors stopped", steps=sum(r.stats.num_steps for _, r in started))


# -- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    defaults, latency = SimulatedConfig(), LatencyModel()
    p = argparse.ArgumentParser(
        prog="python -m npuserve.deploy.bench.simulated_fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="first port (0: free ones)")
    p.add_argument("--count", type=int, default=1, help="simulated executors in this process")
    p.add_argument("--ready-file", type=Path, help="write the addresses and handshake here as JSON")
    p.add_argument("--executor-id", help="id (with --count > 1: prefix of ids); default HOSTNAME:PORT")
    p.add_argument("--base-ms", type=float, default=latency.base_s * 1e3, help="fixed cost of a step")
    p.add_argument("--per-token-ms", type=float, default=latency.per_token_s * 1e3)
    p.add_argument("--per-seq-ms", type=float, default=latency.per_seq_s * 1e3)
    p.add_argument(
        "--prefill-executors",
        type=int,
        default=0,
        help="the first N prefill, the others decode (0: all mixed)",
    )
    p.add_argument(
        "--kv-bytes-per-token", type=int, default=defaults.kv_bytes_per_token, help="modelled KV a pull moves"
    )
    p.add_argument(
        "--pull-gb-per-s",
        type=float,
        default=latency.pull_bytes_per_s / 1e9,
        help="the modelled rate of a pull from another executor (GB: 1e9 bytes)",
    )
    p.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    p.add_argument("--eos-token-ids", type=csv(int), default=defaults.eos_token_ids, help="comma list")
    p.add_argument("--eos-after", type=int, help="make every request's N-th output token an EOS")
    p.add_argument("--model-name", default=defaults.model)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats-file", type=Path, help="rewrite every runner's step totals here as JSON")
    p.add_argument("--stats-interval", type=float, default=0.5, help="seconds between stats writes")
    add_logging_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> SimulatedConfig:
    """The config of the flags named as its fields, the latency flags' model and ``--model-name``."""
    latency = LatencyModel(
        args.base_ms / 1e3, args.per_token_ms / 1e3, args.per_seq_ms / 1e3, args.pull_gb_per_s * 1e9
    )
    return SimulatedConfig(**same_named(SimulatedConfig, args), latency=latency, model=args.model_name)


def main(argv: list[str] | None = None) -> None:
    from npuserve.deploy.grpc_env import set_grpc_environment
    from npuserve.deploy.runtime.logs import configure_logging

    set_grpc_environment()  # NOTE: first, as an executor's `npuserve executor` does
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format == "json")
    try:
        if args.count < 1:
            raise ValueError(f"--count must be >= 1, got {args.count}")
        serve_simulated(config_from_args(args), args)
    except ValueError as exc:  # ConfigError (a busy port) included
        sys.exit(command_error("simulated executor", exc))


if __name__ == "__main__":
    main()
