"""The KV block pool of one executor: ref counts, an LRU free list and the prefix-cache hash map.

Ownership: the pool is touched only by the scheduling thread of its executor. Block 0 is the
null block, never handed out. A block whose ref count drops to zero goes to the tail of the free
list but keeps its hash, so a later request with the same prefix can take it back (`touch`);
the hash is dropped only when the block is handed out again (lazy eviction from the head).
With a host-memory tier (`host_tier`), such a block is copied there first, and a prefix hit
there is copied back into a fresh block (`load`): the copies go out with the next step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from npuserve.proto.kv_layout import NULL_BLOCK_ID
from npuserve.proto.step_plan import BlockCopy
from npuserve.scheduler.core.block_hash import BlockHash
from npuserve.scheduler.core.host_tier import HostTier

# Where a prefix-cache hash is held (`BlockPool.tier_of`, and the KV events that mirror it).
NOT_CACHED, ON_DEVICE, ON_HOST = 0, 1, 2


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"
        )


class FreeBlockQueue:
    """A doubly linked list of free blocks through the blocks' own links: O(1) pop from the
    head, append to the tail and removal from the middle, with no allocation."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free list"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, num_host_blocks: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs the null block and at least one more, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # KV events, when someone mirrors this pool's prefix cache (a scheduler worker reports
        # them to the front's prefix index): (where the hash is held now, hash), in order.
        self.events: list[tuple[int, BlockHash]] | None = None
        # The host-memory tier (prefix-cache blocks only), and the copies the next step runs.
        self.host = HostTier(num_host_blocks) if num_host_blocks and enable_caching else None
        self.copies: list[BlockCopy] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unused ones included."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def tier_of(self, block_hash: BlockHash) -> int:
        """`ON_DEVICE`, `ON_HOST` (only there) or `NOT_CACHED`."""
        if block_hash in self.cached_blocks:
            return ON_DEVICE
        return ON_HOST if self.in_host_tier(block_hash) else NOT_CACHED

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hands out blocks from the head of the free list (the least recently freed first)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks with {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if self.host is not None and block.block_hash is not None:
                self._spill(block)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def in_host_tier(self, block_hash: BlockHash) -> bool:
        """Whether the host tier holds ``block_hash`` (a hit `load` can bring back)."""
        return self.host is not None and block_hash in self.host

    def load(self, block_hash: BlockHash) -> KVCacheBlock:
        """A fresh block (one reference) that the next step fills from the host tier's copy of
        ``block_hash``, cached under it; the host block stays (`in_host_tier` must hold)."""
        assert self.host is not None
        host_id = self.host.lookup(block_hash)
        assert host_id is not None, "not in the host tier"
        (block,) = self.get_new_blocks(1)
        self.copies.append(BlockCopy(False, host_id, block.block_id))
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.events is not None:
            self.events.append((ON_DEVICE, block_hash))
        return block

    def take_copies(self) -> list[BlockCopy]:
        """The copies planned since the last call, for the step being built (in order)."""
        copies, self.copies = self.copies, []
        if self.host is not None:
            self.host.unpin()
        return copies

    def undo_copies(self, copies: list[BlockCopy]) -> None:
        """A step that failed may not have run its copies: what they would have put in the host
        tier is forgotten (its loads' device blocks are forgotten with its requests')."""
        if self.host is None:
            return
        for copy in copies:
            if copy.to_host and (block_hash := self.host.drop(copy.dst)) is not None:
                self._removed_from_host(block_hash)

    def _spill(self, block: KVCacheBlock) -> None:
        """Copies a cached block about to be handed out to the host tier (unless it holds the
        hash already, or every host block is pinned)."""
        assert self.host is not None and block.block_hash is not None
        if self.cached_blocks.get(block.block_hash) is not block:
            return  # an uncached duplicate of a cached block
        host_id, dropped = self.host.store(block.block_hash)
        if host_id is not None:
            self.copies.append(BlockCopy(True, block.block_id, host_id))
        if dropped is not None:
            self._removed_from_host(dropped)

    def _removed_from_host(self, block_hash: BlockHash) -> None:
        if self.events is not None and block_hash not in self.cached_blocks:
            self.events.append((NOT_CACHED, block_hash))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits, reviving them from the free list if unused."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash], start: int, end: int
    ) -> None:
        """Registers blocks ``start:end`` of a request (all full) under their prefix hashes."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end], strict=True):
            if block.block_hash is not None:
                continue  # a prefix-cache hit: already registered
            block.block_hash = block_hash
            # NOTE: two requests may compute the same block concurrently; the first stays the
            # cached copy and the second is an ordinary (uncached) block.
            if self.cached_blocks.setdefault(block_hash, block) is block and self.events is not None:
                self.events.append((ON_DEVICE, block_hash))

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; callers pass a request's blocks tail first, so
        the ends of prefix chains are reused before their beginnings."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than taken"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def forget(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Removes blocks from the prefix cache (their contents are not to be trusted)."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            if self.events is not None:  # NOTE: held on the host still, or not at all
                self.events.append((self.tier_of(block.block_hash), block.block_hash))
        block.block_hash = None

    def check_integrity(self, expect_idle: bool = False) -> None:
        """free + in use == total, free list and hash map consistent; with ``expect_idle``, no
        block held by a request. Raises AssertionError."""
        free = list(self.free_queue)
        free_ids = {b.block_id for b in free}
        assert len(free) == len(free_ids) == self.free_queue.num_free_blocks, "free list corrupt"
        assert NULL_BLOCK_ID not in free_ids, "the null block is in the free list"
        in_use = [b for b in self.blocks[1:] if b.ref_cnt > 0]
        assert all(b.ref_cnt == 0 for b in free), "a referenced block is in the free list"
        assert len(free) + len(in_use) == self.num_blocks - 1, (
            f"{len(free)} free + {len(in_use)} in use != {self.num_blocks - 1} blocks"
        )
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"{block} is cached under another hash"
        if self.host is not None:
            self.host.check_integrity()
        if expect_idle:
            assert not in_use, f"blocks still in use: {[b.block_id for b in in_use][:16]}"
