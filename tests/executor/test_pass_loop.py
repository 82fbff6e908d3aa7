"""The order of a step's passes (`PassLoop`), on a runner that records what it is asked to do:
the real and the simulated runner both run their steps through it (their own tests check what
their passes compute and how long they take)."""

from __future__ import annotations

import pytest
from harness.step_driver import OneJoiningStep

from npuserve.executor.pass_loop import PassLoop, StepPass
from npuserve.proto.step_plan import NewRequest, SamplingOptions, StepPlan, StepResult


class RecordingRunner:
    """A `PassRunner` whose every request samples token 7 in each pass it runs; ``fail_at``:
    the pass that raises instead."""

    def __init__(self, events: list[object], fail_at: int | None = None) -> None:
        self.events, self.fail_at = events, fail_at
        self.dropped: list[str] = []

    def begin_step(self, plan: StepPlan, started: float) -> None:
        self.events.append(("begin", plan.step_id))

    def run_pass(self, plan: StepPlan, step_pass: StepPass, result: StepResult) -> list[StepResult]:
        joiner_ids = [joiner.step_id for joiner in step_pass.joiners]
        self.events.append(("pass", step_pass.index, dict(step_pass.tokens), joiner_ids))
        if step_pass.index == self.fail_at:
            raise RuntimeError("device lost")
        _sample(result, list(step_pass.tokens))
        answers = []
        for joiner in step_pass.joiners:
            answers.append(StepResult(step_id=joiner.step_id))
            _sample(answers[-1], list(joiner.num_scheduled_tokens))
        return answers

    def await_pass_end(self) -> None:
        self.events.append("await")

    def end_step(self, plan: StepPlan, result: StepResult, started: float) -> None:
        self.events.append(("end", plan.step_id))

    def drop_requests(self, req_ids: list[str]) -> None:
        self.dropped += req_ids


def _sample(result: StepResult, req_ids: list[str]) -> None:
    result.sampled_req_ids += req_ids
    result.sampled_token_ids += [7] * len(req_ids)
    result.logprobs += [None] * len(req_ids)


def _new(req_id: str) -> NewRequest:
    return NewRequest(req_id, [1, 2, 3], 3, SamplingOptions(), [1], 0)


# "a" runs three passes, "b" (admitted) only the first.
THREE_PASSES = StepPlan(
    1, new_requests=[_new("a"), _new("b")], num_scheduled_tokens={"a": 3, "b": 3}, num_steps={"a": 3}
)
JOINER = StepPlan(2, new_requests=[_new("c")], num_scheduled_tokens={"c": 3}, joins_running=True)


def test_a_multi_pass_step_answers_early_and_its_joiners_after_their_pass() -> None:
    """The first pass's early answer, then each later pass once the one before has ended (steps
    may join it), a joiner answered once its pass has ended; the result names the rest."""
    events: list[object] = []
    joining = OneJoiningStep(JOINER, events)
    result = PassLoop(RecordingRunner(events), 100).run(THREE_PASSES, events.append, joining)
    early = StepResult(1, ["b"], [7], [None], partial=True)
    assert events == [
        ("begin", 1),
        ("pass", 0, {"a": 3, "b": 3}, []),
        "await",
        early,
        "await",
        ("pass", 1, {"a": 1}, [2]),
        "await",
        StepResult(2, ["c"], [7], [None]),
        "await",
        ("pass", 2, {"a": 1}, []),
        ("end", 1),
    ]
    assert joining.asked_with == [100 - 6, 100 - 1, 100 - 1 - 3, 100 - 1]  # the room each ask left
    assert result.sampled_req_ids == ["a", "a", "a"]


def test_without_steps_to_join_the_passes_follow_one_another_and_one_pass_steps_take_none() -> None:
    events: list[object] = []
    PassLoop(RecordingRunner(events), 100).run(THREE_PASSES)
    assert "await" not in events and len(events) == 5  # begin, three passes, end
    events.clear()
    joining = OneJoiningStep(JOINER, events, absent_for=0)
    one_pass = StepPlan(3, new_requests=[_new("d")], num_scheduled_tokens={"d": 3})
    PassLoop(RecordingRunner(events), 100).run(one_pass, events.append, joining)
    assert events == [("begin", 3), ("pass", 0, {"d": 3}, []), ("end", 3)] and not joining.asked_with


def test_a_repeated_step_is_answered_again_and_a_failed_one_drops_what_it_and_its_joiners_name() -> None:
    events: list[object] = []
    loop = PassLoop(RecordingRunner(events), 100)
    first = loop.run(THREE_PASSES)
    assert loop.run(THREE_PASSES) is first and events.count(("begin", 1)) == 1
    runner = RecordingRunner(events, fail_at=1)
    with pytest.raises(RuntimeError, match="device lost"):
        PassLoop(runner, 100).run(THREE_PASSES, joining=OneJoiningStep(JOINER, events))
    assert runner.dropped == ["a", "b", "a", "b", "c", "c"]  # scheduled and sent whole, the joiner's too
