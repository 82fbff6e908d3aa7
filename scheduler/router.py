"""Placing a new request on an executor.

The scheduler sees every executor's prefix-cache hash map exactly, so the cost of an executor is
the prefill work left after its cached overlap with the prompt plus its load, both in blocks
(NVIDIA Dynamo's KV router uses the same idea):

    cost = (prompt blocks - cached prefix blocks) + blocks in use + blocks queued to prefill
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from npuserve.scheduler.block_hash import BlockHash

if TYPE_CHECKING:
    from npuserve.scheduler.lane import Lane

ROUTING_POLICIES = ("prefix-aware", "least-load")


def cached_prefix_blocks(lane: Lane, block_hashes: Sequence[BlockHash]) -> int:
    """Leading blocks of the prompt found in the lane's cache (read without locking: a hint)."""
    count = 0
    for block_hash in block_hashes:
        if not lane.has_cached(block_hash):
            break
        count += 1
    return count


def lane_load_blocks(lane: Lane) -> int:
    """Blocks held by the lane's requests plus the prompt blocks of those placed there that
    have not produced a token yet (so a burst of placements spreads out at once)."""
    return lane.num_used_blocks + lane.queued_blocks


def choose_lane(
    lanes: Sequence[Lane], block_hashes: Sequence[BlockHash], num_prompt_blocks: int, policy: str
) -> Lane:
    if len(lanes) == 1:
        return lanes[0]
    # NOTE: ties go to the lane with fewer queued requests, then to a random one, so equal
    # lanes share a burst instead of the first one taking all of it.
    if policy == "least-load":
        return min(
            lanes,
            key=lambda lane: (lane.load + lane.queued_requests, lane_load_blocks(lane), random.random()),
        )

    def cost(lane: Lane) -> tuple[int, int, float]:
        uncached = num_prompt_blocks - cached_prefix_blocks(lane, block_hashes)
        return uncached + lane_load_blocks(lane), lane.queued_requests, random.random()

    return min(lanes, key=cost)
