"""A step's forward passes, in the one order every step runner keeps: the `ModelRunner` (and
through it each rank of a tensor-parallel group) and the `SimulatedRunner`.

A step runs its plan's scheduled tokens in a first pass; a multi-step plan (`StepPlan.num_steps`)
then runs later passes, each feeding back, for the requests that run it, the token the pass
before sampled. Around the passes `PassLoop` keeps the step contract:

- joining: before each pass of a multi-pass step (the first too: the steps sent while it waited
  to run), the steps that join it (`StepPlan.joins_running`) are taken while the pass stays
  within max_num_batched_tokens; their prompts run in that pass, and each is answered once the
  pass has ended, with a result of its own;
- early answers: with ``on_first_pass``, the tokens of the requests that run only the first pass
  are answered once it has ended (`take_first_pass_only`); the step's result leaves them out;
- retries: a repeated step id returns the earlier result;
- failures: any failure drops the state of every request that the plan, and the steps that
  joined it, name; the scheduler then fails them or sends them again whole.

What a pass does is the runner's (`PassRunner`): the real one gathers the batch, runs the model
and samples; the simulated one makes its tokens and models the pass's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from npuserve.proto.plan_checks import check_joining
from npuserve.proto.step_plan import (
    FirstPassAnswer,
    JoiningSteps,
    StepPlan,
    StepResult,
    named_req_ids,
    take_first_pass_only,
)

__all__ = ["PassLoop", "PassRunner", "StepPass"]


@dataclass(slots=True)
class StepPass:
    """One forward pass of a step, as the loop hands it to the runner."""

    index: int  # 0: the plan's scheduled tokens; later: one token fed back per request that runs it
    tokens: dict[str, int]  # the step's own new tokens per request, in batch order
    joiners: list[StepPlan]  # the steps that join this pass: their prompts run beside ``tokens``
    started: float  # time.perf_counter() as the pass began (the first's: as the step began)


class PassRunner(Protocol):
    """What a step runner does for `PassLoop`: the work of a step and of each of its passes."""

    def begin_step(self, plan: StepPlan, started: float) -> None:
        """Applies the plan's changes to the requests held (drops, admissions, new blocks) before
        any pass; ``started``: time.perf_counter() as the step began."""

    def run_pass(self, plan: StepPlan, step_pass: StepPass, result: StepResult) -> list[StepResult]:
        """Runs one pass of ``plan``, the joiners' requests added first: the tokens it samples for
        the plan's requests go to ``result``, each joiner's to a result of its own (returned, in
        the joiners' order). The first pass refuses what the plan gets wrong before it computes."""

    def await_pass_end(self) -> None:
        """Returns once the pass last run has ended (at once where a pass ends as it returns)."""

    def end_step(self, plan: StepPlan, result: StepResult, started: float) -> None:
        """Completes a step that ran its passes (or had none to run): its timings in ``result``."""

    def drop_requests(self, req_ids: list[str]) -> None:
        """Forgets these requests, those it holds: a step that named them failed."""


class PassLoop:
    """Runs steps on one runner, pass by pass (steps one at a time: the server's step lock)."""

    def __init__(self, runner: PassRunner, max_num_batched_tokens: int) -> None:
        self._runner = runner
        self._max_num_batched_tokens = max_num_batched_tokens
        self._last_result: StepResult | None = None

    def run(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        """Runs one step (the module's docstring says in what order); a repeated step id returns
        the earlier result. ``on_first_pass`` takes the early answer; ``joining`` holds the steps
        that may join a multi-pass plan's passes. A failure drops the state of every request the
        plan and the steps that joined it name, then is raised."""
        if self._last_result is not None and plan.step_id == self._last_result.step_id:
            return self._last_result
        joined: list[StepPlan] = []
        try:
            result = self._run(plan, on_first_pass, joining if plan.num_steps else None, joined)
        except Exception:
            self._runner.drop_requests(named_req_ids(plan, *joined))
            raise
        self._last_result = result
        return result

    def _run(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None,
        joining: JoiningSteps | None,
        joined: list[StepPlan],
    ) -> StepResult:
        runner = self._runner
        started = time.perf_counter()
        runner.begin_step(plan, started)
        result = StepResult(step_id=plan.step_id)
        if plan.num_scheduled_tokens:
            for index in range(plan.num_passes):
                if index and joining is not None:
                    runner.await_pass_end()  # NOTE: the steps that come until then join this pass
                pass_started = started if index == 0 else time.perf_counter()
                # A later pass feeds back one token to each request with passes that many left.
                tokens = (
                    plan.num_scheduled_tokens
                    if index == 0
                    else {req_id: 1 for req_id, num_steps in plan.num_steps.items() if num_steps > index}
                )
                joiners = self._take_joiners(joining, joined, sum(tokens.values()))
                answers = runner.run_pass(plan, StepPass(index, tokens, joiners, pass_started), result)
                if joining is not None and answers:
                    runner.await_pass_end()
                    for answer in answers:
                        joining.answer(answer)
                if index == 0 and on_first_pass is not None and plan.has_first_pass_only:
                    early = take_first_pass_only(result, plan.num_steps)
                    if early.sampled_req_ids:
                        runner.await_pass_end()
                        on_first_pass(early)
        runner.end_step(plan, result, started)
        return result

    def _take_joiners(
        self, joining: JoiningSteps | None, joined: list[StepPlan], num_tokens: int
    ) -> list[StepPlan]:
        """The steps that have come to join the pass about to begin, while its tokens
        (``num_tokens`` of its own) stay within max_num_batched_tokens; each recorded in
        ``joined`` before it is checked (`check_joining`), so that a refused one has its
        requests dropped with the running step's."""
        joiners: list[StepPlan] = []
        while (
            joining is not None
            and (joiner := joining.take(self._max_num_batched_tokens - num_tokens)) is not None
        ):
            joined.append(joiner)
            check_joining(joiner)
            joiners.append(joiner)
            num_tokens += joiner.total_num_scheduled_tokens
        return joiners
