"""Prefill/decode disaggregation through the engine over simulated executors: a prompt longer
than --max-local-prefill-length waits on a decode executor, its blocks reserved there, while it
prefills on the prefill executor (its first token sampled there); the decode executor then pulls
its blocks and decodes it. Shorter ones stay where they decode. Every stream has exactly its
tokens, whichever executor or pull fails; every pool ends idle (the blocks held for the pulls,
and those reserved for them, included)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Any

import pytest
from harness.simulated_engine import SMALL, Collected, SimulatedEngine, generate, simulated_engine
from prometheus_client.parser import text_string_to_metric_families

from npuserve.proto.step_plan import EXECUTOR_ROLE_DECODE, EXECUTOR_ROLE_PREFILL
from npuserve.proto.structured_outputs import StructuredOutputs
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.text.tokenizer import Tokenizer

ROLES = {"e0": EXECUTOR_ROLE_PREFILL, "e1": EXECUTOR_ROLE_DECODE, "e2": EXECUTOR_ROLE_DECODE}
ONE_EACH = {"e0": EXECUTOR_ROLE_PREFILL, "e1": EXECUTOR_ROLE_DECODE}
MAX_LOCAL_PREFILL_LENGTH = 12  # tokens: three blocks of the simulated executors' four
LONG, SHORT = 22, 9  # prompt tokens
LONG_BLOCKS = -(-LONG // 4)


def disaggregated(
    tokenizer: Tokenizer, roles: dict[str, str], max_local_prefill_length: int = 0, **options: Any
) -> AbstractAsyncContextManager[SimulatedEngine]:
    """The simulated engine over one executor per role, ``e0, e1, ...`` (``roles``); with the
    default ``max_local_prefill_length``, every prompt prefills on a prefill executor."""
    return simulated_engine(
        tokenizer,
        num_executors=len(roles),
        roles=roles,
        max_local_prefill_length=max_local_prefill_length,
        **options,
    )


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 3 for i in range(n)]


def start(sim: SimulatedEngine, num_prompt: int, max_tokens: int, req_id: str) -> asyncio.Task[Collected]:
    """Request ``req_id`` (its prompt from its number), streamed to its end in a task."""
    prompt = prompt_of(num_prompt, int(req_id[1:]))
    return asyncio.create_task(generate(sim.engine, prompt, SamplingParams(max_tokens=max_tokens), req_id))


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition did not come true")


def metric(sim: SimulatedEngine, name: str, executor: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(sim.engine.metrics.render())
        for sample in family.samples
        if sample.name == name and sample.labels.get("executor") == executor
    )


async def run_all(sim: SimulatedEngine, lengths: list[tuple[int, int]]) -> None:
    """Runs requests ``r0, r1, ...`` of (prompt tokens, max tokens) at once; each streams
    exactly its tokens."""
    results = await asyncio.gather(
        *(
            generate(sim.engine, prompt_of(n, i), SamplingParams(max_tokens=m), f"r{i}")
            for i, (n, m) in enumerate(lengths)
        )
    )
    for i, ((n, m), result) in enumerate(zip(lengths, results, strict=True)):
        assert result.tokens == {0: sim.expected_tokens(f"r{i}", n, m)}, f"r{i}"
        assert result.finish_reasons == {0: "length"}


@pytest.mark.parametrize(("num_scheduler_steps", "async_scheduling"), [(1, False), (4, True)])
def test_long_prompts_prefill_on_the_prefill_executor_and_decode_where_they_pull(
    tokenizer: Tokenizer, num_scheduler_steps: int, async_scheduling: bool
) -> None:
    """Long prompts sample their first token on the prefill executor and every other token on
    a decode executor, which pulls every block of the prompt; short ones, and a long one that
    ends at its first token, run where they are placed; the prefill executor's blocks stay in
    its prefix cache once pulled (a prompt placed there again is a hit)."""

    async def scenario() -> None:
        async with disaggregated(
            tokenizer,
            ROLES,
            MAX_LOCAL_PREFILL_LENGTH,
            num_scheduler_steps=num_scheduler_steps,
            async_scheduling=async_scheduling,
        ) as sim:
            long, short, one = [(LONG, 6)] * 4, [(SHORT, 5)] * 3, [(LONG, 1)]
            await run_all(sim, long + short + one)
            roles = {
                sample.labels["executor"]: sample.labels["role"]
                for family in text_string_to_metric_families(sim.engine.metrics.render())
                for sample in family.samples
                if sample.name == "npuserve:executor_info"
            }
            assert roles == ROLES
            sampled = sim.sampled_by()
            assert sampled["e0"] == len(long) + len(one), sampled  # first tokens only
            assert sampled["e1"] + sampled["e2"] == 4 * 5 + 3 * 5, sampled
            pulled = sum(sim.executors[e].simulated.num_pulled_blocks for e in ("e1", "e2"))
            assert pulled == len(long) * -(-LONG // 4)
            assert sim.executors["e0"].simulated.num_pulled_blocks == 0
            await sim.wait_idle()
            lanes = sim.engine.lanes
            for lane in lanes.values():
                assert not await asyncio.wrap_future(lane.call(lambda scheduler: len(scheduler.held)))
            # The prompts' full blocks stay cached on the prefill executor once pulled, and on the
            # decode executor that pulled them: the same prompt again prefills there no more.
            states = {state.executor_id: state for state in await sim.engine.check_integrity()}
            assert states["e0"].num_cached_blocks == (len(long) + len(one)) * (LONG // 4)
            again = await generate(sim.engine, prompt_of(LONG, 0), SamplingParams(max_tokens=2), "again")
            usage = again.last.usage
            assert usage is not None and usage.cached_prompt_tokens == LONG // 4 * 4
            assert sim.sampled_by()["e0"] == sampled["e0"]

    asyncio.run(scenario())


@pytest.mark.parametrize("lost", ["e0", "e1"])
def test_a_lost_prefill_or_decode_executor_costs_no_token_and_no_block(
    tokenizer: Tokenizer, lost: str
) -> None:
    """The prefill executor (e0) or a decode executor (e1) is lost after a few steps, with
    prompts prefilling, pulled or decoding: every request still streams exactly its tokens
    (prefilled again on the prefill executor or where it decodes, with no prefill executor
    left), and every pool ends idle."""

    async def scenario() -> None:
        async with disaggregated(
            tokenizer, ROLES, MAX_LOCAL_PREFILL_LENGTH, failing={lost: (3, "UNAVAILABLE")}
        ) as sim:
            await run_all(sim, [(LONG, 8)] * 6 + [(SHORT, 8)] * 2)
            assert not sim.engine.lanes.get(lost)
            await sim.wait_idle()

    asyncio.run(scenario())


def test_with_only_prefill_executors_left_they_decode_too(tokenizer: Tokenizer) -> None:
    """A prefill executor alone serves every request, long prompts included, as a mixed one."""

    async def scenario() -> None:
        async with disaggregated(tokenizer, {"e0": EXECUTOR_ROLE_PREFILL}) as sim:
            await run_all(sim, [(LONG, 5), (SHORT, 5)])
            assert sim.executors["e0"].simulated.num_pulled_blocks == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("paused", ["e0", "e1"])
def test_an_abort_while_the_prompt_prefills_or_is_pulled_frees_both_sides(
    tokenizer: Tokenizer, paused: str
) -> None:
    """Aborted while the prefill executor computes its prompt (its decode executor holding its
    blocks), or while the decode executor's step pulls it, a request ends as aborted instead of
    decoding on: the blocks held for it on both sides are freed."""

    async def scenario() -> None:
        async with disaggregated(tokenizer, ONE_EACH) as sim:
            sim.executors[paused].pause_at = 0
            run = start(sim, LONG, 8, "r0")
            assert await sim.wait_paused() == paused
            assert sim.engine.abort("r0")
            sim.resume()
            result = await run
            assert result.finish_reasons == {0: "abort"} and len(result.tokens[0]) <= (paused == "e1") + 1
            assert sim.sampled_by()["e1"] <= (paused == "e1")
            await sim.wait_idle()

    asyncio.run(scenario())


def test_a_decode_executor_lost_while_the_prompt_prefills_waits_elsewhere_for_that_prefill(
    tokenizer: Tokenizer,
) -> None:
    """The decode executor that holds a request's blocks goes while the prefill executor
    computes its prompt: the request waits on the other decode executor, for the same prefill."""

    async def scenario() -> None:
        async with disaggregated(tokenizer, ROLES, pause_at=0) as sim:
            run = start(sim, LONG, 6, "r0")
            assert await sim.wait_paused() == "e0"
            lost = sim.engine._lane_of["r0"].executor_id
            sim.engine.remove_executor(lost, "lost")
            await until(lambda: sim.engine._lane_of["r0"].executor_id != lost)
            other = sim.engine._lane_of["r0"].executor_id
            sim.resume()
            assert (await run).tokens == {0: sim.expected_tokens("r0", LONG, 6)}
            assert sim.sampled_by() == {"e0": 1, lost: 0, other: 5}  # prefilled once
            assert sim.executors[other].simulated.num_pulled_blocks == LONG_BLOCKS
            await sim.wait_idle()

    asyncio.run(scenario())


def test_a_decode_executor_lost_in_its_pull_step_releases_the_held_blocks_and_the_request_moves(
    tokenizer: Tokenizer,
) -> None:
    """The decode executor dies in the step that pulls a request's blocks: the prefill executor
    frees them, and the request, with its first token, prefills again there (from its prefix
    cache) and decodes on the other decode executor."""

    async def scenario() -> None:
        async with disaggregated(tokenizer, ROLES) as sim:
            for name in ("e1", "e2"):
                sim.executors[name].pause_at = 0
            run = start(sim, LONG, 6, "r0")
            lost = await sim.wait_paused()
            sim.executors[lost].fail_at = 0
            sim.resume()
            assert (await run).tokens == {0: sim.expected_tokens("r0", LONG, 6)}
            assert lost not in sim.engine.lanes
            assert sim.sampled_by()["e0"] == 2  # its first token, then its second
            states = {state.executor_id: state for state in await sim.engine.check_integrity()}
            assert states["e0"].prefix_cache_hits == LONG // 4 * 4
            await sim.wait_idle()

    asyncio.run(scenario())


def test_a_lost_prefill_executor_prefills_again_on_another_while_the_decode_one_waits(
    tokenizer: Tokenizer,
) -> None:
    """Two prefill executors; the one computing a request's prompt dies: the other computes it,
    and the decode executor, which kept the request's blocks, pulls them from there."""

    async def scenario() -> None:
        roles = {"e0": EXECUTOR_ROLE_PREFILL, "e1": EXECUTOR_ROLE_PREFILL, "e2": EXECUTOR_ROLE_DECODE}
        async with disaggregated(tokenizer, roles, pause_at=0) as sim:
            run = start(sim, LONG, 6, "r0")
            lost = await sim.wait_paused()
            other = {"e0": "e1", "e1": "e0"}[lost]
            sim.executors[lost].fail_at = 0
            sim.resume()
            assert (await run).tokens == {0: sim.expected_tokens("r0", LONG, 6)}
            assert sim.sampled_by() == {lost: 0, other: 1, "e2": 5}
            assert sim.executors["e2"].simulated.num_pulled_blocks == LONG_BLOCKS
            await sim.wait_idle()

    asyncio.run(scenario())


def test_a_prompt_its_prefill_executor_fails_is_computed_where_it_decodes(tokenizer: Tokenizer) -> None:
    """The prefill executor serves on but fails every step: each twin fails there (its step, then
    its one retry) and ends no client request: its decode executor computes the prompt."""

    async def scenario() -> None:
        async with disaggregated(tokenizer, ONE_EACH, failing={"e0": (0, "INTERNAL")}) as sim:
            await run_all(sim, [(LONG, 6)] * 2)
            assert sim.sampled_by() == {"e0": 0, "e1": 2 * 6} and "e0" in sim.engine.lanes
            assert metric(sim, "npuserve:executor_failed_steps_total", "e0") >= 2
            await sim.wait_idle()

    asyncio.run(scenario())


@pytest.mark.parametrize(("num_scheduler_steps", "async_scheduling"), [(1, False), (4, True)])
def test_a_failed_pull_fails_only_its_request_which_computes_its_prompt(
    tokenizer: Tokenizer, num_scheduler_steps: int, async_scheduling: bool
) -> None:
    """The prefill executor serves on but its blocks cannot be read: each pull fails its own
    request only (no step fails), which computes its prompt where it decodes, beside the
    requests decoding there."""

    async def scenario() -> None:
        async with disaggregated(
            tokenizer,
            ONE_EACH,
            MAX_LOCAL_PREFILL_LENGTH,
            num_scheduler_steps=num_scheduler_steps,
            async_scheduling=async_scheduling,
        ) as sim:
            sim.executors["e0"].refuses_reads = True
            await run_all(sim, [(SHORT, 16), (LONG, 6), (LONG, 6)])
            # NOTE: none over the blocks the failed pulls left: no step runs a request it pulls
            assert sim.sampled_by() == {"e0": 2, "e1": 16 + 2 * 5}
            assert sim.executors["e1"].simulated.num_pulled_blocks == 0
            assert metric(sim, "npuserve:executor_failed_steps_total", "e1") == 0
            await sim.wait_idle()

    asyncio.run(scenario())


def test_a_draining_prefill_executor_stays_until_its_held_blocks_are_pulled(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with disaggregated(tokenizer, ONE_EACH) as sim:
            sim.executors["e1"].pause_at = 0  # its step that pulls waits
            run = start(sim, LONG, 4, "r0")
            assert await sim.wait_paused() == "e1"
            sim.engine.drain_executor("e0", "draining")
            prefill = sim.engine.lanes["e0"]
            assert await asyncio.wrap_future(prefill.call(lambda scheduler: list(scheduler.held))) == ["r0"]
            await asyncio.sleep(0.05)
            assert sim.engine.lanes.get("e0") is prefill
            sim.resume()
            assert (await run).tokens == {0: sim.expected_tokens("r0", LONG, 4)}
            await until(lambda: "e0" not in sim.engine.lanes)
            await sim.wait_idle()

    asyncio.run(scenario())


def test_a_request_reserved_while_its_prompt_prefills_counts_as_waiting(tokenizer: Tokenizer) -> None:
    """Reserved on its decode executor while the prefill executor computes its prompt, a request
    counts as waiting there (vLLM counts WAITING_FOR_REMOTE_KVS as waiting): in
    vllm:num_requests_waiting and against --max-queued-requests; once it decodes, no longer."""

    async def scenario() -> None:
        async with disaggregated(tokenizer, ONE_EACH) as sim:
            sim.executors["e0"].pause_at = 0
            run = start(sim, LONG, 8, "r0")
            assert await sim.wait_paused() == "e0"
            decode = next(lane for lane in sim.engine.routable_lanes if lane.executor_id == "e1")
            await until(lambda: "r0" in decode.scheduler.awaiting)  # type: ignore[attr-defined]
            assert decode.num_waiting == 1
            sim.resume()
            assert (await run).finish_reasons == {0: "length"}
            await sim.wait_idle()
            assert decode.num_waiting == 0

    asyncio.run(scenario())


def test_requests_wait_for_the_decode_executors_blocks_while_their_prompts_prefill(
    tokenizer: Tokenizer,
) -> None:
    """More long prompts than the decode executor's pool can reserve blocks for: the rest wait
    in its queue while they prefill, and are admitted, pulling, as blocks come free."""

    async def scenario() -> None:
        async with disaggregated(tokenizer, ONE_EACH) as sim:
            await run_all(sim, [(LONG, 8)] * 14)  # 14 x 6 blocks reserved: 84 of 64
            assert sim.sampled_by()["e0"] == 14
            await sim.wait_idle()

    asyncio.run(scenario())


def test_full_pools_on_both_sides_of_the_hand_off_do_not_deadlock(tokenizer: Tokenizer) -> None:
    """Pools that hold one long prompt each. r0 and r1 are reserved on the two decode executors
    while the prefill executor computes r0; r0's decode executor goes, and r0 waits, told its
    source, behind r1's reservation on the other one, whose pool it cannot get into, while the
    prefill executor's pool holds r0's blocks, so r1's prompt cannot start there. r0, whose KV is
    ready, takes r1's reservation (r1 waits in the queue again); r0 pulls and decodes, which frees
    the prefill executor's blocks, and r1 goes on."""
    one_long_prompt = replace(SMALL, num_blocks=10)  # 9 usable blocks; a long prompt takes 6

    async def scenario() -> None:
        async with disaggregated(tokenizer, ROLES, config=one_long_prompt) as sim:
            sim.executors["e0"].pause_at = 0
            runs = [start(sim, LONG, 4, "r0")]
            assert await sim.wait_paused() == "e0"
            runs.append(start(sim, LONG, 4, "r1"))
            lane_of = sim.engine._lane_of
            await until(lambda: "r1" in lane_of)
            lost, other = lane_of["r0"], lane_of["r1"]
            assert lost is not other
            await until(
                lambda: "r0" in lost.scheduler.awaiting and "r1" in other.scheduler.awaiting  # type: ignore[attr-defined]
            )
            sim.engine.remove_executor(lost.executor_id, "lost")
            await until(lambda: lane_of["r0"] is other)
            sim.resume()
            try:
                results = await asyncio.wait_for(asyncio.gather(*runs), timeout=10)
            except TimeoutError:
                raise AssertionError("deadlock: no request finished before the deadline") from None
            for req_id, result in zip(("r0", "r1"), results, strict=True):
                assert result.tokens == {0: sim.expected_tokens(req_id, LONG, 4)}, req_id
            assert sim.sampled_by()["e0"] == 2  # each prompt prefilled once
            assert sim.executors[other.executor_id].simulated.num_pulled_blocks == 2 * LONG_BLOCKS
            await sim.wait_idle()

    asyncio.run(scenario())


CONSTRAINTS = {
    "regex": StructuredOutputs("regex", "[a-z]{2,6}( [a-z]{2,6}){2,4}"),
    "json_schema": StructuredOutputs.json_schema(
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        }
    ),
}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_a_constrained_request_crosses_the_hand_off_as_it_runs_colocated(
    tokenizer: Tokenizer, kind: str
) -> None:
    """A constrained request's first token is sampled under its grammar on the prefill executor,
    and the decode executor's matcher goes on from it: the output is the one a single mixed
    executor gives, token for token."""
    params = SamplingParams(max_tokens=40, structured_outputs=CONSTRAINTS[kind])

    async def serve(roles: dict[str, str]) -> tuple[Collected, dict[str, int]]:
        async with disaggregated(tokenizer, roles) as sim:
            result = await generate(sim.engine, prompt_of(LONG, 0), params, "r0")
            await sim.wait_idle()
            return result, sim.sampled_by()

    colocated, _ = asyncio.run(serve({"e0": "mixed"}))
    handed_off, sampled = asyncio.run(serve(ONE_EACH))
    assert sampled["e0"] == 1 and sampled["e1"] == len(colocated.tokens[0]) - 1 > 2
    assert handed_off.tokens == colocated.tokens and handed_off.text == colocated.text
    assert handed_off.finish_reasons == colocated.finish_reasons == {0: "stop"}
    if kind == "json_schema":
        assert '"name":' in colocated.text[0]
