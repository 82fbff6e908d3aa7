"""The registry's contract: where an executor's record lives in Redis, what it holds, and how
both sides connect (no torch: the scheduler reads records, executors write them).

An executor writes ``{prefix}:executor:{executor_id}`` as JSON with a TTL and rewrites it while
it serves; a new ``instance_id`` under the same key means it restarted with an empty KV cache.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from npuserve.proto.step_plan import ExecutorInfo

MAX_SOCKET_TIMEOUT_S = 1.0


def registry_key(prefix: str, executor_id: str) -> str:
    return f"{prefix}:executor:{executor_id}"


def registry_pattern(prefix: str) -> str:
    """The SCAN pattern of every executor key under ``prefix`` (glob characters escaped)."""
    escaped = "".join(f"\\{c}" if c in "*?[]\\" else c for c in prefix)
    return f"{escaped}:executor:*"


def redis_client(url: str, timeout_s: float = MAX_SOCKET_TIMEOUT_S) -> redis.Redis:
    """A client that fails fast: bounded socket waits, one immediate reconnect, no hidden backoff
    (callers own their retry policy)."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


def registration_record(
    address: str,
    executor_id: str,
    info: ExecutorInfo,
    version: str,
    ttl_s: float,
    instance_id: str | None = None,
) -> dict[str, Any]:
    """What the registry holds for one executor process (``instance_id`` is new at every start:
    the executor's own, or a new one). A draining executor's record adds ``"draining": true``."""
    return {
        "address": address,
        "executor_id": executor_id,
        "instance_id": instance_id or uuid.uuid4().hex,
        "model": info.model,
        "architecture": info.architecture,
        "device": info.device,
        "dtype": info.dtype,
        "block_size": info.block_size,
        "num_blocks": info.num_blocks,
        "max_model_len": info.max_model_len,
        "tensor_parallel_size": info.tensor_parallel_size,
        "role": info.role,
        "version": version,
        "started_at": datetime.now(timezone.utc).isoformat(),
        "ttl_s": ttl_s,
    }


def parse_record(text: str | bytes) -> dict[str, Any] | None:
    """A registration as written by `registration_record`; None when it is not one."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    required = ("address", "executor_id", "instance_id")
    if isinstance(record, dict) and all(isinstance(record.get(k), str) and record[k] for k in required):
        return record
    return None
