"""The engine in this process over simulated executors: streams to completion, siblings, stop on
EOS, abort, bad requests, executors that fail, leave or do not match; every pool ends intact."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from harness.serve import metric_total
from harness.simulated_engine import SMALL, SimulatedEngine, generate, simulated_engine

from npuserve.executor.simulated import LatencyModel, SimulatedRunner
from npuserve.scheduler.core.request import InvalidRequestError, SamplingParams
from npuserve.scheduler.core.step_passes import AUTO_SCHEDULER_STEPS, MAX_SCHEDULER_STEPS
from npuserve.scheduler.engine.engine_config import EngineConfig, NoExecutorError, QueueFullError
from npuserve.scheduler.lanes.in_process_client import InProcessClient
from npuserve.scheduler.text.prompts import ModelNotFoundError, PromptInput
from npuserve.scheduler.text.tokenizer import Tokenizer


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 3 for i in range(n)]


@pytest.mark.parametrize(
    ("num_scheduler_steps", "async_scheduling"),
    [(1, False), (4, False), (AUTO_SCHEDULER_STEPS, False), (1, True), (4, True)],
)
def test_concurrent_requests_stream_their_tokens_to_completion(
    tokenizer: Tokenizer, num_scheduler_steps: int, async_scheduling: bool
) -> None:
    """Six requests over two executors: each streams exactly its tokens, in order, then "length"
    with its usage; the prompt comes with the first output; both executors take work. With
    `--num-scheduler-steps 4` the same tokens come, several a step, and with `auto` too; and so
    they do with async scheduling (each step sent while the one before runs)."""

    async def scenario() -> None:
        async with simulated_engine(
            tokenizer,
            num_executors=2,
            num_scheduler_steps=num_scheduler_steps,
            async_scheduling=async_scheduling,
        ) as sim:
            lengths = [(5 + 3 * i, 4 + i) for i in range(6)]
            results = await asyncio.gather(
                *(
                    generate(sim.engine, prompt_of(n, i), SamplingParams(max_tokens=m), f"r{i}")
                    for i, (n, m) in enumerate(lengths)
                )
            )
            for i, ((n, m), result) in enumerate(zip(lengths, results, strict=True)):
                assert result.tokens == {0: sim.expected_tokens(f"r{i}", n, m)}
                assert result.finish_reasons == {0: "length"}
                assert result.outputs[0].prompt_token_ids == prompt_of(n, i)
                assert all(o.prompt_token_ids is None for o in result.outputs[1:])
                assert [o.finished for o in result.outputs] == [False] * (len(result.outputs) - 1) + [True]
                usage = result.last.usage
                assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (n, m)
                assert result.text[0]  # detokenized on the way (tests/scheduler/text/test_detokenizer.py)
            assert all(sampled > 0 for sampled in sim.sampled_by().values()), sim.sampled_by()
            assert sum(sim.sampled_by().values()) == sum(m for _, m in lengths)
            assert sim.engine.num_active_requests == 0
            # One token a step per sequence, or more: the executors ran later passes.
            stats = [e.simulated.stats for e in sim.executors.values()]
            num_seq_steps, num_sampled = sum(s.num_seqs for s in stats), sum(s.num_sampled for s in stats)
            assert (num_sampled > num_seq_steps) == (num_scheduler_steps > 1), (num_sampled, num_seq_steps)
            generated = metric_total(sim.engine.metrics.render(), "vllm:generation_tokens_total")
            assert generated == sum(m for _, m in lengths)  # tokens, not sequences, per step

    asyncio.run(scenario())


def test_a_stream_interval_groups_each_streams_tokens(tokenizer: Tokenizer) -> None:
    """`--stream-interval 4` through the engine: every token arrives, in at most
    1 + ceil((m - 1) / 4) outputs per sequence (the exact grouping: tests/scheduler/engine/test_outputs.py).
    An interval below 1 is refused."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=2, stream_interval=4) as sim:
            single, siblings = await asyncio.gather(
                generate(sim.engine, prompt_of(6), SamplingParams(max_tokens=11), "one"),
                generate(sim.engine, prompt_of(8, 1), SamplingParams(n=2, max_tokens=9), "two"),
            )
            assert single.tokens == {0: sim.expected_tokens("one", 6, 11)}
            assert len(single.outputs) <= 1 + 3  # fewer when the reader is slower (`coalesce`)
            assert siblings.tokens == {i: sim.expected_tokens(f"two-{i}", 8, 9) for i in (0, 1)}
            assert len(siblings.outputs) <= 2 * (1 + 2)
            assert siblings.last.usage is not None and siblings.last.usage.completion_tokens == 18

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="--stream-interval"):
        EngineConfig("m", stream_interval=0)
    for num_steps in (-1, MAX_SCHEDULER_STEPS + 1):
        with pytest.raises(ValueError, match="--num-scheduler-steps"):
            EngineConfig("m", num_scheduler_steps=num_steps)
    assert (
        EngineConfig("m", num_scheduler_steps=AUTO_SCHEDULER_STEPS).num_scheduler_steps
        == AUTO_SCHEDULER_STEPS
    )


def test_siblings_of_an_n_request_run_on_one_executor(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=3) as sim:
            result = await generate(sim.engine, prompt_of(9), SamplingParams(n=3, max_tokens=5), "sib")
            assert result.tokens == {i: sim.expected_tokens(f"sib-{i}", 9, 5) for i in range(3)}
            assert result.finish_reasons == {0: "length", 1: "length", 2: "length"}
            assert result.last.usage is not None and result.last.usage.completion_tokens == 15
            assert sorted(sim.sampled_by().values()) == [0, 0, 15]

    asyncio.run(scenario())


def test_eos_ends_a_request_with_stop(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, 1, dataclasses.replace(SMALL, eos_after=3)) as sim:
            result = await generate(sim.engine, prompt_of(6), SamplingParams(max_tokens=10), "e")
            assert result.tokens[0] == [*sim.expected_tokens("e", 6, 2), 2]
            assert result.finish_reasons == {0: "stop"}

    asyncio.run(scenario())


def test_abort_frees_the_blocks_at_once(tokenizer: Tokenizer) -> None:
    """A request aborted mid-run ends with "abort", and its blocks are free when that output
    arrives; the executor is told to drop it."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1, pause_at=2) as sim:
            engine = sim.engine
            stream = engine.generate(PromptInput(token_ids=prompt_of(30)), SamplingParams(max_tokens=90), "a")
            first = await anext(stream)
            assert first.completions[0].token_ids and not first.finished
            await sim.wait_paused()  # in its third step: the lane waits on it
            pool = engine.lanes["e0"].scheduler.kv.pool
            assert pool.num_free_blocks == SMALL.num_blocks - 1 - 8  # 30 prompt + 2 output tokens
            assert engine.abort("a") and not engine.abort("nobody")
            sim.resume()
            rest = [output async for output in stream]
            assert rest[-1].finished and rest[-1].completions[-1].finish_reason == "abort"
            assert len([t for o in [first, *rest] for c in o.completions for t in c.token_ids]) == 3
            (state,) = await engine.check_integrity(expect_idle=True)
            assert state.num_free_blocks == state.num_blocks
            assert engine.num_active_requests == 0
            await sim.wait_idle()
            for _ in range(1000):  # the drop goes out with the next plan
                if not sim.executors["e0"].simulated.num_requests:
                    break
                await asyncio.sleep(0.005)
            assert sim.executors["e0"].simulated.num_requests == 0

    asyncio.run(scenario())


def test_a_client_that_stops_reading_aborts_its_request(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1, pause_at=2) as sim:
            stream = sim.engine.generate(
                PromptInput(token_ids=prompt_of(30, 1)), SamplingParams(max_tokens=90)
            )
            await anext(stream)
            await sim.wait_paused()
            await stream.aclose()  # the client went away
            assert sim.engine.num_active_requests == 0
            sim.resume()
            await sim.wait_idle()
            (state,) = await sim.engine.check_integrity(expect_idle=True)
            assert state.num_free_blocks == state.num_blocks

    asyncio.run(scenario())


def test_bad_requests_are_refused_before_anything_is_queued(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1) as sim:
            engine = sim.engine

            async def refused(prompt: list[int], field: str, **params: object) -> str:
                with pytest.raises(InvalidRequestError) as error:
                    await engine.open(PromptInput(token_ids=prompt), SamplingParams(**params))  # type: ignore[arg-type]
                assert error.value.field == field
                return str(error.value)

            assert "temperature" in await refused(prompt_of(4), "temperature", temperature=-1.0)
            assert "[0, 512)" in await refused([3, 512], "prompt")
            assert "empty" in await refused([], "prompt")
            assert "128 tokens" in await refused(prompt_of(128), "prompt")
            assert "(120 in the prompt, 9 in the completion)" in await refused(
                prompt_of(120), "max_tokens", max_tokens=9
            )
            with pytest.raises(ModelNotFoundError, match="`other`"):
                await engine.open(PromptInput(token_ids=[3]), SamplingParams(), model="other")
            with pytest.raises(InvalidRequestError, match="exactly one"):
                await engine.open(PromptInput(text="x", token_ids=[3]), SamplingParams())

            await engine.open(PromptInput(token_ids=prompt_of(8)), SamplingParams(max_tokens=50), "dup")
            with pytest.raises(InvalidRequestError) as duplicate:
                await engine.open(PromptInput(token_ids=[3]), SamplingParams(), "dup")
            assert duplicate.value.field == "request_id"
            assert engine.abort("dup")
            await sim.wait_idle()

    asyncio.run(scenario())


def test_a_full_queue_refuses_new_requests(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1, max_queued_requests=0) as sim:
            with pytest.raises(QueueFullError, match="--max-queued-requests=0"):
                await sim.engine.open(PromptInput(token_ids=[3, 4]), SamplingParams())
            assert sim.engine.num_active_requests == 0

    asyncio.run(scenario())


async def _stream_all(sim: SimulatedEngine, count: int, max_tokens: int) -> None:
    """``count`` requests to completion, each with exactly its tokens: nothing repeated or lost."""
    results = await asyncio.gather(
        *(
            generate(sim.engine, prompt_of(6 + i, i), SamplingParams(max_tokens=max_tokens), f"m{i}")
            for i in range(count)
        )
    )
    for i, result in enumerate(results):
        assert result.finish_reasons == {0: "length"}, result.last.error
        assert result.tokens[0] == sim.expected_tokens(f"m{i}", 6 + i, max_tokens)
        assert result.last.error is None


def test_requests_of_an_unreachable_executor_move_to_another(tokenizer: Tokenizer) -> None:
    """e0 becomes unreachable after three steps: its requests resume on e1 from the tokens they
    have, and every stream completes with exactly its tokens."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, 2, failing={"e0": (3, "UNAVAILABLE")}) as sim:
            await _stream_all(sim, count=4, max_tokens=12)
            assert list(sim.engine.lanes) == ["e1"]
            assert sim.sampled_by()["e0"] > 0  # requests did run there first

    asyncio.run(scenario())


class MidRun:
    """Request "x" (10 prompt tokens, 40 new) started, its executor paused inside a step."""

    def __init__(self, sim: SimulatedEngine) -> None:
        self.sim = sim
        self.stream = sim.engine.generate(
            PromptInput(token_ids=prompt_of(10)), SamplingParams(max_tokens=40), "x"
        )

    async def start(self, paused: bool = True) -> str:
        """Waits for the first output (and the paused step); the executor holding "x"."""
        self.outputs = [await anext(self.stream)]
        if paused:
            return await self.sim.wait_paused()
        (holder,) = [name for name, sampled in self.sim.sampled_by().items() if sampled]
        return holder

    async def finish(self) -> None:
        """Resumes; "x" streams exactly its tokens to "length"."""
        self.sim.resume()
        self.outputs += [output async for output in self.stream]
        tokens = [t for output in self.outputs for t in output.completions[0].token_ids]
        assert tokens == self.sim.expected_tokens("x", 10, 40)
        assert self.outputs[-1].completions[0].finish_reason == "length"


def test_requests_of_a_leaving_executor_move_to_another(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=2, pause_at=2) as sim:
            x = MidRun(sim)
            holder = await x.start()
            sim.engine.remove_executor(holder, "its registration expired")
            await x.finish()
            assert holder not in sim.engine.lanes and len(sim.engine.lanes) == 1

    asyncio.run(scenario())


def test_a_draining_executor_finishes_its_requests_takes_no_new_ones_then_leaves(
    tokenizer: Tokenizer,
) -> None:
    """Drained mid-request (its registration marked draining): the request completes there, not
    moved; new requests go to the other executor; the drained one leaves once it holds nothing.
    With every executor draining, new requests are unavailable."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=2, pause_at=2) as sim:
            x = MidRun(sim)
            holder = await x.start()
            sim.engine.drain_executor(holder, "its registration is marked draining")
            await _only_the_drained_request_runs_there(sim, x, holder)

    asyncio.run(scenario())


def test_an_executor_that_answers_draining_is_drained(tokenizer: Tokenizer) -> None:
    """The same when the executor's step answer says it drains (SIGTERM, with --executors)."""
    slow = dataclasses.replace(SMALL, latency=LatencyModel(0.01, 0.0, 0.0))  # 40 steps: 0.4 s

    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=2, config=slow) as sim:
            x = MidRun(sim)
            holder = await x.start(paused=False)
            sim.executors[holder].draining = True
            for _ in range(100):
                if sim.engine.lanes[holder].draining:
                    break
                await asyncio.sleep(0.005)
            await _only_the_drained_request_runs_there(sim, x, holder)

    asyncio.run(scenario())


async def _only_the_drained_request_runs_there(sim: SimulatedEngine, x: MidRun, holder: str) -> None:
    engine = sim.engine
    assert engine.lanes[holder].draining
    later = [
        asyncio.create_task(generate(engine, prompt_of(6, seed), SamplingParams(max_tokens=5)))
        for seed in range(1, 4)
    ]
    await x.finish()
    assert all(c.finish_reasons[0] == "length" for c in await asyncio.gather(*later))
    other = next(name for name in sim.executors if name != holder)
    assert sim.sampled_by() == {holder: 40, other: 3 * 5}  # x never moved; the rest never came
    for _ in range(500):
        if holder not in engine.lanes:
            break
        await asyncio.sleep(0.01)
    assert list(engine.lanes) == [other]
    engine.drain_executor(other, "its registration is marked draining")
    with pytest.raises(NoExecutorError):
        await engine.open(PromptInput(token_ids=prompt_of(4)), SamplingParams(max_tokens=2))


def test_a_failed_step_ends_its_requests_with_the_error(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, 1, failing={"e0": (2, "INTERNAL")}) as sim:
            result = await generate(sim.engine, prompt_of(7), SamplingParams(max_tokens=10), "f")
            assert result.finish_reasons == {0: "error"}
            assert result.tokens[0] == sim.expected_tokens("f", 7, 2)  # steps 0 and 1 ran
            assert result.last.error is not None and "executor e0 failed" in result.last.error

    asyncio.run(scenario())


def test_losing_the_last_executor_fails_requests_and_refuses_new_ones(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, 1, failing={"e0": (2, "UNAVAILABLE")}) as sim:
            result = await generate(sim.engine, prompt_of(7), SamplingParams(max_tokens=10), "g")
            assert result.finish_reasons == {0: "error"}
            assert result.last.error is not None and "no executor is available" in result.last.error
            with pytest.raises(NoExecutorError):
                await sim.engine.open(PromptInput(token_ids=[3]), SamplingParams())
            assert not sim.engine.lanes

    asyncio.run(scenario())


def test_an_executor_that_does_not_match_is_refused(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1) as sim:
            for change, words in (
                ({"block_size": 8}, "block size 8"),
                ({"max_model_len": 64}, "holds 64 tokens"),
            ):
                runner = SimulatedRunner(dataclasses.replace(SMALL, **change))  # type: ignore[arg-type]
                with pytest.raises(ValueError, match=words):
                    sim.engine.add_executor("odd", InProcessClient(runner), runner.info())
            assert list(sim.engine.lanes) == ["e0"]

    asyncio.run(scenario())
