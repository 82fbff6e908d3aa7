"""`InProcessClient`: a runner in this process answers a lane as an executor answers over the step
stream. Pipelined steps come back in order, off the event loop's thread; a refused step fails
those sent after it, which are not run, and the next step opens a new stream; a multi-step
plan's admitted requests are answered before its result when asked; a step that joins a running
multi-pass one is answered after the pass it joined; a closed client neither steps nor serves."""

from __future__ import annotations

import asyncio
import threading

import pytest
from harness.faulty_runner import FaultyRunner

from npuserve.executor.simulated import LatencyModel, SimulatedConfig, SimulatedRunner
from npuserve.proto.step_plan import (
    ExecutorInfo,
    FirstPassAnswer,
    JoiningSteps,
    NewRequest,
    SamplingOptions,
    StepPlan,
    StepResult,
)
from npuserve.scheduler.lanes.executor_client import ExecutorError
from npuserve.scheduler.lanes.in_process_client import InProcessClient

INFO = ExecutorInfo(
    model="m", architecture="LlamaForCausalLM", block_size=4, num_blocks=16, max_model_len=64,
    max_num_seqs=4, max_num_batched_tokens=64, vocab_size=512, eos_token_ids=[2], dtype="float32",
    device="cpu",
)  # fmt: skip
GREEDY = SamplingOptions(temperature=0)


class _RecordedFaults(FaultyRunner):
    """`FaultyRunner` (step 0 fails as a device fault would), keeping the ids of the steps it ran
    and the threads it ran them on."""

    def __init__(self) -> None:
        super().__init__(INFO)
        self.ran: list[int] = []
        self.threads: set[int] = set()

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        self.ran.append(plan.step_id)
        self.threads.add(threading.get_ident())
        return super().execute(plan, on_first_pass, joining)


def test_pipelined_steps_come_back_in_order_and_a_refusal_fails_those_after_it() -> None:
    async def run() -> None:
        runner = _RecordedFaults()
        client = InProcessClient(runner)
        pending = [await client.submit(StepPlan(step_id=i)) for i in (2, 3, 4)]
        assert [await p.result() for p in pending] == [StepResult(step_id=i) for i in (2, 3, 4)]
        done, refused, after = [await client.submit(StepPlan(step_id=i)) for i in (5, 0, 6)]
        assert await done.result() == StepResult(step_id=5)
        with pytest.raises(ExecutorError) as failure:
            await refused.result()
        assert (failure.value.code, failure.value.message) == ("INTERNAL", "RuntimeError: device lost")
        with pytest.raises(ExecutorError) as cancelled:
            await after.result()
        assert cancelled.value.code == "CANCELLED"
        assert await (await client.submit(StepPlan(step_id=7))).result() == StepResult(step_id=7)
        assert runner.ran == [2, 3, 4, 5, 0, 7]  # the step after the refusal was not run
        assert threading.get_ident() not in runner.threads and len(runner.threads) == 1
        await client.close()

    asyncio.run(run())


def test_a_closed_client_takes_no_step_and_does_not_serve() -> None:
    async def run() -> None:
        client = InProcessClient(FaultyRunner(INFO))
        assert await client.health()
        await client.close()
        await client.close()  # NOTE: closing twice is closing once
        assert not await client.health()
        with pytest.raises(ExecutorError) as refused:
            await client.submit(StepPlan(step_id=2))
        assert refused.value.code == "UNAVAILABLE"

    asyncio.run(run())


def _simulated() -> SimulatedRunner:
    return SimulatedRunner(SimulatedConfig(latency=LatencyModel(0.0, 0.0, 0.0), num_blocks=16, block_size=4))


def _admit(req_id: str, prompt: list[int], block_ids: list[int]) -> NewRequest:
    return NewRequest(req_id, prompt, len(prompt), GREEDY, block_ids, 0)


def test_the_requests_a_multi_step_plan_admits_are_answered_before_its_result() -> None:
    """With `early_results`, the requests that run only the first pass of a multi-step plan come
    in a partial answer before the plan's result, which names the others; not asked, one answer."""

    async def run() -> None:
        runner = _simulated()
        client = InProcessClient(runner)
        admit_a = StepPlan(0, [_admit("a", [1, 2, 3], [1, 2, 5])], num_scheduled_tokens={"a": 3})
        await (await client.submit(admit_a)).result()
        both = StepPlan(
            1, [_admit("b", [4, 5], [3])], num_scheduled_tokens={"a": 1, "b": 2}, num_steps={"a": 4}
        )
        pending = await client.submit(both, early_results=True)
        early, final = await pending.result(), await pending.result()
        assert early == StepResult(1, ["b"], [runner.token_for("b", 2)], [None], partial=True)
        a_tokens = [runner.token_for("a", k) for k in range(4, 8)]
        assert (final.sampled_req_ids, final.sampled_token_ids, final.partial) == (["a"] * 4, a_tokens, False)
        again = StepPlan(
            2, [_admit("c", [6, 7], [4])], num_scheduled_tokens={"a": 1, "c": 2}, num_steps={"a": 2}
        )
        whole = await (await client.submit(again)).result()  # not asked: one answer
        assert len(whole.sampled_req_ids) == 3 and not whole.partial
        await client.close()

    asyncio.run(run())


class _Gated(SimulatedRunner):
    """A simulated runner whose first step waits for ``gate``: the steps sent meanwhile queue."""

    def __init__(self) -> None:
        super().__init__(_simulated().config)
        self.gate = threading.Event()

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        assert self.gate.wait(10)
        return super().execute(plan, on_first_pass, joining)


def test_a_step_that_joins_a_running_one_is_answered_before_its_result() -> None:
    """A step marked `joins_running`, sent while a multi-pass step waited to run, joins its first
    pass: its answer comes on the running step's stream before that step's result."""

    async def run() -> None:
        runner = _Gated()
        client = InProcessClient(runner)
        admitted = await client.submit(
            StepPlan(0, [_admit("a", [1, 2, 3], [1, 2])], num_scheduled_tokens={"a": 3})
        )
        host = await client.submit(StepPlan(1, num_scheduled_tokens={"a": 1}, num_steps={"a": 4}))
        joiner = StepPlan(2, [_admit("c", [4, 5], [3])], num_scheduled_tokens={"c": 2}, joins_running=True)
        await client.submit(joiner)
        runner.gate.set()
        await admitted.result()
        joined, final = await host.result(), await host.result()
        assert (joined.step_id, joined.sampled_req_ids) == (2, ["c"])
        assert joined.sampled_token_ids == [runner.token_for("c", 2)]
        assert (final.step_id, final.sampled_req_ids) == (1, ["a"] * 4)
        await client.close()

    asyncio.run(run())
