"""One executor's lane on its own thread, over a simulated executor in this process: requests run
to completion, `finish` frees blocks at once, `call` runs on the lane thread, and an executor
that fails either ends the step's requests (step failure) or hands every request back (down)."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from harness.simulated_engine import SMALL, ControlledExecutor, PipelinedExecutor

from npuserve.executor.local import LocalExecutor
from npuserve.executor.simulated import SimulatedRunner
from npuserve.scheduler.core.request import Request, RequestStatus, SamplingParams
from npuserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from npuserve.scheduler.core.step_passes import AUTO_SCHEDULER_STEPS, PassController
from npuserve.scheduler.lanes.lane import ExecutorLane, LaneEvent, StepExecutor

EOS = SMALL.eos_token_ids


def make_request(req_id: str, num_prompt: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(
        req_id,
        [3 + (i * 7) % 500 for i in range(num_prompt)],
        params=params,
        options=params.to_options(EOS),
        eos_token_ids=EOS,
        max_model_len=SMALL.max_model_len,
        block_size=SMALL.block_size,
    )


class Events:
    """The lane's events, as its thread reports them."""

    def __init__(self) -> None:
        self.queue: queue.Queue[LaneEvent] = queue.Queue()

    def on_event(self, lane: ExecutorLane, event: LaneEvent) -> None:
        self.queue.put(event)

    def next(self) -> LaneEvent:
        return self.queue.get(timeout=10)

    def until(self, done: object, max_events: int = 1000) -> list[LaneEvent]:
        """Events until one satisfies ``done`` (a predicate on an event)."""
        seen = []
        for _ in range(max_events):
            seen.append(self.next())
            if done(seen[-1]):  # type: ignore[operator]
                return seen
        raise AssertionError(f"no such event in {max_events}")


@contextmanager
def running_lane(executor: ControlledExecutor) -> Iterator[tuple[ExecutorLane, Events]]:
    events = Events()
    lane = ExecutorLane(
        "x", executor, Scheduler(SchedulerConfig.for_executor(executor.info())), events.on_event
    )
    lane.start()
    try:
        yield lane, events
        lane.call(lambda s: s.check_integrity(expect_idle=True)).result(timeout=10)
    finally:
        executor.resume.set()
        lane.stop()


def test_requests_run_to_completion_with_their_tokens() -> None:
    executor = ControlledExecutor(SimulatedRunner(SMALL))
    with running_lane(executor) as (lane, events):
        lane.submit([make_request("a", 9, 5), make_request("b", 3, 2)])
        finished: dict[str, RequestStatus] = {}
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        while len(finished) < 2:
            event = events.next()
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


def test_call_runs_on_the_lane_thread_and_returns_or_raises() -> None:
    with running_lane(ControlledExecutor(SimulatedRunner(SMALL))) as (lane, _):
        assert lane.call(lambda s: s.kv.pool.num_free_blocks).result(timeout=10) == SMALL.num_blocks - 1

        def broken(_: Scheduler) -> None:
            raise KeyError("nope")

        with pytest.raises(KeyError):
            lane.call(broken).result(timeout=10)


def test_finish_frees_a_running_requests_blocks_at_once() -> None:
    executor = ControlledExecutor(SimulatedRunner(SMALL), pause_at=2)
    with running_lane(executor) as (lane, events):
        lane.submit([make_request("a", 20, 50)])
        assert executor.paused.wait(10)  # in its third step
        assert lane.scheduler.kv.pool.num_free_blocks == SMALL.num_blocks - 1 - 6  # 22 tokens
        lane.finish(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
        executor.resume.set()
        (event,) = events.until(lambda e: e.ended)[-1:]
        (ended,) = event.ended
        assert (ended.req_id, ended.status, ended.num_output_tokens) == (
            "a",
            RequestStatus.FINISHED_ABORTED,
            3,
        )
        assert lane.call(lambda s: s.kv.pool.num_free_blocks).result(timeout=10) == SMALL.num_blocks - 1


def test_a_step_that_fails_again_ends_its_requests_with_an_error() -> None:
    """Every step after the first fails: the requests run again once, then end with the error."""
    executor = ControlledExecutor(SimulatedRunner(SMALL), fail_at=1, code="INTERNAL")
    with running_lane(executor) as (lane, events):
        lane.submit([make_request("a", 6, 10), make_request("b", 6, 10)])
        event = events.until(lambda e: e.ended)[-1]
        assert sorted(r.req_id for r in event.ended) == ["a", "b"]
        assert all(r.status == RequestStatus.FINISHED_ERROR and r.num_step_retries == 1 for r in event.ended)
        assert executor.num_steps >= 3  # the first, the failed one, and the one they ran again in
        assert event.error == "executor x failed: INTERNAL: injected failure"
        assert lane.alive  # one failed step does not take the executor out


def test_a_failed_step_is_no_interval_of_the_executors_busy_time() -> None:
    """Under `--num-scheduler-steps auto` the lane measures the executor's busy share between
    steps that land back to back. A step that fails (here after hanging 1 s) tells nothing of
    it, so the step after it does not follow a landing: no interval across the failure is
    measured as the executor waiting."""
    executor = ControlledExecutor(SimulatedRunner(SMALL), pause_at=1, fail_at=1, code="INTERNAL")
    events = Events()
    config = SchedulerConfig.for_executor(executor.info(), num_scheduler_steps=AUTO_SCHEDULER_STEPS)
    lane = ExecutorLane("x", executor, Scheduler(config), events.on_event)
    spans: list[float] = []

    class Watched(PassController):
        """The controller the lane starts with, whose intervals this test sees."""

        def observe(self, busy_s: float, span_s: float, now: float) -> int:
            spans.append(span_s)
            return super().observe(busy_s, span_s, now)

    assert lane.pass_controller is not None
    lane.pass_controller = Watched()
    lane.start()
    try:
        lane.submit([make_request("a", 6, 10)])
        assert executor.paused.wait(timeout=10)  # its second step hangs
        time.sleep(1.0)
        executor.resume.set()
        events.until(lambda e: e.ended)  # ... and fails
        executor.fail_at = None
        lane.submit([make_request("b", 6, 10)])
        events.until(lambda e: any(u.finished for u in e.updates))
        # b's steps, back to back (sub-millisecond here), and none across the hang
        assert spans and max(spans) < 1.0, spans
        lane.call(lambda s: s.check_integrity(expect_idle=True)).result(timeout=10)
    finally:
        lane.stop()


def test_an_unreachable_executor_hands_every_request_back() -> None:
    """The requests come back reset to recompute, with the tokens they have; requests submitted
    afterwards come straight back too."""
    executor = ControlledExecutor(SimulatedRunner(SMALL), fail_at=2, code="UNAVAILABLE")
    with running_lane(executor) as (lane, events):
        lane.submit([make_request("a", 6, 10), make_request("b", 10, 10)])
        event = events.until(lambda e: e.lane_down)[-1]
        assert sorted(r.req_id for r in event.evacuated) == ["a", "b"]
        for request in event.evacuated:
            assert request.status == RequestStatus.WAITING
            assert request.num_computed_tokens == 0 and request.num_output_tokens == 2
        assert not lane.alive and event.error == lane.down_reason
        assert lane.down_reason is not None and "executor x is unreachable" in lane.down_reason

        lane.submit([make_request("late", 4, 2)])
        late = events.next()
        assert [r.req_id for r in late.evacuated] == ["late"] and not late.lane_down


def test_a_failed_step_of_an_executor_that_answers_no_health_check_takes_the_lane_down() -> None:
    """A killed executor's step stream can end as INTERNAL (gRPC's client reports a write after
    the connection broke so): not the executor failing the step's requests, since it no longer
    answers. Its requests are handed back with their tokens, none ends in an error."""
    executor = ControlledExecutor(SimulatedRunner(SMALL), fail_at=2, code="INTERNAL")
    executor.answers_health = False
    with running_lane(executor) as (lane, events):
        lane.submit([make_request("a", 6, 10), make_request("b", 10, 10)])
        event = events.until(lambda e: e.lane_down or e.ended)[-1]
        assert event.lane_down and not event.ended
        assert sorted(r.req_id for r in event.evacuated) == ["a", "b"]
        assert all(r.num_output_tokens == 2 for r in event.evacuated)
        assert lane.down_reason is not None and "answers no health check" in lane.down_reason


def test_take_down_hands_every_request_back() -> None:
    executor = ControlledExecutor(SimulatedRunner(SMALL), pause_at=1)
    with running_lane(executor) as (lane, events):
        lane.submit([make_request("a", 6, 10)])
        assert executor.paused.wait(10)
        lane.take_down("its registration expired")
        executor.resume.set()
        event = events.until(lambda e: e.lane_down)[-1]
        assert [r.req_id for r in event.evacuated] == ["a"]
        assert (event.error, lane.alive) == ("its registration expired", False)


def run_to_completion(
    executor: StepExecutor, requests: list[Request], async_scheduling: bool
) -> dict[str, list[int]]:
    """Every request's tokens, run on one lane (which had to preempt); the pool is intact and
    idle afterwards."""
    events = Events()
    lane = ExecutorLane(
        "x",
        executor,
        Scheduler(SchedulerConfig.for_executor(executor.info())),
        events.on_event,
        async_scheduling,
    )
    lane.start()
    tokens: dict[str, list[int]] = {r.req_id: [] for r in requests}
    finished: set[str] = set()
    try:
        lane.submit(requests)
        while len(finished) < len(requests):
            event = events.next()
            assert not event.ended and not event.evacuated
            for update in event.updates:
                tokens[update.request.req_id] += update.new_token_ids
                if update.finished is not None:
                    finished.add(update.request.req_id)
        lane.call(lambda s: s.check_integrity(expect_idle=True)).result(timeout=10)
        assert lane.call(lambda s: s.total_preemptions).result(timeout=10) > 0
    finally:
        lane.stop()
    return tokens


def test_async_scheduling_pipelines_steps_and_gives_the_same_tokens_under_preemption() -> None:
    # 12 requests of 9 + 20 tokens need 96 blocks of 4 at the end: 64 force preemptions.
    def requests() -> list[Request]:
        return [make_request(f"r{i}", 9 + i % 3, 20) for i in range(12)]

    sync = run_to_completion(LocalExecutor(SimulatedRunner(SMALL)), requests(), async_scheduling=False)
    pipelined = PipelinedExecutor(LocalExecutor(SimulatedRunner(SMALL)))
    assert run_to_completion(pipelined, requests(), async_scheduling=True) == sync
    assert pipelined.max_queued == 2, "the next step was sent before the last one's result was read"
    assert all(len(t) == 20 or t[-1] in EOS for t in sync.values())
