"""`npuserve executor`'s flags: one table for `ExecutorConfig`, one for the tensor-parallel
options (`ParallelConfig`), one for the registry (`RegistryConfig`), beside the server's own
(address, ready file, id, TLS). Flag names follow vLLM's. Torch loads only when a config is built.

    `npuserve executor`  -> add_executor_command_flags -> `cli.run_executor`
    `npuserve serve`, TP ranks, benches, tests -> EXECUTOR.to_flags(config) for the children
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.deploy.flag_table import Flag, FlagTable, count_or_auto, csv, imported
from npuserve.deploy.flags import (
    CLUSTER_TOKEN_OPTIONS,
    add_allow_unauthenticated_flag,
    add_logging_flags,
    add_server_tls_flags,
    server_tls,
)
from npuserve.deploy.runtime.shutdown import add_shutdown_timeout_flag
from npuserve.executor.cpu_threads import AUTO_CPU_THREADS
from npuserve.executor.parallel_defaults import DEFAULT_DISTRIBUTED_TIMEOUT_S, DEFAULT_TP_CONNECT_TIMEOUT_S
from npuserve.proto.step_plan import (
    EXECUTOR_ROLE_DECODE,
    EXECUTOR_ROLE_MIXED,
    EXECUTOR_ROLE_PREFILL,
    EXECUTOR_ROLES,
)

if TYPE_CHECKING:
    from npuserve.executor.config import ExecutorConfig
    from npuserve.executor.parallel_config import ParallelConfig
    from npuserve.executor.registration import RegistryConfig

TP_RANK_ENV = "NPUSERVE_TP_RANK"
DEVICE_FLAG = re.compile(r"auto|cpu|(cuda|npu)(:\d+)?")


def device_flag(text: str) -> str:
    """An argparse type: auto, cpu, cuda, npu, or cuda:N / npu:N."""
    value = text.strip().lower()
    if DEVICE_FLAG.fullmatch(value) is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose auto, cpu, cuda, npu, or npu:N (N a device index)"
        )
    return value


EXECUTOR: FlagTable[ExecutorConfig] = FlagTable(
    imported("npuserve.executor.config", "ExecutorConfig"),
    [
        Flag(
            "model",
            {
                "default": str(DEMO_MODEL_DIR),
                "help": "a local Hugging Face model directory (default: the bundled stories260K demo model)",
            },
        ),
        Flag(
            "device",
            {
                "default": "auto",
                "type": device_flag,
                "help": "auto, cpu, cuda, npu, or npu:N (the Nth visible NPU; NPUSERVE_EMULATE_NPU=1 emulates one)",
            },
        ),
        Flag("dtype", {"default": "auto"}),
        Flag("block_size", {"type": int}),
        Flag("max_model_len", {"type": int}),
        Flag("max_num_seqs", {"type": int, "default": 256}),
        Flag("max_num_batched_tokens", {"type": int, "default": 8192}),
        Flag(
            "kv_cache_memory_gib", {"type": float, "help": "KV cache size in GiB"}, name="--kv-cache-memory"
        ),
        Flag(
            "kv_host_memory_gib",
            {
                "type": float,
                "default": 0.0,
                "metavar": "GIB",
                "help": "host memory for KV blocks: prefix-cache blocks evicted from the device go there "
                "and come back on a prefix hit instead of being computed again (needs prefix caching; "
                "default: 0, off)",
            },
            name="--kv-host-memory",
        ),
        Flag("gpu_memory_utilization", {"type": float, "default": 0.9}),
        Flag("load_format", {"default": "auto"}),
        Flag("seed", {"type": int, "default": 0}),
        Flag(
            "warmup",
            {
                "action": argparse.BooleanOptionalAction,
                "default": True,
                "help": "run warm-up steps before reporting ready (--no-warmup: the first requests run slower)",
            },
        ),
        Flag(
            "cpu_threads",
            {
                "type": count_or_auto("threads", AUTO_CPU_THREADS),
                "metavar": "{N,auto}",
                "help": "torch threads where the model computes on the CPU (default: one per core; "
                "auto, which `npuserve serve` gives: one fewer when a decode step then takes at most "
                "10%% longer)",
            },
        ),
        Flag(
            "enforce_eager",
            {
                "action": "store_true",
                "help": "run every step eagerly: no decode graphs (graph mode is on by default on npu and cuda)",
            },
        ),
        Flag(
            "graph_capture_sizes",
            {
                "type": csv(int),
                "metavar": "N,N,...",
                "help": "decode batch sizes to capture graphs of (default: 1,2,4,8,16,24,... up to "
                "--max-num-seqs; on npu at most what the device's streams hold)",
            },
        ),
        Flag(
            "role",
            {
                "choices": EXECUTOR_ROLES,
                "default": EXECUTOR_ROLE_MIXED,
                "help": "what the scheduler places here: prefill (the long prompts of requests that "
                "decode elsewhere), decode, or mixed (both; `npuserve serve` sets it with "
                "--prefill-executors)",
            },
        ),
        Flag(
            "profile_dir",
            {
                "type": Path,
                "help": "allow POST /start_profile and /stop_profile; traces are written here (off by default)",
            },
        ),
    ],
)

# One executor over several devices (`npuserve.executor.parallel`). On one node give only
# --tensor-parallel-size; across nodes start every rank with --tp-rank and rank 0's
# --master-addr/--master-port. HCCL_IF_IP, HCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME,
# HCCL_CONNECT_TIMEOUT, HCCL_BUFFSIZE and ASCEND_RT_VISIBLE_DEVICES pass through.
PARALLEL: FlagTable[ParallelConfig] = FlagTable(
    imported("npuserve.executor.parallel_config", "ParallelConfig"),
    [
        Flag(
            "size",
            {"type": int, "default": 1, "help": "devices (ranks) one executor spans"},
            name="--tensor-parallel-size",
        ),
        Flag(
            "rank",
            {
                "type": int,
                "help": "this process's rank in a group started node by node (default: "
                f"${TP_RANK_ENV}; omit it to start every rank on this node)",
            },
            name="--tp-rank",
        ),
        Flag("master_addr", {"help": "rank 0's address for the rendezvous (default: $MASTER_ADDR)"}),
        Flag("master_port", {"type": int, "help": "rank 0's rendezvous port (default: $MASTER_PORT)"}),
        Flag(
            "connect_timeout_s",
            {
                "type": float,
                "default": DEFAULT_TP_CONNECT_TIMEOUT_S,
                "help": "seconds to wait for every rank to join the group",
            },
            name="--tp-connect-timeout",
        ),
        Flag(
            "collective_timeout_s",
            {
                "type": float,
                "default": DEFAULT_DISTRIBUTED_TIMEOUT_S,
                "help": "seconds one collective waits for the other ranks once the group formed",
            },
            name="--distributed-timeout-seconds",
        ),
    ],
)

REGISTRY: FlagTable[RegistryConfig] = FlagTable(
    imported("npuserve.executor.registration", "RegistryConfig"),
    [
        Flag("url", {"help": "redis://HOST:PORT/DB: register this executor there"}, name="--registry"),
        Flag(
            "prefix", {"default": "npuserve", "help": "prefix of the registry keys"}, name="--registry-prefix"
        ),
        Flag(
            "ttl_s",
            {"type": float, "default": 10.0, "help": "seconds a registration lives without a heartbeat"},
            name="--registry-ttl",
        ),
        Flag(
            "advertise_address", {"help": "HOST:PORT the scheduler connects to (default: the bound address)"}
        ),
    ],
)


def add_executor_flags(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """The executor's flags (vLLM names), for `npuserve executor` and `npuserve serve` (which
    sets some of them per executor: ``exclude``)."""
    EXECUTOR.add(parser, only=["model"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ready-file", type=Path, help="write the address and handshake here as JSON")
    parser.add_argument("--executor-id", help="default: HOSTNAME:PORT")
    EXECUTOR.add(parser, exclude=["model", *exclude])
    PARALLEL.add(parser)
    parser.add_argument("--cluster-token", **CLUSTER_TOKEN_OPTIONS)


def add_executor_command_flags(parser: argparse.ArgumentParser) -> None:
    """`npuserve executor`'s flags: the executor's, and those of one that runs on its own in a
    cluster: registry, TLS, and leave to serve a non-loopback address without a cluster token."""
    add_executor_flags(parser)
    REGISTRY.add(parser)
    add_server_tls_flags(parser)
    add_allow_unauthenticated_flag(parser)
    add_shutdown_timeout_flag(parser)
    add_logging_flags(parser)


def serve_executor_roles(num_executors: int, num_prefill: int) -> list[str]:
    """The role of each executor `npuserve serve` starts (``--prefill-executors``): the first
    ``num_prefill`` prefill and the others decode; with none, every one is mixed."""
    if not 0 <= num_prefill < max(num_executors, 1) or (num_prefill and num_executors < 2):
        raise ValueError(
            f"--prefill-executors must be 0, or at least 1 and fewer than --num-executors "
            f"({num_executors}), got {num_prefill}"
        )
    if not num_prefill:
        return [EXECUTOR_ROLE_MIXED] * num_executors
    return [EXECUTOR_ROLE_PREFILL] * num_prefill + [EXECUTOR_ROLE_DECODE] * (num_executors - num_prefill)


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """From `PARALLEL`'s flags; the rank and master fall back to the environment. The ranks this
    process starts get its ``--log-level``/``--log-format``."""
    values = {**PARALLEL.defaults(), **PARALLEL.values(args)}
    if values.get("rank") is None and os.environ.get(TP_RANK_ENV):
        values["rank"] = _env_int(TP_RANK_ENV)
    if values.get("rank") is not None:  # NOTE: a single-node group ignores MASTER_* (it picks a free port)
        values["master_addr"] = values.get("master_addr") or os.environ.get("MASTER_ADDR") or None
        if values.get("master_port") is None:
            values["master_port"] = _env_int("MASTER_PORT")
    logging = {name: getattr(args, name, None) for name in ("log_level", "log_format")}
    worker_flags = tuple(f"--{name.replace('_', '-')}={value}" for name, value in logging.items() if value)
    return PARALLEL.build(**values, worker_flags=worker_flags)


def _env_int(name: str) -> int | None:
    from npuserve.executor.config import ConfigError

    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def cluster_from_args(args: argparse.Namespace) -> tuple[tuple[bytes, bytes] | None, RegistryConfig | None]:
    """TLS key and certificate, and the registry, from `add_executor_command_flags`' flags."""
    from npuserve.executor.config import ConfigError

    try:
        return server_tls(args), REGISTRY.from_args(args) if getattr(args, "registry", None) else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
