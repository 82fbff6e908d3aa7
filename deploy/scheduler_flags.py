"""`npuserve scheduler`'s flags: one table for `ServiceConfig` (vLLM's names where they mean the
same thing), read both ways: `npuserve scheduler` parses them, `npuserve serve` and the benches
write them for the scheduler they start."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.deploy.flag_table import Flag, FlagTable, count_or_auto, csv
from npuserve.deploy.flags import (
    API_KEY_OPTIONS,
    CLUSTER_TOKEN_OPTIONS,
    add_allow_unauthenticated_flag,
    add_logging_flags,
    resolve_api_key,
    resolve_cluster_token,
    server_tls,
)
from npuserve.deploy.runtime.shutdown import add_shutdown_timeout_flag
from npuserve.proto.channel import DEFAULT_STREAM_STALL_TIMEOUT_S
from npuserve.scheduler.core.router import DEFAULT_MAX_LOCAL_PREFILL_LENGTH, DEFAULT_PREFILL_WEIGHT
from npuserve.scheduler.core.step_passes import AUTO_MAX_PASSES, AUTO_SCHEDULER_STEPS
from npuserve.scheduler.service_config import ServiceConfig


def _scheduler_config(
    executors: tuple[str, ...] | list[str] | None = None,
    tls_ca: Path | bytes | None = None,
    cluster_token: str | None = None,
    api_key: str | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls: tuple[bytes, bytes] | None = None,
    **fields: Any,
) -> ServiceConfig:
    """The config; ``--tls-ca`` and ``--tls-cert``/``--tls-key`` are read here (OSError when they
    cannot be, ValueError when only one of the pair is given) and the secrets fall back to the
    environment."""
    return ServiceConfig(
        executors=list(executors or ()),
        tls_ca=tls_ca.read_bytes() if isinstance(tls_ca, Path) else tls_ca,
        cluster_token=resolve_cluster_token(cluster_token),
        api_key=resolve_api_key(api_key),
        tls=tls or server_tls(argparse.Namespace(tls_cert=tls_cert, tls_key=tls_key)),
        **fields,
    )


# `npuserve scheduler`'s own: where the model, the executors and the secrets are.
CLUSTER_FLAGS = [
    Flag(
        "model",
        {
            "default": str(DEMO_MODEL_DIR),
            "help": "model directory (tokenizer and chat template; default: the bundled stories260K demo model)",
        },
    ),
    Flag("executors", {"type": csv(str), "help": "comma list of HOST:PORT (or --registry)"}),
    Flag("registry", {"help": "redis://HOST:PORT/DB: discover the executors registered there"}),
    Flag("registry_prefix", {"default": "npuserve", "help": "prefix of the registry keys"}),
    Flag(
        "connect_timeout_s",
        {"type": float, "default": 600.0, "help": "seconds to wait for the first executor(s)"},
        name="--connect-timeout",
    ),
    # NOTE: the config holds the certificates, not their path: a child gets --tls-ca from its caller.
    Flag("tls_ca", {"type": Path, "help": "PEM CA certificates: reach executors over TLS"}, forward=False),
    # NOTE: the token travels in the environment, not in argv where `ps` shows it.
    Flag("cluster_token", CLUSTER_TOKEN_OPTIONS, forward=False),
    Flag("api_key", API_KEY_OPTIONS, forward=False),
    Flag("tls_cert", {"type": Path, "help": "PEM certificate chain: serve over TLS"}, forward=False),
    Flag("tls_key", {"type": Path, "help": "PEM private key of --tls-cert"}, forward=False),
]
# The serving flags, `npuserve serve`'s too.
SERVING_FLAGS = [
    Flag(
        "served_model_name",
        {"help": "the name clients use (default: --model as given; stories260K for the demo model)"},
    ),
    Flag("chat_template", {"help": "a Jinja chat template, or a file holding one"}),
    Flag(
        "trust_request_chat_template",
        {
            "action": "store_true",
            "help": "render chat templates that clients send (off: such requests are refused)",
        },
    ),
    Flag(
        "enable_prefix_caching",
        {
            "action": argparse.BooleanOptionalAction,
            "default": True,
            "help": "share KV blocks of equal prefixes",
        },
    ),
    Flag("routing", {"default": "prefix-aware", "choices": ["prefix-aware", "least-load"]}),
    Flag(
        "routing_prefill_weight",
        {
            "type": float,
            "default": DEFAULT_PREFILL_WEIGHT,
            "help": "prefix-aware routing: what a block of prefill costs against a block in use "
            "(higher: new requests spread for time to first token; lower: for balanced load)",
        },
    ),
    Flag(
        "max_local_prefill_length",
        {
            "type": int,
            "default": DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
            "metavar": "TOKENS",
            "help": "with prefill executors (--role prefill): a prompt longer than this, less what the "
            "decode executor has cached, prefills on a prefill executor and its KV moves to the decode one",
        },
    ),
    Flag("max_queued_requests", {"type": int, "help": "refuse new requests beyond this many waiting"}),
    Flag(
        "scheduler_workers",
        {
            "type": int,
            "help": "processes that run the executors' step loops (0: the scheduler process's event loop; "
            "default: one per core but one, at most 16)",
        },
    ),
    Flag(
        "api_server_count",
        {
            "type": int,
            "help": "processes that serve the public API on the scheduler's port: client streams, "
            "tokenization, detokenization and stop strings (1: the scheduler's own process; "
            "default: 1 below 8 cores, else one per 4 cores, at most 8)",
        },
    ),
    Flag(
        "async_scheduling",
        {
            "action": argparse.BooleanOptionalAction,
            "default": True,
            "help": "schedule and send each step while the executor runs the one before (default: on)",
        },
    ),
    Flag(
        "stream_interval",
        {
            "type": int,
            "default": 1,
            "help": "tokens per streamed message after a sequence's first (its last goes at once): "
            "fewer, larger messages cost the scheduler and clients less per token",
        },
    ),
    Flag(
        "stream_stall_timeout_s",
        {
            "type": float,
            "default": DEFAULT_STREAM_STALL_TIMEOUT_S,
            "help": "seconds a client may leave a response of its Generate or GenerateMany stream unread; "
            "then the stream's requests are aborted (their blocks freed) and the stream ends ABORTED "
            "(0: never)",
        },
        name="--stream-stall-timeout",
    ),
    Flag(
        "num_scheduler_steps",
        {
            "type": count_or_auto("passes", AUTO_SCHEDULER_STEPS),
            "default": AUTO_SCHEDULER_STEPS,
            "metavar": "{N,auto}",
            "help": "multi-step decoding: each step runs up to this many forward passes for the "
            "sequences that sample in it, a token each, so the scheduler's per-step costs are paid "
            "once for them; new requests wait for the executor's current step, and over the step "
            "stream get their first token after their own pass. auto: one pass while the executor "
            f"keeps busy, up to {AUTO_MAX_PASSES} for each executor that waits on the scheduler (default: auto)",
        },
    ),
    Flag(
        "step_timeout_s",
        {"type": float, "default": 60.0, "help": "seconds an executor may take per step"},
        name="--step-timeout",
    ),
]
SCHEDULER: FlagTable[ServiceConfig] = FlagTable(_scheduler_config, [*CLUSTER_FLAGS, *SERVING_FLAGS])
CLUSTER_FIELDS = tuple(f.field for f in CLUSTER_FLAGS)
SERVING_FIELDS = tuple(f.field for f in SERVING_FLAGS)
# Flags the gateway has too, under the same name: `npuserve serve` takes the gateway's, and its
# scheduler keeps its default for each. (The scheduler's stall timeout is for its own gRPC
# clients; under `serve` that is the gateway, whose one call carries every stream: a timeout
# meant for HTTP clients would end them all the first time its event loop fell behind as long.)
GATEWAY_NAMED_FIELDS = ("stream_stall_timeout_s",)
# How the scheduler runs (its processes, its steps, its streams): the benches take these flags
# and pass them on to the scheduler they start.
BENCH_FIELDS = (
    "scheduler_workers",
    "api_server_count",
    "async_scheduling",
    "stream_interval",
    "num_scheduler_steps",
)


def serve_scheduler_config(args: argparse.Namespace, **fields: Any) -> ServiceConfig:
    """The scheduler's config from `npuserve serve`'s flags, with ``fields`` set beside them;
    `GATEWAY_NAMED_FIELDS` keep their defaults."""
    defaults = SCHEDULER.defaults()
    return SCHEDULER.from_args(args, **{name: defaults[name] for name in GATEWAY_NAMED_FIELDS}, **fields)


def add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    """`npuserve scheduler`'s flags."""
    SCHEDULER.add(parser, only=CLUSTER_FIELDS)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--ready-file", type=Path)
    add_allow_unauthenticated_flag(parser)
    SCHEDULER.add(parser, only=SERVING_FIELDS)
    add_shutdown_timeout_flag(parser)
    add_logging_flags(parser)
