"""Warm-up: the steps it plans, and that it leaves the runner as it found it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.warmup import (
    CPU_MAX_PREFILL_TOKENS,
    decode_batch_sizes,
    largest_prefill,
    warm_up,
    warmup_steps,
)
from npuserve.kernels import NULL_BLOCK_ID
from npuserve.proto.step_plan import EMULATED_NPU_DEVICE, ExecutorInfo, SamplingOptions, StepPlan, StepResult

PROMPT = [1, 403, 407, 261, 378]


def info(device: str = "npu:0", **overrides: int) -> ExecutorInfo:
    fields = {
        "block_size": 16,
        "num_blocks": 100,
        "max_model_len": 512,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
    }
    fields.update(overrides)
    return ExecutorInfo(
        model="m",
        architecture="LlamaForCausalLM",
        vocab_size=512,
        eos_token_ids=[2],
        dtype="bfloat16",
        device=device,
        **fields,
    )


def test_the_largest_prefill_is_bounded_by_tokens_sequences_and_blocks() -> None:
    assert largest_prefill(info(num_blocks=1000)) == [512, 512, 512, 512]
    assert largest_prefill(info()) == [512, 512, 512, 48]  # 99 blocks of 16 tokens
    assert largest_prefill(info(max_num_seqs=2, num_blocks=1000)) == [512, 512]
    assert sum(largest_prefill(info(max_num_batched_tokens=100, num_blocks=1000))) == 100


def test_decode_batch_sizes_double_up_to_max_num_seqs() -> None:
    assert decode_batch_sizes(8, 99) == [1, 2, 4, 8]
    assert decode_batch_sizes(256, 10_000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert decode_batch_sizes(12, 99) == [1, 2, 4, 8, 12]
    assert decode_batch_sizes(256, 5) == [1, 2, 4, 5]  # one block per request


def test_warmup_work_grows_with_the_log_of_max_num_seqs() -> None:
    steps = warmup_steps(info(max_num_seqs=256, num_blocks=100_000, max_num_batched_tokens=8192))
    assert len(steps) == 1 + 9
    assert sum(r.num_scheduled for r in steps[0]) == 8192
    assert [sum(r.num_scheduled for r in s) for s in steps[1:]] == [1, 2, 4, 8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("device", ["cpu", EMULATED_NPU_DEVICE])
def test_cpu_warmup_is_small(device: str) -> None:
    """An emulated NPU computes on the CPU too: nothing to compile, so the same small warm-up."""
    steps = warmup_steps(info(device, max_num_seqs=256, num_blocks=100_000, max_num_batched_tokens=8192))
    assert sum(r.num_scheduled for r in steps[0]) == CPU_MAX_PREFILL_TOKENS
    assert [len(s) for s in steps[1:]] == [1, 256]


class Recorder:
    """A runner that records the plans warm-up sends (and checks them the way the runner does)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.plans: list[StepPlan] = []

    def info(self) -> ExecutorInfo:
        return self.runner.info()

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        return self.runner.execute(plan)


def greedy_tokens(runner: ModelRunner) -> list[int]:
    driver = StepDriver(runner)
    request = DrivenRequest("r", PROMPT, 12, SamplingOptions(temperature=0))
    driver.run([request])
    return request.output


def test_warmup_leaves_no_request_no_null_block_write_and_the_same_outputs(stories_dir: Path) -> None:
    config = ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=0.01, max_num_seqs=16)
    warmed = ModelRunner(config)
    recorder = Recorder(warmed)
    warm_up(recorder)
    assert all(p.step_id < 0 for p in recorder.plans)  # schedulers number from >= 0
    assert recorder.plans[-1].num_scheduled_tokens == {}  # the last plan only drops requests
    assert warmed.batch.num_reqs == 0
    assert all(not torch.any(cache[:, NULL_BLOCK_ID]) for cache in warmed.kv_caches)
    used = {b for p in recorder.plans for r in p.new_requests for b in r.block_ids}
    assert min(used) == 1 and max(used) < warmed.num_blocks
    # Unseeded sampling draws from the runner's seed source: warm-up must leave it alone.
    unseeded = [DrivenRequest("u", PROMPT, 8, SamplingOptions(temperature=1.0))]
    fresh = [DrivenRequest("u", PROMPT, 8, SamplingOptions(temperature=1.0))]
    StepDriver(warmed).run(unseeded)
    StepDriver(ModelRunner(config)).run(fresh)
    assert unseeded[0].output == fresh[0].output
    assert greedy_tokens(warmed) == greedy_tokens(ModelRunner(config))
