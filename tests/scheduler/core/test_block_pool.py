"""BlockPool and FreeBlockQueue: exact block ids, exact free-list order, lazy eviction, integrity.

In the style of vLLM's tests/v1/core/test_prefix_caching.py: every test asserts the exact ids
handed out and the exact order of the free list.
"""

from __future__ import annotations

import pytest

from npuserve.scheduler.core.block_hash import hash_block_tokens
from npuserve.scheduler.core.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return hash_block_tokens(None, [i, i, i, i])


def test_pool_needs_two_blocks() -> None:
    """A pool of fewer than two blocks (the null block and one more) is refused."""
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1)
    BlockPool(2).check_integrity(expect_idle=True)


def test_null_block_is_never_handed_out() -> None:
    """Block 0 is not in the free list; draining the pool hands out 1..N-1 and then refuses."""
    pool = BlockPool(5)
    assert pool.blocks[NULL_BLOCK_ID].block_id == NULL_BLOCK_ID == 0
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 4
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="1 blocks with 0 free"):
        pool.get_new_blocks(1)
    assert pool.blocks[NULL_BLOCK_ID].ref_cnt == 0
    pool.check_integrity()


def test_get_new_blocks_pops_the_head_in_id_order() -> None:
    """On a fresh pool blocks come out in id order, each with one reference."""
    pool = BlockPool(10)
    first = pool.get_new_blocks(3)
    assert ids(first) == [1, 2, 3]
    assert [b.ref_cnt for b in first] == [1, 1, 1]
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9]
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert free_ids(pool) == [6, 7, 8, 9]
    assert ids(pool.get_new_blocks(0)) == []
    pool.check_integrity()


def test_get_new_blocks_refusal_leaves_the_pool_unchanged() -> None:
    """Asking for more blocks than are free raises before taking any."""
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [1, 2, 3]
    pool.check_integrity(expect_idle=True)


def test_free_blocks_appends_to_the_tail_in_the_given_order() -> None:
    """Freeing a request's blocks reversed puts its chain tail first; reuse follows that order."""
    pool = BlockPool(10)
    req = pool.get_new_blocks(4)  # 1, 2, 3, 4
    assert free_ids(pool) == [5, 6, 7, 8, 9]
    pool.free_blocks(reversed(req))
    assert free_ids(pool) == [5, 6, 7, 8, 9, 4, 3, 2, 1]
    assert all(b.ref_cnt == 0 for b in req)
    assert ids(pool.get_new_blocks(6)) == [5, 6, 7, 8, 9, 4]
    assert free_ids(pool) == [3, 2, 1]
    pool.check_integrity()


def test_free_blocks_in_forward_order() -> None:
    """free_blocks keeps whatever order it is given (no sorting)."""
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)  # 1, 2
    b = pool.get_new_blocks(2)  # 3, 4
    pool.free_blocks(b)
    pool.free_blocks(a)
    assert free_ids(pool) == [5, 3, 4, 1, 2]
    pool.check_integrity(expect_idle=True)


def test_free_more_often_than_taken_asserts() -> None:
    """Dropping a reference nobody holds is an error, not a silent negative count."""
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free_blocks([block])


def test_shared_block_returns_to_free_list_only_at_zero_refs() -> None:
    """touch on a held block adds a reference; the block is free only when the last one drops."""
    pool = BlockPool(6)
    block = pool.get_new_blocks(1)[0]  # 1
    pool.touch([block])
    assert block.ref_cnt == 2
    assert free_ids(pool) == [2, 3, 4, 5]
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [2, 3, 4, 5]
    pool.check_integrity()
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_ids(pool) == [2, 3, 4, 5, 1]
    pool.check_integrity(expect_idle=True)


def test_touch_revives_a_cached_free_block_from_the_middle() -> None:
    """A cached block sitting in the middle of the free list leaves it in O(1) when touched."""
    pool = BlockPool(8)
    req = pool.get_new_blocks(3)  # 1, 2, 3
    pool.cache_full_blocks(req, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(reversed(req))
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1]
    hit = pool.cached_blocks.get(h(2))
    assert hit is req[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [4, 5, 6, 7, 3, 1]
    assert pool.cached_blocks.get(h(2)) is hit  # still cached while held
    assert pool.num_free_blocks == 6
    pool.check_integrity()
    # Freed again, it goes to the tail, not back to its old place.
    pool.free_blocks([hit])
    assert free_ids(pool) == [4, 5, 6, 7, 3, 1, 2]
    pool.check_integrity(expect_idle=True)


def test_touch_head_and_tail_of_the_free_list() -> None:
    """Reviving the first and the last free block keeps the list linked correctly."""
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [1, 2, 3, 4]
    pool.touch([blocks[0], blocks[3]])
    assert free_ids(pool) == [2, 3]
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    assert free_ids(pool) == []
    pool.free_blocks([blocks[3], blocks[0]])
    assert free_ids(pool) == [4, 1]
    pool.check_integrity()


def test_cache_full_blocks_registers_hashes() -> None:
    """Blocks start:end are registered under their hashes; blocks outside the range are not."""
    pool = BlockPool(8)
    req = pool.get_new_blocks(4)  # 1..4
    hashes = [h(10), h(11), h(12), h(13)]
    pool.cache_full_blocks(req, hashes, 0, 2)
    assert pool.cached_blocks.get(h(10)) is req[0]
    assert pool.cached_blocks.get(h(11)) is req[1]
    assert pool.cached_blocks.get(h(12)) is None
    assert req[2].block_hash is None
    pool.cache_full_blocks(req, hashes, 2, 3)
    assert pool.cached_blocks.get(h(12)) is req[2]
    assert req[2].block_hash == h(12)
    assert set(pool.cached_blocks) == {h(10), h(11), h(12)}
    pool.check_integrity()


def test_cache_full_blocks_skips_already_registered_blocks() -> None:
    """A block that already has a hash (a prefix-cache hit) keeps it when registered again."""
    pool = BlockPool(6)
    req = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [h(1), h(2)], 0, 2)
    pool.cache_full_blocks(req, [h(7), h(8)], 0, 2)
    assert req[0].block_hash == h(1) and req[1].block_hash == h(2)
    assert set(pool.cached_blocks) == {h(1), h(2)}
    pool.check_integrity()


def test_duplicate_hash_keeps_the_first_block() -> None:
    """Two blocks with one hash: the map keeps the first; reusing the second leaves the first cached."""
    pool = BlockPool(6)
    first = pool.get_new_blocks(1)  # 1
    second = pool.get_new_blocks(1)  # 2
    pool.cache_full_blocks(first, [h(5)], 0, 1)
    pool.cache_full_blocks(second, [h(5)], 0, 1)
    assert pool.cached_blocks.get(h(5)) is first[0]
    assert second[0].block_hash == h(5)  # hashed, but not the cached copy
    pool.check_integrity()
    pool.free_blocks(second)
    pool.free_blocks(first)
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]  # hands out the duplicate
    assert second[0].block_hash is None
    assert pool.cached_blocks.get(h(5)) is first[0]
    pool.check_integrity()


def test_caching_disabled_registers_nothing() -> None:
    """With caching off, cache_full_blocks is a no-op."""
    pool = BlockPool(4, enable_caching=False)
    req = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [h(1), h(2)], 0, 2)
    assert pool.cached_blocks == {}
    assert all(b.block_hash is None for b in req)


def test_lazy_eviction_keeps_hash_until_handed_out_again() -> None:
    """A freed cached block still hits; once get_new_blocks takes it, its hash is gone."""
    pool = BlockPool(4)
    req = pool.get_new_blocks(2)  # 1, 2
    pool.cache_full_blocks(req, [h(1), h(2)], 0, 2)
    pool.free_blocks(reversed(req))
    assert free_ids(pool) == [3, 2, 1]
    assert pool.cached_blocks.get(h(1)) is req[0]
    assert pool.cached_blocks.get(h(2)) is req[1]
    assert req[0].block_hash == h(1)

    assert ids(pool.get_new_blocks(1)) == [3]  # an uncached block: nothing evicted
    assert set(pool.cached_blocks) == {h(1), h(2)}
    assert ids(pool.get_new_blocks(1)) == [2]  # the chain tail goes first
    assert pool.cached_blocks.get(h(2)) is None
    assert req[1].block_hash is None
    assert pool.cached_blocks.get(h(1)) is req[0]
    pool.check_integrity()


def test_forget_unregisters_blocks() -> None:
    """forget drops held blocks from the hash map without touching ref counts or the free list."""
    pool = BlockPool(6)
    req = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, [h(1), h(2), h(3)], 0, 3)
    pool.forget(req[1:])
    assert set(pool.cached_blocks) == {h(1)}
    assert [b.block_hash for b in req] == [h(1), None, None]
    assert [b.ref_cnt for b in req] == [1, 1, 1]
    assert free_ids(pool) == [4, 5]
    pool.forget(req[1:])  # idempotent
    pool.free_blocks(reversed(req))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    assert pool.cached_blocks.get(h(2)) is None
    pool.check_integrity(expect_idle=True)


def test_forget_a_duplicate_keeps_the_cached_copy() -> None:
    """Forgetting the uncached duplicate of a hash leaves the cached block registered."""
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [h(9)], 0, 1)
    pool.cache_full_blocks(b, [h(9)], 0, 1)
    pool.forget(b)
    assert pool.cached_blocks.get(h(9)) is a[0]
    assert b[0].block_hash is None
    pool.check_integrity()


def test_usage() -> None:
    """usage is the fraction of the usable blocks (null block excluded) held by requests."""
    pool = BlockPool(5)
    assert pool.usage == 0.0
    a = pool.get_new_blocks(2)
    assert pool.usage == 0.5
    b = pool.get_new_blocks(2)
    assert pool.usage == 1.0
    pool.cache_full_blocks(b, [h(1), h(2)], 0, 2)
    pool.free_blocks(b)
    assert pool.usage == 0.5  # cached but unused blocks count as free
    pool.free_blocks(a)
    assert pool.usage == 0.0


def _busy_pool() -> tuple[BlockPool, list[KVCacheBlock]]:
    pool = BlockPool(8)
    held = pool.get_new_blocks(3)  # 1, 2, 3
    pool.cache_full_blocks(held, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks([held[2]])  # 3 cached and free
    pool.check_integrity()
    return pool, held


def test_integrity_passes_on_consistent_states() -> None:
    """Fresh, busy, shared and drained pools are all consistent."""
    BlockPool(3).check_integrity(expect_idle=True)
    pool, held = _busy_pool()
    pool.touch([held[0]])
    pool.check_integrity()
    pool.free_blocks([held[0], held[0], held[1]])
    pool.check_integrity(expect_idle=True)


def test_integrity_fails_on_wrong_ref_count() -> None:
    """A held block whose ref count dropped to zero without entering the free list is caught."""
    pool, held = _busy_pool()
    held[0].ref_cnt = 0
    with pytest.raises(AssertionError, match=r"\d+ free \+ \d+ in use"):
        pool.check_integrity()


def test_integrity_fails_on_negative_ref_count() -> None:
    """A negative ref count makes the block neither free nor in use: caught."""
    pool, held = _busy_pool()
    held[1].ref_cnt = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_fails_on_referenced_block_in_free_list() -> None:
    """A block in the free list with a reference is caught."""
    pool, _ = _busy_pool()
    free_block = pool.blocks[5]
    free_block.ref_cnt = 1
    with pytest.raises(AssertionError, match="referenced block is in the free list"):
        pool.check_integrity()


def test_integrity_fails_on_hash_map_pointing_at_another_hash() -> None:
    """A hash map entry whose block carries a different hash is caught."""
    pool, held = _busy_pool()
    pool.cached_blocks[h(1)] = held[1]
    with pytest.raises(AssertionError, match="cached under another hash"):
        pool.check_integrity()


def test_integrity_fails_on_evicted_block_still_in_hash_map() -> None:
    """A block whose hash was cleared but that the map still points to is caught."""
    pool, held = _busy_pool()
    held[0].block_hash = None
    with pytest.raises(AssertionError, match="cached under another hash"):
        pool.check_integrity()


def test_integrity_fails_on_null_block_in_free_list() -> None:
    """The null block in the free list is caught."""
    pool, _ = _busy_pool()
    pool.free_queue.append(pool.blocks[NULL_BLOCK_ID])
    with pytest.raises(AssertionError, match="null block"):
        pool.check_integrity()


def test_integrity_fails_on_free_count_drift() -> None:
    """A free-list length counter that disagrees with the links is caught."""
    pool, _ = _busy_pool()
    pool.free_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="free list corrupt"):
        pool.check_integrity()


def test_integrity_expect_idle_fails_with_held_blocks() -> None:
    """expect_idle rejects a pool where a request still holds blocks (and passes without it)."""
    pool, held = _busy_pool()
    pool.check_integrity()
    with pytest.raises(AssertionError, match="blocks still in use: \\[1, 2\\]"):
        pool.check_integrity(expect_idle=True)
    pool.free_blocks(held[:2])
    pool.check_integrity(expect_idle=True)


def test_free_block_queue_small() -> None:
    """popleft, remove (head, middle, tail) and append keep exact order and length."""
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4, 5]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])
    queue.remove(blocks[5])
    queue.remove(blocks[1])
    assert [b.block_id for b in queue] == [2, 4]
    assert queue.num_free_blocks == 2
    queue.append(blocks[5])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [2, 4, 5, 0]
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    with pytest.raises(AssertionError, match="not in the free list"):
        queue.remove(blocks[3])
    for expected in (2, 4, 5, 0):
        assert queue.popleft().block_id == expected
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError, match="no free block"):
        queue.popleft()


def test_free_block_queue_large_pool_stays_correct_and_fast() -> None:
    """On 100k blocks, middle removals, appends and pops keep the exact order, in linear time (a
    list-based queue with O(n) removals would take minutes: the suite's timeout catches that)."""
    n = 100_000
    blocks = [KVCacheBlock(i) for i in range(n)]
    queue = FreeBlockQueue(blocks)
    for block in blocks[1::2]:  # remove every odd block from the middle
        queue.remove(block)
    assert queue.num_free_blocks == n // 2
    for block in reversed(blocks[1::2]):  # append them back, highest first
        queue.append(block)
    popped = [queue.popleft().block_id for _ in range(n // 2)]
    assert popped == list(range(0, n, 2))
    assert queue.num_free_blocks == n // 2
    assert [b.block_id for b in queue] == list(range(n - 1, 0, -2))


def test_large_pool_touch_from_the_middle() -> None:
    """A 100k-block pool revives cached blocks from deep in the free list and stays consistent."""
    pool = BlockPool(100_001)
    held = pool.get_new_blocks(100_000)
    hashes = [hash_block_tokens(None, [i]) for i in range(0, 100_000, 1000)]
    picked = held[::1000]
    pool.cache_full_blocks(picked, hashes, 0, len(picked))
    pool.free_blocks(reversed(held))
    assert pool.num_free_blocks == 100_000
    revived = [pool.cached_blocks.get(hh) for hh in hashes[::2]]
    assert all(b is not None for b in revived)
    pool.touch([b for b in revived if b is not None])
    assert pool.num_free_blocks == 100_000 - len(revived)
    assert free_ids(pool)[:3] == [100_000, 99_999, 99_998]
    pool.check_integrity()
