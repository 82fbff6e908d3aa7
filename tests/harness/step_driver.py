"""A step driver that plans steps for a ModelRunner, for tests of the executor's contract."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from npuserve.proto.step_plan import (
    CachedRequest,
    NewRequest,
    SamplingOptions,
    StepPlan,
    StepResult,
    TokenBitmask,
    TokenLogprobs,
)


@dataclass
class DrivenRequest:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingOptions
    # Blocks (and their computed tokens) taken over from an earlier request: a prefix-cache hit.
    cached_block_ids: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class StepDriver:
    """Plans steps for a runner the way a scheduler would, under a per-step token budget.

    Blocks come from a shuffled pool, so block tables are never contiguous. It is a test
    harness for the executor's contract, not a scheduler: no preemption, no admission control.
    ``num_steps`` above 1 plans multi-step decoding: a request that samples in a step runs up to
    that many passes in it (no more than it has tokens left to make), with blocks for them all.
    With ``answer_early`` a new request runs one pass, and the runner answers it after that pass
    (`on_first_pass`); ``early_answers`` keeps those answers. With ``join_new`` the new requests
    of a step whose plan runs several passes go, prompts whole, in a step that joins it
    (`StepPlan.joins_running`), which the runner takes before its second pass (with
    ``join_first_pass``, before its first: as a step sent while the one it joins waited to run);
    ``joined_answers`` keeps their answers. ``bitmask``, given the requests that sample in a
    step, returns that step's structured-output bitmask (or None); `preempt` takes a request out
    as a scheduler's preemption by recompute does.
    """

    def __init__(
        self,
        runner,
        token_budget: int = 10_000,
        seed: int = 0,
        num_steps: int = 1,
        answer_early: bool = False,
        join_new: bool = False,
        join_first_pass: bool = False,
        bitmask: Callable[[list[DrivenRequest]], TokenBitmask | None] | None = None,
    ) -> None:
        self.runner = runner
        self.bitmask = bitmask
        self.join_new = join_new
        self.join_first_pass = join_first_pass
        self.joined_answers: list[StepResult] = []
        self.num_joined = 0  # joining steps the runner took into a step's passes
        self.token_budget = token_budget
        self.num_steps = num_steps
        self.answer_early = answer_early
        self.early_answers: list[StepResult] = []
        self.block_size = runner.block_size
        self.free_blocks = list(range(1, runner.num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.step_id = 0
        self.finished: list[str] = []

    def run(self, requests: list[DrivenRequest]) -> list[DrivenRequest]:
        while not all(r.done for r in requests):
            self.step([r for r in requests if not r.done])
        self.step([])  # hand the last finished ids to the runner
        return requests

    def preempt(self, req: DrivenRequest) -> None:
        """Preemption by recompute: the runner drops ``req`` at the next step, its blocks (but
        those of its prefix-cache hit) go back to the pool, and it is sent again whole, its
        prompt and the tokens it made so far, nothing of them computed."""
        self.finished.append(req.req_id)
        self.free_blocks += req.block_ids[len(req.cached_block_ids) :][::-1]
        req.block_ids, req.num_computed_tokens, req.sent = [], 0, False

    def step(self, active: list[DrivenRequest]) -> None:
        plan = StepPlan(step_id=self.step_id, finished_req_ids=self.finished)
        self.step_id += 1
        self.finished = []
        joining = None
        if (
            self.join_new
            and self.num_steps > 1
            and any(r.sent for r in active)
            and not all(r.sent for r in active)
        ):
            joiners = [r for r in active if not r.sent]
            active = [r for r in active if r.sent]
            joining = OneJoiningStep(
                StepPlan(step_id=self.step_id, joins_running=True),
                self.joined_answers,
                absent_for=0 if self.join_first_pass else 1,
            )
            self.step_id += 1
            self._plan(joining.plan, joiners, 1_000_000)
        self._plan(plan, active, self.token_budget)
        if self.bitmask is not None:
            by_id = {r.req_id: r for r in active}
            sampling = [
                by_id[req_id]
                for req_id, num_new in plan.num_scheduled_tokens.items()
                if by_id[req_id].num_computed_tokens + num_new == len(by_id[req_id].tokens)
            ]
            plan.bitmask = self.bitmask(sampling) if sampling else None
        if joining is not None and not plan.num_steps:  # nothing to join: it runs next, as any step
            joining.plan.joins_running = False
        early: list[StepResult] = []
        if joining is not None and joining.plan.joins_running:
            result = self.runner.execute(plan, joining=joining)
            assert joining.taken, "the joining step was not taken"
            # NOTE: each pass asks until nothing more comes: once, and once more where one is
            # taken; so the take was in the first pass or the second as asked, and every pass asked.
            asks = (joining.taken_at, len(joining.asked_with))
            assert asks == (1 if self.join_first_pass else 2, plan.num_passes + 1), asks
            self.num_joined += 1
        elif self.answer_early:
            result = self.runner.execute(plan, on_first_pass=early.append)
            self.early_answers += early
        else:
            result = self.runner.execute(plan)
        answers = [*early, result]
        if joining is not None:
            if not joining.plan.joins_running:
                self.joined_answers.append(self.runner.execute(joining.plan))
            answers.append(self.joined_answers[-1])
            active = active + joiners
            plan.num_scheduled_tokens.update(joining.plan.num_scheduled_tokens)
        self._apply(plan, active, answers)

    def _plan(self, plan: StepPlan, active: list[DrivenRequest], budget: int) -> None:
        for req in active:
            if not req.sent and req.cached_block_ids:
                req.block_ids = list(req.cached_block_ids)
                req.num_computed_tokens = len(req.cached_block_ids) * self.block_size
            num_new = min(len(req.tokens) - req.num_computed_tokens, budget)
            if num_new <= 0:
                break
            budget -= num_new
            samples = req.num_computed_tokens + num_new == len(req.tokens)
            passes = min(self.num_steps, req.max_new_tokens - len(req.output)) if samples else 1
            if (self.answer_early or plan.joins_running) and not req.sent:
                passes = 1
            if passes > 1:
                plan.num_steps[req.req_id] = passes
            num_slots = num_new + passes - 1
            needed = -(-(req.num_computed_tokens + num_slots) // self.block_size) - len(req.block_ids)
            new_blocks = [self.free_blocks.pop() for _ in range(max(0, needed))]
            req.block_ids += new_blocks
            if not req.sent:
                plan.new_requests.append(
                    NewRequest(
                        req_id=req.req_id,
                        token_ids=req.tokens,
                        num_prompt_tokens=len(req.prompt),
                        sampling=req.sampling,
                        block_ids=list(req.block_ids),
                        num_computed_tokens=req.num_computed_tokens,
                    )
                )
                req.sent = True
            elif new_blocks:
                plan.cached_requests.append(CachedRequest(req.req_id, new_blocks))
            plan.num_scheduled_tokens[req.req_id] = num_new

    def _apply(self, plan: StepPlan, active: list[DrivenRequest], answers: list[StepResult]) -> None:
        by_id = {r.req_id: r for r in active}
        for req_id, num_new in plan.num_scheduled_tokens.items():
            by_id[req_id].num_computed_tokens += num_new + plan.num_steps.get(req_id, 1) - 1
        sampled = [
            entry
            for answer in answers  # NOTE: a request is named in one answer only
            for entry in zip(answer.sampled_req_ids, answer.sampled_token_ids, answer.logprobs, strict=True)
        ]
        for req_id, token, logprobs in sampled:
            req = by_id[req_id]
            req.output.append(token)
            req.logprobs.append(logprobs)
            if req.done:
                self.finished.append(req_id)


class OneJoiningStep:
    """One step that joins the running one, for a runner (`JoiningSteps`): taken once, at the
    first pass that asks with room for it once it has come; its answer goes to ``answers``.
    ``absent_for``: the passes that ask before it comes (1: it comes during the first pass, as
    a step sent while the running one runs; 0: it was there before that pass began, sent while
    the running step waited to run)."""

    def __init__(self, plan: StepPlan, answers: list[Any], absent_for: int = 1) -> None:
        self.plan, self.answers, self.taken = plan, answers, False
        self.absent_for = absent_for
        self.asked_with: list[int] = []  # the room each ask offered
        self.taken_at = 0  # the ask (1-based) that took it; 0: none yet

    def take(self, max_tokens: int) -> StepPlan | None:
        self.asked_with.append(max_tokens)
        if self.absent_for > 0:
            self.absent_for -= 1
            return None
        if self.taken or self.plan.total_num_scheduled_tokens > max_tokens:
            return None
        self.taken, self.taken_at = True, len(self.asked_with)
        return self.plan

    def answer(self, result: StepResult) -> None:
        self.answers.append(result)
