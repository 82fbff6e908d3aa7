"""Placing a new request on an executor.

The scheduler sees every executor's prefix-cache hash map exactly, so the cost of an executor is
the prefill work left after its cached overlap with the prompt plus its load, both in blocks
(NVIDIA Dynamo's KV router uses the same idea):

    cost = (prompt blocks - cached prefix blocks) + blocks in use + blocks queued to prefill
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from npuserve.scheduler.block_hash import BlockHash

if TYPE_CHECKING:
    from npuserve.scheduler.lane import ExecutorLane

ROUTING_POLICIES = ("prefix-aware", "least-load")


def cached_prefix_blocks(lane: ExecutorLane, block_hashes: Sequence[BlockHash]) -> int:
    """Leading blocks of the prompt found in the lane's cache (read without locking: a hint)."""
    cached = lane.scheduler.kv.pool.cached_blocks
    count = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


def lane_load_blocks(lane: ExecutorLane) -> int:
    pool = lane.scheduler.kv.pool
    in_use = pool.num_blocks - 1 - pool.num_free_blocks
    queued = sum(len(r.block_hashes) + 1 for r in list(lane.scheduler.waiting))
    return in_use + queued


def choose_lane(
    lanes: Sequence[ExecutorLane], block_hashes: Sequence[BlockHash], num_prompt_blocks: int, policy: str
) -> ExecutorLane:
    if len(lanes) == 1:
        return lanes[0]
    if policy == "least-load":
        return min(lanes, key=lambda lane: (lane.load, lane_load_blocks(lane)))

    def cost(lane: ExecutorLane) -> int:
        return num_prompt_blocks - cached_prefix_blocks(lane, block_hashes) + lane_load_blocks(lane)

    return min(lanes, key=cost)
