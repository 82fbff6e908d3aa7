"""`AioExecutorClient` against a real executor server over real gRPC: the handshake, steps over
the step stream, a refused step and a late one leave the client usable, pipelined steps come back in
order, a step sent after a
refused one fails with an executor error (not a cancellation), and a multi-step plan's admitted
requests are answered before its result when asked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from harness.faulty_runner import FaultyRunner

from npuserve.executor.server import start_executor_server
from npuserve.executor.simulated import LatencyModel, SimulatedConfig, SimulatedRunner
from npuserve.proto.step_plan import ExecutorInfo, NewRequest, SamplingOptions, StepPlan, StepResult
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.executor_client import ExecutorError

INFO = ExecutorInfo(
    model="m", architecture="LlamaForCausalLM", block_size=4, num_blocks=16, max_model_len=64,
    max_num_seqs=4, max_num_batched_tokens=64, vocab_size=512, eos_token_ids=[2], dtype="float32",
    device="cpu",
)  # fmt: skip


@pytest.fixture
def executor() -> Iterator[tuple[str, str]]:
    """(address, instance id) of a running executor server."""
    running = start_executor_server(FaultyRunner(INFO), "127.0.0.1", 0, "faulty")
    yield running.address, running.servicer.instance_id
    running.stop(grace_s=0)


def _client(executor: tuple[str, str], timeout_s: float) -> AioExecutorClient:
    address, instance_id = executor
    return AioExecutorClient(address, instance_id, timeout_s)


def test_a_refused_step_and_a_late_one_leave_the_client_usable(executor: tuple[str, str]) -> None:
    async def run() -> None:
        client = _client(executor, 10)
        with pytest.raises(ExecutorError) as refused:
            await client.step(StepPlan(step_id=0))
        assert (refused.value.code, refused.value.message) == ("INTERNAL", "RuntimeError: device lost")
        assert await client.step(StepPlan(step_id=2)) == StepResult(step_id=2)
        client.timeout_s = 0.1
        with pytest.raises(ExecutorError) as late:
            await client.step(StepPlan(step_id=1))
        assert late.value.code == "DEADLINE_EXCEEDED"
        client.timeout_s = 10
        assert await client.step(StepPlan(step_id=3)) == StepResult(step_id=3)
        await client.close()

    asyncio.run(run())


def test_pipelined_steps_come_back_in_order_and_a_refusal_fails_those_after_it(
    executor: tuple[str, str],
) -> None:
    async def run() -> None:
        client = _client(executor, 10)
        pending = [await client.submit(StepPlan(step_id=i)) for i in (1, 2, 3)]
        assert [await p.result() for p in pending] == [StepResult(step_id=i) for i in (1, 2, 3)]
        refused, after = await client.submit(StepPlan(step_id=0)), await client.submit(StepPlan(step_id=4))
        with pytest.raises(ExecutorError) as failure:
            await refused.result()
        assert failure.value.code == "INTERNAL"
        with pytest.raises(ExecutorError):  # the stream ended with the refusal: not a cancellation
            await after.result()
        assert await client.step(StepPlan(step_id=5)) == StepResult(step_id=5)  # a new stream
        # Sent back to back, so that a pipelined executor has each step before the one before
        # it ends: a refusal still comes after the answer of the step before it, and ends the
        # stream there.
        done, refused, after = [await client.submit(StepPlan(step_id=i)) for i in (6, 0, 7)]
        assert await done.result() == StepResult(step_id=6)
        with pytest.raises(ExecutorError) as failure:
            await refused.result()
        assert failure.value.code == "INTERNAL"
        with pytest.raises(ExecutorError):
            await after.result()
        await client.close()

    asyncio.run(run())


def test_the_handshake_names_the_executor_and_the_process_its_steps_go_to(executor: tuple[str, str]) -> None:
    """`info` answers the executor's capacity and names it; from then on the client's steps and
    health checks are those of the process that answered. A handshake that waits past its
    timeout for an executor that is not there fails UNAVAILABLE or DEADLINE_EXCEEDED."""

    async def run() -> None:
        address, instance_id = executor
        client = AioExecutorClient(address, "", 10)
        assert await client.info() == INFO
        assert (client.executor_id, client.instance_id) == ("faulty", instance_id) and client.version
        assert await client.step(StepPlan(step_id=2)) == StepResult(step_id=2)
        await client.close()
        nobody = AioExecutorClient("127.0.0.1:1", "", 10)
        with pytest.raises(ExecutorError) as failure:
            await nobody.info(timeout_s=0.2)
        assert failure.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
        await nobody.close()

    asyncio.run(run())


def test_an_executor_that_is_not_there_is_unavailable() -> None:
    async def run() -> None:
        client = AioExecutorClient("127.0.0.1:1", "", 5)
        with pytest.raises(ExecutorError) as failure:
            await client.step(StepPlan(step_id=0))
        assert failure.value.code == "UNAVAILABLE"
        await client.close()

    asyncio.run(run())


def test_health_says_whether_the_executor_answers_and_serves(executor: tuple[str, str]) -> None:
    """Asked after a failed step (was it the executor's answer?): True from a serving executor,
    as the process the client handshook with; False from another process at its address (a
    restart), from an address where none listens and from a closed client."""

    async def run() -> None:
        client = _client(executor, 10)
        assert await client.health()
        restarted = AioExecutorClient(executor[0], "an-earlier-instance", 5)
        assert not await restarted.health()
        await restarted.close()
        await client.close()
        assert not await client.health()
        nobody = AioExecutorClient("127.0.0.1:1", "", 5)
        assert not await nobody.health()
        await nobody.close()

    asyncio.run(run())


def _two_request_plans(step_id: int) -> tuple[StepPlan, StepPlan]:
    """Request "a" admitted alone, then a step where it runs four passes and "b" is admitted."""
    greedy = SamplingOptions(temperature=0)
    admit_a = StepPlan(
        step_id, [NewRequest("a", [1, 2, 3], 3, greedy, [1, 2], 0)], num_scheduled_tokens={"a": 3}
    )
    both = StepPlan(
        step_id + 1,
        [NewRequest("b", [4, 5], 2, greedy, [3], 0)],
        num_scheduled_tokens={"a": 1, "b": 2},
        num_steps={"a": 4},
    )
    return admit_a, both


def test_the_requests_a_multi_step_plan_admits_are_answered_before_its_result() -> None:
    """Over the step stream, with `early_results`, the requests that run only the first pass of a
    multi-step plan come in a partial answer before the plan's result, which names the others;
    between them they hold the tokens of one answer."""
    runner = SimulatedRunner(
        SimulatedConfig(latency=LatencyModel(0.0, 0.0, 0.0), num_blocks=16, block_size=4)
    )
    running = start_executor_server(runner, "127.0.0.1", 0, "sim")

    async def run() -> None:
        client = AioExecutorClient(running.address, "", 10)
        await client.info()
        admit_a, both = _two_request_plans(0)
        await client.step(admit_a)
        pending = await client.submit(both, early_results=True)
        answers = [await pending.result(), await pending.result()]
        a_tokens = [runner.token_for("a", k) for k in range(4, 8)]
        b_token = runner.token_for("b", 2)
        early, final = answers
        assert early == StepResult(1, ["b"], [b_token], [None], partial=True)
        assert (final.sampled_req_ids, final.sampled_token_ids, final.partial) == (["a"] * 4, a_tokens, False)
        # Not asked for: one answer over the stream too.
        await client.step(StepPlan(2, finished_req_ids=["a", "b"]))
        admit_a, both = _two_request_plans(3)
        await client.step(admit_a)
        whole = await client.step(both)
        assert len(whole.sampled_req_ids) == 5 and not whole.partial
        await client.close()

    try:
        asyncio.run(run())
    finally:
        running.stop(grace_s=0)
