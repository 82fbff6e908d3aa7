"""The real `Engine`, its lanes and their schedulers in this process, over `SimulatedRunner`s
behind `InProcessClient`s (as `scheduler/server.py` builds it over gRPC clients): the lanes
are the ones scheduler worker processes run, on the engine's event loop; no model, no network,
steps as fast as the bookkeeping allows.

A simulated runner samples a token that depends only on the request id and the position
(`SimulatedRunner.token_for`), so the tokens a request must stream are known in advance, on
whichever executor it runs, and after any move between executors.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from npuserve.executor.simulated import LatencyModel, SimulatedConfig, SimulatedRunner
from npuserve.proto.step_plan import (
    EXECUTOR_ROLE_MIXED,
    ExecutorInfo,
    FirstPassAnswer,
    JoiningSteps,
    StepPlan,
    StepResult,
)
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.core.router import DEFAULT_MAX_LOCAL_PREFILL_LENGTH
from npuserve.scheduler.engine.engine import Engine
from npuserve.scheduler.engine.engine_config import EngineConfig
from npuserve.scheduler.engine.outputs import GenerateOutput
from npuserve.scheduler.lanes.executor_client import ExecutorError
from npuserve.scheduler.lanes.in_process_client import InProcessClient
from npuserve.scheduler.lanes.lane import StepClient
from npuserve.scheduler.text.prompts import PromptInput
from npuserve.scheduler.text.tokenizer import Tokenizer

MODEL = "simulated"
# Small pools, so that block counts are easy to reason about; no modelled latency.
SMALL = SimulatedConfig(
    latency=LatencyModel(0.0, 0.0, 0.0),
    num_blocks=65,  # 64 usable
    block_size=4,
    max_model_len=128,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    vocab_size=512,  # stories260K's tokenizer
)


class ControlledExecutor(InProcessClient):
    """An in-process executor over a simulated runner (the client is its own runner: its steps
    pass through `execute` on the client's thread), whose steps after the first ``pause_at``
    wait for `resume` (so a test can act while a request is surely mid-run), and whose steps
    after the first ``fail_at`` fail with the gRPC status ``code``, as the executor client
    reports it (UNAVAILABLE: the executor is gone, and from then answers no `health` check;
    INTERNAL: this step's requests failed, while it still answers `health`; once
    ``answers_health`` is False, a killed executor's stream that ended as INTERNAL)."""

    def __init__(
        self,
        runner: SimulatedRunner,
        pause_at: int | None = None,
        fail_at: int | None = None,
        code: str = "UNAVAILABLE",
        role: str = EXECUTOR_ROLE_MIXED,
        address: str = "",
    ) -> None:
        """``role``: its `ExecutorInfo.role`; ``address``: where other executors reach it (the
        source address of the blocks they pull from it)."""
        self.simulated = runner
        self.role = role
        # The executors its steps pull from, by address: a pull from one that is gone, or whose
        # reads fail (``refuses_reads``), fails that pull's request only, as `ModelRunner` does
        # (its step's result names it).
        self.peers: dict[str, ControlledExecutor] = {}
        self.refuses_reads = False
        self.pause_at, self.fail_at, self.code = pause_at, fail_at, code
        self.num_steps = 0
        self.paused = threading.Event()  # set while a step waits for `resume`
        self.resume = threading.Event()
        self.draining = False  # what its step answers say (SIGTERM: no new requests for it)
        self.answers_health = True
        super().__init__(self, address)

    def info(self) -> ExecutorInfo:
        return replace(self.simulated.info(), role=self.role)

    async def health(self) -> bool:
        return self.answers_health

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        self.num_steps += 1
        if self.pause_at is not None and self.num_steps > self.pause_at:
            self.paused.set()
            self.resume.wait(timeout=30)
            self.paused.clear()
        if self.fail_at is not None and self.num_steps > self.fail_at:
            if self.code == "UNAVAILABLE":
                self.answers_health = False
            raise ExecutorError(self.code, "injected failure")
        failed = [
            pull.req_id
            for pull in plan.kv_pulls
            if not (source := self.peers[pull.address]).answers_health or source.refuses_reads
        ]
        if failed:  # NOTE: the step runs on; its result names them
            plan = replace(plan, kv_pulls=[pull for pull in plan.kv_pulls if pull.req_id not in failed])
            for req_id in failed:
                self.simulated.pull_outcomes.settle(req_id, landed=False)
        result = self.simulated.execute(plan, on_first_pass, joining)
        result.draining = self.draining
        return result


@dataclass
class SimulatedEngine:
    engine: Engine
    executors: dict[str, ControlledExecutor]

    def expected_tokens(self, req_id: str, num_prompt: int, num_new: int) -> list[int]:
        runner = next(iter(self.executors.values())).simulated
        return [runner.token_for(req_id, num_prompt + i) for i in range(num_new)]

    def sampled_by(self) -> dict[str, int]:
        """Tokens each executor sampled so far."""
        return {name: executor.simulated.stats.num_sampled for name, executor in self.executors.items()}

    async def wait_paused(self) -> str:
        """Until an executor waits in a paused step (its scheduler is then still); its id."""
        for _ in range(2000):
            for name, executor in self.executors.items():
                if executor.paused.is_set():
                    return name
            await asyncio.sleep(0.005)
        raise AssertionError("no executor paused")

    def resume(self) -> None:
        for executor in self.executors.values():
            executor.pause_at = None
            executor.resume.set()

    async def wait_idle(self) -> None:
        """Until no lane holds a request or has a step to send (the one that drops finished
        requests included); lane events sent before are handled by then."""
        for _ in range(1000):
            if not any(lane.has_work for lane in self.engine.lanes.values()) and all(
                state.num_requests == 0 for state in await self.engine.check_integrity()
            ):
                return
            await asyncio.sleep(0.005)
        raise AssertionError("the lanes did not become idle")


@asynccontextmanager
async def simulated_engine(
    tokenizer: Tokenizer,
    num_executors: int = 2,
    config: SimulatedConfig = SMALL,
    pause_at: int | None = None,
    failing: dict[str, tuple[int, str]] | None = None,
    routing: str = "prefix-aware",
    max_queued_requests: int | None = None,
    stream_interval: int = 1,
    num_scheduler_steps: int = 1,
    async_scheduling: bool = False,
    roles: dict[str, str] | None = None,
    max_local_prefill_length: int = DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
) -> AsyncIterator[SimulatedEngine]:
    """A started engine over ``num_executors`` simulated executors ``e0, e1, ...``, each pausing
    after ``pause_at`` steps; ``failing`` maps some of them to (the number of steps they serve,
    the status code they fail with then), ``roles`` some of them to their role (others are
    mixed). On exit every pool must pass its integrity check with
    no request left, and every lane is stopped."""
    failing, roles = failing or {}, roles or {}
    controlled = {
        name: ControlledExecutor(
            SimulatedRunner(config),
            pause_at,
            *failing.get(name, (None, "UNAVAILABLE")),
            role=roles.get(name, EXECUTOR_ROLE_MIXED),
            address=f"simulated-{name}:0",
        )
        for name in (f"e{i}" for i in range(num_executors))
    }
    for executor in controlled.values():
        executor.peers = {peer.address: peer for peer in controlled.values()}
    executors: list[tuple[str, StepClient, ExecutorInfo]] = [
        (name, executor, executor.info()) for name, executor in controlled.items()
    ]
    engine_config = EngineConfig(
        MODEL,
        routing=routing,
        max_queued_requests=max_queued_requests,
        stream_interval=stream_interval,
        num_scheduler_steps=num_scheduler_steps,
        async_scheduling=async_scheduling,
        max_local_prefill_length=max_local_prefill_length,
    )
    engine = Engine(engine_config, tokenizer, executors)
    engine.start()
    simulated = SimulatedEngine(engine, controlled)
    try:
        yield simulated
        await engine.check_integrity(expect_idle=True)
    finally:
        simulated.resume()
        await engine.stop()  # NOTE: the lanes it retired too


@dataclass
class Collected:
    """A client request's stream, put together."""

    outputs: list[GenerateOutput]
    tokens: dict[int, list[int]]  # per choice index
    text: dict[int, str]
    finish_reasons: dict[int, str | None]

    @property
    def last(self) -> GenerateOutput:
        return self.outputs[-1]


def collect_outputs(outputs: list[GenerateOutput]) -> Collected:
    collected = Collected(outputs, {}, {}, {})
    for output in outputs:
        for delta in output.completions:
            collected.tokens.setdefault(delta.index, []).extend(delta.token_ids)
            collected.text[delta.index] = collected.text.get(delta.index, "") + delta.text
            collected.finish_reasons[delta.index] = delta.finish_reason
    return collected


async def generate(
    engine: Engine, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
) -> Collected:
    """Streams one request to its end."""
    stream = engine.generate(PromptInput(token_ids=prompt_ids), params, request_id)
    return collect_outputs([output async for output in stream])
