"""Finding the KV cache budget on a device: run the largest step the executor will ever run,
measure its peak memory, and give the KV cache what is left of the allowed fraction."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from npuserve.executor.kv_cache import GIB, allocate_kv_caches
from npuserve.executor.platform import (
    device_memory,
    empty_cache,
    peak_memory_allocated,
    reset_peak_memory,
    synchronize,
)
from npuserve.kernels import build_attention_metadata, cdiv, slot_mapping

if TYPE_CHECKING:
    from npuserve.executor.model_runner import ModelRunner

log = structlog.get_logger(__name__)


@torch.inference_mode()
def profile_kv_budget(runner: ModelRunner) -> int:
    """Bytes the KV cache may take: ``utilization * total - (in use after the run + activations)``.

    NOTE: device memory is read after the profiling run, as vllm-ascend's worker does
    (``determine_available_memory``): the first forward makes allocations outside torch's
    allocator (operator workspaces, ATB and HCCL buffers) that a reading taken before it misses.
    """
    target, device, config = runner.target, runner.device, runner.config
    synchronize(target)
    empty_cache(target)
    reset_peak_memory(target)
    allocated_before = peak_memory_allocated(target)  # the weights, after the reset

    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * runner.max_model_len)
    # As few sequences of at most max_model_len tokens as hold num_tokens.
    full, rest = divmod(num_tokens, runner.max_model_len)
    query_lens = np.array([runner.max_model_len] * full + ([rest] if rest else []), dtype=np.int32)  # [B]
    block_size = runner.block_size
    blocks_per_req = cdiv(int(query_lens.max()), block_size)
    num_blocks = 1 + len(query_lens) * blocks_per_req
    kv_caches = allocate_kv_caches(
        runner.model_config, num_blocks, block_size, runner.dtype, device, runner.tp
    )
    block_table = 1 + np.arange(len(query_lens) * blocks_per_req, dtype=np.int32).reshape(
        len(query_lens), blocks_per_req
    )
    token_rows = np.repeat(np.arange(len(query_lens)), query_lens)
    query_ends = np.cumsum(query_lens)
    positions = np.arange(num_tokens) - np.repeat(query_ends - query_lens, query_lens)
    metadata = build_attention_metadata(
        query_lens,
        query_lens,
        block_table,
        slot_mapping(block_table, token_rows, positions, block_size),
        block_size,
        device,
    )
    runner.backend.prepare(metadata)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = runner.model(input_ids, torch.from_numpy(positions).to(device), kv_caches, metadata)
    # Logits for as many rows as a step can sample, in float32 as the sampler sees them.
    rows = min(config.max_num_seqs, num_tokens)
    runner.model.compute_logits(hidden[:rows]).float().softmax(dim=-1)
    synchronize(target)
    activation_peak = peak_memory_allocated(target) - allocated_before
    del kv_caches, hidden
    empty_cache(target)
    free_after, total = device_memory(target)
    # Weights, other processes, the runtime, and what the run allocated outside torch.
    in_use = total - free_after

    budget = int(total * config.gpu_memory_utilization) - in_use - activation_peak
    log.info(
        "memory profiled",
        total_gib=round(total / GIB, 2),
        in_use_gib=round(in_use / GIB, 2),
        activation_peak_gib=round(activation_peak / GIB, 2),
        kv_budget_gib=round(budget / GIB, 2),
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    return budget
