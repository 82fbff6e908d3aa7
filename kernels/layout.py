"""KV cache layout and slot arithmetic, shared by every kernel backend.

A layer's cache is one tensor of shape ``(2, num_blocks, block_size, num_kv_heads, head_size)``:
index 0 holds keys, index 1 values. Token ``offset`` of block ``block_id`` lives in slot
``block_id * block_size + offset``. Block 0 is the scheduler's null block: it is allocated like
every other block, but never holds a request's tokens, so padded block-table entries may
point at it.
"""

from __future__ import annotations

import numpy as np

# NOTE: Ascend's paged-attention kernels take block_size 128: npu_fused_infer_attention_score's
# paged prefill needs a multiple of 128 (op-plugin docs, PageAttention约束) and vllm-ascend v0.13.0
# supports only 128 (AscendAttentionBackend.get_supported_block_size); smaller sizes are for CPU
# tests and the torch backend.
NPU_BLOCK_SIZE = 128
# NOTE: npu_fused_infer_attention_score in the TND layout without rope takes head_dim 128 (and
# 192 for Q/K only, which no served architecture uses); newer CANN also 64 (CANN operator docs,
# "npu_fused_infer_attention_score" constraints). Others fail at the first call (error 561002).
NPU_ATTENTION_HEAD_DIMS = (64, 128)


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def kv_cache_block_bytes(
    block_size: int, num_kv_heads: int, head_size: int, num_layers: int, dtype_bytes: int
) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    return 2 * block_size * num_kv_heads * head_size * num_layers * dtype_bytes


def slot_mapping(
    block_table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Cache slot of every token.

    block_table: [R, max_blocks] int32, token_rows: [T] row of each token, positions: [T].
    Returns [T] int32: ``block_table[row, pos // block_size] * block_size + pos % block_size``.
    """
    block_ids = block_table[token_rows, positions // block_size]
    return (block_ids * block_size + positions % block_size).astype(np.int32)
