"""Request-level view of one executor's block pool: prefix hits, slot allocation, freeing.

`allocate_slots` answers with the new blocks or None; what to do on None (preempt, wait) is the
scheduler's policy, not this module's. The blocks of a request that ended while another
executor's KV is still pulled into them are parked (`park`) until that pull is over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from npuserve.proto.kv_layout import cdiv
from npuserve.scheduler.core.block_hash import BlockHash
from npuserve.scheduler.core.block_pool import BlockPool, KVCacheBlock
from npuserve.scheduler.core.request import Request

# A prefix-cache hit: a block of the device pool, or the hash of one the host tier holds (the
# step that admits the request loads it into a fresh block, `BlockPool.load`).
PrefixHit = KVCacheBlock | BlockHash


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of them found in the cache


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, num_host_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request registered in the cache
        # Blocks of ended requests that a pull may still write, by request id (`park`).
        self.parked: dict[str, list[KVCacheBlock]] = {}
        self.stats = PrefixCacheStats()

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[PrefixHit], int]:
        """The longest cached prefix of a request's full blocks, in either tier, and its number
        of tokens. Never the whole sequence: the last token must be computed to get logits.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        pool = self.pool
        hits: list[PrefixHit] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = pool.cached_blocks.get(block_hash)
            if block is not None:
                hits.append(block)
            elif pool.in_host_tier(block_hash):
                hits.append(block_hash)
            else:
                break
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted request's lookup (not the retries while it waited)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[PrefixHit] = (),
        cache_new: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Blocks for ``num_new_tokens`` more tokens after the computed ones and the prefix-cache
        hits ``new_computed_blocks``, or None if the pool cannot hold them. ``cache_new=False``:
        none is registered in the prefix cache yet (a pull fills them: `cache_computed`)."""
        blocks = self.req_blocks.get(request.req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = (
            cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        )
        device_hits = [b for b in new_computed_blocks if isinstance(b, KVCacheBlock)]
        # Hits that sit unused in the free list leave it when taken; host hits take a fresh block.
        num_revived = sum(1 for b in device_hits if b.ref_cnt == 0)
        num_loads = len(new_computed_blocks) - len(device_hits)
        pool = self.pool
        if max(num_needed, 0) + num_loads > pool.num_free_blocks - num_revived:
            return None
        pool.touch(device_hits)
        hits = [b if isinstance(b, KVCacheBlock) else pool.load(b) for b in new_computed_blocks]
        new_blocks = pool.get_new_blocks(max(num_needed, 0))
        blocks = self.req_blocks.setdefault(request.req_id, [])
        blocks += hits
        blocks += new_blocks
        # NOTE: blocks are registered when scheduled, before the step runs: a request later in
        # the same step may share them, since every layer writes the step's keys and values
        # before any attention reads them. A failed step un-registers them (`free(valid=False)`).
        if cache_new:
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
        else:  # NOTE: the hits are registered already
            num_full = len(new_computed_blocks)
        self._cache_blocks(request, blocks, num_full)
        return new_blocks

    def cache_computed(self, request: Request) -> None:
        """Registers the full blocks of a request's computed tokens in the prefix cache (those a
        pull filled, once it has landed)."""
        blocks = self.req_blocks.get(request.req_id)
        if blocks is not None:
            num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            self._cache_blocks(request, blocks, num_full)

    def _cache_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full: int) -> None:
        """Registers the request's first ``num_full`` blocks (all full) that it has not yet."""
        start = self.num_cached_blocks.get(request.req_id, 0)
        self.pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
        self.num_cached_blocks[request.req_id] = max(start, num_full)

    def fits_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``num_new_tokens`` more fit in the blocks a request already holds and fill no
        block the prefix cache does not hold yet: then `allocate_slots` would change nothing."""
        req_id, block_size = request.req_id, self.block_size
        blocks = self.req_blocks.get(req_id)
        end = request.num_computed_tokens + num_new_tokens
        if blocks is None or end > len(blocks) * block_size:
            return False
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        return min(end, num_tokens) // block_size <= self.num_cached_blocks[req_id]

    def free(self, request: Request, valid: bool = True) -> None:
        """Returns a request's blocks, tail first. ``valid=False`` (its last step failed) also
        drops them from the prefix cache, since their contents cannot be trusted."""
        blocks = self.req_blocks.pop(request.req_id, [])
        self.num_cached_blocks.pop(request.req_id, None)
        if not valid:
            self.pool.forget(blocks)
        self.pool.free_blocks(reversed(blocks))

    def park(self, req_id: str) -> None:
        """A request ended while a pull may still write its blocks: they stay taken, no longer its
        (the same id may be placed here again meanwhile), until `free_parked`."""
        self.parked[req_id] = self.req_blocks.pop(req_id, [])
        self.num_cached_blocks.pop(req_id, None)

    def free_parked(self, req_id: str, valid: bool = True) -> None:
        """Returns the blocks parked for ``req_id`` (its pull is over), as `free` does."""
        blocks = self.parked.pop(req_id, [])
        if not valid:
            self.pool.forget(blocks)
        self.pool.free_blocks(reversed(blocks))

    def check_integrity(self, expect_idle: bool = False) -> None:
        self.pool.check_integrity(expect_idle)
        held = sum(len(blocks) for blocks in (*self.req_blocks.values(), *self.parked.values()))
        referenced = sum(b.ref_cnt for b in self.pool.blocks[1:])
        assert held == referenced, f"requests hold {held} block references, the pool counts {referenced}"
        if expect_idle:
            assert not self.req_blocks, f"requests still hold blocks: {list(self.req_blocks)[:8]}"
            assert not self.parked, f"blocks parked for pulls: {list(self.parked)[:8]}"
