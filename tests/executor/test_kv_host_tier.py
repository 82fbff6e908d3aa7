"""The host-memory KV tier end to end on the CPU: the real `Scheduler` plans against the real
`ModelRunner` (stories260K) with a device pool far too small for the working set. Greedy
outputs equal those of serving without the tier (and without any prefix cache), while the tier
brings prefixes back, and preempted requests resume from it rather than from scratch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.kv_cache import GIB, block_bytes
from npuserve.executor.kv_host_tier import HostKvTier, consecutive_runs
from npuserve.executor.model_runner import ModelRunner
from npuserve.kernels.npu_emulation.host_memory import EmulatedHostMemory
from npuserve.kernels.staging import HostStaging
from npuserve.proto.plan_checks import PlanError
from npuserve.proto.step_plan import KV_TRANSFER_HOST_TIER, BlockCopy, StepPlan
from npuserve.scheduler.core.request import Request, SamplingParams
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.core.scheduler_config import SchedulerConfig

MAX_MODEL_LEN = 128
DEVICE_BLOCKS = 12  # 11 usable blocks of 16 tokens: a few requests' worth


def _runner(stories_dir: Path, host_blocks: int) -> ModelRunner:
    probe = ModelRunner(
        ExecutorConfig(str(stories_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_gib=0.001, warmup=False)
    )
    per_block = block_bytes(probe.model_config, probe.block_size, probe.dtype, probe.tp)
    config = ExecutorConfig(
        str(stories_dir),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        kv_cache_memory_gib=DEVICE_BLOCKS * per_block / GIB,
        kv_host_memory_gib=host_blocks * per_block / GIB,
        warmup=False,
    )
    return ModelRunner(config)


def _serve(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: int, caching: bool = True
) -> tuple[list[list[int]], Scheduler, int]:
    """Greedy outputs of every prompt (in waves of 4), the idle scheduler and the number of loads
    from the host tier (each step's timings count the bytes its copies moved)."""
    info = runner.info()
    scheduler = Scheduler(SchedulerConfig.for_executor(info, enable_prefix_caching=caching))
    requests = []
    num_loads = 0
    for wave in range(0, len(prompts), 4):
        for i, prompt in enumerate(prompts[wave : wave + 4]):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            request = Request(f"r{wave + i}", prompt, params=params, options=params.to_options(tuple(info.eos_token_ids)),
                              eos_token_ids=tuple(info.eos_token_ids), max_model_len=MAX_MODEL_LEN, block_size=info.block_size)  # fmt: skip
            requests.append(request)
            scheduler.add_request(request)
        while scheduler.has_work():
            plan, _ = scheduler.schedule()
            num_loads += sum(1 for copy in plan.block_copies if not copy.to_host)
            result = runner.execute(plan)
            copied = sum(t.num_bytes for t in result.timings.kv_transfers if t.kind == KV_TRANSFER_HOST_TIER)
            assert copied == len(plan.block_copies) * (runner.host_kv.block_bytes if runner.host_kv else 0)
            scheduler.update_from_output(plan, result)
            scheduler.check_integrity()
    scheduler.check_integrity(expect_idle=True)
    runner.execute(StepPlan(step_id=10**9, reset=True))  # NOTE: the next run starts on a clean executor
    return [list(r.output_token_ids) for r in requests], scheduler, num_loads


def _prompts(seed: int, num_prefixes: int, num_prompts: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 500) for _ in range(16 * rng.randint(2, 3))] for _ in range(num_prefixes)]
    return [
        rng.choice(prefixes) + [rng.randrange(5, 500) for _ in range(rng.randint(1, 12))]
        for _ in range(num_prompts)
    ]


@pytest.fixture(scope="module")
def tiered(stories_dir: Path) -> ModelRunner:
    return _runner(stories_dir, host_blocks=64)


@pytest.fixture(scope="module")
def untiered(stories_dir: Path) -> ModelRunner:
    return _runner(stories_dir, host_blocks=0)


def test_prefixes_come_back_from_the_host_tier_with_the_same_outputs(
    tiered: ModelRunner, untiered: ModelRunner
) -> None:
    prompts = _prompts(1, num_prefixes=10, num_prompts=24)
    assert tiered.info().num_host_blocks == 64 and untiered.info().num_host_blocks == 0
    reference, _, _ = _serve(untiered, prompts, max_tokens=4, caching=False)
    without, plain, _ = _serve(untiered, prompts, max_tokens=4)
    with_tier, tier, num_loads = _serve(tiered, prompts, max_tokens=4)
    assert with_tier == without == reference
    assert num_loads > 0
    assert tier.kv.stats.hits >= 2 * plain.kv.stats.hits


def test_preempted_requests_resume_from_the_host_tier_with_the_same_outputs(
    tiered: ModelRunner, untiered: ModelRunner
) -> None:
    """Four requests that outgrow the device pool together: the newest is preempted, its full
    blocks stay cached, spill to the host tier as the others take the pool, and load back when
    it resumes; recompute (no tier) gives the same tokens."""
    prompts = _prompts(2, num_prefixes=4, num_prompts=4)
    recomputed, plain, _ = _serve(untiered, prompts, max_tokens=40)
    swapped, tier, num_loads = _serve(tiered, prompts, max_tokens=40)
    assert swapped == recomputed
    assert tier.total_preemptions > 0 and plain.total_preemptions > 0
    assert num_loads > 0 and tier.kv.stats.hits > plain.kv.stats.hits


def test_a_copy_outside_the_tier_is_refused_before_any_copy(tiered: ModelRunner) -> None:
    with pytest.raises(PlanError, match="host block"):
        tiered.execute(
            StepPlan(step_id=10**9 + 1, block_copies=[BlockCopy(True, 1, 0), BlockCopy(True, 1, 64)])
        )


def test_on_a_device_the_copies_are_batched_through_pinned_memory_and_round_trip() -> None:
    """On the emulated NPU's host memory (which refuses a non-blocking copy to or from pageable
    memory): the host blocks are pinned, each run of consecutive host blocks is one copy per
    layer, and blocks spilled then loaded into other device blocks come back equal."""
    memory = EmulatedHostMemory()
    staging = HostStaging(memory, torch.device("cpu"))
    caches = [torch.randn(2, 10, 4, 2, 8) for _ in range(3)]  # [2, N, bs, Hkv, D] per layer
    tier = HostKvTier(caches, num_blocks=6, staging=staging)
    assert all(memory.is_pinned(layer) for layer in tier.layers)
    spilled = [caches[i][:, [1, 2, 7]].clone() for i in range(3)]
    # host blocks 0, 1 (one run) and 4: two copies per layer
    tier.run([BlockCopy(True, 1, 0), BlockCopy(True, 2, 1), BlockCopy(True, 7, 4)], caches, 10)
    assert memory.num_copies_to_host == 2 * len(caches)
    tier.run([BlockCopy(False, 0, 3), BlockCopy(False, 1, 4), BlockCopy(False, 4, 9)], caches, 10)
    assert memory.num_copies == 2 * len(caches) + 2  # two runs per layer, and the two staged indices
    for cache, before in zip(caches, spilled, strict=True):
        assert torch.equal(cache[:, [3, 4, 9]], before)
    assert tier.tally.take().num_bytes == 6 * tier.block_bytes


def test_consecutive_runs() -> None:
    assert list(consecutive_runs([4, 5, 6, 0, 2, 3])) == [(0, 4, 3), (3, 0, 1), (4, 2, 2)]
    assert list(consecutive_runs([])) == []
