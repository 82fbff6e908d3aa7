"""Placing requests on executors: the cost of a lane (prefill blocks, weighted, plus blocks in
use), ties, the least-load policy, and prefix-aware routing through the engine landing a request
on the executor that holds its prefix."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from harness.simulated_engine import SMALL, generate, simulated_engine

from npuserve.executor.simulated import SimulatedRunner
from npuserve.scheduler.core.request import Request, RequestStatus, SamplingParams
from npuserve.scheduler.core.router import cached_prefix, choose_lane, lane_load_blocks
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.core.scheduler_config import SchedulerConfig
from npuserve.scheduler.engine.engine_config import EngineConfig
from npuserve.scheduler.lanes.async_lane import ExecutorLane, always_room
from npuserve.scheduler.lanes.in_process_client import InProcessClient
from npuserve.scheduler.text.tokenizer import Tokenizer

BLOCK = SMALL.block_size


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 3 for i in range(n)]


def make_request(req_id: str, prompt: list[int]) -> Request:
    params = SamplingParams(max_tokens=4)
    return Request(
        req_id,
        prompt,
        params=params,
        options=params.to_options(SMALL.eos_token_ids),
        eos_token_ids=SMALL.eos_token_ids,
        max_model_len=SMALL.max_model_len,
        block_size=BLOCK,
    )


def idle_lane(name: str, num_host_blocks: int = 0) -> ExecutorLane:
    """A lane that is not started: routing reads only its scheduler."""
    runner = SimulatedRunner(dataclasses.replace(SMALL, num_host_blocks=num_host_blocks))
    scheduler = Scheduler(SchedulerConfig.for_executor(runner.info()))
    return ExecutorLane(name, InProcessClient(runner), scheduler, lambda *_: None, False, always_room)


def admit(lane: ExecutorLane, request: Request) -> None:
    """Schedules ``request`` on the lane's scheduler: its blocks are taken and its full ones cached."""
    lane.scheduler.add_request(request)
    plan, _ = lane.scheduler.schedule()
    assert request.req_id in plan.num_scheduled_tokens


def test_the_lane_holding_the_prefix_wins() -> None:
    lanes = [idle_lane(f"e{i}") for i in range(3)]
    prompt = prompt_of(22)  # 5 full blocks
    admit(lanes[1], make_request("a", prompt))
    lanes[1].scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)  # blocks cached, unused
    follower = make_request("b", [*prompt[:20], 9, 9, 9])
    assert cached_prefix(lanes[1], follower.block_hashes) == (5, 0)
    assert cached_prefix(lanes[0], follower.block_hashes) == (0, 0)
    assert all(lane_load_blocks(lane) == 0 for lane in lanes)
    for _ in range(20):
        assert choose_lane(lanes, follower.block_hashes, 6, "prefix-aware") is lanes[1]
    # Only a leading run of blocks counts: a different first block leaves nothing cached.
    other_start = make_request("c", [7, *prompt[1:]])
    assert cached_prefix(lanes[1], other_start.block_hashes) == (0, 0)


def test_a_prefix_on_the_host_tier_costs_less_than_none_and_more_than_one_on_the_device() -> None:
    """Three lanes with host tiers: e0 never saw the prompt, e1 computed it and then handed every
    block out again (its prefix spilled to the host tier), e2 holds it on the device."""
    lanes = [idle_lane(f"e{i}", num_host_blocks=16) for i in range(3)]
    prompt = prompt_of(22)  # 5 full blocks
    for lane in lanes[1:]:
        admit(lane, make_request("a", prompt))
        lane.scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)  # blocks cached, unused
    pool = lanes[1].scheduler.kv.pool
    pool.free_blocks(pool.get_new_blocks(pool.num_free_blocks))  # every cached block handed out again
    follower = make_request("b", [*prompt[:20], 9, 9, 9])
    assert cached_prefix(lanes[1], follower.block_hashes) == (5, 5)
    assert cached_prefix(lanes[2], follower.block_hashes) == (5, 0)
    assert all(choose_lane(lanes, follower.block_hashes, 6, "prefix-aware") is lanes[2] for _ in range(20))
    assert all(
        choose_lane(lanes[:2], follower.block_hashes, 6, "prefix-aware") is lanes[1] for _ in range(20)
    )


def test_load_outweighs_a_short_prefix() -> None:
    """The prefix lane holds more blocks in use than the prefix saves: another lane is cheaper."""
    lanes = [idle_lane("e0"), idle_lane("e1")]
    prompt = prompt_of(9)  # 2 full blocks
    admit(lanes[0], make_request("a", prompt))
    admit(lanes[0], make_request("busy", prompt_of(40, 1)))  # 10 more blocks in use
    assert lane_load_blocks(lanes[0]) == 3 + 10
    follower = make_request("b", prompt)
    assert cached_prefix(lanes[0], follower.block_hashes) == (2, 0)
    assert choose_lane(lanes, follower.block_hashes, 3, "prefix-aware") is lanes[1]


def test_queued_blocks_count_as_load_and_queued_requests_break_ties() -> None:
    lanes = [idle_lane("e0"), idle_lane("e1")]
    hashes = make_request("a", prompt_of(8)).block_hashes
    lanes[0].queued_blocks, lanes[0].queued_requests = 3, 1
    assert lane_load_blocks(lanes[0]) == 3
    assert choose_lane(lanes, hashes, 3, "prefix-aware") is lanes[1]
    lanes[0].queued_blocks = 0  # equal cost: fewer queued requests wins
    assert all(choose_lane(lanes, hashes, 3, "prefix-aware") is lanes[1] for _ in range(20))
    lanes[0].queued_requests = 0  # a full tie: either, at random
    assert {choose_lane(lanes, hashes, 3, "prefix-aware").executor_id for _ in range(200)} == {"e0", "e1"}
    assert choose_lane(lanes[:1], hashes, 3, "least-load") is lanes[0]


def place(lanes: list[ExecutorLane], num_prompt_blocks: int, prefill_weight: float) -> ExecutorLane:
    """What the engine does with a new prompt of no cached prefix: choose, then count it queued."""
    lane = choose_lane(lanes, [], num_prompt_blocks, "prefix-aware", prefill_weight)
    lane.queued_blocks += num_prompt_blocks
    lane.queued_prefill_blocks += num_prompt_blocks
    lane.queued_requests += 1
    return lane


def test_a_burst_of_prompts_spreads_when_prefill_outweighs_blocks_in_use() -> None:
    """e0 holds no blocks, e1 and e2 one request of 7 blocks each. Weighed alike, two of three
    3-block prompts placed at once queue on e0, to prefill there together; a prefill block worth
    4 blocks in use sends the second and third to the others."""
    for weight, expected in ((1.0, ["e0", "e0", "e1"]), (4.0, ["e0", "e1", "e2"])):
        lanes = [idle_lane(f"e{i}") for i in range(3)]
        for i, lane in enumerate(lanes[1:]):
            admit(lane, make_request(f"running-{i}", prompt_of(27, i)))
        assert [lane.num_used_blocks for lane in lanes] == [0, 7, 7]
        placed = [place(lanes, 3, weight).executor_id for _ in range(3)]
        assert sorted(placed).count("e0") == expected.count("e0") and len(set(placed)) == len(set(expected))


def test_the_prefill_weight_scales_what_a_cached_prefix_saves() -> None:
    """A 5-block cached prefix on a lane that also holds 7 blocks in use: at weight 1 the prefix
    saves less than the load costs; at the default weight it saves more."""
    lanes = [idle_lane("e0"), idle_lane("e1")]
    prompt = prompt_of(22)
    admit(lanes[0], make_request("a", prompt))
    lanes[0].scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    admit(lanes[0], make_request("busy", prompt_of(27, 1)))
    hashes = make_request("b", prompt).block_hashes
    assert choose_lane(lanes, hashes, 6, "prefix-aware", 1.0) is lanes[1]  # 1 + 7 > 6
    assert choose_lane(lanes, hashes, 6, "prefix-aware") is lanes[0]  # 4 x 1 + 7 < 4 x 6


def test_a_queued_prompt_counts_as_prefill_only_for_what_was_not_cached() -> None:
    """e0 holds 6 blocks of a queued prompt, e1 9 blocks in use. Had the queued prompt found
    them all cached on e0 it adds no prefill there (e0 is cheaper: 4 x 3 + 6 < 4 x 3 + 9); had
    it found none, it adds 6 (e1 is: 4 x 9 + 6 > 21)."""
    lanes = [idle_lane("e0"), idle_lane("e1")]
    admit(lanes[1], make_request("running", prompt_of(35, 1)))
    assert lanes[1].num_used_blocks == 9
    lanes[0].queued_blocks, lanes[0].queued_requests = 6, 1
    assert choose_lane(lanes, [], 3, "prefix-aware") is lanes[0]
    lanes[0].queued_prefill_blocks = 6
    assert choose_lane(lanes, [], 3, "prefix-aware") is lanes[1]


def test_the_engine_counts_a_placed_request_queued_until_its_first_token(tokenizer: Tokenizer) -> None:
    """A prompt of 7 blocks whose first 6 are cached on its executor queues 7 blocks there and
    1 to prefill, until its first token; then both counts are back at 0."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1) as sim:
            prefix = prompt_of(24, 3)  # 6 full blocks
            await generate(sim.engine, prefix, SamplingParams(max_tokens=2), "first")
            (lane,) = sim.engine.lanes.values()
            executor = sim.executors["e0"]
            executor.pause_at = executor.num_steps  # the next step waits for `resume`
            follower = asyncio.ensure_future(
                generate(sim.engine, [*prefix, 40, 41], SamplingParams(max_tokens=2), "follower")
            )
            await sim.wait_paused()
            assert (lane.queued_requests, lane.queued_blocks, lane.queued_prefill_blocks) == (1, 7, 1)
            sim.resume()
            result = await follower
            assert result.last.usage is not None and result.last.usage.cached_prompt_tokens == 24
            assert (lane.queued_requests, lane.queued_blocks, lane.queued_prefill_blocks) == (0, 0, 0)

    asyncio.run(scenario())


@pytest.mark.parametrize("weight", [-1.0, float("nan")])
def test_the_prefill_weight_must_not_be_negative(weight: float) -> None:
    with pytest.raises(ValueError, match="--routing-prefill-weight"):
        EngineConfig(served_model_name="m", routing_prefill_weight=weight)


def test_least_load_ignores_the_prefix_cache() -> None:
    lanes = [idle_lane("e0"), idle_lane("e1")]
    prompt = prompt_of(22)
    admit(lanes[0], make_request("a", prompt))
    lanes[0].scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    admit(lanes[0], make_request("small", prompt_of(3, 2)))  # e0: the prefix and one request
    hashes = make_request("b", prompt).block_hashes
    assert choose_lane(lanes, hashes, 6, "least-load") is lanes[1]
    assert choose_lane(lanes, hashes, 6, "prefix-aware") is lanes[0]  # 1 uncached + 1 in use < 6


def test_the_engine_routes_a_shared_prefix_to_the_executor_that_holds_it(tokenizer: Tokenizer) -> None:
    """Over four executors, three prompt families: each family's first request lands anywhere;
    every later one lands where the family's prefix is cached and is served from the cache."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=4) as sim:
            for family in range(3):
                prefix = prompt_of(24, family + 1)  # 6 full blocks
                before = sim.sampled_by()
                await generate(sim.engine, prefix, SamplingParams(max_tokens=2), f"f{family}")
                (home,) = [e for e, n in sim.sampled_by().items() if n != before[e]]
                for i in range(2):
                    before = sim.sampled_by()
                    result = await generate(
                        sim.engine, [*prefix, 40 + i, 41 + i], SamplingParams(max_tokens=2), f"f{family}-{i}"
                    )
                    assert result.last.usage is not None and result.last.usage.cached_prompt_tokens == 24
                    (ran_on,) = [e for e, n in sim.sampled_by().items() if n != before[e]]
                    assert ran_on == home
            hits = await sim.engine.prefix_cache_stats()
            assert sum(h for _, h in hits.values()) == 3 * 2 * 24

    asyncio.run(scenario())
