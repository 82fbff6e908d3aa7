"""Step plans, results and the handshake survive the trip through protobuf unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_codec import (
    CodecError,
    info_from_proto,
    info_to_proto,
    plan_from_proto,
    plan_to_proto,
    result_from_proto,
    result_to_proto,
)
from npuserve.proto.step_plan import (
    BlockCopy,
    CachedRequest,
    ExecutorInfo,
    KvPull,
    KvTransfer,
    NewRequest,
    SamplingOptions,
    StepPlan,
    StepResult,
    StepTimings,
    TokenBitmask,
    TokenLogprobs,
    admits_only,
    take_first_pass_only,
)


def _wire_plan(plan: StepPlan) -> StepPlan:
    return plan_from_proto(pb.StepRequest.FromString(plan_to_proto(plan).SerializeToString()))


def _wire_result(result: StepResult) -> StepResult:
    return result_from_proto(pb.StepResponse.FromString(result_to_proto(result).SerializeToString()))


def _mixed_plan() -> StepPlan:
    seeded = SamplingOptions(
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        seed=2**63 - 1,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        num_logprobs=0,
        min_tokens=3,
        stop_token_ids=(2, 7),
    )
    return StepPlan(
        step_id=41,
        new_requests=[
            NewRequest("z-new", [1, 5, 9, 4], 3, seeded, [17, 3], 2),
            NewRequest("a-new", [1, 2], 2, SamplingOptions(temperature=0), [8], 0),
        ],
        cached_requests=[CachedRequest("m-old", [12]), CachedRequest("b-old", [])],
        # NOTE: deliberately not sorted, so a codec that sorts or hashes would reorder it.
        num_scheduled_tokens={"z-new": 2, "m-old": 1, "a-new": 2, "b-old": 1},
        finished_req_ids=["gone", "preempted"],
    )


def test_plan_round_trip_keeps_every_field_and_the_batch_order() -> None:
    plan = _mixed_plan()
    decoded = _wire_plan(plan)
    assert decoded == plan
    assert list(decoded.num_scheduled_tokens.items()) == list(plan.num_scheduled_tokens.items())


def test_unset_seed_and_logprobs_stay_unset() -> None:
    plan = _mixed_plan()
    seeded, unseeded = (req.sampling for req in _wire_plan(plan).new_requests)
    assert seeded.seed == 2**63 - 1 and seeded.num_logprobs == 0
    assert unseeded.seed is None and unseeded.num_logprobs is None


def test_empty_plan_and_empty_result_round_trip() -> None:
    assert _wire_plan(StepPlan(step_id=0)) == StepPlan(step_id=0)
    assert _wire_result(StepResult(step_id=0)) == StepResult(step_id=0)


def test_block_copies_and_pulls_travel_in_order() -> None:
    """A plan's copies to and from the host tier, and its pulls from other executors (one
    source unnamed by instance), each for its request, in order; a result's KV transfers by
    kind, and the requests whose pull failed or landed since the result before."""
    plan = dataclasses.replace(
        _mixed_plan(),
        block_copies=[BlockCopy(True, 5, 0), BlockCopy(False, 3, 9)],
        kv_pulls=[
            KvPull("10.0.0.7:50061", "f00d", [7, 2, 30], [17, 3, 12], "a"),
            KvPull("[::1]:50062", "", [4], [8], "b"),
        ],
    )
    assert _wire_plan(plan) == plan
    timings = StepTimings(
        total_s=0.5, kv_transfers=[KvTransfer("host_tier", 4096, 0.25), KvTransfer("executor", 2**40, 0.125)]
    )
    result = StepResult(
        step_id=3, sampled_req_ids=["a"], sampled_token_ids=[5], logprobs=[None], timings=timings
    )
    result.failed_pull_req_ids = ["a"]
    result.landed_pull_req_ids = ["b", "c"]
    assert _wire_result(result) == result


def test_result_round_trip_keeps_logprobs_per_token() -> None:
    # Values a float32 holds exactly: logprobs come from float32 tensors and travel as float.
    asked = TokenLogprobs(logprob=-0.5, rank=2, top_token_ids=[9, 4], top_logprobs=[-0.25, -0.5])
    only_sampled = TokenLogprobs(logprob=-1.25, rank=1, top_token_ids=[], top_logprobs=[])
    result = StepResult(
        step_id=7,
        sampled_req_ids=["b", "a", "c"],
        sampled_token_ids=[4, 11, 0],
        logprobs=[asked, None, only_sampled],
        timings=StepTimings(prepare_s=0.001, forward_s=0.02, sample_s=0.003, total_s=0.025),
        draining=True,
    )
    assert _wire_result(result) == result
    assert result_to_proto(result).logprobs.indices == [0, 2]  # only the tokens that asked
    early = take_first_pass_only(result, {"b": 3})  # a partial answer travels as one
    assert _wire_result(early) == early and early.partial


def test_the_first_pass_only_requests_are_taken_out_of_a_result() -> None:
    """A multi-step plan whose first pass some requests run alone (those it admits): their tokens
    leave the first pass's result, in order, for an early answer; the others' stay."""
    plan = StepPlan(1, num_scheduled_tokens={"new": 5, "a": 1, "b": 1}, num_steps={"a": 4, "b": 2})
    assert plan.has_first_pass_only
    assert not StepPlan(1, num_scheduled_tokens={"a": 1}, num_steps={"a": 4}).has_first_pass_only
    assert not StepPlan(1, num_scheduled_tokens={"a": 1, "new": 5}).has_first_pass_only
    asked = TokenLogprobs(logprob=-0.5, rank=1, top_token_ids=[7], top_logprobs=[-0.5])
    result = StepResult(1, ["a", "new", "b", "other"], [8, 7, 9, 3], [None, asked, None, None])
    # NOTE: the pulls' outcomes stay for the final result: an early answer names none.
    result.failed_pull_req_ids, result.landed_pull_req_ids = ["p"], ["q"]
    early = take_first_pass_only(result, plan.num_steps)
    assert early == StepResult(1, ["new", "other"], [7, 3], [asked, None], partial=True)
    assert result == StepResult(
        1, ["a", "b"], [8, 9], [None, None], failed_pull_req_ids=["p"], landed_pull_req_ids=["q"]
    )


def test_result_without_logprobs_sends_none() -> None:
    result = StepResult(
        step_id=3, sampled_req_ids=["a", "b"], sampled_token_ids=[1, 2], logprobs=[None, None]
    )
    assert not result_to_proto(result).HasField("logprobs")
    assert _wire_result(result) == result


def test_info_round_trip_and_identity() -> None:
    info = ExecutorInfo(
        model="stories260K-hf",
        architecture="LlamaForCausalLM",
        block_size=16,
        num_blocks=1234,
        max_model_len=512,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        vocab_size=512,
        eos_token_ids=[2],
        dtype="float32",
        device="cpu",
        tensor_parallel_size=1,
    )
    msg = info_to_proto(info, executor_id="host:5000", version="0.1.0")
    assert (msg.executor_id, msg.version) == ("host:5000", "0.1.0")
    assert info_from_proto(pb.ExecutorInfo.FromString(msg.SerializeToString())) == info
    for changed in (dataclasses.replace(info, joins_steps=True), dataclasses.replace(info, role="decode")):
        assert (
            info_from_proto(pb.ExecutorInfo.FromString(info_to_proto(changed).SerializeToString())) == changed
        )


def _joining_plan() -> StepPlan:
    return StepPlan(
        step_id=42,
        new_requests=[
            NewRequest("j1", [1, 5, 9], 3, SamplingOptions(temperature=0), [4], 0),
            NewRequest("j2", [1, 2, 3, 4], 4, SamplingOptions(temperature=0), [9, 11], 2),
        ],
        num_scheduled_tokens={"j1": 3, "j2": 2},
        session=7,
        joins_running=True,
    )


def test_a_step_that_joins_the_running_one_travels_and_admits_only() -> None:
    """`joins_running` survives the wire on a plan that only admits requests; on one that also
    runs a request it does not admit, drops one, pulls blocks or carries a bitmask, it is refused."""
    plan = _joining_plan()
    assert admits_only(plan) and _wire_plan(plan) == plan
    for broken in (
        dataclasses.replace(plan, num_scheduled_tokens={**plan.num_scheduled_tokens, "old": 1}),
        dataclasses.replace(plan, finished_req_ids=["gone"]),
        dataclasses.replace(plan, cached_requests=[CachedRequest("j1", [5])]),
        dataclasses.replace(plan, num_steps={"j1": 2}),
        dataclasses.replace(plan, bitmask=TokenBitmask(["j1"], b"\xff" * 64)),
        dataclasses.replace(plan, num_scheduled_tokens={"j1": 3}),  # j2 sent, not run
        dataclasses.replace(plan, kv_pulls=[KvPull("10.0.0.7:50061", "", [3], [4])]),
    ):
        assert not admits_only(broken)
        with pytest.raises(CodecError, match="may only admit requests"):
            _wire_plan(broken)


def test_multi_step_counts_travel_per_scheduled_request() -> None:
    """`num_steps` names only the requests that run more than one pass; the wire lists a count
    per scheduled request (none at all for a plan without), and the decoded plan is the same."""
    plan = _mixed_plan()
    assert not plan_to_proto(plan).num_steps
    plan.num_steps = {"a-new": 4, "z-new": 2}
    assert plan_to_proto(plan).num_steps == [2, 1, 4, 1]
    assert _wire_plan(plan) == plan


@pytest.mark.parametrize(
    ("counts", "bitmask", "message"),
    [
        ([2], False, "1 num_steps for 2 scheduled"),
        ([2, 0], False, "runs no pass"),
        ([2, 1], True, "constrained request cannot run several passes"),
    ],
)
def test_bad_multi_step_counts_are_refused(counts: list[int], bitmask: bool, message: str) -> None:
    msg = pb.StepRequest(
        step_id=1, scheduled_req_ids=["a", "b"], num_scheduled_tokens=[1, 1], num_steps=counts
    )
    if bitmask:
        msg.bitmask.req_ids.append("a")
        msg.bitmask.words = b"\0\0\0\0"
    with pytest.raises(CodecError, match=message):
        plan_from_proto(msg)


def test_scheduled_lists_of_different_lengths_are_refused() -> None:
    msg = pb.StepRequest(step_id=1, scheduled_req_ids=["a", "b"], num_scheduled_tokens=[1])
    with pytest.raises(CodecError, match="2 scheduled_req_ids but 1"):
        plan_from_proto(msg)


def test_a_request_scheduled_twice_is_refused() -> None:
    msg = pb.StepRequest(step_id=1, scheduled_req_ids=["a", "a"], num_scheduled_tokens=[1, 1])
    with pytest.raises(CodecError, match="scheduled twice"):
        plan_from_proto(msg)


def test_new_request_with_invalid_sampling_is_refused() -> None:
    # An empty SamplingOptions message means top_p 0, which is invalid: never a silent default.
    msg = pb.StepRequest(new_requests=[pb.NewRequest(req_id="x", sampling=pb.SamplingOptions())])
    with pytest.raises(CodecError, match=r"'x'.*top_p"):
        plan_from_proto(msg)
    with pytest.raises(CodecError, match="no sampling options"):
        plan_from_proto(pb.StepRequest(new_requests=[pb.NewRequest(req_id="y")]))


def test_new_request_out_of_its_sampling_ranges_is_refused() -> None:
    """The executor checks decoded options against the same ranges the scheduler checks."""
    for option, value in [("temperature", -1.0), ("num_logprobs", 21), ("repetition_penalty", 0.0)]:
        plan = StepPlan(1, [NewRequest("x", [1], 1, SamplingOptions(**{option: value}), [1], 0)])
        with pytest.raises(CodecError, match=rf"'x': {option} must be in"):
            _wire_plan(plan)


def test_every_sampling_option_has_its_protobuf_field() -> None:
    """The codec carries SamplingOptions by field name: both sides must declare the same fields."""
    fields = {f.name for f in dataclasses.fields(SamplingOptions)}
    assert fields == set(pb.SamplingOptions.DESCRIPTOR.fields_by_name)


def test_logprobs_index_outside_the_sampled_tokens_is_refused() -> None:
    flat = pb.SampledLogprobs(indices=[1], logprobs=[-1.0], ranks=[1], num_top=[0])
    msg = pb.StepResponse(sampled_req_ids=["a"], sampled_token_ids=[1], logprobs=flat)
    with pytest.raises(CodecError, match="index 1"):
        result_from_proto(msg)


def test_logprobs_lists_that_do_not_add_up_are_refused() -> None:
    flat = pb.SampledLogprobs(indices=[0], logprobs=[-1.0], ranks=[1], num_top=[2], top_token_ids=[3])
    msg = pb.StepResponse(sampled_req_ids=["a"], sampled_token_ids=[1], logprobs=flat)
    with pytest.raises(CodecError, match="do not add up"):
        result_from_proto(msg)
