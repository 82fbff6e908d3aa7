"""The torch_npu emulation: every documented refusal raises, and every operator matches a dense
reference written here (full matrices, no paging, no loops over requests)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npuserve.kernels.npu_emulation import ops
from npuserve.kernels.npu_emulation.contracts import OpContractError

BLOCK = 128
CAUSAL = torch.ones(2048, 2048, dtype=torch.bool).triu(1).to(torch.int8)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------------ attention


class PagedCase:
    """Requests with ``(query_len, kv_len)``; their keys and values live in shuffled blocks."""

    def __init__(self, lens: list[tuple[int, int]], heads: int, kv_heads: int, head_size: int) -> None:
        self.lens, self.heads, self.kv_heads, self.head_size = lens, heads, kv_heads, head_size
        blocks_per_req = [-(-kv // BLOCK) for _, kv in lens]
        order = torch.randperm(sum(blocks_per_req), generator=torch.Generator().manual_seed(0)) + 1
        self.block_table = torch.zeros(len(lens), max(blocks_per_req), dtype=torch.int32)
        start = 0
        for row, count in enumerate(blocks_per_req):
            self.block_table[row, :count] = order[start : start + count].to(torch.int32)
            start += count
        num_blocks = int(order.max()) + 1
        self.keys = [randn(kv, kv_heads, head_size, seed=10 + i) for i, (_, kv) in enumerate(lens)]
        self.values = [randn(kv, kv_heads, head_size, seed=20 + i) for i, (_, kv) in enumerate(lens)]
        self.query = randn(sum(q for q, _ in lens), heads, head_size, seed=3)
        cache = torch.zeros(2, num_blocks, BLOCK, kv_heads * head_size, dtype=torch.bfloat16)
        for row, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            for pos in range(k.shape[0]):
                block = int(self.block_table[row, pos // BLOCK])
                cache[0, block, pos % BLOCK] = k[pos].reshape(-1)
                cache[1, block, pos % BLOCK] = v[pos].reshape(-1)
        self.cache = cache

    def call(self, **overrides: object) -> torch.Tensor:
        ends = torch.tensor([q for q, _ in self.lens]).cumsum(0).tolist()
        kwargs: dict[str, object] = dict(
            atten_mask=CAUSAL,
            block_table=self.block_table,
            input_layout="TND",
            block_size=BLOCK,
            actual_seq_lengths=ends,
            actual_seq_lengths_kv=[kv for _, kv in self.lens],
            num_key_value_heads=self.kv_heads,
            num_heads=self.heads,
            scale=self.head_size**-0.5,
            sparse_mode=3,
        )
        kwargs.update(overrides)
        query = kwargs.pop("query", self.query)
        key, value = kwargs.pop("key", self.cache[0]), kwargs.pop("value", self.cache[1])
        out, _ = ops.fused_infer_attention_score(query, key, value, **kwargs)
        return out

    def dense_reference(self) -> torch.Tensor:
        """SDPA over each request's own keys with a bottom-right-aligned causal mask."""
        outs = []
        start = 0
        for (q_len, kv_len), k, v in zip(self.lens, self.keys, self.values, strict=True):
            q = self.query[start : start + q_len].float().transpose(0, 1)  # [H, q, D]
            group = self.heads // self.kv_heads
            kk = k.float().repeat_interleave(group, 1).transpose(0, 1)
            vv = v.float().repeat_interleave(group, 1).transpose(0, 1)
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
            outs.append(F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask).transpose(0, 1))
            start += q_len
        return torch.cat(outs).to(torch.bfloat16)


MIXED = [(1, 300), (40, 40), (20, 150), (1, 17)]


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_attention_matches_dense_reference(head_size: int, heads: int, kv_heads: int) -> None:
    case = PagedCase(MIXED, heads, kv_heads, head_size)
    torch.testing.assert_close(case.call().float(), case.dense_reference().float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(input_layout="BSH"), "input_layout"),
        (dict(sparse_mode=0), "sparse_mode"),
        (dict(atten_mask=None), "compressed atten_mask"),
        (dict(atten_mask=CAUSAL[:1024, :1024].contiguous()), "2048x2048"),
        (dict(atten_mask=torch.ones(2048, 2048, dtype=torch.int8).tril()), "triu"),
        (dict(atten_mask=CAUSAL.float()), "atten_mask dtype"),
        (dict(block_table=None), "paged"),
        (dict(actual_seq_lengths=[1, 40, 20, 1]), "cumulative"),  # per-request, not cumulative ends
        (dict(actual_seq_lengths=[1.0, 41.0, 61.0, 62.0]), "Python ints"),
        (dict(actual_seq_lengths_kv=[300, 40, 150]), "entries for batch"),
        (dict(actual_seq_lengths_kv=[300, 340, 490, 507]), "kv length"),  # cumulative kv: too long
        (dict(num_heads=16), "num_heads"),
        (dict(num_key_value_heads=3), "multiple"),
        (dict(block_size=64), "block_size"),
    ],
)
def test_attention_refusals(overrides: dict[str, object], message: str) -> None:
    case = PagedCase(MIXED, 8, 2, 128)
    with pytest.raises(OpContractError, match=message):
        case.call(**overrides)


def test_attention_refuses_dtypes_layouts_and_head_sizes() -> None:
    case = PagedCase(MIXED, 8, 2, 128)
    with pytest.raises(OpContractError, match="float16 or bfloat16"):
        case.call(query=case.query.float(), key=case.cache[0].float(), value=case.cache[1].float())
    with pytest.raises(OpContractError, match="contiguous"):
        case.call(query=case.query.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(OpContractError, match="int32"):
        case.call(block_table=case.block_table.long())
    for head_size in (8, 80, 96, 256):
        other = PagedCase([(2, 2)], 2, 2, head_size)
        with pytest.raises(OpContractError, match="head dim"):
            other.call()


def test_decode_may_use_a_smaller_block_but_prefill_may_not() -> None:
    # FIA PageAttention: Q_S = 1 takes any non-zero block_size <= 512; Q_S > 1 a multiple of 128.
    from npuserve.kernels.npu_emulation.contracts import _check_block_size

    _check_block_size(16, 1, "op")
    with pytest.raises(OpContractError, match="multiple of 128"):
        _check_block_size(16, 2, "op")
    with pytest.raises(OpContractError, match=r"1\.\.512"):
        _check_block_size(1024, 1, "op")


# ------------------------------------------------------------------------ cache write


def test_reshape_and_cache_writes_slots_and_skips_negative_ones() -> None:
    key, value = randn(5, 2, 64, seed=1), randn(5, 2, 64, seed=2)
    key_cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([0, 17, 63, -1, 35], dtype=torch.int32)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(-1, 2, 64), value_cache.view(-1, 2, 64)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 4


def test_reshape_and_cache_refusals() -> None:
    key = randn(3, 2, 64, seed=1)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    good = torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(OpContractError, match="int32"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), good.long())
    with pytest.raises(OpContractError, match="beyond"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([1, 2, 64], dtype=torch.int32))
    with pytest.raises(OpContractError, match="does not fit"):
        ops.reshape_and_cache(randn(3, 1, 64, seed=1), key, cache, cache.clone(), good)
    with pytest.raises(OpContractError, match="dtype"):
        ops.reshape_and_cache(key.half(), key.half(), cache, cache.clone(), good)


# ------------------------------------------------------------------------ norms, activation


def test_rms_norms_match_the_formula() -> None:
    x, residual, gamma = randn(7, 96, seed=1), randn(7, 96, seed=2), randn(96, seed=3)
    y, rstd = ops.rms_norm(x, gamma, 1e-5)
    reference = x.float() / (x.float().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * gamma.float()
    torch.testing.assert_close(y.float(), reference, rtol=1e-2, atol=1e-2)
    assert rstd.dtype == torch.float32 and rstd.shape == (7, 1) and y.dtype == x.dtype
    y2, _, summed = ops.add_rms_norm(x, residual, gamma, 1e-5)
    torch.testing.assert_close(summed, x + residual, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y2, ops.rms_norm(summed, gamma, 1e-5)[0], rtol=1e-2, atol=1e-2)


def test_norm_refusals() -> None:
    x, gamma = randn(7, 96, seed=1), randn(96, seed=3)
    with pytest.raises(OpContractError, match="2-8 dims"):
        ops.rms_norm(randn(96, seed=1), gamma)
    with pytest.raises(OpContractError, match="dtypes"):
        ops.rms_norm(x.float(), gamma)  # float32 input with a bfloat16 gamma
    with pytest.raises(OpContractError, match="trailing"):
        ops.rms_norm(x, randn(48, seed=3))
    with pytest.raises(OpContractError, match="gamma dtype"):
        ops.add_rms_norm(x, x, gamma.float())


def test_swiglu_is_silu_of_first_half_times_second() -> None:
    x = randn(5, 2 * 48, seed=4)
    reference = F.silu(x[:, :48].float()) * x[:, 48:].float()
    torch.testing.assert_close(ops.swiglu(x).float(), reference, rtol=1e-2, atol=1e-2)
    with pytest.raises(OpContractError, match="contiguous"):
        ops.swiglu(randn(96, 5, seed=4).t())
    with pytest.raises(OpContractError, match="not even"):
        ops.swiglu(randn(5, 7, seed=4))


# ------------------------------------------------------------------------ rotary embedding


def table(head_size: int, theta: float) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, head_size, 2).float() / head_size)
    freqs = torch.outer(torch.arange(512).float(), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def complex_rope(x: torch.Tensor, positions: torch.Tensor, head_size: int, theta: float) -> torch.Tensor:
    """Neox rope as a complex rotation of (x[:D/2], x[D/2:]) pairs."""
    heads = x.float().view(x.shape[0], -1, head_size)
    half = head_size // 2
    pairs = torch.complex(heads[..., :half], heads[..., half:])
    inv = 1.0 / theta ** (torch.arange(0, head_size, 2).float() / head_size)
    angle = torch.polar(torch.ones(len(positions), half), positions.float()[:, None] * inv)
    rotated = pairs * angle[:, None, :]
    return torch.cat((rotated.real, rotated.imag), dim=-1).view_as(x.float())


def test_rotary_matches_complex_rotation_and_keeps_its_first_table() -> None:
    rope = ops.RotaryEmbedding()
    positions = torch.tensor([0, 5, 511, 7])
    q, k = randn(4, 4 * 64, seed=1, dtype=torch.float32), randn(4, 2 * 64, seed=2, dtype=torch.float32)
    expected_q = complex_rope(q, positions, 64, 10000.0)
    rope(positions, q, k, 64, table(64, 10000.0), True)
    torch.testing.assert_close(q, expected_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        k, complex_rope(randn(4, 2 * 64, seed=2, dtype=torch.float32), positions, 64, 1e4)
    )
    # RopeAtb.cpp keeps the first table: a second, different one is ignored.
    q2 = randn(4, 4 * 64, seed=1, dtype=torch.float32)
    rope(positions, q2, randn(4, 2 * 64, seed=2, dtype=torch.float32), 64, table(64, 500.0), True)
    torch.testing.assert_close(q2, expected_q, rtol=1e-4, atol=1e-4)


def test_rotary_refusals() -> None:
    rope = ops.RotaryEmbedding()
    q, k = randn(4, 128, seed=1), randn(4, 128, seed=2)
    with pytest.raises(OpContractError, match="positions"):
        rope(torch.arange(4).float(), q, k, 64, table(64, 1e4), True)
    with pytest.raises(OpContractError, match="contiguous"):
        rope(torch.arange(4), randn(128, 4, seed=1).t(), k, 64, table(64, 1e4), True)
    with pytest.raises(OpContractError, match="one position per token"):
        rope(torch.arange(3), q, k, 64, table(64, 1e4), True)
