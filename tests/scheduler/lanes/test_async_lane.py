"""`ExecutorLane`, every executor's step loop (a scheduler worker's, and the engine's own).

Over a simulated executor in this process (`InProcessClient`): requests run to completion,
`finish` frees blocks at once, `call` runs between steps and returns or raises, a step that
fails runs its requests again once and then ends them, an executor that is gone (or answers no
health check) hands every request back, and async scheduling pipelines steps without changing a
token. Over a real executor server (gRPC): an executor that cannot be reached takes the lane
down with every request handed back (evacuated) for another executor, a request admitted beside
running ones (multi-step) is answered before its step lands, steps join running ones, and
`--num-scheduler-steps auto` follows the executor's waits. Its steps in whole deployments are
the scenarios' (`test_step_workers`, `test_failover`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from harness.simulated_engine import SMALL, ControlledExecutor

from npuserve.executor.server import RunningExecutor, start_executor_server
from npuserve.executor.simulated import LatencyModel, SimulatedConfig, SimulatedRunner
from npuserve.proto.step_plan import FirstPassAnswer, JoiningSteps, StepPlan, StepResult
from npuserve.scheduler.core.request import Request, RequestStatus, SamplingParams
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.core.scheduler_config import SchedulerConfig
from npuserve.scheduler.core.step_passes import AUTO_MAX_PASSES, AUTO_SCHEDULER_STEPS, PassController
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.async_lane import ExecutorLane, always_room
from npuserve.scheduler.lanes.in_process_client import InProcessClient
from npuserve.scheduler.lanes.lane import LaneEvent, PendingStep
from npuserve.scheduler.lanes.step_frames import make_report


def _request(req_id: str) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    return Request(req_id, [1, 5, 6, 7], params, params.to_options((2,)), (2,), 64, 4)


async def _room() -> bool:
    return True


# -- over an executor in this process ------------------------------------------------------------

EOS = SMALL.eos_token_ids


def _small_request(req_id: str, num_prompt: int, max_tokens: int) -> Request:
    """A request sized for `SMALL`'s pool of 64 blocks of 4."""
    params = SamplingParams(max_tokens=max_tokens)
    prompt = [3 + (i * 7) % 500 for i in range(num_prompt)]
    return Request(req_id, prompt, params, params.to_options(EOS), EOS, SMALL.max_model_len, SMALL.block_size)


class _Awaited:
    """A lane's `on_event`: keeps every event; `until` waits for one that satisfies a test."""

    def __init__(self) -> None:
        self.seen: list[LaneEvent] = []
        self._came = asyncio.Event()

    def __call__(self, lane: ExecutorLane, event: LaneEvent) -> None:
        self.seen.append(event)
        self._came.set()

    async def until(self, done: Callable[[LaneEvent], bool]) -> LaneEvent:
        """The first event since the last `until` that satisfies ``done``, within 10 s (a bound)."""
        while True:
            while self.seen:
                event = self.seen.pop(0)
                if done(event):
                    return event
            self._came.clear()
            await asyncio.wait_for(self._came.wait(), 10)


def _in_process_lane(
    client: InProcessClient, on_event: _Awaited, async_scheduling: bool = False, **config: Any
) -> ExecutorLane:
    """A started lane over ``client`` (its executor's capacity, and ``config`` on top)."""
    info = client.runner.info()
    scheduler_config = SchedulerConfig.for_executor(info, **config)
    lane = ExecutorLane("x", client, Scheduler(scheduler_config), on_event, async_scheduling, always_room)
    lane.start()
    return lane


async def _close_idle(lane: ExecutorLane) -> None:
    """The lane's pool is whole and idle (checked between its steps), and it closes."""
    await asyncio.wrap_future(lane.call(lambda s: s.check_integrity(expect_idle=True)))
    await lane.aclose(5)


def test_requests_run_to_completion_with_their_tokens() -> None:
    async def run() -> None:
        executor = ControlledExecutor(SimulatedRunner(SMALL))
        events = _Awaited()
        lane = _in_process_lane(executor, events)
        lane.submit([_small_request("a", 9, 5), _small_request("b", 3, 2)])
        finished: dict[str, RequestStatus] = {}
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        while len(finished) < 2:
            event = await events.until(lambda e: True)
            assert event.stats is not None and not event.ended and not event.evacuated
            for update in event.updates:
                tokens[update.request.req_id] += update.new_token_ids
                if update.finished is not None:
                    finished[update.request.req_id] = update.finished
        runner = executor.simulated
        assert tokens == {
            "a": [runner.token_for("a", 9 + i) for i in range(5)],
            "b": [runner.token_for("b", 3 + i) for i in range(2)],
        }
        assert finished == {"a": RequestStatus.FINISHED_LENGTH, "b": RequestStatus.FINISHED_LENGTH}
        assert lane.num_steps >= 5 and lane.alive and lane.load == 0  # then a plan with the drops
        await _close_idle(lane)

    asyncio.run(run())


def test_the_lane_says_it_went_idle_once_each_time_its_work_ends() -> None:
    async def run() -> None:
        client = ControlledExecutor(SimulatedRunner(SMALL))
        events = _Awaited()
        went_idle = asyncio.Event()
        idle_calls: list[int] = []

        def on_idle() -> None:
            idle_calls.append(lane.num_steps)
            went_idle.set()

        config = SchedulerConfig.for_executor(client.runner.info())
        lane = ExecutorLane("x", client, Scheduler(config), events, False, always_room, on_idle=on_idle)
        lane.start()
        await asyncio.wrap_future(lane.call(lambda s: None))  # a turn of the loop with no work
        assert not idle_calls, "a lane that had no work did not go idle"
        for turn in range(2):
            went_idle.clear()
            lane.submit([_small_request(f"r{turn}", 9, 3)])
            await asyncio.wait_for(went_idle.wait(), 10)
            assert lane.load == 0 and not lane.has_work and len(idle_calls) == turn + 1
            for _ in range(3):  # more turns of the idle loop: no second call
                await asyncio.wrap_future(lane.call(lambda s: None))
            assert len(idle_calls) == turn + 1
        assert idle_calls[0] < idle_calls[1]  # each after its work's steps
        await _close_idle(lane)

    asyncio.run(run())


def test_call_runs_between_steps_and_returns_or_raises() -> None:
    async def run() -> None:
        lane = _in_process_lane(ControlledExecutor(SimulatedRunner(SMALL)), _Awaited())
        assert (
            await asyncio.wrap_future(lane.call(lambda s: s.kv.pool.num_free_blocks)) == SMALL.num_blocks - 1
        )

        def broken(_: Scheduler) -> None:
            raise KeyError("nope")

        with pytest.raises(KeyError):
            await asyncio.wrap_future(lane.call(broken))
        await _close_idle(lane)

    asyncio.run(run())


def test_finish_frees_a_running_requests_blocks_at_once() -> None:
    async def run() -> None:
        executor = ControlledExecutor(SimulatedRunner(SMALL), pause_at=2)
        events = _Awaited()
        lane = _in_process_lane(executor, events)
        lane.submit([_small_request("a", 20, 50)])
        assert await asyncio.to_thread(executor.paused.wait, 10)  # in its third step
        assert lane.scheduler.kv.pool.num_free_blocks == SMALL.num_blocks - 1 - 6  # 22 tokens
        lane.finish(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
        executor.resume.set()
        (ended,) = (await events.until(lambda e: bool(e.ended))).ended
        assert (ended.req_id, ended.status, ended.num_output_tokens) == (
            "a",
            RequestStatus.FINISHED_ABORTED,
            3,
        )
        free = await asyncio.wrap_future(lane.call(lambda s: s.kv.pool.num_free_blocks))
        assert free == SMALL.num_blocks - 1
        await _close_idle(lane)

    asyncio.run(run())


def test_a_step_that_fails_again_ends_its_requests_with_an_error() -> None:
    """Every step after the first fails: the requests run again once, then end with the error."""

    async def run() -> None:
        executor = ControlledExecutor(SimulatedRunner(SMALL), fail_at=1, code="INTERNAL")
        events = _Awaited()
        lane = _in_process_lane(executor, events)
        lane.submit([_small_request("a", 6, 10), _small_request("b", 6, 10)])
        event = await events.until(lambda e: bool(e.ended))
        assert sorted(r.req_id for r in event.ended) == ["a", "b"] and event.failed_step
        assert all(r.status == RequestStatus.FINISHED_ERROR and r.num_step_retries == 1 for r in event.ended)
        assert executor.num_steps >= 3  # the first, the failed one, and the one they ran again in
        assert event.error == "executor x failed: INTERNAL: injected failure"
        assert lane.alive  # one failed step does not take the executor out
        await _close_idle(lane)

    asyncio.run(run())


def test_a_failed_step_is_no_interval_of_the_executors_busy_time() -> None:
    """Under `--num-scheduler-steps auto` the lane measures the executor's busy share between
    steps that land back to back. A step that fails (here after hanging 1 s) tells nothing of
    it, so the step after it does not follow a landing: no interval across the failure is
    measured as the executor waiting."""
    spans: list[float] = []

    class Watched(PassController):
        """The controller the lane starts with, whose intervals this test sees."""

        def observe(self, busy_s: float, span_s: float, now: float) -> int:
            spans.append(span_s)
            return super().observe(busy_s, span_s, now)

    async def run() -> None:
        executor = ControlledExecutor(SimulatedRunner(SMALL), pause_at=1, fail_at=1, code="INTERNAL")
        events = _Awaited()
        lane = _in_process_lane(executor, events, num_scheduler_steps=AUTO_SCHEDULER_STEPS)
        assert lane.pacing.controller is not None
        lane.pacing.controller = Watched()
        lane.submit([_small_request("a", 6, 10)])
        assert await asyncio.to_thread(executor.paused.wait, 10)  # its second step hangs
        await asyncio.sleep(1.0)
        executor.resume.set()
        await events.until(lambda e: bool(e.ended))  # ... and fails
        executor.fail_at = None
        lane.submit([_small_request("b", 6, 10)])
        await events.until(lambda e: any(u.finished for u in e.updates))
        # b's steps, back to back (sub-millisecond here), and none across the hang
        assert spans and max(spans) < 1.0, spans
        await _close_idle(lane)

    asyncio.run(run())


def test_an_unreachable_executor_hands_every_request_back() -> None:
    """The requests come back reset to recompute, with the tokens they have; requests submitted
    afterwards come straight back too."""

    async def run() -> None:
        executor = ControlledExecutor(SimulatedRunner(SMALL), fail_at=2, code="UNAVAILABLE")
        events = _Awaited()
        lane = _in_process_lane(executor, events)
        lane.submit([_small_request("a", 6, 10), _small_request("b", 10, 10)])
        event = await events.until(lambda e: e.lane_down)
        assert sorted(r.req_id for r in event.evacuated) == ["a", "b"]
        for request in event.evacuated:
            assert request.status == RequestStatus.WAITING
            assert request.num_computed_tokens == 0 and request.num_output_tokens == 2
        assert not lane.alive and event.error == lane.down_reason
        assert lane.down_reason is not None and "executor x is unreachable" in lane.down_reason
        lane.submit([_small_request("late", 4, 2)])
        late = await events.until(lambda e: True)
        assert [r.req_id for r in late.evacuated] == ["late"] and not late.lane_down
        await lane.aclose(5)

    asyncio.run(run())


def test_a_failed_step_of_an_executor_that_answers_no_health_check_takes_the_lane_down() -> None:
    """A killed executor's step stream can end as INTERNAL (gRPC's client reports a write after
    the connection broke so): not the executor failing the step's requests, since it no longer
    answers. Its requests are handed back with their tokens, none ends in an error."""

    async def run() -> None:
        executor = ControlledExecutor(SimulatedRunner(SMALL), fail_at=2, code="INTERNAL")
        executor.answers_health = False
        events = _Awaited()
        lane = _in_process_lane(executor, events)
        lane.submit([_small_request("a", 6, 10), _small_request("b", 10, 10)])
        event = await events.until(lambda e: e.lane_down or bool(e.ended))
        assert event.lane_down and not event.ended
        assert sorted(r.req_id for r in event.evacuated) == ["a", "b"]
        assert all(r.num_output_tokens == 2 for r in event.evacuated)
        assert lane.down_reason is not None and "answers no health check" in lane.down_reason
        await lane.aclose(5)

    asyncio.run(run())


def test_take_down_hands_every_request_back() -> None:
    async def run() -> None:
        executor = ControlledExecutor(SimulatedRunner(SMALL), pause_at=1)
        events = _Awaited()
        lane = _in_process_lane(executor, events)
        lane.submit([_small_request("a", 6, 10)])
        assert await asyncio.to_thread(executor.paused.wait, 10)
        lane.take_down("its registration expired")
        executor.resume.set()
        event = await events.until(lambda e: e.lane_down)
        assert [r.req_id for r in event.evacuated] == ["a"]
        assert (event.error, lane.alive) == ("its registration expired", False)
        await lane.aclose(5)

    asyncio.run(run())


class _CountsUnread(InProcessClient):
    """Counts the steps sent whose answer has not been read: two at once when the lane sends the
    next step before it reads the last one's result."""

    def __init__(self, runner: SimulatedRunner) -> None:
        super().__init__(runner)
        self.unread = 0
        self.most_unread = 0

    async def submit(self, plan: StepPlan, early_results: bool = False) -> PendingStep:
        pending = await super().submit(plan, early_results)
        self.unread += 1
        self.most_unread = max(self.most_unread, self.unread)
        return _Counted(self, pending)


class _Counted:
    def __init__(self, client: _CountsUnread, pending: PendingStep) -> None:
        self.client, self.pending = client, pending

    async def result(self) -> StepResult:
        try:
            return await self.pending.result()
        finally:
            self.client.unread -= 1


async def _run_to_completion(
    client: InProcessClient, requests: list[Request], async_scheduling: bool
) -> dict[str, list[int]]:
    """Every request's tokens, run on one lane (which had to preempt); the pool is intact and
    idle afterwards."""
    events = _Awaited()
    lane = _in_process_lane(client, events, async_scheduling)
    tokens: dict[str, list[int]] = {r.req_id: [] for r in requests}
    finished: set[str] = set()
    lane.submit(requests)
    while len(finished) < len(requests):
        event = await events.until(lambda e: True)
        assert not event.ended and not event.evacuated
        for update in event.updates:
            tokens[update.request.req_id] += update.new_token_ids
            if update.finished is not None:
                finished.add(update.request.req_id)
    assert await asyncio.wrap_future(lane.call(lambda s: s.total_preemptions)) > 0
    await _close_idle(lane)
    return tokens


def test_async_scheduling_pipelines_steps_and_gives_the_same_tokens_under_preemption() -> None:
    # 12 requests of 9 + 20 tokens need 96 blocks of 4 at the end: 64 force preemptions.
    def requests() -> list[Request]:
        return [_small_request(f"r{i}", 9 + i % 3, 20) for i in range(12)]

    async def run() -> None:
        one_at_a_time = await _run_to_completion(InProcessClient(SimulatedRunner(SMALL)), requests(), False)
        pipelined = _CountsUnread(SimulatedRunner(SMALL))
        assert await _run_to_completion(pipelined, requests(), True) == one_at_a_time
        assert pipelined.most_unread == 2, "the next step was sent before the last one's result was read"
        assert all(len(t) == 20 or t[-1] in EOS for t in one_at_a_time.values())

    asyncio.run(run())


# -- over an executor server ---------------------------------------------------------------------


class _PacedRunner(SimulatedRunner):
    """A simulated runner whose every forward pass takes ``pass_s``."""

    def __init__(self, pass_s: float, num_blocks: int = 64) -> None:
        latency = LatencyModel(base_s=pass_s, per_token_s=0.0, per_seq_s=0.0)
        super().__init__(SimulatedConfig(latency=latency, num_blocks=num_blocks, block_size=4))
        self.pass_s = pass_s


def _paced_executor(pass_s: float, num_blocks: int) -> tuple[SimulatedRunner, RunningExecutor]:
    """A `_PacedRunner` serving on loopback."""
    runner = _PacedRunner(pass_s, num_blocks)
    return runner, start_executor_server(runner, "127.0.0.1", 0, "sim")


async def _stream_client(
    address: str, kind: type[AioExecutorClient] = AioExecutorClient
) -> AioExecutorClient:
    """A step-stream client of the executor at ``address``, after the front's handshake."""
    client = kind(address, "", 10)
    await client.info()
    return client


class _Events:
    """A lane's `on_event`: keeps every event, and sets ``woken`` for those ``wakes`` picks."""

    def __init__(self, wakes: Callable[[LaneEvent], bool] = lambda event: True) -> None:
        self.seen: list[LaneEvent] = []
        self.woken = asyncio.Event()
        self.wakes = wakes

    def __call__(self, lane: ExecutorLane, event: LaneEvent) -> None:
        self.seen.append(event)
        if self.wakes(event):
            self.woken.set()


async def _until_finished(*requests: Request) -> None:
    """Until every one of ``requests`` has finished, or 10 s (a bound, not a measure)."""
    for _ in range(500):
        if all(r.status.is_finished for r in requests):
            return
        await asyncio.sleep(0.02)


async def _close_after_generating(lane: ExecutorLane, runner: SimulatedRunner, *requests: Request) -> None:
    """Each of ``requests`` (a prompt of 4 tokens) ran to its ``max_tokens`` with the simulated
    executor's tokens; the lane closes with its pool idle and whole."""
    for request in requests:
        want = request.params.max_tokens
        assert want is not None
        assert request.output_token_ids == [runner.token_for(request.req_id, k) for k in range(4, 4 + want)]
    await lane.aclose(5)
    lane.scheduler.check_integrity(expect_idle=True)


def _run_against(running: RunningExecutor, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
    try:
        asyncio.run(run())
    finally:
        running.stop(grace_s=0)


async def _start_and_learn_the_pace(
    address: str, on_event: _Events, joins_steps: bool, client: type[AioExecutorClient] = AioExecutorClient
) -> tuple[ExecutorLane, Request]:
    """A lane with four passes a step, async scheduling and early first tokens over the
    executor at ``address``, and a request "a" of 24 tokens on it, once three steps have landed
    (its prefill, then multi-pass steps: the lane has learnt their pace; ``on_event`` must wake
    at each landing) and 50 ms more: into the first pass of the step in flight."""
    config = SchedulerConfig(num_blocks=64, block_size=4, num_scheduler_steps=4, early_first_tokens=True)
    lane = ExecutorLane(
        "e0",
        await _stream_client(address, client),
        Scheduler(config),
        on_event,
        True,
        _room,
        joins_steps=joins_steps,
    )
    lane.start()
    params = SamplingParams(temperature=0.0, max_tokens=24)
    a = Request("a", [1, 5, 6, 7], params, params.to_options((2,)), (2,), 64, 4)
    lane.submit([a])
    for _ in range(3):
        on_event.woken.clear()
        await asyncio.wait_for(on_event.woken.wait(), 10)
    assert lane.pacing.pass_seconds > 0
    await asyncio.sleep(0.05)
    return lane, a


def test_an_unreachable_executor_takes_the_lane_down_with_its_requests_handed_back() -> None:
    async def run() -> None:
        on_event = _Events(lambda event: event.lane_down)
        events, down = on_event.seen, on_event.woken

        client = AioExecutorClient("127.0.0.1:1", "", 5)
        scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
        lane = ExecutorLane("e0", client, scheduler, on_event, True, _room)
        lane.start()
        assert await asyncio.wrap_future(lane.call(lambda s: s.num_unfinished)) == 0
        lane.submit([_request("r1"), _request("r2")])
        await asyncio.wait_for(down.wait(), 30)
        (event,) = [e for e in events if e.lane_down]
        assert sorted(r.req_id for r in event.evacuated) == ["r1", "r2"]
        assert "unreachable" in (event.error or "") and not lane.alive
        # Requests that come after it went down go straight back too.
        lane.submit([_request("r3")])
        for _ in range(1000):  # NOTE: bounded: the lane's task takes its commands on its next turn
            if [r.req_id for r in events[-1].evacuated] == ["r3"]:
                break
            await asyncio.sleep(0.01)
        assert [r.req_id for r in events[-1].evacuated] == ["r3"]
        await lane.aclose(5)
        assert lane._task is not None and lane._task.done()

    asyncio.run(run())


class _FailingRunner(SimulatedRunner):
    """A simulated runner whose third step fails as a device fault would (the executor answers
    INTERNAL): that step only (``failure`` "once"), every step from it ("always"), or that
    step, its executor draining then, as one that is going away does ("stops serving": its
    `Health` says it no longer serves)."""

    def __init__(self, failure: str) -> None:
        super().__init__(SimulatedConfig(num_blocks=16, block_size=4))
        self.failure = failure
        self.running: RunningExecutor | None = None
        self.num_steps = 0

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        self.num_steps += 1
        if self.num_steps == 3 or (self.failure == "always" and self.num_steps > 3):
            if self.failure == "stops serving" and self.running is not None:
                self.running.servicer.start_draining()
            raise RuntimeError("device lost")
        return super().execute(plan, on_first_pass, joining)


@pytest.mark.parametrize("failure", ["once", "always", "stops serving"])
def test_a_failed_step_runs_its_requests_again_once_while_the_executor_answers_health(failure: str) -> None:
    """A step the executor fails (INTERNAL) while it still serves runs its requests again, from
    their prompt and the tokens they have, on the same executor: a failure once changes no token
    of theirs; a second failure ends them with an error. An executor that answers no health check
    after the failure is taken as gone (a killed executor's stream can end as INTERNAL too): its
    requests are handed back."""
    runner = _FailingRunner(failure)
    running = start_executor_server(runner, "127.0.0.1", 0, "sim")
    runner.running = running

    async def run() -> None:
        requests = [_request("r1"), _request("r2")]
        on_event = _Events(
            lambda event: bool(event.ended or event.lane_down) or all(r.status.is_finished for r in requests)
        )
        client = await _stream_client(running.address)
        lane = ExecutorLane(
            "e0", client, Scheduler(SchedulerConfig(num_blocks=16, block_size=4)), on_event, True, _room
        )
        lane.start()
        lane.submit(requests)
        await asyncio.wait_for(on_event.woken.wait(), 30)
        if failure == "once":
            assert all(
                r.status == RequestStatus.FINISHED_LENGTH and r.num_step_retries == 1 for r in requests
            )
            assert not any(e.ended or e.lane_down for e in on_event.seen) and lane.alive
            await _close_after_generating(lane, runner, *requests)
            return
        (event,) = [e for e in on_event.seen if e.ended or e.lane_down]
        if failure == "stops serving":
            assert event.lane_down and not event.ended and not lane.alive
            assert sorted(r.req_id for r in event.evacuated) == ["r1", "r2"]
            assert "answers no health check" in (event.error or "")
        elif failure == "always":
            assert sorted(r.req_id for r in event.ended) == ["r1", "r2"] and not event.lane_down
            assert all(
                r.status == RequestStatus.FINISHED_ERROR and r.num_step_retries == 1 for r in event.ended
            )
            assert "device lost" in (event.error or "") and lane.alive
            assert runner.num_steps >= 4  # they ran again before they failed
        await lane.aclose(5)
        lane.scheduler.check_integrity(expect_idle=True)

    _run_against(running, run)


def test_a_request_admitted_beside_running_ones_gets_its_first_token_before_the_step_lands() -> None:
    """With multi-step decoding over the step stream, a request admitted while another runs is
    answered after the step's first pass: its first token is reported in an event of its own (no
    step counted) before the step's result, which carries the running request's passes."""
    runner, running = _paced_executor(pass_s=0.05, num_blocks=16)

    async def run() -> None:
        on_event = _Events()
        events, woken = on_event.seen, on_event.woken

        async def until(done: Callable[[], bool]) -> None:
            for _ in range(200):  # NOTE: bounded: each step takes 50 ms a pass
                if done():
                    return
                woken.clear()
                await asyncio.wait_for(woken.wait(), 10)
            raise AssertionError("the lane did not get there")

        client = await _stream_client(running.address)
        config = SchedulerConfig(num_blocks=16, block_size=4, num_scheduler_steps=4, early_first_tokens=True)
        scheduler = Scheduler(config)
        lane = ExecutorLane("e0", client, scheduler, on_event, False, _room)
        lane.start()
        a, b = _request("a"), _request("b")
        lane.submit([a])
        await until(lambda: bool(a.output_token_ids))
        lane.submit([b])
        await until(lambda: a.status.is_finished and b.status.is_finished)
        first_b = next(i for i, e in enumerate(events) if any(u.request is b for u in e.updates))
        assert events[first_b].stats is None and [u.request for u in events[first_b].updates] == [b]
        landed = events[first_b + 1]  # the step that admitted b lands with a's passes
        assert landed.stats is not None and [u.request for u in landed.updates] == [a]
        assert len(landed.updates[0].new_token_ids) > 1  # its passes after the first
        await _close_after_generating(lane, runner, a, b)

    _run_against(running, run)


def test_a_pipelined_step_after_a_multi_pass_one_waits_for_its_last_pass() -> None:
    """With async scheduling and multi-step decoding, the step after a multi-pass one is sent
    shortly before that one ends, not as it starts: a request that arrives early in a step joins
    the next one (one step landed before its first token), as without async scheduling, rather
    than the one after it (two landed). Landed steps are counted, not times measured; the
    executor's passes are 100 ms each so the request comes well before the last one."""
    runner, running = _paced_executor(pass_s=0.1, num_blocks=64)

    async def run() -> None:
        on_event = _Events(lambda event: event.stats is not None)
        events = on_event.seen
        lane, a = await _start_and_learn_the_pace(running.address, on_event, joins_steps=False)
        since = len(events)
        b = _request("b")
        lane.submit([b])
        for _ in range(200):  # NOTE: bounded: a step is 400 ms
            if b.output_token_ids:
                break
            await asyncio.sleep(0.01)
        steps_before_b = [
            e for e in events[since:] if e.stats is not None and all(u.request is not b for u in e.updates)
        ]
        assert b.output_token_ids and len(steps_before_b) == 1
        await _until_finished(a, b)
        await _close_after_generating(lane, runner, a, b)

    _run_against(running, run)


def test_requests_that_come_during_a_multi_pass_step_join_its_next_pass() -> None:
    """Where the executor joins steps, requests that come while a multi-pass step runs start in
    a step that joins its next pass (`StepPlan.joins_running`): their first tokens come before
    that step lands, in an event marked `joined_step`, and their outputs and the running
    request's are the executor's, with the pool idle and whole at the end. Landed steps are
    counted, not times measured; each pass is 100 ms, so they come well before the last."""
    runner, running = _paced_executor(pass_s=0.1, num_blocks=64)

    async def run() -> None:
        on_event = _Events(lambda event: event.stats is not None)
        events = on_event.seen
        lane, a = await _start_and_learn_the_pace(running.address, on_event, joins_steps=True)
        assert lane.joining is not None and runner.info().joins_steps
        since = len(events)
        b, c = _request("b"), _request("c")
        lane.submit([b, c])
        for _ in range(200):  # NOTE: bounded: a step is 400 ms
            if b.output_token_ids and c.output_token_ids:
                break
            await asyncio.sleep(0.01)
        first = next(e for e in events[since:] if any(u.request is b for u in e.updates))
        assert first.joined_step and {u.request.req_id for u in first.updates} == {"b", "c"}
        steps_before = [e for e in events[since : events.index(first)] if e.stats is not None]
        assert not steps_before  # the step it joined had not landed
        await _until_finished(a, b, c)
        await _close_after_generating(lane, runner, a, b, c)

    _run_against(running, run)


class _RecordsSends(AioExecutorClient):
    """Keeps each plan it sends, with how many steps had landed then (``landed``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sent: list[tuple[StepPlan, int]] = []
        self.landed: Callable[[], int] = lambda: 0

    async def submit(self, plan: StepPlan, early_results: bool = False) -> Any:
        self.sent.append((plan, self.landed()))
        return await super().submit(plan, early_results)


def test_a_request_that_comes_after_the_next_step_was_sent_joins_that_step_at_once() -> None:
    """The step after a multi-pass one is sent two passes before that one ends. A request that
    comes after it was sent starts in a step that joins it, sent at once, while the step before
    still runs, rather than once that step has landed (by then the one it joins has begun). Its
    first token comes in a joined step. Steps are counted, not times measured: each pass is
    100 ms, so the request comes well inside those two passes."""
    runner, running = _paced_executor(pass_s=0.1, num_blocks=64)

    async def run() -> None:
        on_event = _Events(lambda event: event.stats is not None)
        events = on_event.seen
        lane, a = await _start_and_learn_the_pace(running.address, on_event, True, _RecordsSends)
        client = lane.client
        assert isinstance(client, _RecordsSends)
        client.landed = lambda: sum(event.stats is not None for event in events)
        since = len(client.sent)
        for _ in range(200):  # NOTE: bounded: a step is 400 ms
            if any(not plan.joins_running for plan, _ in client.sent[since:]):
                break
            await asyncio.sleep(0.005)
        ((_, landed_then),) = [(plan, n) for plan, n in client.sent[since:] if not plan.joins_running]
        b = _request("b")
        lane.submit([b])
        for _ in range(200):
            if b.output_token_ids:
                break
            await asyncio.sleep(0.01)
        joining = [n for plan, n in client.sent if plan.joins_running and "b" in plan.num_scheduled_tokens]
        assert joining == [landed_then]  # sent before the step that ran when it came had landed
        first = next(e for e in events if any(u.request is b for u in e.updates))
        assert first.joined_step
        await _until_finished(a, b)
        await _close_after_generating(lane, runner, a, b)

    _run_against(running, run)


class _FailsAtAJoin(_PacedRunner):
    """A paced simulated runner whose first joined pass fails as a device fault would: the
    step that was running fails (INTERNAL) and the one that joined it is never answered."""

    failed = False

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        return super().execute(plan, on_first_pass, None if joining is None else _FailingJoins(self, joining))


class _FailingJoins:
    """``joining``, but the first step taken from it fails the runner's step instead."""

    def __init__(self, runner: _FailsAtAJoin, joining: JoiningSteps) -> None:
        self.runner, self.joining = runner, joining

    def take(self, max_tokens: int) -> StepPlan | None:
        joiner = self.joining.take(max_tokens)
        if joiner is not None and not self.runner.failed:
            self.runner.failed = True
            raise RuntimeError("device lost")
        return joiner

    def answer(self, result: StepResult) -> None:
        self.joining.answer(result)


def test_a_step_that_fails_with_a_step_joining_it_runs_the_requests_of_both_again() -> None:
    """The running step fails at the pass a joining step was taken into (the executor still
    serves): the requests of both run again, from their prompts and tokens, and every output is
    the executor's; the pool ends idle and whole."""
    runner = _FailsAtAJoin(pass_s=0.1)
    running = start_executor_server(runner, "127.0.0.1", 0, "sim")

    async def run() -> None:
        on_event = _Events(lambda event: event.stats is not None)
        lane, a = await _start_and_learn_the_pace(running.address, on_event, joins_steps=True)
        b, c = _request("b"), _request("c")
        lane.submit([b, c])
        await _until_finished(a, b, c)  # NOTE: steps of 400 ms, one of them run again
        assert runner.failed, "no step joined: the failure was not exercised"
        assert not any(e.ended or e.lane_down for e in on_event.seen) and lane.alive
        assert a.num_step_retries == 1 and {b.num_step_retries, c.num_step_retries} == {1}
        await _close_after_generating(lane, runner, a, b, c)

    _run_against(running, run)


def _run_auto_passes(
    pass_s: float, async_scheduling: bool, room_wait_s: float, max_tokens: int
) -> tuple[list[int], int]:
    """One request on a lane under `--num-scheduler-steps auto` against an executor whose passes
    take ``pass_s``; the lane waits ``room_wait_s`` for room before each step (as it does behind
    a front that is behind). Returns the tokens of each landed step (its passes) and the passes
    the lane's report to the front gives last; the request's tokens are the executor's, and the
    lane closes idle."""
    runner, running = _paced_executor(pass_s=pass_s, num_blocks=128)
    tokens_per_step: list[int] = []
    reported: list[int] = []

    def landed(event: LaneEvent) -> bool:
        if event.stats is not None and event.updates:
            tokens_per_step.append(len(event.updates[0].new_token_ids))
        return False

    async def run() -> None:
        async def room() -> bool:
            await asyncio.sleep(room_wait_s)
            return True

        client = await _stream_client(running.address)
        config = SchedulerConfig.for_executor(
            runner.info(), num_scheduler_steps=AUTO_SCHEDULER_STEPS, early_first_tokens=True
        )
        assert config.auto_passes and config.num_scheduler_steps == 1
        lane = ExecutorLane("e0", client, Scheduler(config), _Events(landed), async_scheduling, room)
        lane.start()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        request = Request("a", [1, 5, 6, 7], params, params.to_options((2,)), (2,), 512, 4)
        lane.submit([request])
        for _ in range(3000):  # NOTE: bounded: at most 30 s
            if request.status.is_finished:
                break
            await asyncio.sleep(0.01)
        reported.append(make_report("e0", lane, LaneEvent(), {}).load.num_scheduler_steps)
        await _close_after_generating(lane, runner, request)

    _run_against(running, run)
    return tokens_per_step, reported[0]


def test_auto_passes_rise_while_the_executor_waits_on_the_scheduler() -> None:
    """`--num-scheduler-steps auto`: an executor whose 1 ms passes wait 20 ms for each step (the
    lane held back, as behind a front that is behind) is given more passes a step, up to the cap;
    the tokens are the executor's as with one pass."""
    tokens_per_step, reported = _run_auto_passes(
        pass_s=0.001, async_scheduling=False, room_wait_s=0.02, max_tokens=400
    )
    assert reported == AUTO_MAX_PASSES  # what the front's `npuserve:executor_scheduler_steps` shows
    assert tokens_per_step[0] == 1  # one pass to start with
    assert max(tokens_per_step) == AUTO_MAX_PASSES, tokens_per_step
    assert tokens_per_step[-2] == AUTO_MAX_PASSES, tokens_per_step  # and it stays there (the last: the rest)


def test_auto_passes_stay_at_one_while_the_executor_keeps_busy() -> None:
    """An executor whose 100 ms passes the lane keeps fed (async scheduling, room at once) never
    waits long on the scheduler: every step is one pass, vLLM's behaviour."""
    tokens_per_step, reported = _run_auto_passes(
        pass_s=0.1, async_scheduling=True, room_wait_s=0.0, max_tokens=24
    )
    assert tokens_per_step == [1] * 24 and reported == 1


class _FailsLate(_PacedRunner):
    """A paced simulated runner whose ``fail_at``-th step fails after its passes' time."""

    def __init__(self, pass_s: float, fail_at: int) -> None:
        super().__init__(pass_s)
        self.fail_at = fail_at
        self.num_steps = 0

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            time.sleep(self.pass_s * plan.num_passes)
            raise RuntimeError("device lost")
        return super().execute(plan, on_first_pass, joining)


class _HeldClient(AioExecutorClient):
    """Holds the sending of its ``hold_at``-th step until its health check, asked by a lane whose
    step failed, has answered (the lane then handles the failure before the send goes on)."""

    hold_at = 0
    num_submits = 0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.health_answered = asyncio.Event()

    async def health(self) -> bool:
        answer = await super().health()
        self.health_answered.set()
        return answer

    async def submit(self, plan: StepPlan, early_results: bool = False) -> Any:
        self.num_submits += 1
        if self.num_submits == self.hold_at:
            await asyncio.wait_for(self.health_answered.wait(), 10)
        return await super().submit(plan, early_results)


def test_a_step_being_sent_when_the_one_before_it_fails_fails_with_it() -> None:
    """With async scheduling and multi-pass steps, the next step is sent while the one before it
    lands; that one can fail meanwhile, its requests set to run again. The step being sent was
    planned from what the failure undid: it counts among the steps after the failed one (its
    answers read in their turn and dropped, its requests run again), and no token changes."""
    runner = _FailsLate(pass_s=0.02, fail_at=5)
    running = start_executor_server(runner, "127.0.0.1", 0, "sim")

    async def run() -> None:
        requests = [_request("r1"), _request("r2")]
        for request in requests:
            request.params.max_tokens = 24
        on_event = _Events(lambda event: all(r.status.is_finished for r in requests))
        client = await _stream_client(running.address, _HeldClient)
        client.hold_at = 6  # the step sent while the 5th runs
        config = SchedulerConfig(num_blocks=64, block_size=4, num_scheduler_steps=4, early_first_tokens=True)
        lane = ExecutorLane("e0", client, Scheduler(config), on_event, True, _room)
        lane.start()
        lane.submit(requests)
        await asyncio.wait_for(on_event.woken.wait(), 30)
        assert client.health_answered.is_set() and client.num_submits > 6
        assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_step_retries == 1 for r in requests)
        await _close_after_generating(lane, runner, *requests)

    _run_against(running, run)
