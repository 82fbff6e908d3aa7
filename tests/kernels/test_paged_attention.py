"""The torch backend's paged attention against dense causal attention computed directly.

Each scenario simulates a real step: some context of every request was written to the paged
cache in earlier steps (through `write_kv_cache` or straight into its slots), this step's tokens
are written by `write_kv_cache`, then `attention` runs over the flat batch. The reference is a
plain ``softmax(Q K^T * scale + causal mask) V`` per request in float64, with K/V repeated for
grouped-query attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from npuserve.kernels import (
    NULL_BLOCK_ID,
    AttentionMetadata,
    build_attention_metadata,
    cdiv,
    kv_cache_shape,
    slot_mapping,
)
from npuserve.kernels.backends.torch_backend import TorchBackend

CPU = torch.device("cpu")
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
GARBAGE = 1e4  # finite cache filler, large enough that any leak shows


@dataclass
class Request:
    context_len: int  # tokens already in the cache before this step
    query_len: int  # tokens computed (and written) this step
    blocks: list[int]  # this request's block ids, in order
    keys: torch.Tensor  # [seq_len, Hkv, D], all tokens, in the cache dtype
    values: torch.Tensor  # [seq_len, Hkv, D]
    query: torch.Tensor  # [query_len, H, D]

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class Scenario:
    requests: list[Request]
    block_size: int
    num_blocks: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def block_table(self, extra_columns: int = 0) -> np.ndarray:
        """[B, max_blocks + extra_columns] int32, padded with the null block."""
        width = max(len(r.blocks) for r in self.requests) + extra_columns
        table = np.full((len(self.requests), width), NULL_BLOCK_ID, dtype=np.int32)
        for row, request in enumerate(self.requests):
            table[row, : len(request.blocks)] = request.blocks
        return table

    def new_cache(self, fill: float = GARBAGE) -> torch.Tensor:
        shape = kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        # Garbage everywhere: null block, free blocks and the unwritten tails of used blocks.
        cache = torch.empty(shape, dtype=torch.float32).uniform_(-fill, fill)
        return cache.to(self.dtype)


def _seq_len(rng: np.random.Generator, block_size: int, max_blocks: int) -> int:
    """A length that often sits on or right next to a block boundary."""
    if rng.random() < 0.5:
        edge = block_size * int(rng.integers(1, max_blocks + 1))
        return max(1, edge + int(rng.integers(-1, 2)))
    return int(rng.integers(1, block_size * max_blocks + 1))


def make_scenario(
    seed: int,
    *,
    block_size: int,
    head_size: int,
    group: int,
    dtype: torch.dtype,
    num_reqs: int | None = None,
    kinds: tuple[str, ...] = ("decode", "prefill", "chunked"),
    max_blocks: int | None = None,
) -> Scenario:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    num_reqs = int(rng.integers(1, 7)) if num_reqs is None else num_reqs
    num_kv_heads = int(rng.integers(1, 3))
    num_heads = num_kv_heads * group
    max_blocks = max_blocks if max_blocks is not None else (5 if block_size <= 16 else 2)

    lengths: list[tuple[int, int]] = []
    for _ in range(num_reqs):
        kind = kinds[int(rng.integers(len(kinds)))]
        seq_len = _seq_len(rng, block_size, max_blocks)
        if kind == "prefill" or seq_len == 1:
            context_len = 0
        elif kind == "decode":
            context_len = seq_len - 1
        else:  # chunked prefill or prefix-cache hit: part cached, several new tokens
            if seq_len > block_size and rng.random() < 0.5:
                context_len = block_size * int(rng.integers(1, cdiv(seq_len, block_size)))
            else:
                context_len = int(rng.integers(1, seq_len))
        lengths.append((context_len, seq_len - context_len))

    # Block ids: shuffled, non-contiguous, from a pool larger than needed; never the null block.
    needed = sum(cdiv(c + q, block_size) for c, q in lengths)
    num_blocks = 1 + 2 * needed + 3
    pool = rng.permutation(np.arange(1, num_blocks)).tolist()

    requests: list[Request] = []
    for context_len, query_len in lengths:
        seq_len = context_len + query_len
        blocks = [int(pool.pop()) for _ in range(cdiv(seq_len, block_size))]
        kv_shape = (seq_len, num_kv_heads, head_size)
        requests.append(
            Request(
                context_len=context_len,
                query_len=query_len,
                blocks=blocks,
                keys=torch.randn(kv_shape, generator=gen).to(dtype),
                values=torch.randn(kv_shape, generator=gen).to(dtype),
                query=torch.randn(query_len, num_heads, head_size, generator=gen).to(dtype),
            )
        )
    return Scenario(requests, block_size, num_blocks, num_heads, num_kv_heads, head_size, dtype)


def write_context(
    scenario: Scenario, cache: torch.Tensor, backend: TorchBackend, rng: np.random.Generator
) -> None:
    """Put every request's context into the cache as earlier steps would have."""
    table = scenario.block_table()
    bs = scenario.block_size
    earlier: list[int] = []
    for row, request in enumerate(scenario.requests):
        if request.context_len == 0:
            continue
        if rng.random() < 0.5:
            earlier.append(row)
            continue
        for pos in range(request.context_len):  # straight into the slot, by hand
            block = request.blocks[pos // bs]
            cache[0, block, pos % bs] = request.keys[pos]
            cache[1, block, pos % bs] = request.values[pos]
    if not earlier:
        return
    # One earlier prefill step over those requests' context tokens.
    query_lens = np.array([scenario.requests[r].context_len for r in earlier])
    rows = np.repeat(np.arange(len(earlier)), query_lens)
    positions = np.concatenate([np.arange(n) for n in query_lens])
    sub_table = table[earlier]
    metadata = build_attention_metadata(
        query_lens=query_lens,
        seq_lens=query_lens.copy(),
        block_table=sub_table,
        slot_mapping=slot_mapping(sub_table, rows, positions, bs),
        block_size=bs,
        device=CPU,
    )
    keys = torch.cat([scenario.requests[r].keys[: scenario.requests[r].context_len] for r in earlier])
    values = torch.cat([scenario.requests[r].values[: scenario.requests[r].context_len] for r in earlier])
    backend.write_kv_cache(keys, values, cache, metadata)


def step_metadata(scenario: Scenario, extra_columns: int = 0) -> AttentionMetadata:
    """The metadata of this step's requests (their new tokens after their context)."""
    table = scenario.block_table(extra_columns)
    requests = scenario.requests
    query_lens = np.array([r.query_len for r in requests])
    rows = np.repeat(np.arange(len(requests)), query_lens)
    positions = np.concatenate([np.arange(r.context_len, r.seq_len) for r in requests])
    return build_attention_metadata(
        query_lens=query_lens,
        seq_lens=np.array([r.seq_len for r in requests]),
        block_table=table,
        slot_mapping=slot_mapping(table, rows, positions, scenario.block_size),
        block_size=scenario.block_size,
        device=CPU,
    )


def run_step(
    scenario: Scenario,
    cache: torch.Tensor,
    backend: TorchBackend,
    scale: float,
    extra_columns: int = 0,
    metadata: AttentionMetadata | None = None,
) -> torch.Tensor:
    """This step: write the new tokens' K/V, then attention. Returns [T, H, D]."""
    if metadata is None:
        metadata = step_metadata(scenario, extra_columns)
    requests = scenario.requests
    keys = torch.cat([r.keys[r.context_len :] for r in requests])
    values = torch.cat([r.values[r.context_len :] for r in requests])
    query = torch.cat([r.query for r in requests])
    backend.write_kv_cache(keys, values, cache, metadata)
    return backend.attention(query, cache, metadata, scale)


def reference_attention(request: Request, scale: float) -> torch.Tensor:
    """Dense causal attention of one request in float64. Returns [query_len, H, D]."""
    q = request.query.double()
    group = q.shape[1] // request.keys.shape[1]
    k = request.keys.double().repeat_interleave(group, dim=1)  # [S, H, D]
    v = request.values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(request.context_len, request.seq_len)[:, None]
    key_pos = torch.arange(request.seq_len)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def check_against_reference(scenario: Scenario, out: torch.Tensor, scale: float) -> None:
    assert out.shape == (
        sum(r.query_len for r in scenario.requests),
        scenario.num_heads,
        scenario.head_size,
    )
    assert out.dtype == scenario.dtype
    start = 0
    for index, request in enumerate(scenario.requests):
        got = out[start : start + request.query_len].double()
        start += request.query_len
        torch.testing.assert_close(
            got,
            reference_attention(request, scale),
            **TOLERANCES[scenario.dtype],
            msg=lambda m, i=index, r=request: (
                f"request {i} (context {r.context_len}, query {r.query_len}): {m}"
            ),
        )


def _stable_seed(parts: tuple[object, ...]) -> int:
    return int.from_bytes(repr(parts).encode(), "little") % (2**31 - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_size", [8, 64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block_size", [16, 128], ids=lambda b: f"bs{b}")
def test_random_mix_matches_dense(block_size: int, head_size: int, group: int, dtype: torch.dtype) -> None:
    seed = _stable_seed((block_size, head_size, group, str(dtype)))
    scenario = make_scenario(seed, block_size=block_size, head_size=head_size, group=group, dtype=dtype)
    backend = TorchBackend()
    cache = scenario.new_cache()
    write_context(scenario, cache, backend, np.random.default_rng(seed))
    scale = head_size**-0.5
    check_against_reference(scenario, run_step(scenario, cache, backend, scale), scale)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "kinds",
    [("decode",), ("prefill",), ("chunked",), ("decode", "chunked")],
    ids=lambda k: "+".join(k),
)
@pytest.mark.parametrize("num_reqs", [1, 6])
def test_batch_kinds(num_reqs: int, kinds: tuple[str, ...], seed: int) -> None:
    """Pure decode (no query padding), pure prefill, chunked prefill, one or many requests."""
    block_size = 16
    scenario = make_scenario(
        seed,
        block_size=block_size,
        head_size=32,
        group=int(np.random.default_rng(seed).choice([1, 2, 4, 8])),
        dtype=torch.float32,
        num_reqs=num_reqs,
        kinds=kinds,
    )
    backend = TorchBackend()
    cache = scenario.new_cache()
    write_context(scenario, cache, backend, np.random.default_rng(seed + 100))
    scale = 0.3  # any scale, not only 1/sqrt(D)
    out = run_step(scenario, cache, backend, scale, extra_columns=int(seed % 3))
    check_against_reference(scenario, out, scale)


@pytest.mark.parametrize("fill", [GARBAGE, math.nan, math.inf], ids=["big", "nan", "inf"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_other_requests_blocks_do_not_leak(block_size: int, fill: float) -> None:
    """A request's output is the same alone and batched with others holding garbage.

    Everything the request does not own (free blocks, other requests' blocks and the unwritten
    tail of its own last block) holds ``fill`` before the step; the other requests' blocks are
    additionally refilled with garbage after their tokens were written. Only the null block,
    which nothing ever writes, stays zero.
    """
    scenario = make_scenario(
        7 + block_size,
        block_size=block_size,
        head_size=16,
        group=2,
        dtype=torch.float32,
        num_reqs=5,
        kinds=("decode", "chunked", "prefill"),
    )
    scale = 0.25
    backend = TorchBackend()
    # The shortest request: its context is padded up to the batch's longest.
    target = min(range(5), key=lambda i: scenario.requests[i].seq_len)
    cache = torch.full(kv_cache_shape(scenario.num_blocks, block_size, scenario.num_kv_heads, 16), fill)
    write_context(scenario, cache, backend, np.random.default_rng(0))
    # Scribble over every block but the target's, after the context was written.
    own = set(scenario.requests[target].blocks)
    others = [b for b in range(scenario.num_blocks) if b not in own]
    cache[:, others] = fill
    # The null block is the one exception: zeroed at allocation and never written (the contract
    # that lets padded context positions read it).
    cache[:, NULL_BLOCK_ID] = 0
    batched = run_step(scenario, cache, backend, scale)
    start = sum(r.query_len for r in scenario.requests[:target])
    target_out = batched[start : start + scenario.requests[target].query_len]

    alone = Scenario(
        [scenario.requests[target]],
        block_size,
        scenario.num_blocks,
        scenario.num_heads,
        scenario.num_kv_heads,
        16,
        torch.float32,
    )
    assert torch.isfinite(target_out).all()
    check_against_reference(alone, target_out, scale)


def test_metadata_reused_across_layers() -> None:
    """One metadata (and its prepared state) serves every layer, each with its own cache."""
    scenario = make_scenario(3, block_size=16, head_size=32, group=4, dtype=torch.float32, num_reqs=4)
    backend = TorchBackend()
    scale = 32**-0.5
    rng = np.random.default_rng(3)
    caches = [scenario.new_cache() for _ in range(3)]
    table = scenario.block_table()
    requests = scenario.requests
    query_lens = np.array([r.query_len for r in requests])
    rows = np.repeat(np.arange(len(requests)), query_lens)
    positions = np.concatenate([np.arange(r.context_len, r.seq_len) for r in requests])
    metadata = build_attention_metadata(
        query_lens=query_lens,
        seq_lens=np.array([r.seq_len for r in requests]),
        block_table=table,
        slot_mapping=slot_mapping(table, rows, positions, 16),
        block_size=16,
        device=CPU,
    )
    backend.prepare(metadata)
    for layer, cache in enumerate(caches):
        # Fresh K/V/Q per layer, same lengths and blocks.
        layer_scenario = make_scenario(
            3, block_size=16, head_size=32, group=4, dtype=torch.float32, num_reqs=4
        )
        gen = torch.Generator().manual_seed(layer)
        for request in layer_scenario.requests:
            request.keys = torch.randn(request.keys.shape, generator=gen)
            request.values = torch.randn(request.values.shape, generator=gen)
            request.query = torch.randn(request.query.shape, generator=gen)
        write_context(layer_scenario, cache, backend, rng)
        keys = torch.cat([r.keys[r.context_len :] for r in layer_scenario.requests])
        values = torch.cat([r.values[r.context_len :] for r in layer_scenario.requests])
        query = torch.cat([r.query for r in layer_scenario.requests])
        backend.write_kv_cache(keys, values, cache, metadata)
        out = backend.attention(query, cache, metadata, scale)
        check_against_reference(layer_scenario, out, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_cache_lands_at_block_offset(dtype: torch.dtype) -> None:
    block_size, num_blocks, num_kv_heads, head_size = 4, 9, 2, 8
    sentinel = -7.0
    cache = torch.full(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), sentinel)
    cache = cache.to(dtype)
    # Two requests with non-contiguous blocks; request 0 has 2 cached tokens, request 1 none.
    block_table = np.array([[6, 2, NULL_BLOCK_ID], [3, 8, 5]], dtype=np.int32)
    query_lens = np.array([5, 9])
    seq_lens = np.array([7, 9])
    rows = np.repeat(np.arange(2), query_lens)
    positions = np.concatenate([np.arange(2, 7), np.arange(0, 9)])
    slots = slot_mapping(block_table, rows, positions, block_size)
    metadata = build_attention_metadata(query_lens, seq_lens, block_table, slots, block_size, CPU)
    num_tokens = int(query_lens.sum())
    # Distinct, exactly representable values per (token, head, dim); values differ from keys.
    base = torch.arange(num_tokens * num_kv_heads * head_size, dtype=torch.float32) % 251
    key = base.view(num_tokens, num_kv_heads, head_size).to(dtype)
    value = (base + 1000).view(num_tokens, num_kv_heads, head_size).to(dtype)
    TorchBackend().write_kv_cache(key, value, cache, metadata)

    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for token, (row, pos) in enumerate(zip(rows.tolist(), positions.tolist(), strict=True)):
        block, offset = int(block_table[row, pos // block_size]), pos % block_size
        assert slots[token] == block * block_size + offset
        assert torch.equal(cache[0, block, offset], key[token])
        assert torch.equal(cache[1, block, offset], value[token])
        written[block, offset] = True
    # Hand-checked corners: request 0 position 2 -> block 6 offset 2; position 4 -> block 2
    # offset 0; request 1 position 8 -> block 5 offset 0.
    assert torch.equal(cache[0, 6, 2], key[0])
    assert torch.equal(cache[0, 2, 0], key[2])
    assert torch.equal(cache[1, 5, 0], value[num_tokens - 1])
    # Nothing else was touched (the null block included).
    untouched = cache[:, ~written]
    assert (untouched == sentinel).all()
    assert not written[NULL_BLOCK_ID].any()


@pytest.mark.parametrize("seed", range(24))
def test_random_seeds(seed: int) -> None:
    """Everything drawn at random: block size, head size, GQA ratio, dtype, request mix."""
    rng = np.random.default_rng(1000 + seed)
    block_size = int(rng.choice([16, 128]))
    head_size = int(rng.choice([8, 64, 128]))
    dtype = torch.bfloat16 if rng.random() < 0.3 else torch.float32
    scenario = make_scenario(
        1000 + seed,
        block_size=block_size,
        head_size=head_size,
        group=int(rng.choice([1, 2, 4, 8])),
        dtype=dtype,
        max_blocks=int(rng.integers(1, 4)) if block_size == 128 else int(rng.integers(1, 9)),
    )
    backend = TorchBackend()
    cache = scenario.new_cache()
    write_context(scenario, cache, backend, rng)
    scale = head_size**-0.5
    out = run_step(scenario, cache, backend, scale, extra_columns=int(rng.integers(0, 3)))
    check_against_reference(scenario, out, scale)


def test_a_mixed_step_pads_its_decodes_apart_from_its_chunks() -> None:
    """Decodes next to prefill chunks form a batch of one query row each (no decode is padded to
    a chunk's length), and each longer query is attended on its own, over its own context (a
    prompt's first chunk, with none before it, by SDPA's causal kernel: no mask); a step of
    decodes alone is one batch."""
    mixed = make_scenario(
        5,
        block_size=16,
        head_size=32,
        group=2,
        dtype=torch.float32,
        num_reqs=8,
        kinds=("decode", "chunked", "prefill"),
    )
    backend = TorchBackend()
    cache = mixed.new_cache()
    write_context(mixed, cache, backend, np.random.default_rng(5))
    metadata = step_metadata(mixed)
    check_against_reference(mixed, run_step(mixed, cache, backend, 0.2, metadata=metadata), 0.2)
    query_lens, seq_lens = metadata.query_lens_host, metadata.seq_lens_host
    longer = [(q, s) for q, s in zip(query_lens, seq_lens, strict=True) if q > 1]
    assert 1 in query_lens and any(q < s for q, s in longer) and any(q == s for q, s in longer)
    (decodes,) = metadata.backend_state["batches"]  # one query row each: the decodes' own rows
    rows = np.cumsum([0, *query_lens])[:-1]
    assert decodes.token_rows.tolist() == [int(r) for r, q in zip(rows, query_lens, strict=True) if q == 1]
    chunks = metadata.backend_state["chunks"]
    assert [(c.num_rows, int(c.context_slots.shape[0])) for c in chunks] == longer
    assert [c.mask is None for c in chunks] == [q == s for q, s in longer]

    decode_only = make_scenario(
        5, block_size=16, head_size=32, group=2, dtype=torch.float32, num_reqs=6, kinds=("decode",)
    )
    metadata = step_metadata(decode_only)
    backend.prepare(metadata)
    assert [b.mask.shape[0] for b in metadata.backend_state["batches"]] == [6]
    assert metadata.backend_state["chunks"] == []
