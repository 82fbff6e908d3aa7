"""The engine's settings (`EngineConfig`), and the errors it raises to refuse a request."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from npuserve.scheduler.core.router import (
    DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
    DEFAULT_PREFILL_WEIGHT,
    ROUTING_POLICIES,
)
from npuserve.scheduler.core.step_passes import check_num_scheduler_steps

__all__ = ["EngineConfig", "NoExecutorError", "QueueFullError", "new_request_id"]


class QueueFullError(RuntimeError):
    """More requests wait than --max-queued-requests allows (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class NoExecutorError(RuntimeError):
    """No executor is available to serve (gRPC UNAVAILABLE, HTTP 503)."""


@dataclass(slots=True)
class EngineConfig:
    served_model_name: str
    enable_prefix_caching: bool = True
    routing: str = "prefix-aware"
    routing_prefill_weight: float = DEFAULT_PREFILL_WEIGHT  # a prefill block's cost against a block in use
    max_queued_requests: int | None = None  # None: unbounded
    trust_request_chat_template: bool = False  # render chat templates that clients send
    async_scheduling: bool = False  # schedule each step while the executor runs the one before
    stream_interval: int = 1  # tokens per streamed delta after a sequence's first (`RequestStream`)
    # Passes per step of a sampling request (multi-step decoding); `AUTO_SCHEDULER_STEPS`: each
    # executor's lane chooses them (`step_passes`).
    num_scheduler_steps: int = 1
    # Prefill/decode disaggregation: a request whose prompt, less what the chosen decode (or
    # mixed) executor has cached, is longer than this prefills on a prefill executor
    # (`disaggregation`); shorter ones prefill where they decode. Dynamo's name and default.
    max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH

    def __post_init__(self) -> None:
        if self.max_local_prefill_length < 0:
            raise ValueError(f"--max-local-prefill-length must be >= 0, got {self.max_local_prefill_length}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
        if not self.routing_prefill_weight >= 0:  # NOTE: NaN too
            raise ValueError(f"--routing-prefill-weight must be >= 0, got {self.routing_prefill_weight}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        check_num_scheduler_steps(self.num_scheduler_steps)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"
