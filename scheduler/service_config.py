"""What the scheduler service runs with (`npuserve scheduler`'s flags, `scheduler_flags`).

NOTE: apart from `server`, so that reading the flags (`npuserve serve`, which starts the
scheduler as a process of its own) does not import the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from npuserve.proto.channel import DEFAULT_STREAM_STALL_TIMEOUT_S
from npuserve.scheduler.core.router import DEFAULT_MAX_LOCAL_PREFILL_LENGTH, DEFAULT_PREFILL_WEIGHT
from npuserve.scheduler.core.step_passes import AUTO_SCHEDULER_STEPS

MAX_DEFAULT_WORKERS = 16
MAX_DEFAULT_API_SERVERS = 8


@dataclass(slots=True)
class ServiceConfig:
    """The scheduler service's settings (`npuserve scheduler`'s flags); the policy core's own
    limits are `scheduler_config.SchedulerConfig`."""

    model: str  # model directory (tokenizer, chat template)
    executors: list[str]  # executor addresses (empty: discover them in the registry)
    served_model_name: str | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False  # render chat templates that clients send
    enable_prefix_caching: bool = True
    routing: str = "prefix-aware"
    routing_prefill_weight: float = DEFAULT_PREFILL_WEIGHT  # `router`: a prefill block against a block in use
    max_queued_requests: int | None = None
    # Prefill/decode disaggregation: longer uncached prompts prefill on a prefill executor.
    max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH
    scheduler_workers: int | None = None  # step-loop processes; 0: threads; None: from the cores
    api_server_count: int | None = None  # processes serving the public API; 1: this one; None: from the cores
    # Build and send step N+1 while the executor runs step N (vLLM's --async-scheduling, on here
    # by default): over gRPC (`npuserve bench --compare offline,grpc-stream`, 2 cores) the ~150M
    # Llama preset kept a median 0.98x of in-process throughput against 0.88x without.
    async_scheduling: bool = True
    stream_interval: int = 1  # tokens per streamed delta after a sequence's first
    # How long a client may leave a stream's response unread before its requests are aborted; 0: for ever.
    stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S
    # Passes per step of a sampling request (multi-step decoding); 0 (`AUTO_SCHEDULER_STEPS`): auto.
    num_scheduler_steps: int = AUTO_SCHEDULER_STEPS
    step_timeout_s: float = 60.0
    connect_timeout_s: float = 120.0
    registry: str | None = None  # redis://HOST:PORT/DB where executors register
    registry_prefix: str = "npuserve"
    cluster_token: str | None = None  # presented to executors on every call
    tls_ca: bytes | None = None  # PEM roots: talk TLS to executors and verify them against these
    api_key: str | None = None  # clients of the public API present it (Health stays open)
    tls: tuple[bytes, bytes] | None = None  # (private key, certificate chain) in PEM: serve TLS

    def __post_init__(self) -> None:
        if not self.stream_stall_timeout_s >= 0:
            raise ValueError(f"--stream-stall-timeout must be 0 or more, got {self.stream_stall_timeout_s}")


def default_api_server_count() -> int:
    """This process alone below 8 cores; above, one API process per 4 cores, at most 8."""
    cores = len(os.sched_getaffinity(0))
    return 1 if cores < 8 else min(MAX_DEFAULT_API_SERVERS, cores // 4)


def default_scheduler_workers() -> int:
    """One worker process per core but one (the front's), at least one, at most 16."""
    return max(1, min(MAX_DEFAULT_WORKERS, len(os.sched_getaffinity(0)) - 1))
