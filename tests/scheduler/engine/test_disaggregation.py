"""Prefill/decode disaggregation through the engine over simulated executors: a prompt longer
than --max-local-prefill-length prefills on the prefill executor (its first token sampled there)
and decodes on a decode executor, which pulls its blocks; shorter ones stay where they decode.
Every stream has exactly its tokens, whichever executor fails; every pool ends idle (the
blocks held for the pulls included)."""

from __future__ import annotations

import asyncio

import pytest
from harness.simulated_engine import SimulatedEngine, generate, simulated_engine
from prometheus_client.parser import text_string_to_metric_families

from npuserve.proto.step_plan import EXECUTOR_ROLE_DECODE, EXECUTOR_ROLE_PREFILL
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.text.tokenizer import Tokenizer

ROLES = {"e0": EXECUTOR_ROLE_PREFILL, "e1": EXECUTOR_ROLE_DECODE, "e2": EXECUTOR_ROLE_DECODE}
MAX_LOCAL_PREFILL_LENGTH = 12  # tokens: three blocks of the simulated executors' four
LONG, SHORT = 22, 9  # prompt tokens


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 3 for i in range(n)]


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
        async with simulated_engine(
            tokenizer,
            num_executors=3,
            roles=ROLES,
            max_local_prefill_length=MAX_LOCAL_PREFILL_LENGTH,
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
        async with simulated_engine(
            tokenizer,
            num_executors=3,
            roles=ROLES,
            max_local_prefill_length=MAX_LOCAL_PREFILL_LENGTH,
            failing={lost: (3, "UNAVAILABLE")},
        ) as sim:
            await run_all(sim, [(LONG, 8)] * 6 + [(SHORT, 8)] * 2)
            assert not sim.engine.lanes.get(lost)
            await sim.wait_idle()

    asyncio.run(scenario())


def test_with_only_prefill_executors_left_they_decode_too(tokenizer: Tokenizer) -> None:
    """A prefill executor alone serves every request, long prompts included, as a mixed one."""

    async def scenario() -> None:
        async with simulated_engine(
            tokenizer,
            num_executors=1,
            roles={"e0": EXECUTOR_ROLE_PREFILL},
            max_local_prefill_length=0,
        ) as sim:
            await run_all(sim, [(LONG, 5), (SHORT, 5)])
            assert sim.executors["e0"].simulated.num_pulled_blocks == 0

    asyncio.run(scenario())


def test_an_abort_while_the_prompt_prefills_ends_the_request_and_frees_every_block(
    tokenizer: Tokenizer,
) -> None:
    """Aborted while the prefill executor computes its prompt, a request ends as aborted (the
    abort reaches the prefill lane after the request has left it) instead of decoding on; the
    blocks held for it are freed."""

    async def scenario() -> None:
        async with simulated_engine(
            tokenizer, num_executors=2, roles=ROLES, max_local_prefill_length=0, pause_at=0
        ) as sim:
            run = asyncio.create_task(
                generate(sim.engine, prompt_of(LONG, 0), SamplingParams(max_tokens=8), "r0")
            )
            assert await sim.wait_paused() == "e0"
            assert sim.engine.abort("r0")
            sim.resume()
            result = await run
            assert result.finish_reasons == {0: "abort"} and len(result.tokens[0]) <= 1
            assert sim.sampled_by()["e1"] == 0
            await sim.wait_idle()

    asyncio.run(scenario())
