"""A decode executor's pulls beside its steps (`kv_handoff`), driven over a simulated runner.

The runner lands each pull as it starts and names it in every result until a plan names its
request again; `Decode` holds those outcomes back from the scheduler until the test lets one
through (`land`, `fail`), so each stage of a pulled request can be looked at: the step that
starts the pull runs none of its tokens while the others decode on, the request runs after
the result that says its pull landed, an abort parks its blocks until the pull is over, and a
failure makes it compute its prompt. Every plan is checked to name no block a pull still
writes, and every step ends with the block pool's integrity check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from npuserve.executor.simulated import LatencyModel, SimulatedConfig, SimulatedRunner
from npuserve.proto.step_plan import KvPull, StepPlan, StepResult
from npuserve.scheduler.core.request import (
    Prefilled,
    PrefilledBlocks,
    Request,
    RequestStatus,
    SamplingParams,
)
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.core.scheduler_config import SchedulerConfig

BLOCK_SIZE = 4
LONG = 14  # a prompt of 3 full blocks and part of a fourth
SOURCE = PrefilledBlocks("prefill:1", "i", [11, 12, 13, 14], LONG)


def make_request(req_id: str, num_prompt: int, max_tokens: int, seed: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    prompt = [(seed * 31 + i * 7) % 90 + 5 for i in range(num_prompt)]
    return Request(req_id, prompt, params, params.to_options((2,)), (2,), 256, BLOCK_SIZE)


@dataclass
class Decode:
    """A decode executor's scheduler over a simulated runner; the pulls' outcomes reach the
    scheduler only once the test says (`land`, `fail`)."""

    scheduler: Scheduler
    runner: SimulatedRunner
    held_back: set[str] = field(default_factory=set)  # pulls whose outcome the scheduler does not see
    failing: set[str] = field(default_factory=set)  # pulls the scheduler is told failed
    pulling: dict[str, KvPull] = field(default_factory=dict)  # as far as the scheduler knows
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def step(self) -> tuple[StepPlan, StepResult]:
        plan, _ = self.scheduler.schedule()
        written = {b for pull in self.pulling.values() for b in pull.dst_block_ids}
        for new in plan.new_requests:
            assert written.isdisjoint(new.block_ids), f"{new.req_id} is sent a block a pull writes"
        for cached in plan.cached_requests:
            assert written.isdisjoint(cached.new_block_ids), "a step names a block a pull writes"
        for pull in plan.kv_pulls:
            assert pull.req_id not in plan.num_scheduled_tokens, "a step runs a request it pulls"
            self.pulling[pull.req_id] = pull
            self.held_back.add(pull.req_id)
        result = self.runner.execute(plan)
        seen = StepResult(plan.step_id, result.sampled_req_ids, result.sampled_token_ids, result.logprobs)
        for req_id in result.landed_pull_req_ids + result.failed_pull_req_ids:
            if req_id not in self.held_back:
                failed = req_id in self.failing or req_id in result.failed_pull_req_ids
                (seen.failed_pull_req_ids if failed else seen.landed_pull_req_ids).append(req_id)
                self.pulling.pop(req_id, None)
        for update in self.scheduler.update_from_output(plan, seen):
            self.outputs.setdefault(update.request.req_id, []).extend(update.new_token_ids)
        self.scheduler.check_integrity()
        return plan, seen

    def land(self, req_id: str) -> None:
        self.held_back.discard(req_id)

    def fail(self, req_id: str) -> None:
        self.failing.add(req_id)
        self.held_back.discard(req_id)

    def reserve(self, request: Request) -> None:
        """``request`` waits here for the KV that another executor computes."""
        request.remote_prefill = True
        self.scheduler.add_request(request)

    def prefilled(self, req_id: str, source: PrefilledBlocks | None = SOURCE) -> None:
        """The prefill is over: its first token, and where its KV is."""
        first = self.runner.token_for(req_id, LONG)
        self.scheduler.start_decode(Prefilled(req_id, source, [first], [None], 0))

    def until_idle(self) -> None:
        for _ in range(200):
            if not self.scheduler.has_work():
                break
            self.step()
        self.scheduler.check_integrity(expect_idle=True)

    def expected(self, req_id: str, num_prompt: int, num_output: int) -> list[int]:
        return [self.runner.token_for(req_id, num_prompt + k) for k in range(num_output)]


def decode_side(num_blocks: int = 32, max_num_seqs: int = 4) -> Decode:
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs)
    runner = SimulatedRunner(
        SimulatedConfig(
            # NOTE: a pull lands as it starts; `Decode` decides when the scheduler hears of it.
            latency=LatencyModel(0.0, 0.0, 0.0, pull_bytes_per_s=math.inf),
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=256,
            max_num_seqs=max_num_seqs,
        )
    )
    return Decode(Scheduler(config), runner)


def decoding(decode: Decode, req_id: str = "b") -> Request:
    """A request that decodes on ``decode`` beside the pulls."""
    request = make_request(req_id, 6, max_tokens=20, seed=1)
    decode.scheduler.add_request(request)
    return request


def test_a_pull_runs_beside_steps_that_run_none_of_its_tokens_and_its_request_runs_after_it_landed() -> None:
    decode = decode_side()
    decoding(decode)
    pulled = make_request("a", LONG, max_tokens=4)
    decode.reserve(pulled)
    decode.step()
    reserved = decode.scheduler.kv.get_block_ids("a")
    decode.prefilled("a")
    plan, _ = decode.step()
    assert plan.kv_pulls == [KvPull("prefill:1", "i", SOURCE.block_ids, reserved, "a")]
    assert set(plan.num_scheduled_tokens) == {"b"} and not plan.new_requests
    for _ in range(3):  # the pull runs on: the other request decodes, "a" holds its slot
        plan, _ = decode.step()
        assert set(plan.num_scheduled_tokens) == {"b"} and not plan.kv_pulls
        assert pulled.status is RequestStatus.WAITING_FOR_REMOTE_KVS and "a" in decode.scheduler.pulling
        assert decode.scheduler.num_unfinished == 2 and decode.scheduler.num_reserved == 1
    decode.land("a")
    _, result = decode.step()
    assert result.landed_pull_req_ids == ["a"] and "a" not in result.sampled_req_ids
    # Its pulled blocks joined the prefix cache once it landed.
    assert decode.scheduler.kv.get_computed_blocks(make_request("c", LONG, 1))[1] == 12
    plan, _ = decode.step()
    (new,) = plan.new_requests
    assert (new.req_id, new.num_computed_tokens, new.block_ids) == ("a", LONG, reserved)
    assert plan.num_scheduled_tokens == {"b": 1, "a": 1}
    decode.until_idle()
    assert decode.outputs["a"] == decode.expected("a", LONG, 4)[1:]  # its first token came with the prefill
    assert decode.outputs["b"] == decode.expected("b", 6, 20)


def test_an_abort_while_the_pull_runs_frees_its_blocks_only_once_the_pull_is_over() -> None:
    """The request ends at once; its blocks stay taken (a later step must not reuse blocks the
    pull still writes), and the executor is told to drop it only once the pull's outcome came."""
    decode = decode_side(num_blocks=9)  # 8 usable blocks: 4 for "a", 2 for "b"
    decoding(decode)
    decode.reserve(make_request("a", LONG, max_tokens=4))
    decode.step()
    decode.prefilled("a")
    decode.step()
    aborted = decode.scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in aborted] == ["a"] and "a" not in decode.scheduler.requests
    assert list(decode.scheduler.kv.parked) == ["a"] and decode.scheduler.has_work()
    decode.scheduler.add_request(make_request("c", 10, max_tokens=2, seed=2))  # needs 3 blocks
    for _ in range(3):
        plan, _ = decode.step()
        assert "a" not in plan.finished_req_ids
        assert "c" not in plan.num_scheduled_tokens, "it would take blocks the pull still writes"
    decode.land("a")
    decode.step()  # its result says the pull landed: the blocks go back
    assert not decode.scheduler.kv.parked and not decode.scheduler.orphaned
    plan, _ = decode.step()
    assert "a" in plan.finished_req_ids and "c" in plan.num_scheduled_tokens
    decode.until_idle()
    assert decode.outputs["c"] == decode.expected("c", 10, 2)


def test_a_failure_named_in_a_later_step_makes_the_request_compute_its_prompt() -> None:
    decode = decode_side()
    decoding(decode)
    pulled = make_request("a", LONG, max_tokens=4)
    decode.reserve(pulled)
    decode.step()
    decode.prefilled("a")
    decode.step()
    decode.step()
    decode.fail("a")
    _, result = decode.step()
    assert result.failed_pull_req_ids == ["a"]
    assert pulled.status is RequestStatus.WAITING and not pulled.remote_prefill and pulled.pull is None
    assert decode.scheduler.waiting[0] is pulled
    assert decode.scheduler.kv.get_computed_blocks(make_request("c", LONG, 1))[1] == 0  # none registered
    plan, _ = decode.step()
    (new,) = plan.new_requests
    assert (new.req_id, new.num_computed_tokens) == ("a", 0) and plan.num_scheduled_tokens["a"] == LONG + 1
    decode.until_idle()
    assert decode.outputs["a"] == decode.expected("a", LONG, 4)[1:]


def test_an_outcome_from_before_the_pull_is_of_an_earlier_one_and_ignored() -> None:
    """A result of a step older than the one that carried a pull names an earlier pull of that
    id (results repeat outcomes): only the newer results say how this pull went."""
    decode = decode_side()
    decoding(decode)
    decode.reserve(make_request("a", LONG, max_tokens=2))
    decode.step()
    decode.prefilled("a")
    plan, _ = decode.step()
    assert [pull.req_id for pull in plan.kv_pulls] == ["a"]
    decode.scheduler.update_from_output(plan, StepResult(plan.step_id - 1, failed_pull_req_ids=["a"]))
    assert "a" in decode.scheduler.pulling
    decode.land("a")
    decode.until_idle()
    assert decode.outputs["a"] == decode.expected("a", LONG, 2)[1:]


def test_with_nothing_to_run_but_pulls_a_step_goes_out_alone() -> None:
    """A lane with only pulls running still sends a step, so that its result can say when they
    land; but not beside another step in flight (it would wait in the executor's queue)."""
    decode = decode_side()
    decode.reserve(make_request("a", LONG, max_tokens=2))
    decode.step()
    decode.prefilled("a")
    plan, _ = decode.step()
    assert plan.kv_pulls and not plan.num_scheduled_tokens
    scheduler = decode.scheduler
    assert scheduler.has_work()
    alone, _ = scheduler.schedule(may_poll=False)
    assert not scheduler.worth_sending(alone, may_poll=False)
    polled, _ = scheduler.schedule()
    assert scheduler.worth_sending(polled) and not polled.num_scheduled_tokens
    decode.land("a")
    decode.until_idle()


def test_a_failed_step_that_carried_a_pull_makes_its_request_compute_its_prompt() -> None:
    decode = decode_side()
    decoding(decode)
    pulled = make_request("a", LONG, max_tokens=3)
    decode.reserve(pulled)
    decode.step()
    decode.prefilled("a")
    plan, _ = decode.scheduler.schedule()
    assert plan.kv_pulls
    decode.scheduler.fail_step(plan)  # NOTE: the executor never saw it
    assert pulled.status is RequestStatus.WAITING and pulled in decode.scheduler.waiting
    assert not decode.scheduler.pulling and not pulled.remote_prefill
    decode.scheduler.check_integrity()
    decode.until_idle()
    assert decode.outputs["a"] == decode.expected("a", LONG, 3)[1:]


def test_prefix_hits_that_cover_the_pull_leave_nothing_to_pull() -> None:
    decode = decode_side()
    decode.scheduler.add_request(make_request("c", 13, max_tokens=1))  # the prompt's first 3 blocks
    decode.until_idle()
    pulled = make_request("a", LONG, max_tokens=2)
    decode.reserve(pulled)
    decode.step()
    decode.prefilled("a", PrefilledBlocks("prefill:1", "i", [11, 12, 13], 12))
    plan, _ = decode.step()
    assert not plan.kv_pulls and plan.num_scheduled_tokens == {"a": LONG + 1 - 12}
    decode.until_idle()
    assert decode.outputs["a"] == decode.expected("a", LONG, 2)[1:]


def pull_until_idle(decode: Decode) -> None:
    """Steps until nothing is left, each pull landing in the step after the one that carried it."""
    for _ in range(200):
        for req_id in list(decode.held_back):
            decode.land(req_id)
        if not decode.scheduler.has_work():
            break
        decode.step()
    decode.scheduler.check_integrity(expect_idle=True)


@pytest.mark.parametrize(("num_blocks", "max_num_seqs"), [(9, 4), (32, 2)], ids=["blocks", "slots"])
def test_a_queued_request_whose_kv_is_ready_takes_the_newest_reservation_still_awaiting_a_prefill(
    num_blocks: int, max_num_seqs: int
) -> None:
    """The pool (8 usable blocks: two reservations of 4) or the sequence slots are taken by
    reservations whose prompts still prefill elsewhere ("s1", "s2"); "x" and "q" wait in the
    queue. Until a queued request's KV is ready nothing changes; once "q"'s is, it goes first:
    the newest reservation, "s2", gives its blocks back (its prefix hits among them) and waits
    in the queue again, behind "q" and before "x", and "q" pulls. Everyone ends with its tokens."""
    decode = decode_side(num_blocks, max_num_seqs)
    scheduler = decode.scheduler
    scheduler.add_request(make_request("c", 13, max_tokens=1, seed=2))  # "s2"'s first 3 blocks
    decode.until_idle()
    for req_id, seed in (("s1", 1), ("s2", 2), ("x", 3), ("q", 4)):
        decode.reserve(make_request(req_id, LONG, max_tokens=3, seed=seed))
    for _ in range(3):
        decode.step()
        assert list(scheduler.awaiting) == ["s1", "s2"]
        assert [r.req_id for r in scheduler.waiting] == ["x", "q"]
    hits = scheduler.kv.req_blocks["s2"][:3]
    assert all(block.block_hash is not None for block in hits)  # "c"'s, cached
    decode.prefilled("q")
    assert list(scheduler.ready_queued) == ["q"]
    decode.step()
    assert list(scheduler.awaiting) == ["s1"] and list(scheduler.ready) == [scheduler.requests["q"]]
    assert not scheduler.ready_queued
    assert [r.req_id for r in scheduler.waiting] == ["s2", "x"]
    released = scheduler.requests["s2"]
    assert released.status is RequestStatus.WAITING and released.num_computed_tokens == 0
    assert "s2" not in scheduler.kv.req_blocks and released.remote_prefill and released.pull is None
    # Its prefix hits are cached still, unless "q" took their blocks (all 8 of the pool's).
    assert scheduler.kv.get_computed_blocks(released)[1] == (0 if num_blocks == 9 else 12)
    assert scheduler.num_unfinished == 4 and len(scheduler.waiting) + scheduler.num_reserved == 4
    plan, _ = decode.step()
    assert [pull.req_id for pull in plan.kv_pulls] == ["q"]
    for req_id in ("s1", "s2", "x"):
        decode.prefilled(req_id)
    pull_until_idle(decode)
    for req_id in ("s1", "s2", "x", "q"):
        assert decode.outputs[req_id] == decode.expected(req_id, LONG, 3)[1:], req_id
