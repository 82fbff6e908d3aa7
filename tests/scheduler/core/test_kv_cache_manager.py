"""KVCacheManager: prefix hits, slot allocation, freeing, stats, with exact block ids."""

from __future__ import annotations

import pytest

from npuserve.scheduler.core.block_pool import KVCacheBlock
from npuserve.scheduler.core.kv_cache_manager import KVCacheManager
from npuserve.scheduler.core.request import Request, SamplingParams

BS = 4


def make_request(req_id: str, tokens: list[int], max_model_len: int = 1024) -> Request:
    params = SamplingParams(max_tokens=64)
    return Request(
        req_id,
        list(tokens),
        params=params,
        options=params.to_options((2,)),
        eos_token_ids=(2,),
        max_model_len=max_model_len,
        block_size=BS,
    )


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def ids(blocks: list[KVCacheBlock] | None) -> list[int]:
    assert blocks is not None
    return [b.block_id for b in blocks]


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[int]:
    """Does what the scheduler does for a waiting request; returns its block ids."""
    hits, num_hit = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit
    assert kv.allocate_slots(request, num_new, hits) is not None
    request.num_computed_tokens = num_hit
    return kv.get_block_ids(request.req_id)


PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks and one token


def test_never_matches_the_whole_sequence() -> None:
    """A prompt of exactly k cached full blocks matches k-1 of them; one token more matches all k."""
    kv = KVCacheManager(10, BS)
    assert admit(kv, make_request("a", PROMPT[:12])) == [1, 2, 3]
    hits, n = kv.get_computed_blocks(make_request("b", PROMPT[:12]))
    assert ids(hits) == [1, 2] and n == 8
    hits, n = kv.get_computed_blocks(make_request("c", [*PROMPT[:12], 99]))
    assert ids(hits) == [1, 2, 3] and n == 12
    hits, n = kv.get_computed_blocks(make_request("d", PROMPT[:4]))
    assert hits == [] and n == 0
    kv.check_integrity()


def test_hit_shares_exact_blocks_with_the_first_request() -> None:
    """A second request with the same prefix gets the first's block ids, each with two references."""
    kv = KVCacheManager(10, BS)
    a = make_request("a", PROMPT)
    assert admit(kv, a) == [1, 2, 3, 4]
    assert kv.num_cached_blocks["a"] == 3
    assert set(kv.pool.cached_blocks) == set(a.block_hashes)

    b = make_request("b", [*PROMPT[:8], 50, 51, 52, 53, 54])
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == [1, 2] and n == 8
    new = kv.allocate_slots(b, b.num_tokens - n, hits)
    assert ids(new) == [5, 6]
    assert kv.get_block_ids("b") == [1, 2, 5, 6]
    assert [kv.pool.blocks[i].ref_cnt for i in range(1, 7)] == [2, 2, 1, 1, 1, 1]
    assert free_ids(kv) == [7, 8, 9]
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity(expect_idle=True)


def test_same_step_sharing_of_blocks_registered_at_schedule_time() -> None:
    """Blocks are registered when allocated, so a request admitted right after may share them."""
    kv = KVCacheManager(10, BS)
    a = make_request("a", PROMPT)
    hits, _ = kv.get_computed_blocks(a)
    kv.allocate_slots(a, 13, hits)  # a.num_computed_tokens is still 0: its step has not run
    b = make_request("b", PROMPT)
    assert admit(kv, b) == [1, 2, 3, 5]
    assert b.num_computed_tokens == 12


def test_allocate_returns_none_when_pool_is_short_and_changes_nothing() -> None:
    """allocate_slots refuses tokens the pool cannot hold and leaves every structure as it was."""
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    a = make_request("a", PROMPT[:12])
    assert admit(kv, a) == [1, 2, 3]
    b = make_request("b", list(range(100, 108)))
    cached_before = dict(kv.pool.cached_blocks)
    assert kv.allocate_slots(b, 8) is None
    assert "b" not in kv.req_blocks and "b" not in kv.num_cached_blocks
    assert free_ids(kv) == [4]
    assert kv.pool.cached_blocks == cached_before
    assert [kv.pool.blocks[i].ref_cnt for i in range(1, 5)] == [1, 1, 1, 0]
    assert ids(kv.allocate_slots(b, 4)) == [4]  # a smaller chunk fits
    kv.check_integrity()


def test_revived_cached_blocks_count_against_free_capacity() -> None:
    """Hits sitting in the free list leave it when taken, so they cannot also serve as new blocks."""
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    a = make_request("a", PROMPT[:12])
    assert admit(kv, a) == [1, 2, 3]
    kv.free(a)
    assert free_ids(kv) == [4, 3, 2, 1]

    # 17 tokens: 3 hits + 2 new blocks, but only 1 block is free besides the hits.
    b = make_request("b", [*PROMPT[:12], 60, 61, 62, 63, 64])
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == [1, 2, 3] and n == 12
    assert kv.allocate_slots(b, 5, hits) is None
    assert free_ids(kv) == [4, 3, 2, 1]
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in range(1, 5))
    assert len(kv.pool.cached_blocks) == 3
    kv.check_integrity(expect_idle=True)

    # 15 tokens: 3 hits + 1 new block fits exactly.
    c = make_request("c", [*PROMPT[:12], 60, 61, 62])
    assert admit(kv, c) == [1, 2, 3, 4]
    assert free_ids(kv) == []
    kv.check_integrity()


def test_free_returns_blocks_tail_first() -> None:
    """free puts a request's last block at the front of its run in the free list."""
    kv = KVCacheManager(8, BS)
    a = make_request("a", PROMPT)
    assert admit(kv, a) == [1, 2, 3, 4]
    kv.free(a)
    assert free_ids(kv) == [5, 6, 7, 4, 3, 2, 1]
    assert kv.get_block_ids("a") == []
    assert "a" not in kv.num_cached_blocks
    kv.free(a)  # freeing twice is a no-op
    kv.check_integrity(expect_idle=True)


def test_free_invalid_unregisters_hashes() -> None:
    """free(valid=False) drops the request's blocks from the prefix cache: no later hit."""
    kv = KVCacheManager(8, BS)
    a = make_request("a", PROMPT)
    admit(kv, a)
    assert len(kv.pool.cached_blocks) == 3
    kv.free(a, valid=False)
    assert kv.pool.cached_blocks == {}
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert free_ids(kv) == [5, 6, 7, 4, 3, 2, 1]
    hits, n = kv.get_computed_blocks(make_request("b", PROMPT))
    assert hits == [] and n == 0
    kv.check_integrity(expect_idle=True)


def test_same_prompt_after_free_revives_exactly_the_first_blocks() -> None:
    """After the first request is freed, an identical prompt takes back its blocks 1, 2, 3."""
    kv = KVCacheManager(10, BS)
    a = make_request("a", PROMPT)
    assert admit(kv, a) == [1, 2, 3, 4]
    kv.free(a)
    assert free_ids(kv) == [5, 6, 7, 8, 9, 4, 3, 2, 1]
    b = make_request("b", PROMPT)
    assert admit(kv, b) == [1, 2, 3, 5]
    assert b.num_computed_tokens == 12
    assert free_ids(kv) == [6, 7, 8, 9, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 5)] == [1, 1, 1, 1]
    kv.free(b)
    kv.check_integrity(expect_idle=True)


def test_chunked_allocation_registers_blocks_as_they_fill() -> None:
    """Allocating chunk by chunk adds only the missing blocks and registers each block once full."""
    kv = KVCacheManager(10, BS)
    a = make_request("a", list(range(30, 50)))  # 20 tokens
    assert ids(kv.allocate_slots(a, 6)) == [1, 2]
    assert kv.num_cached_blocks["a"] == 1
    assert set(kv.pool.cached_blocks) == set(a.block_hashes[:1])
    a.num_computed_tokens = 6
    assert ids(kv.allocate_slots(a, 2)) == []  # 8 tokens still fit in 2 blocks
    assert kv.num_cached_blocks["a"] == 2
    a.num_computed_tokens = 8
    assert ids(kv.allocate_slots(a, 12)) == [3, 4, 5]
    assert kv.num_cached_blocks["a"] == 5
    assert set(kv.pool.cached_blocks) == set(a.block_hashes)
    kv.free(a)
    kv.check_integrity(expect_idle=True)


def test_decode_growth_registers_output_blocks() -> None:
    """Output tokens that fill a block are hashed and registered when that block is scheduled."""
    kv = KVCacheManager(10, BS)
    a = make_request("a", list(range(30, 36)))  # 6 tokens
    assert admit(kv, a) == [1, 2]
    a.num_computed_tokens = 6
    a.append_output(7, None)  # 7 tokens
    assert ids(kv.allocate_slots(a, 1)) == []
    a.num_computed_tokens = 7
    a.append_output(8, None)  # 8 tokens: block 1 full
    assert len(a.block_hashes) == 2
    assert ids(kv.allocate_slots(a, 1)) == []
    assert kv.num_cached_blocks["a"] == 2
    assert kv.pool.cached_blocks.get(a.block_hashes[1]) is kv.pool.blocks[2]
    a.num_computed_tokens = 8
    a.append_output(9, None)
    assert ids(kv.allocate_slots(a, 1)) == [3]
    # A new request whose prompt is a's tokens so far hits both blocks, outputs included.
    hits, n = kv.get_computed_blocks(make_request("b", a.all_token_ids))
    assert ids(hits) == [1, 2] and n == 8
    kv.free(a)
    kv.check_integrity(expect_idle=True)


def test_stats_count_recorded_lookups_only() -> None:
    """Lookups count only when recorded (once per admitted request), not on every retry."""
    kv = KVCacheManager(10, BS)
    admit(kv, make_request("a", PROMPT))
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)
    for _ in range(3):  # a request retried at the head of the queue
        _, n = kv.get_computed_blocks(make_request("b", PROMPT))
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)
    kv.record_prefix_lookup(len(PROMPT), n)
    assert (kv.stats.queries, kv.stats.hits) == (13, 12)
    _, n = kv.get_computed_blocks(make_request("c", PROMPT[:9]))
    kv.record_prefix_lookup(9, n)
    assert (kv.stats.queries, kv.stats.hits) == (22, 20)


def test_caching_disabled() -> None:
    """With caching off nothing is registered, nothing hits, and stats stay zero."""
    kv = KVCacheManager(10, BS, enable_caching=False)
    a = make_request("a", PROMPT)
    assert admit(kv, a) == [1, 2, 3, 4]
    assert kv.pool.cached_blocks == {}
    hits, n = kv.get_computed_blocks(make_request("b", PROMPT))
    assert hits == [] and n == 0
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)
    kv.free(a)
    kv.check_integrity(expect_idle=True)


def test_usage_follows_the_pool() -> None:
    """The pool's usage is the fraction of usable blocks held."""
    kv = KVCacheManager(9, BS)
    a = make_request("a", PROMPT)
    admit(kv, a)
    assert kv.pool.usage == 0.5
    kv.free(a)
    assert kv.pool.usage == 0.0


def test_manager_integrity_catches_ref_count_drift() -> None:
    """A pool ref count that disagrees with the requests' block lists is caught."""
    kv = KVCacheManager(10, BS)
    admit(kv, make_request("a", PROMPT))
    kv.check_integrity()
    kv.pool.blocks[2].ref_cnt += 1
    with pytest.raises(AssertionError, match="requests hold 4 block references, the pool counts 5"):
        kv.check_integrity()


def test_manager_integrity_expect_idle_fails_with_live_request() -> None:
    """expect_idle fails while a request holds blocks."""
    kv = KVCacheManager(10, BS)
    a = make_request("a", PROMPT)
    admit(kv, a)
    with pytest.raises(AssertionError):
        kv.check_integrity(expect_idle=True)
    kv.free(a)
    kv.check_integrity(expect_idle=True)


def test_fits_held_blocks_exactly_when_allocate_slots_would_change_nothing() -> None:
    """A decode fits while its blocks have room and it fills no block the cache must register."""
    kv = KVCacheManager(10, BS)
    request = make_request("a", PROMPT)  # 13 tokens: 4 blocks, the last with room for 3
    admit(kv, request)
    request.num_computed_tokens = request.num_tokens
    fits = []
    for token in range(5):
        request.append_output(100 + token, None)
        before = (kv.get_block_ids("a"), kv.num_cached_blocks["a"], dict(kv.pool.cached_blocks))
        fit = kv.fits_held_blocks(request, 1)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        assert fit == (before == (kv.get_block_ids("a"), kv.num_cached_blocks["a"], kv.pool.cached_blocks))
        fits.append(fit)
    # the 16th token fills block 4 (registered), the 17th needs block 5
    assert fits == [True, True, False, False, True]
    assert not kv.fits_held_blocks(make_request("b", PROMPT), 1)  # holds no block yet
    kv.check_integrity()
