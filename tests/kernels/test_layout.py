"""KV cache layout arithmetic on hand-computed examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npuserve.kernels import (
    NPU_BLOCK_SIZE,
    NULL_BLOCK_ID,
    cdiv,
    kv_cache_block_bytes,
    kv_cache_shape,
    slot_mapping,
)


def test_constants() -> None:
    assert NULL_BLOCK_ID == 0
    assert NPU_BLOCK_SIZE == 128


def test_kv_cache_shape() -> None:
    assert kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    assert kv_cache_shape(1, 128, 1, 64) == (2, 1, 128, 1, 64)


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_size", "num_layers", "dtype_bytes", "expected"),
    [
        # Llama-3-8B in bf16: 128 KiB per token across 32 layers, 16 MiB per 128-token block.
        (128, 8, 128, 32, 2, 16 * 1024 * 1024),
        (16, 8, 128, 32, 2, 2 * 1024 * 1024),
        # Tiny: 2 (k, v) * 4 tokens * 1 head * 8 dims * 1 layer * 4 bytes.
        (4, 1, 8, 1, 4, 256),
        (16, 2, 64, 3, 1, 2 * 16 * 2 * 64 * 3),
    ],
)
def test_kv_cache_block_bytes(
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    num_layers: int,
    dtype_bytes: int,
    expected: int,
) -> None:
    assert kv_cache_block_bytes(block_size, num_kv_heads, head_size, num_layers, dtype_bytes) == (expected)


def test_kv_cache_block_bytes_matches_allocated_tensor() -> None:
    num_blocks, block_size, num_kv_heads, head_size, num_layers = 3, 16, 2, 8, 2
    per_block = kv_cache_block_bytes(block_size, num_kv_heads, head_size, num_layers, 2)
    caches = [
        torch.empty(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), dtype=torch.bfloat16)
        for _ in range(num_layers)
    ]
    total = sum(c.numel() * c.element_size() for c in caches)
    assert total == num_blocks * per_block


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (0, 4, 0),
        (1, 4, 1),
        (3, 4, 1),
        (4, 4, 1),
        (5, 4, 2),
        (8, 4, 2),
        (9, 4, 3),
        (127, 128, 1),
        (128, 128, 1),
        (129, 128, 2),
        (1, 1, 1),
        (7, 1, 7),
    ],
)
def test_cdiv(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected


def test_slot_mapping_hand_computed() -> None:
    block_table = np.array([[3, 7, 0], [5, 2, 9]], dtype=np.int32)
    token_rows = np.array([0, 0, 1, 1, 1, 1])
    positions = np.array([0, 5, 3, 4, 9, 11])
    slots = slot_mapping(block_table, token_rows, positions, block_size=4)
    # row 0 pos 0 -> block 3 off 0; row 0 pos 5 -> block 7 off 1; row 1 pos 3 -> block 5 off 3;
    # row 1 pos 4 -> block 2 off 0; row 1 pos 9 -> block 9 off 1; row 1 pos 11 -> block 9 off 3.
    assert slots.tolist() == [12, 29, 23, 8, 37, 39]
    assert slots.dtype == np.int32


def test_slot_mapping_block_size_128() -> None:
    block_table = np.array([[42, 17], [1, 300]], dtype=np.int32)
    token_rows = np.array([0, 0, 0, 1])
    positions = np.array([0, 127, 128, 255])
    slots = slot_mapping(block_table, token_rows, positions, block_size=128)
    assert slots.tolist() == [42 * 128, 42 * 128 + 127, 17 * 128, 300 * 128 + 127]


def test_slot_mapping_matches_cache_indexing() -> None:
    """A slot indexes the cache viewed as [num_blocks * block_size, ...] at (block, offset)."""
    block_size, num_blocks = 4, 6
    cache = torch.arange(2 * num_blocks * block_size).view(2, num_blocks, block_size, 1, 1)
    block_table = np.array([[4, 1, 5]], dtype=np.int32)
    positions = np.arange(10)
    slots = slot_mapping(block_table, np.zeros(10, dtype=np.int64), positions, block_size)
    flat = cache[0].view(-1)
    for pos, slot in zip(positions.tolist(), slots.tolist(), strict=True):
        block = int(block_table[0, pos // block_size])
        assert flat[slot] == cache[0, block, pos % block_size, 0, 0]
