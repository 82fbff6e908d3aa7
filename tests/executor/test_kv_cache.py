"""KV cache sizing and allocation: exact block arithmetic, refusals, bytes, the null block.

The budget divides into whole blocks; block 0 is the null block, so a budget must hold one
max-length sequence plus that block, or the executor refuses to start with a `ConfigError` that
names the budget, the need and the flags that fix it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.executor.config import ConfigError, ExecutorConfig, ModelConfig
from npuserve.executor.kv_cache import GIB, allocate_kv_caches, block_bytes, num_blocks_for_budget
from npuserve.executor.layers import TensorParallel
from npuserve.executor.model_runner import ModelRunner
from npuserve.kernels import NULL_BLOCK_ID
from npuserve.proto.step_plan import SamplingOptions

# stories260K: 5 layers, 4 kv heads, head_dim 8; keys and values; float32.
STORIES_BLOCK_BYTES = 2 * 16 * 4 * 8 * 5 * 4


@pytest.mark.parametrize(
    ("budget", "per_block", "block_size", "max_model_len", "expected"),
    [
        (1000, 100, 16, 32, 10),  # 10 blocks; one 32-token sequence needs 2 + the null block
        (300, 100, 16, 32, 3),  # exactly enough
        (399, 100, 16, 32, 3),  # a partial block is not a block
        (1000, 100, 16, 33, 10),  # 33 tokens need 3 blocks + the null block
        (400, 100, 16, 33, 4),
        (10 * GIB, 64 * 1024, 128, 4096, 163840),
    ],
)
def test_num_blocks_for_budget_is_exact(
    budget: int, per_block: int, block_size: int, max_model_len: int, expected: int
) -> None:
    """Blocks = budget // bytes per block, whenever that holds ceil(len / block) + 1 blocks."""
    assert num_blocks_for_budget(budget, per_block, block_size, max_model_len) == expected


@pytest.mark.parametrize(
    ("budget", "per_block", "block_size", "max_model_len"),
    [(299, 100, 16, 32), (399, 100, 16, 33), (0, 100, 16, 1), (-5, 100, 16, 1), (100, 100, 16, 1)],
)
def test_budget_below_one_sequence_is_refused(
    budget: int, per_block: int, block_size: int, max_model_len: int
) -> None:
    """One block short of a max-length sequence (plus the null block) is a ConfigError."""
    with pytest.raises(ConfigError):
        num_blocks_for_budget(budget, per_block, block_size, max_model_len)


def test_refusal_names_budget_need_and_flags() -> None:
    """The message says the budget, what it holds, what one sequence needs, and which flags fix it."""
    with pytest.raises(ConfigError) as info:
        num_blocks_for_budget(GIB, 64 << 20, 16, 512)
    message = str(info.value)
    assert "budget of 1.000 GiB holds 16 blocks of 16 tokens" in message
    assert "--max-model-len 512 needs 33 (2.062 GiB)" in message
    assert "raise --kv-cache-memory" in message
    assert "--gpu-memory-utilization" in message
    assert "lower --max-model-len" in message


def test_runner_with_tiny_budget_refuses_before_serving(stories_dir: Path) -> None:
    """A ModelRunner whose budget cannot hold one sequence fails in its constructor; lowering
    --max-model-len (the fix the message names) makes the same budget enough."""
    budget_gib = 20 * STORIES_BLOCK_BYTES / GIB  # 20 blocks: 512 tokens need 33, 256 need 17
    with pytest.raises(ConfigError, match="raise --kv-cache-memory") as info:
        ModelRunner(ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=budget_gib))
    assert "holds 20 blocks" in str(info.value) and "needs 33" in str(info.value)
    runner = ModelRunner(
        ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=budget_gib, max_model_len=256)
    )
    assert runner.num_blocks == 20


def test_block_bytes_formula(stories_dir: Path) -> None:
    """Bytes per block = 2 (k, v) * block_size * kv heads on this rank * head_dim * layers * itemsize."""
    config = ModelConfig.from_pretrained(stories_dir)
    assert block_bytes(config, 16, torch.float32, TensorParallel()) == STORIES_BLOCK_BYTES
    assert block_bytes(config, 128, torch.bfloat16, TensorParallel()) == STORIES_BLOCK_BYTES * 8 // 2
    assert block_bytes(config, 16, torch.float32, TensorParallel(rank=1, size=2)) == STORIES_BLOCK_BYTES // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocated_tensors_match_block_bytes(stories_dir: Path, dtype: torch.dtype) -> None:
    """The allocated caches take exactly num_blocks * block_bytes, in the kernel layout, zeroed."""
    config = ModelConfig.from_pretrained(stories_dir)
    tp = TensorParallel()
    caches = allocate_kv_caches(config, 7, 32, dtype, torch.device("cpu"), tp)
    assert len(caches) == config.num_layers
    assert sum(c.numel() * c.element_size() for c in caches) == 7 * block_bytes(config, 32, dtype, tp)
    for cache in caches:
        assert cache.shape == (2, 7, 32, config.num_kv_heads, config.head_dim)
        assert cache.dtype == dtype
        assert not cache.any()


def test_runner_caches_match_its_budget(stories_dir: Path) -> None:
    """A runner's caches hold num_blocks blocks whose bytes fit inside --kv-cache-memory."""
    runner = ModelRunner(ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=0.01))
    total = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert runner.num_blocks == int(0.01 * GIB) // STORIES_BLOCK_BYTES
    assert total == runner.num_blocks * STORIES_BLOCK_BYTES <= 0.01 * GIB
    assert total + STORIES_BLOCK_BYTES > 0.01 * GIB  # no whole block left unused


def test_null_block_stays_zero_while_serving(stories_dir: Path) -> None:
    """Caches start zeroed; serving writes the scheduler's blocks and never block 0."""
    runner = ModelRunner(ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=0.01))
    assert all(not cache.any() for cache in runner.kv_caches)
    requests = [
        DrivenRequest(f"r{i}", list(range(3, 3 + n)), 4, SamplingOptions(temperature=0))
        for i, n in enumerate([5, 20, 40])
    ]
    driver = StepDriver(runner, token_budget=16)
    driver.run(requests)
    used = sorted({b for r in requests for b in r.block_ids})
    assert NULL_BLOCK_ID not in used
    for cache in runner.kv_caches:
        assert not cache[:, NULL_BLOCK_ID].any()
        assert cache[:, used].abs().sum(dim=(0, 2, 3, 4)).gt(0).all()  # every used block written
        unused = [b for b in range(runner.num_blocks) if b not in used]
        assert not cache[:, unused].any()
