"""Maps the step contract's dataclasses (`npuserve.proto.step_plan`) to protobuf and back.

This is the only module that knows both sides of the scheduler<->executor wire: the scheduler's
client encodes plans and decodes results, the executor's server does the reverse. It imports no
torch. A message that cannot describe a valid plan or result raises `CodecError`.
"""

from __future__ import annotations

import dataclasses

from npuserve.proto import executor_pb2 as pb
from npuserve.proto.sampling_ranges import check_options
from npuserve.proto.step_plan import (
    EXECUTOR_ROLE_MIXED,
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
)

__all__ = [
    "CodecError",
    "info_from_proto",
    "info_to_proto",
    "plan_from_proto",
    "plan_to_proto",
    "result_from_proto",
    "result_to_proto",
]


class CodecError(ValueError):
    """A message that does not describe a valid step plan or result."""


# -- StepPlan <-> StepRequest ----------------------------------------------------------------------


def plan_to_proto(plan: StepPlan) -> pb.StepRequest:
    msg = pb.StepRequest(
        step_id=plan.step_id,
        finished_req_ids=plan.finished_req_ids,
        reset=plan.reset,
        session=plan.session,
        joins_running=plan.joins_running,
        # NOTE: two parallel lists, not a map: the batch order of the scheduled requests matters.
        scheduled_req_ids=plan.num_scheduled_tokens.keys(),
        num_scheduled_tokens=plan.num_scheduled_tokens.values(),
    )
    if plan.new_requests:  # NOTE: most steps carry neither kind (cheaper than an empty extend)
        msg.new_requests.extend(_new_request_to_proto(req) for req in plan.new_requests)
    if plan.cached_requests:
        msg.cached_requests.extend(
            pb.CachedRequest(req_id=req.req_id, new_block_ids=req.new_block_ids)
            for req in plan.cached_requests
        )
    if plan.bitmask is not None:
        msg.bitmask.req_ids.extend(plan.bitmask.req_ids)
        msg.bitmask.words = plan.bitmask.words
    if plan.num_steps:
        msg.num_steps.extend([plan.num_steps.get(r, 1) for r in plan.num_scheduled_tokens])
    if plan.block_copies:
        msg.block_copies.extend(pb.BlockCopy(**c._asdict()) for c in plan.block_copies)
    if plan.kv_pulls:
        # NOTE: not dataclasses.asdict, which deep-copies the block-id lists an int at a time.
        msg.kv_pulls.extend(
            pb.KvPull(
                address=p.address,
                instance_id=p.instance_id,
                src_block_ids=p.src_block_ids,
                dst_block_ids=p.dst_block_ids,
                req_id=p.req_id,
            )
            for p in plan.kv_pulls
        )
    return msg


def plan_from_proto(msg: pb.StepRequest) -> StepPlan:
    # NOTE: slicing copies a repeated field in one call, faster than iterating it item by item.
    req_ids, counts = msg.scheduled_req_ids[:], msg.num_scheduled_tokens[:]
    if len(req_ids) != len(counts):
        raise CodecError(
            f"step {msg.step_id}: {len(req_ids)} scheduled_req_ids but {len(counts)} num_scheduled_tokens"
        )
    num_scheduled_tokens = dict(zip(req_ids, counts, strict=True))
    if len(num_scheduled_tokens) != len(req_ids):
        raise CodecError(f"step {msg.step_id}: a request is scheduled twice")
    bitmask = _bitmask_from_proto(msg, num_scheduled_tokens)
    num_steps = _num_steps_from_proto(msg, req_ids)
    if bitmask is not None and num_steps and not num_steps.keys().isdisjoint(bitmask.req_ids):
        raise CodecError(f"step {msg.step_id}: a constrained request cannot run several passes")
    plan = StepPlan(
        step_id=msg.step_id,
        new_requests=[_new_request_from_proto(req) for req in msg.new_requests],
        cached_requests=[CachedRequest(req.req_id, req.new_block_ids[:]) for req in msg.cached_requests],
        num_scheduled_tokens=num_scheduled_tokens,
        finished_req_ids=msg.finished_req_ids[:],
        reset=msg.reset,
        bitmask=bitmask,
        num_steps=num_steps,
        session=msg.session,
        joins_running=msg.joins_running,
        block_copies=[BlockCopy(c.to_host, c.src, c.dst) for c in msg.block_copies],
        kv_pulls=[
            KvPull(p.address, p.instance_id, p.src_block_ids[:], p.dst_block_ids[:], p.req_id)
            for p in msg.kv_pulls
        ],
    )
    if plan.joins_running and not admits_only(plan):
        raise CodecError(f"step {msg.step_id}: a step that joins the running one may only admit requests")
    return plan


def _num_steps_from_proto(msg: pb.StepRequest, req_ids: list[str]) -> dict[str, int]:
    """The requests that run more than one pass (the wire lists every scheduled one, or none)."""
    steps = msg.num_steps[:]
    if not steps:
        return {}
    if len(steps) != len(req_ids):
        raise CodecError(f"step {msg.step_id}: {len(steps)} num_steps for {len(req_ids)} scheduled requests")
    if min(steps) < 1:
        raise CodecError(f"step {msg.step_id}: a request runs no pass (num_steps 0)")
    return {r: n for r, n in zip(req_ids, steps, strict=True) if n > 1}


def _bitmask_from_proto(msg: pb.StepRequest, scheduled: dict[str, int]) -> TokenBitmask | None:
    if not msg.HasField("bitmask"):
        return None
    req_ids, words = msg.bitmask.req_ids[:], msg.bitmask.words
    if not req_ids or len(words) % (4 * len(req_ids)):
        raise CodecError(
            f"step {msg.step_id}: a bitmask of {len(words)} bytes for {len(req_ids)} requests "
            "is not one row of int32 words per request"
        )
    if len(set(req_ids)) != len(req_ids) or not all(r in scheduled for r in req_ids):
        raise CodecError(f"step {msg.step_id}: bitmask rows must name distinct scheduled requests")
    return TokenBitmask(req_ids, words)


def _new_request_to_proto(req: NewRequest) -> pb.NewRequest:
    return pb.NewRequest(
        req_id=req.req_id,
        token_ids=req.token_ids,
        num_prompt_tokens=req.num_prompt_tokens,
        sampling=_sampling_to_proto(req.sampling),
        block_ids=req.block_ids,
        num_computed_tokens=req.num_computed_tokens,
    )


def _new_request_from_proto(msg: pb.NewRequest) -> NewRequest:
    if not msg.HasField("sampling"):
        raise CodecError(f"new request {msg.req_id!r} has no sampling options")
    return NewRequest(
        req_id=msg.req_id,
        token_ids=msg.token_ids[:],
        num_prompt_tokens=msg.num_prompt_tokens,
        sampling=_sampling_from_proto(msg.req_id, msg.sampling),
        block_ids=msg.block_ids[:],
        num_computed_tokens=msg.num_computed_tokens,
    )


# Every SamplingOptions field travels under its own name: (name, optional in proto, repeated).
_SAMPLING_FIELDS = tuple(
    (f.name, f.has_presence, f.is_repeated)
    for f in (
        pb.SamplingOptions.DESCRIPTOR.fields_by_name[d.name] for d in dataclasses.fields(SamplingOptions)
    )
)


def _sampling_to_proto(s: SamplingOptions) -> pb.SamplingOptions:
    # NOTE: every field is written, so proto3's zero defaults never stand in for ours (top_p 1.0);
    # None (an unset optional) is the one value left out.
    values = {name: value for name, _, _ in _SAMPLING_FIELDS if (value := getattr(s, name)) is not None}
    return pb.SamplingOptions(**values)


def _sampling_from_proto(req_id: str, msg: pb.SamplingOptions) -> SamplingOptions:
    values: dict[str, object] = {}
    for name, optional, repeated in _SAMPLING_FIELDS:
        if optional and not msg.HasField(name):
            values[name] = None
        else:
            values[name] = tuple(getattr(msg, name)) if repeated else getattr(msg, name)
    options = SamplingOptions(**values)  # type: ignore[arg-type]
    try:
        check_options(options)
    except ValueError as exc:
        raise CodecError(f"new request {req_id!r}: {exc}") from None
    return options


# -- StepResult <-> StepResponse -------------------------------------------------------------------


# StepTimings' scalar fields, each under its own name in both (`kv_transfers` is mapped apart).
_TIMING_FIELDS = tuple(f.name for f in dataclasses.fields(StepTimings) if f.name != "kv_transfers")


def result_to_proto(result: StepResult) -> pb.StepResponse:
    t = result.timings
    msg = pb.StepResponse(
        step_id=result.step_id,
        sampled_req_ids=result.sampled_req_ids,
        sampled_token_ids=result.sampled_token_ids,
        timings=pb.StepTimings(
            **{name: getattr(t, name) for name in _TIMING_FIELDS},
            kv_transfers=[pb.KvTransfer(**k._asdict()) for k in t.kv_transfers],
        ),
        draining=result.draining,
        partial=result.partial,
        failed_pull_req_ids=result.failed_pull_req_ids,
        landed_pull_req_ids=result.landed_pull_req_ids,
    )
    asked = [(i, lp) for i, lp in enumerate(result.logprobs) if lp is not None]
    if asked:  # NOTE: only the tokens whose request asked for logprobs travel
        out = msg.logprobs
        out.indices.extend([i for i, _ in asked])
        out.logprobs.extend([lp.logprob for _, lp in asked])
        out.ranks.extend([lp.rank for _, lp in asked])
        out.num_top.extend([len(lp.top_token_ids) for _, lp in asked])
        out.top_token_ids.extend([t for _, lp in asked for t in lp.top_token_ids])
        out.top_logprobs.extend([t for _, lp in asked for t in lp.top_logprobs])
    return msg


def result_from_proto(msg: pb.StepResponse) -> StepResult:
    num_sampled = len(msg.sampled_req_ids)
    if len(msg.sampled_token_ids) != num_sampled:
        raise CodecError(
            f"step {msg.step_id}: {num_sampled} sampled_req_ids but "
            f"{len(msg.sampled_token_ids)} sampled_token_ids"
        )
    t = msg.timings
    return StepResult(
        step_id=msg.step_id,
        sampled_req_ids=msg.sampled_req_ids[:],
        sampled_token_ids=msg.sampled_token_ids[:],
        logprobs=_logprobs_from_proto(msg, num_sampled),
        timings=StepTimings(
            **{name: getattr(t, name) for name in _TIMING_FIELDS},
            kv_transfers=[KvTransfer(k.kind, k.num_bytes, k.seconds) for k in t.kv_transfers],
        ),
        draining=msg.draining,
        partial=msg.partial,
        failed_pull_req_ids=msg.failed_pull_req_ids[:],
        landed_pull_req_ids=msg.landed_pull_req_ids[:],
    )


def _logprobs_from_proto(msg: pb.StepResponse, num_sampled: int) -> list[TokenLogprobs | None]:
    logprobs: list[TokenLogprobs | None] = [None] * num_sampled
    if not msg.HasField("logprobs"):
        return logprobs
    flat = msg.logprobs
    indices, values, ranks, num_top = flat.indices[:], flat.logprobs[:], flat.ranks[:], flat.num_top[:]
    top_ids, top_lps = flat.top_token_ids[:], flat.top_logprobs[:]
    if not len(indices) == len(values) == len(ranks) == len(num_top):
        raise CodecError(f"step {msg.step_id}: logprobs lists of different lengths")
    if any(n < 0 for n in num_top) or not sum(num_top) == len(top_ids) == len(top_lps):
        raise CodecError(f"step {msg.step_id}: top logprobs do not add up to num_top")
    start = 0
    for index, value, rank, n in zip(indices, values, ranks, num_top, strict=True):
        if not 0 <= index < num_sampled:
            raise CodecError(f"step {msg.step_id}: logprobs index {index} outside 0..{num_sampled - 1}")
        end = start + n
        logprobs[index] = TokenLogprobs(value, rank, top_ids[start:end], top_lps[start:end])
        start = end
    return logprobs


# -- ExecutorInfo ----------------------------------------------------------------------------------


# Every ExecutorInfo field travels under its own name (`executor_id`, `version`: the message's own).
_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(ExecutorInfo))


def info_to_proto(info: ExecutorInfo, executor_id: str = "", version: str = "") -> pb.ExecutorInfo:
    fields = {name: getattr(info, name) for name in _INFO_FIELDS}
    return pb.ExecutorInfo(executor_id=executor_id, version=version, **fields)


def info_from_proto(msg: pb.ExecutorInfo) -> ExecutorInfo:
    """The capacity fields; `executor_id` and `version` are read from the message directly."""
    fields = {name: getattr(msg, name) for name in _INFO_FIELDS}
    fields["eos_token_ids"] = msg.eos_token_ids[:]
    fields["role"] = msg.role or EXECUTOR_ROLE_MIXED
    return ExecutorInfo(**fields)
