"""Warm-up: dummy steps before the executor reports ready, so no real request pays first-use costs.

The first step of each shape pays for allocator growth, kernel selection and (on NPU) operator
compilation and workspace allocation; unwarmed, the first big prefill took ~45% longer than the
next. `warm_up` runs real step plans through the runner (`ModelRunner`, or a tensor-parallel
`GroupLeader`, which sends them to every rank): one prefill as large as a step may be
(``max_num_batched_tokens``, bounded by the blocks), then one decode step per batch size
1, 2, 4, ... ``max_num_seqs``. The plans use block ids of their own from ``1..num_blocks-1``
and drop every request at the end, so the runner holds nothing afterwards. Plan checks keep block
0 out of any plan, so the null block stays zeroed; the other blocks' stale contents are never
read (a request's blocks are written before they are attended to).
Warm-up step ids are negative: schedulers number their steps from a non-negative start.

On the CPU (an emulated NPU too: its operators are plain torch on the CPU) there is nothing to
compile and a big prefill costs seconds, so the warm-up is kept small there (`CPU_MAX_PREFILL_TOKENS`, decode batch sizes 1 and ``max_num_seqs`` only): it then
covers the first-call paths without making every start (and every test) seconds slower.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import structlog

from npuserve.proto.kv_layout import cdiv
from npuserve.proto.step_plan import (
    ExecutorInfo,
    NewRequest,
    PlanRunner,
    SamplingOptions,
    StepPlan,
    computes_on_cpu,
)

log = structlog.get_logger(__name__)

CPU_MAX_PREFILL_TOKENS = 512


@dataclass(frozen=True, slots=True)
class WarmupRequest:
    num_tokens: int  # tokens the request holds after the step
    num_scheduled: int  # of them, scheduled in the step (the rest count as cached)


def decode_batch_sizes(max_num_seqs: int, usable_blocks: int) -> list[int]:
    """1, 2, 4, ... up to ``max_num_seqs`` (and it), each request taking one block."""
    limit = min(max_num_seqs, usable_blocks)
    sizes = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    return sizes + ([limit] if limit and sizes[-1] != limit else [])


def largest_prefill(info: ExecutorInfo, max_tokens: int | None = None) -> list[int]:
    """Prompt lengths of the largest prefill step: ``max_num_batched_tokens`` tokens (at most
    ``max_tokens``) in requests of at most ``max_model_len``, no more requests than
    ``max_num_seqs`` and no more blocks than the cache holds."""
    budget_blocks = info.num_blocks - 1
    lengths: list[int] = []
    remaining = min(info.max_num_batched_tokens, max_tokens or info.max_num_batched_tokens)
    while remaining > 0 and len(lengths) < info.max_num_seqs and budget_blocks > 0:
        length = min(remaining, info.max_model_len, budget_blocks * info.block_size)
        lengths.append(length)
        remaining -= length
        budget_blocks -= cdiv(length, info.block_size)
    return lengths


def warmup_steps(info: ExecutorInfo) -> list[list[WarmupRequest]]:
    """The requests of each warm-up step: the largest prefill, then one decode per batch size."""
    on_cpu = computes_on_cpu(info.device)
    prefill = largest_prefill(info, CPU_MAX_PREFILL_TOKENS if on_cpu else None)
    steps = [[WarmupRequest(n, n) for n in prefill]]
    sizes = decode_batch_sizes(info.max_num_seqs, info.num_blocks - 1)
    for size in sorted({sizes[0], sizes[-1]}) if on_cpu else sizes:
        steps.append(decode_step(info, size))
    return [step for step in steps if step]


def decode_step(info: ExecutorInfo, size: int) -> list[WarmupRequest]:
    """A decode step of ``size`` requests (no more than ``max_num_seqs`` or the blocks hold),
    each one block of context with its last token scheduled."""
    context = max(1, min(info.block_size, info.max_model_len))
    return [WarmupRequest(context, 1)] * min(size, info.max_num_seqs, info.num_blocks - 1)


def warmup_plans(
    info: ExecutorInfo, steps: list[list[WarmupRequest]], first_step_id: int = -1
) -> Iterator[StepPlan]:
    """The plans of ``steps`` (step ids counting down from ``first_step_id``), then one that
    drops every request they admitted."""
    step_ids = itertools.count(first_step_id, -1)
    finished: list[str] = []
    for index, requests in enumerate(steps):
        block_ids = itertools.count(1)
        plan = StepPlan(step_id=next(step_ids), finished_req_ids=finished)
        for i, req in enumerate(requests):
            req_id = f"warmup-{index}-{i}"
            plan.new_requests.append(
                NewRequest(
                    req_id=req_id,
                    token_ids=[t % info.vocab_size for t in range(req.num_tokens)],
                    num_prompt_tokens=req.num_tokens,
                    sampling=SamplingOptions(seed=0),  # NOTE: leaves the runner's seed source alone
                    block_ids=list(itertools.islice(block_ids, cdiv(req.num_tokens, info.block_size))),
                    num_computed_tokens=req.num_tokens - req.num_scheduled,
                )
            )
            plan.num_scheduled_tokens[req_id] = req.num_scheduled
        finished = list(plan.num_scheduled_tokens)
        yield plan
    yield StepPlan(step_id=next(step_ids), finished_req_ids=finished)


def warm_up(runner: PlanRunner) -> float:
    """Runs the warm-up steps; returns the seconds they took."""
    info = runner.info()
    steps = warmup_steps(info)
    start = time.perf_counter()
    for plan in warmup_plans(info, steps):
        runner.execute(plan)
    seconds = time.perf_counter() - start
    log.info(
        "warmed up",
        prefill_tokens=sum(r.num_scheduled for r in steps[0]) if steps else 0,
        decode_batch_sizes=[len(s) for s in steps[1:]],
        seconds=round(seconds, 3),
    )
    return seconds
