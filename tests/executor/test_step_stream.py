"""`StepStreamPipeline` on its own: answers in the steps' order (a step's early answer before
its result), a step that arrived starts before the answer before it is taken, a step that joins the running
one is taken between its passes and answered before it, a failure (in
reading, running or the request stream) comes after the answers before it and ends the stream,
and a closed pipeline runs no further step."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from npuserve.executor.step_stream import StepStreamPipeline
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_plan import FirstPassAnswer, JoiningSteps, StepPlan, StepResult

WAIT_S = 30.0  # NOTE: a bound on waiting for the pipeline's threads, never reached when it works


def _requests(
    *step_ids: int, early: tuple[int, ...] = (), joins: tuple[int, ...] = ()
) -> list[pb.StepRequest]:
    return [pb.StepRequest(step_id=i, early_results=i in early, joins_running=i in joins) for i in step_ids]


def _read(request: pb.StepRequest) -> tuple[StepPlan, bool]:
    if request.step_id < 0:
        raise ValueError(f"step {request.step_id} cannot be read")
    return StepPlan(step_id=request.step_id, joins_running=request.joins_running), request.early_results


def _answer(result: StepResult) -> pb.StepResponse:
    return pb.StepResponse(step_id=result.step_id)


class _Runs:
    """The steps run, in order; step 0 fails; ``hold`` waits for `release` before running."""

    def __init__(self, hold: int | None = None) -> None:
        self.step_ids: list[int] = []
        self.ran: dict[int, threading.Event] = {}
        self._hold = hold
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def started(self, step_id: int) -> threading.Event:
        return self.ran.setdefault(step_id, threading.Event())

    def __call__(
        self, plan: StepPlan, on_first_pass: FirstPassAnswer | None, joining: JoiningSteps | None
    ) -> StepResult:
        self.step_ids.append(plan.step_id)
        self.started(plan.step_id).set()
        if plan.step_id == self._hold:
            assert self._released.wait(WAIT_S)
        if plan.step_id == 0:
            raise RuntimeError("device lost")
        if on_first_pass is not None:
            on_first_pass(StepResult(step_id=-plan.step_id))  # the early answer, told apart by its sign
        return StepResult(step_id=plan.step_id)


def _answered(pipeline: StepStreamPipeline) -> list[int]:
    return [answer.step_id for answer in pipeline.answers()]


def test_answers_come_in_order_with_a_steps_early_answer_before_its_result() -> None:
    runs = _Runs()
    pipeline = StepStreamPipeline(iter(_requests(1, 2, 3, early=(2,))), _read, runs, _answer)
    assert _answered(pipeline) == [1, -2, 2, 3]
    assert runs.step_ids == [1, 2, 3]


def test_a_step_that_arrived_runs_before_the_answer_before_it_is_taken() -> None:
    runs = _Runs()
    pipeline = StepStreamPipeline(iter(_requests(1, 2)), _read, runs, _answer)
    assert runs.started(2).wait(WAIT_S)  # NOTE: no answer has been taken yet
    assert _answered(pipeline) == [1, 2]


@pytest.mark.parametrize("where", ["run", "read", "request stream"])
def test_a_failure_ends_the_stream_after_the_answers_before_it(where: str) -> None:
    def broken() -> Iterator[pb.StepRequest]:
        yield from _requests(1)
        raise RuntimeError("stream broken")

    requests = {
        "run": iter(_requests(1, 0, 3)),
        "read": iter(_requests(1, -2, 3)),
        "request stream": broken(),
    }
    runs = _Runs()
    pipeline = StepStreamPipeline(requests[where], _read, runs, _answer)
    answers = pipeline.answers()
    assert next(answers).step_id == 1
    with pytest.raises((RuntimeError, ValueError), match=r"device lost|cannot be read|stream broken"):
        next(answers)
    assert runs.step_ids == ([1, 0] if where == "run" else [1])  # step 3 never ran


def test_a_closed_pipeline_finishes_its_step_and_runs_no_other() -> None:
    runs = _Runs(hold=1)
    pipeline = StepStreamPipeline(iter(_requests(1, 2)), _read, runs, _answer)
    assert runs.started(1).wait(WAIT_S)
    pipeline.close()
    runs.release()
    assert _answered(pipeline) == [1]  # NOTE: ends once the step thread has stopped
    assert runs.step_ids == [1]


def test_the_steps_that_join_the_running_one_are_taken_in_it_and_answered_before_it() -> None:
    """While step 1 runs, the joining step next in the stream (2) is taken and answered in it;
    the next one (3) does not join, so it stays next, and the joining step after it (4) runs
    after it, as any step: the order of the stream is kept but for the steps taken."""
    everything_read = threading.Event()

    def requests() -> Iterator[pb.StepRequest]:
        yield from _requests(1, 2, 3, 4, joins=(2, 4))
        everything_read.set()

    taken: list[int | None] = []

    def run(
        plan: StepPlan, on_first_pass: FirstPassAnswer | None, joining: JoiningSteps | None
    ) -> StepResult:
        assert joining is not None
        if plan.step_id == 1:
            assert everything_read.wait(WAIT_S)
            for _ in range(3):  # NOTE: 2, then nothing: 3 is next and does not join
                joiner = joining.take(100)
                taken.append(None if joiner is None else joiner.step_id)
                if joiner is not None:
                    joining.answer(StepResult(step_id=joiner.step_id))
        return StepResult(step_id=plan.step_id)

    pipeline = StepStreamPipeline(requests(), _read, run, _answer)
    assert _answered(pipeline) == [2, 1, 3, 4]
    assert taken == [2, None, None]
