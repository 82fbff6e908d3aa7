"""gRPC message-size limits, one per link, used by both ends of each link."""

from __future__ import annotations

# Scheduler <-> executor: a step plan carries whole prompts for every new request of a batch.
MAX_STEP_MESSAGE_BYTES = 256 * 1024 * 1024
# Clients <-> the scheduler's public API: one request or one stream message.
MAX_API_MESSAGE_BYTES = 64 * 1024 * 1024


def message_size_options(max_bytes: int) -> list[tuple[str, int]]:
    """Channel and server options that allow messages up to ``max_bytes`` each way."""
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
    ]
