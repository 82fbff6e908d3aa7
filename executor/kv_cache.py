"""Sizing and allocating the paged KV cache from a memory budget."""

from __future__ import annotations

import torch

from npuserve.executor.config import ConfigError, ModelConfig
from npuserve.executor.layers import TensorParallel
from npuserve.kernels import cdiv, kv_cache_block_bytes, kv_cache_shape

GIB = 1 << 30
# NOTE: like vLLM's CPU default KV space; --kv-cache-memory sets it.
CPU_DEFAULT_KV_CACHE_GIB = 4


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, tp: TensorParallel) -> int:
    """Bytes one block of ``block_size`` tokens takes across all layers on this rank."""
    num_kv_heads = max(1, config.num_kv_heads // tp.size)
    return kv_cache_block_bytes(block_size, num_kv_heads, config.head_dim, config.num_layers, dtype.itemsize)


def num_blocks_for_budget(
    budget_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int
) -> int:
    """Blocks that fit the budget; refuses a budget that cannot hold one max-length sequence."""
    num_blocks = max(0, budget_bytes) // bytes_per_block
    # NOTE: block 0 is the null block and never holds tokens.
    needed = cdiv(max_model_len, block_size) + 1
    if num_blocks < needed:
        raise ConfigError(
            f"the KV cache budget of {budget_bytes / GIB:.3f} GiB holds {num_blocks} blocks of "
            f"{block_size} tokens, but one sequence of --max-model-len {max_model_len} needs "
            f"{needed} ({needed * bytes_per_block / GIB:.3f} GiB); raise --kv-cache-memory "
            "(or --gpu-memory-utilization on a device) or lower --max-model-len"
        )
    return num_blocks


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel,
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, Hkv, D]`` tensor per layer, zeroed."""
    num_kv_heads = max(1, config.num_kv_heads // tp.size)
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
