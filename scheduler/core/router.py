"""Placing a new request on an executor.

The scheduler sees every executor's prefix-cache hash map exactly, so the cost of an executor is
the prefill work there (what its cache leaves of the prompt, and the prompts placed there that
have not produced a token yet) plus its decode load, both in blocks (NVIDIA Dynamo's KV router
weighs the same two):

    cost = prefill weight x (prompt blocks - cached prefix blocks + blocks queued to prefill)
           + blocks in use + blocks of the prompts queued

A block of prefill weighs more than a block in use (`--routing-prefill-weight`, default
`DEFAULT_PREFILL_WEIGHT`): a prompt queued on an executor delays the first token of every
request placed behind it by its whole prefill, while a running sequence adds one token to each
pass. Weighed alike, the requests that replace a burst of finished ones all land on the executor
that finished them (it now holds the fewest blocks) and share one long prefill pass there.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from npuserve.scheduler.core.block_hash import BlockHash
from npuserve.scheduler.core.block_pool import ON_HOST

if TYPE_CHECKING:
    from npuserve.scheduler.lanes.lane import Lane

ROUTING_POLICIES = ("prefix-aware", "least-load")
# NOTE: the scale bench (16 simulated executors x 1,024 streams, `--num-scheduler-steps auto`,
# 2 cores, three interleaved rounds): with 1, the prompts that a request shared its first pass
# with were 4.5-5.9 on average (a 35-44 ms pass); with 4, 2.8-3.4 (24-28 ms), and the streams
# without a first token 67-80 against 76-82, for the same tokens/s; 8 did as well as 4, and 16
# no better.
DEFAULT_PREFILL_WEIGHT = 4.0
# What a prefix block held only in an executor's host-memory tier costs, in blocks of prefill: a
# copy back to the device, cheaper than computing it, dearer than a hit on the device. (A block
# copy moves its KV once; its prefill runs every layer's projections over its tokens.)
HOST_HIT_WEIGHT = 0.25
# Prefill/decode disaggregation (`engine.disaggregation`): a prompt whose uncached part on the
# decode executor is longer than this prefills on a prefill executor (`--max-local-prefill-length`,
# Dynamo's name and default).
DEFAULT_MAX_LOCAL_PREFILL_LENGTH = 1000


def cached_prefix(lane: Lane, block_hashes: Sequence[BlockHash]) -> tuple[int, int]:
    """Leading blocks of the prompt found in the lane's cache, and how many of them only its
    host tier holds (read without locking: a hint)."""
    count = on_host = 0
    for block_hash in block_hashes:
        tier = lane.cached_tier(block_hash)
        if not tier:
            break
        count += 1
        on_host += tier == ON_HOST
    return count, on_host


def uncached_blocks(lane: Lane, block_hashes: Sequence[BlockHash], num_prompt_blocks: int) -> int:
    """The prompt's blocks that the lane would compute: all but its cached prefix."""
    return num_prompt_blocks - cached_prefix(lane, block_hashes)[0]


def lane_load_blocks(lane: Lane) -> int:
    """Blocks held by the lane's requests plus the prompt blocks of those placed there that
    have not produced a token yet (so a burst of placements spreads out at once)."""
    return lane.num_used_blocks + lane.queued_blocks


def choose_lane(
    lanes: Sequence[Lane],
    block_hashes: Sequence[BlockHash],
    num_prompt_blocks: int,
    policy: str,
    prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
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

    def cost(lane: Lane) -> tuple[float, int, float]:
        cached, on_host = cached_prefix(lane, block_hashes)
        prefill = num_prompt_blocks - cached + HOST_HIT_WEIGHT * on_host + lane.queued_prefill_blocks
        return prefill_weight * prefill + lane_load_blocks(lane), lane.queued_requests, random.random()

    return min(lanes, key=cost)
