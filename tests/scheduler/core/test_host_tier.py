"""The host-memory KV tier as the scheduler plans it: evicted prefix-cache blocks spill to host
blocks, host hits load back into fresh device blocks, and every copy is planned so that a shadow
of both tiers, replayed plan by plan, holds exactly the tokens each request's computed prefix
claims. Failed steps forget what their copies would have stored."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from npuserve.executor.simulated import LatencyModel, SimulatedConfig, SimulatedRunner
from npuserve.proto.step_plan import BlockCopy, StepPlan
from npuserve.scheduler.core.block_hash import hash_block_tokens
from npuserve.scheduler.core.host_tier import HostTier
from npuserve.scheduler.core.request import Request, SamplingParams
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.core.scheduler_config import SchedulerConfig

EOS = 2
BLOCK = 4


def test_the_host_tier_drops_its_least_recently_used_unpinned_block() -> None:
    tier = HostTier(2)
    a, b, c = (hash_block_tokens(None, [i] * BLOCK) for i in range(3))
    assert tier.store(a) == (0, None) and tier.store(b) == (1, None)
    assert tier.store(c) == (None, None), "both blocks are pinned by the plan being built"
    tier.unpin()
    assert tier.lookup(a) == 0  # a is now the most recently used, and pinned
    assert tier.store(c) == (1, b)
    tier.unpin()
    assert tier.store(a) == (None, None) and a in tier  # already held: no copy
    assert tier.drop(1) == c and c not in tier
    tier.check_integrity()


@dataclass
class _Shadow:
    """What each block of both tiers holds, replayed from the plans: a token id per slot."""

    block_size: int
    device: dict[int, list[int | None]] = field(default_factory=dict)
    host: dict[int, list[int | None]] = field(default_factory=dict)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    num_loads: int = 0
    num_spills: int = 0

    def apply(self, plan: StepPlan, scheduler: Scheduler) -> None:
        for copy in plan.block_copies:
            if copy.to_host:
                self.host[copy.dst] = list(self.device[copy.src])
                self.num_spills += 1
            else:
                self.device[copy.dst] = list(self.host[copy.src])
                self.num_loads += 1
        bs = self.block_size
        for new in plan.new_requests:
            self.blocks[new.req_id] = list(new.block_ids)
        for cached in plan.cached_requests:
            self.blocks[cached.req_id] += cached.new_block_ids
        for req_id, num in plan.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            tokens, start = request.all_token_ids, request.num_computed_tokens - num
            for pos in range(start, start + num):
                slots = self.device.setdefault(self.blocks[req_id][pos // bs], [None] * bs)
                slots[pos % bs] = tokens[pos]
        # NOTE: after the step's writes: a request may hit blocks another of the same step computes.
        for new in plan.new_requests:
            for i in range(new.num_computed_tokens // bs):
                held = self.device.get(new.block_ids[i])
                assert held == new.token_ids[i * bs : (i + 1) * bs], (
                    f"{new.req_id}: block {i} is not its prefix"
                )


def _request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(
        req_id,
        prompt,
        params=params,
        options=params.to_options((EOS,)),
        eos_token_ids=(EOS,),
        max_model_len=256,
        block_size=BLOCK,
    )


def _prompts(rng: random.Random) -> list[list[int]]:
    """Prompts over 12 shared prefixes (3-6 blocks each: about twice the device pool), each with a
    tail of its own."""
    prefixes = [[rng.randrange(5, 500) for _ in range(BLOCK * rng.randint(3, 6))] for _ in range(12)]
    return [
        rng.choice(prefixes) + [rng.randrange(5, 500) for _ in range(rng.randint(1, 9))] for _ in range(40)
    ]


def _serve(prompts: list[list[int]], num_host_blocks: int, num_blocks: int = 24) -> tuple[Scheduler, _Shadow]:
    """Runs every prompt in waves of 4 against a simulated executor, each plan replayed on the
    shadow first; returns the scheduler (idle) and the shadow."""
    config = SchedulerConfig(
        num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=4, num_host_blocks=num_host_blocks
    )
    scheduler = Scheduler(config)
    runner = SimulatedRunner(
        SimulatedConfig(
            latency=LatencyModel(0.0, 0.0, 0.0),
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_model_len=256,
            num_host_blocks=num_host_blocks,
            eos_token_ids=(EOS,),
        )
    )
    shadow = _Shadow(BLOCK)
    for wave in range(0, len(prompts), 4):
        for i, prompt in enumerate(prompts[wave : wave + 4]):
            scheduler.add_request(_request(f"r{wave + i}", prompt, max_tokens=3))
        while scheduler.has_work():
            plan, _ = scheduler.schedule()
            shadow.apply(plan, scheduler)
            scheduler.update_from_output(plan, runner.execute(plan))
            scheduler.check_integrity()
    scheduler.check_integrity(expect_idle=True)
    assert runner.num_block_copies == shadow.num_loads + shadow.num_spills
    return scheduler, shadow


def test_every_planned_copy_brings_back_the_prefix_it_claims() -> None:
    prompts = _prompts(random.Random(7))
    _, shadow = _serve(prompts, num_host_blocks=96)
    assert shadow.num_spills > 0 and shadow.num_loads > 0


def test_a_host_tier_at_least_doubles_the_prefix_hits_of_a_pool_too_small_for_the_working_set() -> None:
    prompts = _prompts(random.Random(11))
    without, _ = _serve(prompts, num_host_blocks=0)
    with_tier, shadow = _serve(prompts, num_host_blocks=96)
    assert shadow.num_loads > 0
    assert with_tier.kv.stats.hits >= 2 * without.kv.stats.hits > 0


def test_a_tier_too_small_for_one_step_spills_what_it_can_and_stays_consistent() -> None:
    prompts = _prompts(random.Random(3))
    _, shadow = _serve(prompts, num_host_blocks=2)
    assert shadow.num_spills > 0


def test_a_failed_step_forgets_what_its_spills_would_have_stored() -> None:
    config = SchedulerConfig(num_blocks=6, block_size=BLOCK, num_host_blocks=8)
    scheduler = Scheduler(config)
    first = _request("a", list(range(10, 10 + 2 * BLOCK + 1)), max_tokens=1)
    scheduler.add_request(first)
    plan, _ = scheduler.schedule()
    runner = SimulatedRunner(
        SimulatedConfig(
            num_blocks=6, block_size=BLOCK, num_host_blocks=8, latency=LatencyModel(0.0, 0.0, 0.0)
        )
    )
    scheduler.update_from_output(plan, runner.execute(plan))  # "a" ends; its 2 full blocks stay cached
    scheduler.add_request(_request("b", list(range(100, 100 + 4 * BLOCK + 1)), max_tokens=1))
    plan, _ = scheduler.schedule()
    spills = [c for c in plan.block_copies if c.to_host]
    assert spills and all(isinstance(c, BlockCopy) for c in spills)
    assert all(scheduler.kv.pool.in_host_tier(h) for h in first.block_hashes[:2])
    scheduler.fail_step(plan)
    assert not any(scheduler.kv.pool.in_host_tier(h) for h in first.block_hashes[:2])
    scheduler.check_integrity()
