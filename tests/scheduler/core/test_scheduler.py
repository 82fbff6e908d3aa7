"""Scheduler policy, driven by the simulated executor (`SimulatedRunner`) with every plan checked.

The runner keeps per-request state the way the real executor does (a request arrives whole, then
as block deltas; finished ids are dropped before the step) and refuses plans the real one
refuses; `CheckedExecutor` also checks each plan against the scheduler's own state. A sampled
token depends only on the request id and its position, so a run that recomputes after
preemption must reproduce a plain run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest
from harness.step_driver import OneJoiningStep

from npuserve.executor.rpc_status import KvPullFailed
from npuserve.executor.simulated import LatencyModel, SimulatedConfig, SimulatedRunner
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_plan import KvPull, NewRequest, StepPlan, StepResult, admits_only
from npuserve.proto.structured_outputs import StructuredOutputs
from npuserve.scheduler.core.request import (
    Prefilled,
    PrefilledBlocks,
    Request,
    RequestStatus,
    SamplingParams,
)
from npuserve.scheduler.core.scheduler import RequestUpdate, Scheduler
from npuserve.scheduler.core.scheduler_config import SchedulerConfig
from npuserve.scheduler.structured.grammar_compiler import GrammarCompiler
from npuserve.scheduler.text.tokenizer import Tokenizer

EOS = 2
NUM_PROMPT = 5  # the prompt length of the stop-rule runs


@dataclass
class _Sent:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CheckedExecutor:
    """A `SimulatedRunner` for the scheduler's executor; every plan is first checked for what
    the executor was sent so far (`sent`) agreeing with the scheduler's state, and for touching
    no block a pull still writes (`pulling`: until a result names its outcome)."""

    scheduler: Scheduler
    runner: SimulatedRunner
    sent: dict[str, _Sent] = field(default_factory=dict)
    pulling: dict[str, KvPull] = field(default_factory=dict)
    pulled: dict[str, KvPull] = field(default_factory=dict)  # landed, until sent whole
    sent_whole: list[tuple[int, NewRequest]] = field(default_factory=list)  # (step_id, request)
    plans: list[StepPlan] = field(default_factory=list)
    last_step_id: int | None = None

    def step(self, plan: StepPlan) -> StepResult:
        self.check(plan)
        result = self.runner.execute(plan)
        self._sent_after(plan, result)
        return result

    def step_joined(self, plan: StepPlan, joiner: StepPlan) -> tuple[StepResult, StepResult]:
        """``plan`` with ``joiner`` joining its second pass; both results."""
        self.check(plan)
        self.check(joiner)
        answers: list[StepResult] = []
        result = self.runner.execute(plan, joining=OneJoiningStep(joiner, answers))
        assert len(answers) == 1, "the joining step was not run in the plan's passes"
        self._sent_after(plan, result)
        self._sent_after(joiner, answers[0])
        return result, answers[0]

    def _sent_after(self, plan: StepPlan, result: StepResult) -> None:
        for req_id, num in plan.num_scheduled_tokens.items():
            self.sent[req_id].num_computed_tokens += num + plan.num_steps.get(req_id, 1) - 1
        for req_id, token in zip(result.sampled_req_ids, result.sampled_token_ids, strict=True):
            self.sent[req_id].token_ids.append(token)
        for req_id in [*result.landed_pull_req_ids, *result.failed_pull_req_ids]:
            pull = self.pulling.pop(req_id, None)
            if pull is not None and req_id in result.landed_pull_req_ids:
                self.pulled[req_id] = pull
        assert self.runner.num_requests == len(self.sent) and all(map(self.runner.holds, self.sent))

    def check(self, plan: StepPlan) -> None:
        cfg = self.scheduler.config
        bs = cfg.block_size
        assert self.last_step_id is None or plan.step_id == self.last_step_id + 1, "step ids must not skip"
        self.last_step_id = plan.step_id
        self.plans.append(plan)
        for req_id in plan.finished_req_ids:
            self.sent.pop(req_id, None)  # a request aborted while waiting was never sent
        pulled_blocks = {b for pull in self.pulling.values() for b in pull.dst_block_ids}
        for new in plan.new_requests:
            assert new.req_id not in self.sent, f"{new.req_id} sent whole while the executor holds it"
            assert new.req_id not in self.pulling, f"{new.req_id} sent whole while its pull runs"
            assert pulled_blocks.isdisjoint(new.block_ids), "a step names a block a pull writes"
            pull = self.pulled.pop(new.req_id, None)
            if pull is None:
                assert new.num_computed_tokens % bs == 0, "a prefix hit covers whole blocks"
            else:  # NOTE: pulled blocks are its computed ones past its prefix hits, the last maybe partial
                num_blocks = -(-new.num_computed_tokens // bs)
                assert new.block_ids[num_blocks - len(pull.dst_block_ids) : num_blocks] == pull.dst_block_ids
            self.sent[new.req_id] = _Sent(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.num_computed_tokens
            )
            self.sent_whole.append((plan.step_id, new))
        for cached in plan.cached_requests:
            assert cached.req_id in self.sent, f"{cached.req_id} not sent whole since its last drop"
            assert cached.new_block_ids, "a delta without new blocks is not sent"
            assert pulled_blocks.isdisjoint(cached.new_block_ids), "a step names a block a pull writes"
            self.sent[cached.req_id].block_ids += cached.new_block_ids
        sent = {n.req_id for n in plan.new_requests} | {c.req_id for c in plan.cached_requests}
        assert sent <= set(plan.num_scheduled_tokens), "a request sent but not scheduled"
        for pull in plan.kv_pulls:  # NOTE: its request runs once a result says it landed
            assert pull.req_id not in plan.num_scheduled_tokens, "a step runs a request it pulls"
            assert pulled_blocks.isdisjoint(pull.dst_block_ids), "two pulls write one block"
            self.pulling[pull.req_id] = pull

        written: dict[int, str] = {}
        for req_id, num_scheduled in plan.num_scheduled_tokens.items():
            assert req_id in self.sent, f"{req_id} scheduled without having been sent whole"
            st = self.sent[req_id]
            req = self.scheduler.requests[req_id]
            # NOTE: a multi-step request's later passes compute one token each (the one sampled before).
            num_steps = plan.num_steps.get(req_id, 1)
            num = num_scheduled + num_steps - 1
            if num_steps > 1:
                assert st.num_computed_tokens + num_scheduled == len(st.token_ids), "it samples first"
                assert num_steps <= cfg.num_scheduler_steps and req.grammar is None
                assert len(req.output_token_ids) + num_steps <= req.max_output_tokens, "no token past max"
            # NOTE: the scheduler counts the plan's tokens as computed once it is scheduled.
            assert st.num_computed_tokens == req.num_computed_tokens - num
            assert st.token_ids == req.all_token_ids, "executor and scheduler disagree on tokens"
            assert st.num_prompt_tokens == req.num_prompt_tokens
            assert st.block_ids == self.scheduler.kv.get_block_ids(req_id)
            assert len(set(st.block_ids)) == len(st.block_ids)
            for pos in range(st.num_computed_tokens, st.num_computed_tokens + num):
                block = st.block_ids[pos // bs]
                assert written.setdefault(block, req_id) == req_id, f"two requests write block {block}"


def output_token(k: int, req_id: str = "a", num_prompt: int = NUM_PROMPT) -> int:
    """The k-th (1-based) output token the simulated executor samples for ``req_id``."""
    return SimulatedRunner().token_for(req_id, num_prompt + k - 1)


def make_request(
    req_id: str,
    prompt: list[int],
    block_size: int = 4,
    max_model_len: int = 4096,
    **params: object,
) -> Request:
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    return Request(
        req_id,
        list(prompt),
        params=sp,
        options=sp.to_options((EOS,)),
        eos_token_ids=(EOS,),
        max_model_len=max_model_len,
        block_size=block_size,
    )


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 7) % 90 + 5 for i in range(n)]


@dataclass
class Run:
    scheduler: Scheduler
    executor: CheckedExecutor
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, RequestStatus] = field(default_factory=dict)
    stop_reasons: dict[str, int | str | None] = field(default_factory=dict)
    updates: list[list[RequestUpdate]] = field(default_factory=list)

    def step(self) -> StepPlan:
        sched, cfg = self.scheduler, self.scheduler.config
        plan, stats = sched.schedule()
        assert plan.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(plan.num_scheduled_tokens) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        later_passes = sum(n - 1 for n in plan.num_steps.values())
        assert stats.num_scheduled_tokens == plan.total_num_scheduled_tokens + later_passes
        result = self.executor.step(plan)
        updates = sched.update_from_output(plan, result)
        self.updates.append(updates)
        for u in updates:
            if u.finished is not None:
                self.outputs[u.request.req_id] = list(u.request.output_token_ids)
                self.finished[u.request.req_id] = u.finished
                self.stop_reasons[u.request.req_id] = u.request.stop_reason
        sched.check_integrity()
        return plan

    def until_done(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                break
            self.step()
        assert not self.scheduler.has_work(), "the run did not finish"
        self.scheduler.check_integrity(expect_idle=True)


def new_run(eos_after: int | None = None, **config: int | bool) -> Run:
    sched = Scheduler(SchedulerConfig(**{"num_blocks": 64, "block_size": 4, **config}))  # type: ignore[arg-type]
    c = sched.config
    runner = SimulatedRunner(
        SimulatedConfig(
            # NOTE: a pull lands as it starts: the result of the step that carries it says so.
            latency=LatencyModel(0.0, 0.0, 0.0, pull_bytes_per_s=math.inf),
            num_blocks=c.num_blocks,
            block_size=c.block_size,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            eos_token_ids=(EOS,),
            eos_after=eos_after,
        )
    )
    return Run(sched, CheckedExecutor(sched, runner))


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    """No step schedules more than max_num_batched_tokens tokens or max_num_seqs requests."""
    run = new_run(num_blocks=200, max_num_batched_tokens=20, max_num_seqs=3)
    for i in range(7):
        run.scheduler.add_request(make_request(f"r{i}", prompt_of(5 + 3 * i, i), max_tokens=4 + i))
    sizes = []
    while run.scheduler.has_work():
        plan = run.step()
        sizes.append((plan.total_num_scheduled_tokens, len(plan.num_scheduled_tokens)))
    assert max(t for t, _ in sizes) == 20  # the budget is used to the full
    assert max(n for _, n in sizes) == 3
    assert set(run.finished) == {f"r{i}" for i in range(7)}
    assert all(len(run.outputs[f"r{i}"]) == 4 + i for i in range(7))
    run.scheduler.check_integrity(expect_idle=True)


def test_chunked_prefill_exact_chunks() -> None:
    """A 50-token prompt under a 16-token budget runs as chunks 16, 16, 16, 2, then 1-token decodes."""
    run = new_run(max_num_batched_tokens=16)
    run.scheduler.add_request(make_request("a", prompt_of(50), max_tokens=3))
    chunks = []
    samples = []
    while run.scheduler.has_work():
        plan = run.step()
        chunks.append(plan.num_scheduled_tokens.get("a"))
        samples.append(sum(len(u.new_token_ids) for u in run.updates[-1]))
    assert chunks == [16, 16, 16, 2, 1, 1, None]
    assert samples == [0, 0, 0, 1, 1, 1, 0]  # no token until the prefill completes
    assert [len(p.new_requests) for p in run.executor.plans] == [1, 0, 0, 0, 0, 0, 0]
    assert run.executor.plans[-1].finished_req_ids == ["a"]
    assert run.finished["a"] == RequestStatus.FINISHED_LENGTH
    run.scheduler.check_integrity(expect_idle=True)


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    """A decoding request takes its one token first; the newcomer gets the rest of the budget."""
    run = new_run(max_num_batched_tokens=16)
    run.scheduler.add_request(make_request("a", prompt_of(8), max_tokens=5))
    run.step()
    run.scheduler.add_request(make_request("b", prompt_of(40, 1), max_tokens=2))
    plan = run.step()
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    plan = run.step()
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    plan = run.step()
    assert list(plan.num_scheduled_tokens.items()) == [("a", 1), ("b", 10)]
    run.until_done()
    assert len(run.outputs["a"]) == 5 and len(run.outputs["b"]) == 2


def test_waiting_requests_admitted_in_fifo_order() -> None:
    """Waiting requests are admitted in arrival order, each whole until the budget runs out."""
    run = new_run(max_num_batched_tokens=10)
    for name in "abc":
        run.scheduler.add_request(make_request(name, prompt_of(4, ord(name)), max_tokens=2))
    plan = run.step()
    assert list(plan.num_scheduled_tokens.items()) == [("a", 4), ("b", 4), ("c", 2)]
    assert [n.req_id for n in plan.new_requests] == ["a", "b", "c"]
    run.until_done()


def test_decode_takes_exactly_one_token() -> None:
    """Once the prompt is computed, every step schedules exactly one token for the request."""
    run = new_run()
    run.scheduler.add_request(make_request("a", prompt_of(6), max_tokens=6))
    first = run.step()
    assert first.num_scheduled_tokens == {"a": 6}
    for _ in range(5):
        assert run.step().num_scheduled_tokens == {"a": 1}
    run.until_done()
    assert len(run.outputs["a"]) == 6


def test_prefix_hit_starts_the_first_chunk_at_the_hit() -> None:
    """A second request with a cached 3-block prefix is sent with 12 computed tokens and its blocks."""
    run = new_run(num_blocks=32)
    prompt = prompt_of(14)
    run.scheduler.add_request(make_request("a", prompt, max_tokens=2))
    plan = run.step()
    assert plan.new_requests[0].block_ids == [1, 2, 3, 4]
    run.until_done()  # a is freed: its blocks stay cached in the free list
    run.scheduler.add_request(make_request("b", [*prompt, 77, 78], max_tokens=2))
    plan = run.step()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 12
    assert new.block_ids == [1, 2, 3, 5]  # a's three full blocks, then the free list's head
    assert plan.num_scheduled_tokens == {"b": 4}
    assert run.scheduler.requests["b"].num_cached_tokens == 12
    run.until_done()


def test_prefix_hit_while_the_first_request_runs() -> None:
    """A request that arrives while the first still runs shares its blocks (ref count 2)."""
    run = new_run(num_blocks=32)
    prompt = prompt_of(13)
    run.scheduler.add_request(make_request("a", prompt, max_tokens=4))
    run.step()
    run.scheduler.add_request(make_request("b", prompt, max_tokens=4))
    plan = run.step()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    assert plan.new_requests[0].block_ids == [1, 2, 3, 5]
    assert [run.scheduler.kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    run.until_done()
    assert len(run.outputs["a"]) == len(run.outputs["b"]) == 4


def _preemption_run(num_blocks: int) -> Run:
    run = new_run(num_blocks=num_blocks)
    for i, name in enumerate("abc"):
        run.scheduler.add_request(make_request(name, prompt_of(7, i), max_tokens=4))
    return run


def test_preemption_of_the_newest_request() -> None:
    """A full pool preempts the newest running request, which goes to the front of the queue,
    is dropped by the executor, blocks admission that step, and resumes whole."""
    run = _preemption_run(num_blocks=8)  # 7 usable blocks: 2 for each 7-token prompt, 1 spare
    sched = run.scheduler
    plan0 = run.step()
    assert [(n.req_id, n.block_ids) for n in plan0.new_requests] == [
        ("a", [1, 2]),
        ("b", [3, 4]),
        ("c", [5, 6]),
    ]
    plan1 = run.step()  # 8 tokens each: still 2 blocks
    assert plan1.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert not plan1.cached_requests
    c_tokens = sched.requests["c"].all_token_ids
    assert len(c_tokens) == 9

    sched.add_request(make_request("d", prompt_of(3, 9), max_tokens=1))
    plan2 = run.step()  # the 9th token needs a 3rd block: a takes the spare, b preempts c
    assert plan2.finished_req_ids == ["c"]
    assert plan2.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [(c.req_id, c.new_block_ids) for c in plan2.cached_requests] == [("a", [7]), ("b", [6])]
    # Block 5 is free and d needs only one block, but nobody is admitted after a preemption.
    assert [b.block_id for b in sched.kv.pool.free_queue] == [5]
    assert not plan2.new_requests
    assert [r.req_id for r in sched.waiting] == ["c", "d"]
    c = sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.total_preemptions == 1
    assert not run.executor.runner.holds("c")
    assert sched.kv.get_block_ids("c") == []

    plan3 = run.step()  # c (head of the queue) does not fit, so d waits behind it
    assert plan3.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not plan3.new_requests and not plan3.finished_req_ids
    assert run.finished == {"a": RequestStatus.FINISHED_LENGTH, "b": RequestStatus.FINISHED_LENGTH}

    plan4 = run.step()
    assert plan4.finished_req_ids == ["a", "b"]
    assert [n.req_id for n in plan4.new_requests] == ["c", "d"]
    resumed = plan4.new_requests[0]
    assert resumed.token_ids == c_tokens  # prompt + the 2 outputs it had
    assert resumed.num_prompt_tokens == 7
    # Its first block (5) survived in the free list; block 6 was handed to b and evicted.
    assert resumed.num_computed_tokens == 4
    assert resumed.block_ids == [5, 7, 2]
    assert plan4.new_requests[1].block_ids == [1]
    assert plan4.num_scheduled_tokens == {"c": 5, "d": 3}
    run.until_done()
    assert [sid - plan0.step_id for sid, n in run.executor.sent_whole if n.req_id == "c"] == [0, 4]
    assert len(run.outputs["c"]) == 4


def test_preempted_run_gives_the_same_outputs_as_a_large_pool() -> None:
    """Recompute after preemption reproduces the tokens of an unconstrained run."""
    small = _preemption_run(num_blocks=8)
    small.until_done()
    large = _preemption_run(num_blocks=200)
    large.until_done()
    assert small.scheduler.total_preemptions >= 1
    assert large.scheduler.total_preemptions == 0
    assert small.outputs == large.outputs
    assert all(len(v) == 4 for v in small.outputs.values())


def test_many_requests_under_pressure_match_a_large_pool() -> None:
    """A crowded run with chunking, prefix sharing and repeated preemption matches a roomy one."""

    def requests() -> list[Request]:
        shared = prompt_of(9, 3)
        return [
            make_request(f"r{i}", [*shared, *prompt_of(3 + i % 5, i)], max_tokens=3 + i % 7)
            for i in range(12)
        ]

    outputs = []
    for num_blocks, budget in ((14, 12), (500, 4096)):
        run = new_run(num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=6)
        for r in requests():
            run.scheduler.add_request(r)
        run.until_done()
        outputs.append(run.outputs)
        if num_blocks == 14:
            assert run.scheduler.total_preemptions > 0
    assert outputs[0] == outputs[1]


def test_a_request_may_preempt_itself() -> None:
    """When the request that needs a block is itself the newest, it is the one preempted."""
    run = new_run(num_blocks=5)  # 4 usable blocks
    run.scheduler.add_request(make_request("a", prompt_of(6), max_tokens=2))
    run.scheduler.add_request(make_request("b", prompt_of(8, 1), max_tokens=2))
    run.step()
    assert run.scheduler.kv.get_block_ids("b") == [3, 4]
    plan = run.step()  # a fits its 7th token; b's 9th needs a block and b is the newest
    assert plan.finished_req_ids == ["b"]
    assert plan.num_scheduled_tokens == {"a": 1}
    assert run.scheduler.requests["b"].num_preemptions == 1
    plan = run.step()  # a finished last step; b resumes from its own cached prompt blocks
    assert plan.finished_req_ids == ["a"]
    (resumed,) = plan.new_requests
    assert (resumed.req_id, resumed.block_ids, resumed.num_computed_tokens) == ("b", [3, 4, 2], 8)
    assert plan.num_scheduled_tokens == {"b": 1}
    run.until_done()
    assert len(run.outputs["a"]) == 2 and len(run.outputs["b"]) == 2


def _stop_run(eos_after: int | None = None, **params: object) -> tuple[Run, Request]:
    run = new_run(eos_after)
    max_model_len = params.pop("max_model_len", 4096)
    request = make_request("a", prompt_of(NUM_PROMPT), max_model_len=max_model_len, **params)  # type: ignore[arg-type]
    run.scheduler.add_request(request)
    run.until_done()
    return run, request


def test_stop_on_eos() -> None:
    """EOS ends the request with "stop", EOS included in the output, no stop_reason."""
    run, req = _stop_run(eos_after=3, max_tokens=5)
    assert run.outputs["a"] == [output_token(1), output_token(2), EOS]
    assert run.finished["a"] == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    """ignore_eos keeps generating through EOS until max_tokens ("length")."""
    run, _ = _stop_run(eos_after=2, max_tokens=4, ignore_eos=True)
    assert run.outputs["a"] == [output_token(1), EOS, output_token(3), output_token(4)]
    assert run.finished["a"] == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_set_stop_reason() -> None:
    """A stop token id ends the request with "stop" and records the token as the stop reason."""
    stop = output_token(3)
    run, req = _stop_run(max_tokens=4, stop_token_ids=[stop, 500])
    assert run.outputs["a"] == [output_token(1), output_token(2), stop]
    assert run.finished["a"] == RequestStatus.FINISHED_STOPPED
    assert run.stop_reasons["a"] == stop == req.stop_reason


def test_stop_token_ids_apply_with_ignore_eos() -> None:
    """ignore_eos ignores only EOS, not explicit stop token ids."""
    stop = output_token(2)
    run, req = _stop_run(eos_after=1, max_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    assert run.outputs["a"] == [EOS, stop]
    assert req.stop_reason == stop


def test_max_tokens_finishes_with_length() -> None:
    """max_tokens outputs end the request with "length"."""
    run, req = _stop_run(max_tokens=3)
    assert len(run.outputs["a"]) == 3
    assert run.finished["a"] == RequestStatus.FINISHED_LENGTH
    assert req.stop_reason is None


def test_requests_finishing_in_one_step_leave_the_others_running_in_order() -> None:
    """Several requests that end in the same step all leave, their drops go out in batch order,
    and the rest keep their order (preemption takes the newest from its tail)."""
    run = new_run()
    for req_id, max_tokens in [("a", 2), ("b", 5), ("c", 2), ("d", 5), ("e", 2)]:
        run.scheduler.add_request(make_request(req_id, prompt_of(NUM_PROMPT), max_tokens=max_tokens))
    run.step()
    run.step()
    assert [r.req_id for r in run.scheduler.running] == ["b", "d"]
    assert run.finished == dict.fromkeys("ace", RequestStatus.FINISHED_LENGTH)
    assert run.step().finished_req_ids == ["a", "c", "e"]
    run.until_done()


def test_max_model_len_finishes_with_length() -> None:
    """Without max_tokens the request stops when prompt + output reach max_model_len."""
    run, req = _stop_run(max_model_len=9)
    assert len(run.outputs["a"]) == 4
    assert req.num_tokens == 9
    assert run.finished["a"] == RequestStatus.FINISHED_LENGTH


def test_max_model_len_caps_max_tokens() -> None:
    """max_model_len wins over a larger max_tokens."""
    run, _ = _stop_run(max_tokens=100, max_model_len=8)
    assert len(run.outputs["a"]) == 3


def test_min_tokens_delays_eos_and_stop_ids() -> None:
    """Before min_tokens outputs, EOS and stop token ids do not end the request."""
    stop = output_token(2)
    run, req = _stop_run(eos_after=1, max_tokens=5, min_tokens=3, stop_token_ids=[stop])
    assert run.outputs["a"] == [EOS, stop, *(output_token(k) for k in (3, 4, 5))]
    assert run.finished["a"] == RequestStatus.FINISHED_LENGTH
    assert req.stop_reason is None
    assert req.options.stop_token_ids == (stop, EOS)  # the executor is told to mask them


def test_eos_at_the_min_tokens_th_output_stops() -> None:
    """The output that reaches min_tokens may itself stop the request (vLLM's rule)."""
    run, _ = _stop_run(eos_after=3, max_tokens=3, min_tokens=3)
    assert run.outputs["a"] == [output_token(1), output_token(2), EOS]
    assert run.finished["a"] == RequestStatus.FINISHED_STOPPED


def test_abort_running_request_frees_blocks_now() -> None:
    """finish_requests frees a running request's blocks at once and drops it in the next plan."""
    run = new_run(num_blocks=16)
    run.scheduler.add_request(make_request("a", prompt_of(10), max_tokens=20))
    run.scheduler.add_request(make_request("b", prompt_of(5, 1), max_tokens=3))
    run.step()
    assert run.scheduler.kv.get_block_ids("a") == [1, 2, 3]
    free_before = run.scheduler.kv.pool.num_free_blocks
    (aborted,) = run.scheduler.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert run.scheduler.kv.get_block_ids("a") == []
    assert run.scheduler.kv.pool.num_free_blocks == free_before + 3
    assert [r.req_id for r in run.scheduler.running] == ["b"]
    plan = run.step()
    assert plan.finished_req_ids == ["a"]
    assert "a" not in plan.num_scheduled_tokens
    assert not run.executor.runner.holds("a")
    run.until_done()
    assert "a" not in run.outputs


def test_abort_waiting_request() -> None:
    """Aborting a request that never ran removes it from the queue; the executor ignores its id."""
    run = new_run(max_num_seqs=1)
    run.scheduler.add_request(make_request("a", prompt_of(5), max_tokens=2))
    run.scheduler.add_request(make_request("b", prompt_of(5, 1), max_tokens=2))
    run.step()
    assert [r.req_id for r in run.scheduler.waiting] == ["b"]
    run.scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert not run.scheduler.waiting
    assert run.step().finished_req_ids == ["b"]
    run.until_done()
    assert set(run.outputs) == {"a"}


def test_abort_while_the_step_runs_ignores_its_result() -> None:
    """A request aborted between schedule and update gets no token and no stale computed count."""
    run = new_run()
    sched = run.scheduler
    sched.add_request(make_request("a", prompt_of(5), max_tokens=4))
    sched.add_request(make_request("b", prompt_of(5, 1), max_tokens=4))
    plan, _ = sched.schedule()
    result = run.executor.step(plan)
    (aborted,) = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    updates = sched.update_from_output(plan, result)
    assert [u.request.req_id for u in updates] == ["b"]
    assert aborted.output_token_ids == []
    sched.check_integrity()
    run.until_done()


def test_fail_step_runs_the_plan_again_once_then_errors_and_unregisters_its_blocks() -> None:
    """fail_step frees the plan's requests' blocks and drops their hashes; the requests run again
    from the head of the queue, the executor dropping what it held of them, and a second failure
    ends them with an error. Those that ran again produce what an undisturbed run does."""
    undisturbed = new_run(num_blocks=16, max_num_seqs=2)
    run = new_run(num_blocks=16, max_num_seqs=2)
    sched = run.scheduler
    prompt = prompt_of(13)
    for each in (undisturbed, run):
        each.scheduler.add_request(make_request("a", prompt, max_tokens=4))
        each.scheduler.add_request(make_request("b", prompt_of(6, 1), max_tokens=4))
        each.scheduler.add_request(make_request("late", prompt_of(6, 2), max_tokens=4))
    undisturbed.until_done()
    plan, _ = sched.schedule()
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    assert len(sched.kv.pool.cached_blocks) == 4  # a's 3 full blocks, b's 1
    run.executor.step(plan)  # it ran, but its result was lost on the way back
    failed, retried = sched.fail_step(plan)
    assert failed == [] and [r.req_id for r in retried] == ["a", "b"]
    assert all(r.status == RequestStatus.WAITING and r.num_step_retries == 1 for r in retried)
    assert sched.kv.pool.cached_blocks == {}
    assert sched.kv.get_block_ids("a") == [] and sched.kv.get_block_ids("b") == []
    assert not sched.running and [r.req_id for r in sched.waiting] == ["a", "b", "late"]
    sched.check_integrity()
    run.executor.last_step_id = plan.step_id

    again, _ = sched.schedule()  # the executor drops what it held of them, then takes them whole
    assert again.finished_req_ids == ["a", "b"]
    assert [(n.req_id, n.num_computed_tokens) for n in again.new_requests] == [("a", 0), ("b", 0)]
    run.scheduler.update_from_output(again, run.executor.step(again))
    plan, _ = sched.schedule()
    failed, retried = sched.fail_step(plan)  # a second failure: they end
    assert sorted(r.req_id for r in failed) == ["a", "b"] and retried == []
    assert all(r.status == RequestStatus.FINISHED_ERROR for r in failed)
    run.executor.last_step_id = plan.step_id
    sched.check_integrity()
    run.until_done()
    assert run.outputs == {"late": undisturbed.outputs["late"]}

    once = new_run(num_blocks=16, max_num_seqs=2)
    once.scheduler.add_request(make_request("a", prompt, max_tokens=4))
    once.step()
    once.step()
    plan, _ = once.scheduler.schedule()
    once.executor.step(plan)
    once.executor.last_step_id = plan.step_id
    assert once.scheduler.fail_step(plan)[1][0].output_token_ids == undisturbed.outputs["a"][:2]
    once.until_done()
    assert once.outputs == {"a": undisturbed.outputs["a"]}  # resumed from its two tokens, unchanged


def test_step_ids_increase_and_idle_steps_are_empty() -> None:
    """Each schedule() call takes the next step id; with nothing to do the plan is empty."""
    run = new_run()
    plan, stats = run.scheduler.schedule()
    assert plan.total_num_scheduled_tokens == 0 and stats.num_scheduled_tokens == 0
    assert not run.scheduler.has_work()
    following, _ = run.scheduler.schedule()
    assert following.step_id == plan.step_id + 1
    # Another scheduler (a restart) starts elsewhere: it never repeats the executor's last step id.
    assert new_run().scheduler.schedule()[0].step_id != plan.step_id


def test_step_stats_count_prompt_tokens() -> None:
    """StepStats splits scheduled tokens into prompt work."""
    run = new_run(max_num_batched_tokens=8)
    run.scheduler.add_request(make_request("a", prompt_of(6), max_tokens=3))
    run.scheduler.add_request(make_request("b", prompt_of(6, 1), max_tokens=3))
    plan, stats = run.scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 6, "b": 2}
    assert (stats.num_scheduled_tokens, stats.num_prompt_tokens) == (8, 8)
    run.scheduler.update_from_output(plan, run.executor.step(plan))
    plan, stats = run.scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 4}
    assert (stats.num_scheduled_tokens, stats.num_prompt_tokens) == (5, 4)
    run.scheduler.update_from_output(plan, run.executor.step(plan))
    run.until_done()


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_prefix_caching_switch_does_not_change_outputs(enable_prefix_caching: bool) -> None:
    """Outputs are the same with and without prefix caching."""
    outs = []
    for caching in (enable_prefix_caching, not enable_prefix_caching):
        run = new_run(enable_prefix_caching=caching, max_num_batched_tokens=10)
        for i in range(4):
            run.scheduler.add_request(make_request(f"r{i}", prompt_of(11), max_tokens=3 + i))
        run.until_done()
        outs.append(run.outputs)
    assert outs[0] == outs[1]


def test_fail_step_resends_the_failed_plans_drops() -> None:
    """A plan that never reached the executor loses its drops; the next plan must carry them, so a
    request preempted in the failed plan is dropped before it is sent whole again (after the
    failed plan's requests, which run again first)."""
    run = _preemption_run(num_blocks=8)
    sched = run.scheduler
    run.step()
    run.step()
    plan, _ = sched.schedule()  # preempts c; the executor still holds c
    assert plan.finished_req_ids == ["c"]
    failed, retried = sched.fail_step(plan)  # a transport error: the executor never saw this plan
    assert failed == [] and [r.req_id for r in retried] == ["a", "b"]
    run.executor.last_step_id = plan.step_id
    assert run.executor.runner.holds("c")
    nxt = run.step()
    assert set(nxt.finished_req_ids) == {"a", "b", "c"}
    assert [n.req_id for n in nxt.new_requests] == ["a", "b"]  # run again first, c after them
    run.until_done()
    undisturbed = _preemption_run(num_blocks=8)
    undisturbed.until_done()
    assert run.outputs == undisturbed.outputs and set(run.outputs) == {"a", "b", "c"}


@pytest.mark.parametrize("num_scheduler_steps", [1, 3])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_every_invariant(seed: int, num_scheduler_steps: int) -> None:
    """Random arrivals, aborts and failed steps on a small pool: every plan is consistent, the pool
    stays whole, and every request ends returning all its blocks (multi-step plans too)."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    run = new_run(
        # The longest request (15 prompt + 9 output tokens) must fit the pool on its own.
        num_blocks=1 + rng.randint(25 // bs, 25 // bs + 4),
        block_size=bs,
        max_num_batched_tokens=rng.randint(8, 24),
        max_num_seqs=rng.randint(2, 6),
        num_scheduler_steps=num_scheduler_steps,
    )
    sched = run.scheduler
    prefixes = [prompt_of(rng.randint(2, 9), s) for s in range(3)]
    added = failures = 0
    for _ in range(300):
        if added < 40 and rng.random() < 0.4:
            prompt = [*rng.choice(prefixes), *prompt_of(rng.randint(1, 6), rng.randint(0, 99))]
            sched.add_request(
                make_request(
                    f"r{added}", prompt, block_size=bs, max_model_len=40, max_tokens=rng.randint(1, 9)
                )
            )
            added += 1
        if sched.requests and rng.random() < 0.05:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
        if rng.random() < 0.05:
            plan, _ = sched.schedule()
            if rng.random() < 0.5:
                run.executor.step(plan)  # it ran, but its result was lost on the way back
            run.executor.last_step_id = plan.step_id
            sched.fail_step(plan)
            failures += 1
            sched.check_integrity()
        elif sched.has_work():
            run.step()
    run.until_done()
    assert added == 40 and failures > 0
    assert sched.total_preemptions > 0


# ------------------------------------------------------------------------ multi-step decoding


def test_multi_step_runs_decodes_ahead_with_blocks_for_every_pass() -> None:
    """With four passes per step: the step that admits requests runs one pass (their first tokens
    come after it); then each step runs four passes for every running request, with the blocks
    for all of them allocated with the first, no pass past max_tokens, and every token counted."""
    run = new_run(num_scheduler_steps=4)
    sched = run.scheduler
    sched.add_request(make_request("a", prompt_of(5), max_tokens=10))
    sched.add_request(make_request("b", prompt_of(6, 1), max_tokens=6))
    admit = run.step()
    assert not admit.num_steps and admit.num_scheduled_tokens == {"a": 5, "b": 6}
    decode = run.step()
    assert decode.num_steps == {"a": 4, "b": 4} and decode.num_scheduled_tokens == {"a": 1, "b": 1}
    # a: 6 known tokens + 3 more passes = 9 slots, 3 blocks of 4; b: 7 + 3 = 10, 3 blocks.
    assert [len(sched.kv.get_block_ids(r)) for r in "ab"] == [3, 3]
    assert [len(sched.requests[r].output_token_ids) for r in "ab"] == [5, 5]
    last = run.step()
    assert last.num_steps == {"a": 4}  # b has one token left: one pass; a has five
    assert run.finished == {"b": RequestStatus.FINISHED_LENGTH}
    run.until_done()
    assert run.outputs == {
        "a": [output_token(k) for k in range(1, 11)],
        "b": [output_token(k, "b", 6) for k in range(1, 7)],
    }


def test_multi_step_drops_tokens_sampled_after_a_stop() -> None:
    """EOS (or a stop token id) sampled in a step's second pass ends the request there: the
    tokens its later passes sampled are not output, and its blocks all come back."""
    for params in ({"eos_after": 3}, {"stop_token_ids": [output_token(3)]}):
        eos_after = params.pop("eos_after", None)
        outputs = []
        for num_steps in (1, 4):
            run = new_run(eos_after, num_scheduler_steps=num_steps)  # type: ignore[arg-type]
            run.scheduler.add_request(make_request("a", prompt_of(NUM_PROMPT), max_tokens=9, **params))
            run.until_done()
            outputs.append((run.outputs, run.finished, run.stop_reasons))
        assert outputs[0] == outputs[1]
        assert len(outputs[1][0]["a"]) == 3


@pytest.mark.parametrize("early_first_tokens", [False, True])
@pytest.mark.parametrize("num_blocks", [14, 500])
def test_multi_step_gives_the_outputs_of_single_steps(num_blocks: int, early_first_tokens: bool) -> None:
    """A crowded run (chunked prefills, prefix sharing, preemption when the pool is small) gives
    every request the same tokens with four passes per step as with one, whether the steps that
    admit requests run one pass or (`early_first_tokens`) four for the running requests."""
    shared = prompt_of(9, 3)
    outputs = []
    for num_steps in (1, 4):
        run = new_run(
            num_blocks=num_blocks,
            max_num_batched_tokens=12,
            max_num_seqs=6,
            num_scheduler_steps=num_steps,
            early_first_tokens=early_first_tokens,
        )
        for i in range(12):
            run.scheduler.add_request(
                make_request(f"r{i}", [*shared, *prompt_of(3 + i % 5, i)], max_tokens=3 + i % 7)
            )
        run.until_done()
        outputs.append(run.outputs)
        if num_steps > 1:
            assert any(p.num_steps for p in run.executor.plans)
    assert outputs[0] == outputs[1]


def test_with_early_first_tokens_a_step_that_admits_runs_every_pass_for_the_running() -> None:
    """When the executor answers the first pass's requests early, a step that admits requests
    runs its passes for the running ones and one pass for the admitted."""
    run = new_run(num_scheduler_steps=4, early_first_tokens=True)
    sched = run.scheduler
    sched.add_request(make_request("a", prompt_of(5), max_tokens=10))
    assert not run.step().num_steps  # only an admission: one pass
    sched.add_request(make_request("b", prompt_of(6, 1), max_tokens=6))
    both = run.step()
    assert both.num_steps == {"a": 4} and [r.req_id for r in both.new_requests] == ["b"]
    assert both.has_first_pass_only
    assert [len(sched.requests[r].output_token_ids) for r in "ab"] == [5, 1]
    run.until_done()
    assert run.outputs == {
        "a": [output_token(k) for k in range(1, 11)],
        "b": [output_token(k, "b", 6) for k in range(1, 7)],
    }


def test_with_early_first_tokens_a_queue_the_budget_cannot_take_is_admitted_in_one_pass_steps() -> None:
    """Prompts waiting beyond one step's token budget: the steps that admit them run one pass,
    so the next admission does not wait for the running requests' later passes."""
    run = new_run(num_scheduler_steps=4, early_first_tokens=True, max_num_batched_tokens=12)
    sched = run.scheduler
    sched.add_request(make_request("a", prompt_of(5), max_tokens=20))
    run.step()
    for name in "bcd":  # 3 x 8 prompt tokens: more than a step's budget of 12
        sched.add_request(make_request(name, prompt_of(8, ord(name)), max_tokens=2))
    assert not run.step().num_steps
    run.until_done()
    assert [len(run.outputs[r]) for r in "abcd"] == [20, 2, 2, 2]


def test_a_joining_step_leaves_the_slots_of_requests_not_dropped_yet() -> None:
    """A joining step carries no drops, so a request that ended since the last step still holds
    its sequence slot on the executor: with every slot held so, nothing joins."""
    run = new_run(num_scheduler_steps=4, early_first_tokens=True, max_num_seqs=2)
    sched = run.scheduler
    for name in ("a", "b"):
        sched.add_request(make_request(name, prompt_of(5, ord(name)), max_tokens=10))
    run.step()
    running, _ = sched.schedule()
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # its drop goes with the next step
    sched.add_request(make_request("c", prompt_of(6, 3), max_tokens=6))
    assert running.num_steps == {"a": 4, "b": 4}
    assert sched.schedule_joining(budget=100) is None  # the executor holds a and b: c would be a third
    sched.check_integrity()


def test_a_joining_step_admits_whole_prompts_in_its_budget_and_the_outputs_stay(tokenizer: Tokenizer) -> None:
    """Requests that come while a multi-pass step runs start in a step that joins it: whole
    prompts, in order, within the budget it is given; nothing when the first one waiting is
    constrained (the joined pass takes no bitmask) or nothing fits. The requests then run on as
    if admitted in a step of their own: every output is the simulated executor's."""
    run = new_run(num_scheduler_steps=4, early_first_tokens=True)
    sched = run.scheduler
    sched.add_request(make_request("a", prompt_of(5), max_tokens=10))
    run.step()
    running, _ = sched.schedule()
    assert running.num_steps == {"a": 4}
    for name, length in (("b", 6), ("c", 8)):
        sched.add_request(make_request(name, prompt_of(length, ord(name)), max_tokens=6))
    assert sched.schedule_joining(budget=5) is None  # b's prompt does not fit whole
    scheduled = sched.schedule_joining(budget=10)
    assert scheduled is not None
    joiner, stats = scheduled
    assert joiner.joins_running and admits_only(joiner)
    assert joiner.num_scheduled_tokens == {"b": 6} and stats.num_scheduled_tokens == 6
    assert [r.req_id for r in sched.waiting] == ["c"]  # c's 8 tokens are past the 4 left
    result, answer = run.executor.step_joined(running, joiner)
    assert answer.sampled_req_ids == ["b"]
    sched.update_from_output(running, result)
    sched.update_from_output(joiner, answer)
    sched.check_integrity()
    compiler = GrammarCompiler(tokenizer.to_json(), 512, tokenizer.eos_token_ids)
    grammar = compiler.grammar_for(StructuredOutputs("choice", choices=("yes", "no"))).new_state(6)
    sched.waiting[0].grammar = grammar
    assert sched.schedule_joining(budget=100) is None  # c is constrained: it waits for a step
    sched.waiting[0].grammar = None
    grammar.release()
    compiler.close()
    run.until_done()
    assert run.outputs == {
        "a": [output_token(k) for k in range(1, 11)],
        "b": [output_token(k, "b", 6) for k in range(1, 7)],
        "c": [output_token(k, "c", 8) for k in range(1, 7)],
    }


def test_multi_step_goes_on_while_waiting_requests_cannot_start() -> None:
    """A waiting request that the free blocks could not hold does not hold the running ones to
    one pass a step; once blocks are back, the step that admits it runs one pass."""
    run = new_run(num_blocks=13, num_scheduler_steps=4)  # 12 usable blocks of 4 tokens
    sched = run.scheduler
    sched.add_request(make_request("a", prompt_of(10), max_tokens=9))
    sched.add_request(make_request("b", prompt_of(10, 1), max_tokens=9))
    run.step()  # both admitted, one pass: 3 blocks each
    assert run.step().num_steps == {"a": 4, "b": 4}  # 14 slots each: 4 blocks, 4 left free
    sched.add_request(make_request("c", prompt_of(20, 2), max_tokens=2))  # needs 5 blocks
    stalled = run.step()
    assert stalled.num_steps == {"a": 4, "b": 4} and not stalled.new_requests
    assert [r.req_id for r in sched.waiting] == ["c"]
    assert run.finished == {"a": RequestStatus.FINISHED_LENGTH, "b": RequestStatus.FINISHED_LENGTH}
    admitted = run.step()
    assert [r.req_id for r in admitted.new_requests] == ["c"] and not admitted.num_steps
    run.until_done()
    assert [len(run.outputs[r]) for r in "abc"] == [9, 9, 2]


def test_a_prefilled_request_decodes_on_another_scheduler_that_reserved_its_blocks() -> None:
    """Prefill/decode disaggregation, one scheduler per side (`kv_handoff`): the decode side
    takes the request at once (its blocks, its own prefix hits among them, and a sequence slot)
    but schedules nothing for it; the prefill side, its twin, samples the first token and holds
    its blocks (PREFILLED) until released. Told where the KV is, the decode side pulls the blocks
    its hits lack, into the blocks it reserved, beside a step that runs none of its tokens; the
    step after the result that says the pull landed runs it, and the outputs are those of a
    request that ran on one side alone."""
    prompt = prompt_of(14)
    decode = new_run(num_blocks=32, max_num_seqs=2)
    decode.scheduler.add_request(make_request("c", [*prompt[:8], 99], max_tokens=1))
    decode.until_done()  # the prompt's first two blocks are cached on the decode side
    request = make_request("a", prompt, max_tokens=4)
    request.remote_prefill = True
    twin = request.prefill_twin()
    decode.scheduler.add_request(request)
    decode.scheduler.add_request(make_request("d", prompt_of(6, seed=1), max_tokens=8))
    plan = decode.step()  # "a" reserved, "d" takes the last sequence slot
    assert plan.num_scheduled_tokens == {"d": 6} and not plan.kv_pulls
    reserved = decode.scheduler.kv.get_block_ids("a")
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS and len(reserved) == 4
    assert decode.scheduler.num_unfinished == 2 and decode.scheduler.waits_on_others()
    decode.scheduler.add_request(make_request("e", prompt_of(5, seed=2), max_tokens=1))
    decode.step()
    assert [r.req_id for r in decode.scheduler.waiting] == ["e"]  # no slot: "a" holds one

    prefill = new_run(num_blocks=32)
    prefill.scheduler.add_request(twin)
    prefill.step()
    (update,) = prefill.updates[-1]
    assert update.finished is RequestStatus.PREFILLED and twin.output_token_ids == [output_token(1, "a", 14)]
    assert twin.pull is not None and (twin.pull.block_ids, twin.pull.num_tokens) == ([1, 2, 3, 4], 14)
    assert prefill.scheduler.held == {"a": twin} and not prefill.scheduler.requests
    assert prefill.scheduler.waits_on_others()  # a draining executor waits for the pull
    with pytest.raises(AssertionError, match="in use"):
        prefill.scheduler.check_integrity(expect_idle=True)

    pull = replace(twin.pull, address="prefill:1", instance_id="i")
    decode.scheduler.start_decode(Prefilled("a", pull, twin.output_token_ids, twin.output_logprobs, 0))
    plan = decode.step()
    assert plan.kv_pulls == [KvPull("prefill:1", "i", [3, 4], reserved[2:4], "a")]
    assert set(plan.num_scheduled_tokens) == {"d"} and not plan.new_requests
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert decode.executor.runner.num_pulled_blocks == 2  # and its result said it landed
    plan = decode.step()
    new = next(n for n in plan.new_requests if n.req_id == "a")
    assert new.num_computed_tokens == 14 and plan.num_scheduled_tokens["a"] == 1
    assert new.block_ids == reserved and not plan.kv_pulls
    prefill.scheduler.release_held(["a"])
    prefill.scheduler.check_integrity(expect_idle=True)
    decode.until_done()
    assert decode.outputs["a"] == [output_token(k, "a", 14) for k in range(1, 5)]
    # The pulled blocks joined the prefix cache once the pull landed.
    assert decode.scheduler.kv.get_computed_blocks(make_request("f", prompt))[1] == 12


def test_a_failed_pull_fails_its_request_only_which_computes_its_prompt() -> None:
    """The step runs on; the request whose pull failed, as its result says, gives its blocks
    back (none was registered in the prefix cache) and computes its prompt from the head of the
    queue; the other request of the step keeps its token."""
    run = new_run(num_blocks=32)

    def refusing(pull: KvPull) -> Iterator[pb.BlockChunk]:
        raise KvPullFailed(f"kv pull from {pull.address}: refused")

    run.executor.runner = SimulatedRunner(run.executor.runner.config, block_reader=refusing)
    pulled = make_request("a", prompt_of(14), max_tokens=4)
    pulled.remote_prefill = True
    run.scheduler.add_request(pulled)
    run.step()
    first = output_token(1, "a", 14)
    source = PrefilledBlocks("prefill:1", "", [1, 2, 3, 4], 14)
    run.scheduler.start_decode(Prefilled("a", source, [first], [None], 0))
    run.scheduler.add_request(make_request("b", prompt_of(6, seed=1), max_tokens=4))
    plan = run.step()
    assert [p.req_id for p in plan.kv_pulls] == ["a"] and set(plan.num_scheduled_tokens) == {"b"}
    assert [u.request.req_id for u in run.updates[-1]] == ["b"]
    assert pulled.status is RequestStatus.WAITING and pulled.pull is None and not pulled.remote_prefill
    assert pulled.output_token_ids == [first] and run.scheduler.waiting[0] is pulled
    assert run.scheduler.kv.get_computed_blocks(make_request("c", prompt_of(14)))[1] == 0
    plan = run.step()
    assert not plan.kv_pulls and plan.num_scheduled_tokens == {"b": 1, "a": 15}
    run.until_done()
    assert run.outputs["a"] == [first, *(output_token(k, "a", 14) for k in range(2, 5))]
