"""The NPU backend: the host-side metadata it hands to torch_npu (CPU), and its operators (NPU).

The metadata tests build steps the way an executor does (a persistent block table padded with
the null block, `slot_mapping`, `build_attention_metadata`) and check every value the Ascend
operators read: int32 block table and slot mapping, cumulative query ends, kv lengths as host
ints. The operator tests compare `NpuBackend` with `TorchBackend`: on an Ascend device when
there is one, otherwise on the CPU emulation of torch_npu (`npuserve.kernels.npu_emulation`),
which checks every argument the way the operators' documentation states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from npuserve.kernels import (
    NULL_BLOCK_ID,
    AttentionMetadata,
    build_attention_metadata,
    cdiv,
    slot_mapping,
)
from npuserve.kernels.backends.base import KernelBackend
from npuserve.kernels.backends.torch_backend import TorchBackend
from npuserve.kernels.rope import RopeScaling, cos_sin_cache

MAX_BLOCKS_PER_REQ = 40  # columns of the executor's persistent table, more than any step needs


@dataclass
class Step:
    """One request's part of a step: ``query_len`` new tokens ending a ``seq_len`` sequence."""

    query_len: int
    seq_len: int


# Decode, prefill with no cache, prefix-cache hit (or a later chunk), decode.
MIXED = [Step(1, 300), Step(40, 40), Step(20, 150), Step(1, 17)]


def assign_blocks(steps: list[Step], block_size: int, seed: int = 0) -> list[list[int]]:
    """Distinct, shuffled (so non-contiguous) block ids per request, never the null block."""
    needed = [cdiv(step.seq_len, block_size) for step in steps]
    pool = np.random.default_rng(seed).permutation(np.arange(1, 4 * sum(needed) + 1))
    ends = np.cumsum(needed)
    return [pool[end - n : end].tolist() for n, end in zip(needed, ends, strict=True)]


def persistent_table(block_ids: list[list[int]]) -> np.ndarray:
    table = np.full((len(block_ids), MAX_BLOCKS_PER_REQ), NULL_BLOCK_ID, dtype=np.int32)
    for row, ids in enumerate(block_ids):
        table[row, : len(ids)] = ids
    return table


def build_step(
    steps: list[Step], block_ids: list[list[int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    query_lens = np.array([s.query_len for s in steps], dtype=np.int32)
    seq_lens = np.array([s.seq_len for s in steps], dtype=np.int32)
    table = persistent_table(block_ids)
    token_rows = np.repeat(np.arange(len(steps)), query_lens)
    positions = np.concatenate([np.arange(s.seq_len - s.query_len, s.seq_len) for s in steps])
    slots = slot_mapping(table, token_rows, positions, block_size)
    return build_attention_metadata(query_lens, seq_lens, table, slots, block_size, device)


def expected_slots(steps: list[Step], block_ids: list[list[int]], block_size: int) -> list[int]:
    return [
        ids[pos // block_size] * block_size + pos % block_size
        for step, ids in zip(steps, block_ids, strict=True)
        for pos in range(step.seq_len - step.query_len, step.seq_len)
    ]


# --------------------------------------------------------------------------------------------
# Host-side metadata (CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [128, 16])
def test_block_table_is_int32_and_padded_with_the_null_block(block_size: int) -> None:
    block_ids = assign_blocks(MIXED, block_size)
    md = build_step(MIXED, block_ids, block_size, torch.device("cpu"))

    num_columns = cdiv(300, block_size)  # the longest sequence's blocks, no more
    assert md.block_table.dtype == torch.int32
    assert md.block_table.shape == (len(MIXED), num_columns)
    for row, ids in enumerate(block_ids):
        expected = ids + [NULL_BLOCK_ID] * (num_columns - len(ids))
        assert md.block_table[row].tolist() == expected
    assert md.block_size == block_size


@pytest.mark.parametrize("block_size", [128, 16])
def test_slot_mapping_is_int32_block_id_times_block_size_plus_offset(block_size: int) -> None:
    block_ids = assign_blocks(MIXED, block_size, seed=1)
    md = build_step(MIXED, block_ids, block_size, torch.device("cpu"))

    assert md.slot_mapping.dtype == torch.int32
    assert md.slot_mapping.shape == (sum(s.query_len for s in MIXED),)
    assert md.slot_mapping.tolist() == expected_slots(MIXED, block_ids, block_size)


@pytest.mark.parametrize("block_size", [128, 16])
def test_lengths_for_the_tnd_layout(block_size: int) -> None:
    md = build_step(MIXED, assign_blocks(MIXED, block_size), block_size, torch.device("cpu"))

    # actual_seq_lengths: cumulative query ends; actual_seq_lengths_kv: per-request kv lengths.
    assert md.query_ends_host == [1, 41, 61, 62]
    assert md.seq_lens_host == [300, 40, 150, 17]
    assert md.query_lens_host == [1, 40, 20, 1]
    # torch_npu parses them as int lists: numpy scalars would not do.
    assert all(type(n) is int for n in md.query_ends_host + md.seq_lens_host)
    assert md.query_start_loc.dtype == torch.int32
    assert md.query_start_loc.tolist() == [0, 1, 41, 61, 62]
    assert md.seq_lens.dtype == torch.int32
    assert md.seq_lens.tolist() == md.seq_lens_host
    assert (md.num_reqs, md.num_tokens, md.max_query_len, md.max_seq_len) == (4, 62, 40, 300)
    assert not md.is_decode_only


def test_decode_only_step() -> None:
    steps = [Step(1, 129), Step(1, 1), Step(1, 256)]
    block_ids = assign_blocks(steps, 128, seed=2)
    md = build_step(steps, block_ids, 128, torch.device("cpu"))

    assert md.is_decode_only
    assert md.query_ends_host == [1, 2, 3]
    assert md.seq_lens_host == [129, 1, 256]
    assert md.block_table.shape == (3, 2)
    assert md.block_table[1].tolist() == [block_ids[1][0], NULL_BLOCK_ID]
    # The new token of a 129-token sequence is the first token of its second block.
    assert md.slot_mapping.tolist()[0] == block_ids[0][1] * 128
    assert md.slot_mapping.tolist() == expected_slots(steps, block_ids, 128)


# --------------------------------------------------------------------------------------------
# Operators (NPU only)
# --------------------------------------------------------------------------------------------

HEAD_SIZE = 128
# NOTE: the ATB rotary kernel keeps the first cos/sin table it sees for the whole process, so
# every rotary test here uses this one table, in one dtype.
ROPE_TABLE = cos_sin_cache(4096, HEAD_SIZE, 10000.0, RopeScaling())


def _real_npu_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


@pytest.fixture
def npu(request: pytest.FixtureRequest) -> torch.device:
    """An Ascend device, or (without one) the CPU under the torch_npu emulation."""
    if _real_npu_available():
        return torch.device("npu")
    request.getfixturevalue("emulated_npu")
    from npuserve.executor.platform import resolve_target

    return resolve_target("npu").device


def _backends() -> tuple[KernelBackend, TorchBackend]:
    from npuserve.kernels.backends.npu_backend import NpuBackend

    return NpuBackend(), TorchBackend()


def _random(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (8, 2)])
def test_cache_write_and_attention_match_torch(
    npu: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int
) -> None:
    npu_backend, torch_backend = _backends()
    block_size = 128
    block_ids = assign_blocks(MIXED, block_size, seed=3)
    num_blocks = max(max(ids) for ids in block_ids) + 1
    shape = (2, num_blocks, block_size, num_kv_heads, HEAD_SIZE)
    # Earlier context of every request, already in the cache.
    cache = _random(*shape, dtype=dtype, device=npu, seed=4)
    md = build_step(MIXED, block_ids, block_size, npu)
    query = _random(md.num_tokens, num_heads, HEAD_SIZE, dtype=dtype, device=npu, seed=5)
    key = _random(md.num_tokens, num_kv_heads, HEAD_SIZE, dtype=dtype, device=npu, seed=6)
    value = _random(md.num_tokens, num_kv_heads, HEAD_SIZE, dtype=dtype, device=npu, seed=7)

    npu_cache, torch_cache = cache.clone(), cache.clone()
    npu_backend.write_kv_cache(key, value, npu_cache, md)
    torch_backend.write_kv_cache(key, value, torch_cache, md)
    torch.testing.assert_close(npu_cache, torch_cache, rtol=0, atol=0)

    scale = HEAD_SIZE**-0.5
    npu_out = npu_backend.attention(query, npu_cache, md, scale)
    torch_out = torch_backend.attention(query, torch_cache, md, scale)
    assert npu_out.shape == (md.num_tokens, num_heads, HEAD_SIZE)
    torch.testing.assert_close(npu_out.float(), torch_out.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_and_activation_match_torch(npu: torch.device, dtype: torch.dtype) -> None:
    npu_backend, torch_backend = _backends()
    x = _random(33, 256, dtype=dtype, device=npu, seed=8)
    residual = _random(33, 256, dtype=dtype, device=npu, seed=9)
    weight = _random(256, dtype=dtype, device=npu, seed=10)
    tol = {"rtol": 2e-2, "atol": 2e-2}

    torch.testing.assert_close(
        npu_backend.rms_norm(x, weight, 1e-6), torch_backend.rms_norm(x, weight, 1e-6), **tol
    )
    npu_normed, npu_sum = npu_backend.add_rms_norm(x, residual, weight, 1e-6)
    torch_normed, torch_sum = torch_backend.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(npu_sum, torch_sum, **tol)
    torch.testing.assert_close(npu_normed, torch_normed, **tol)

    gate_up = _random(33, 2 * 96, dtype=dtype, device=npu, seed=11)
    torch.testing.assert_close(npu_backend.silu_and_mul(gate_up), torch_backend.silu_and_mul(gate_up), **tol)


def test_rotary_embedding_matches_torch(npu: torch.device) -> None:
    npu_backend, torch_backend = _backends()
    dtype = torch.bfloat16
    positions = torch.tensor([0, 1, 2, 300, 4095, 17], device=npu)
    query = _random(6, 4 * HEAD_SIZE, dtype=dtype, device=npu, seed=12)
    key = _random(6, 2 * HEAD_SIZE, dtype=dtype, device=npu, seed=13)
    table = ROPE_TABLE.to(npu)

    npu_q, npu_k = npu_backend.rotary_embedding(positions, query.clone(), key.clone(), HEAD_SIZE, table)
    torch_q, torch_k = torch_backend.rotary_embedding(positions, query, key, HEAD_SIZE, table.to(dtype))
    torch.testing.assert_close(npu_q, torch_q, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(npu_k, torch_k, rtol=2e-2, atol=2e-2)
