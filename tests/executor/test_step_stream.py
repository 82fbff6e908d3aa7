"""`StepStreamPipeline` on its own: answers in the steps' order (a step's early answer before
its result), a step that arrived starts before the answer before it is taken, a failure (in
reading, running or the request stream) comes after the answers before it and ends the stream,
and a closed pipeline runs no further step."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from npuserve.executor.step_stream import StepStreamPipeline
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_plan import FirstPassAnswer, StepPlan, StepResult

WAIT_S = 30.0  # NOTE: a bound on waiting for the pipeline's threads, never reached when it works


def _requests(*step_ids: int, early: tuple[int, ...] = ()) -> list[pb.StepRequest]:
    return [pb.StepRequest(step_id=i, early_results=i in early) for i in step_ids]


def _read(request: pb.StepRequest) -> tuple[StepPlan, bool]:
    if request.step_id < 0:
        raise ValueError(f"step {request.step_id} cannot be read")
    return StepPlan(step_id=request.step_id), request.early_results


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

    def __call__(self, plan: StepPlan, on_first_pass: FirstPassAnswer | None) -> StepResult:
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
