"""Checks a step plan must pass against an executor's state (no torch: the simulated executor
and the scheduler's tests use them too)."""

from __future__ import annotations

from npuserve.proto.step_plan import BlockCopy, KvPull, NewRequest, StepPlan, admits_only


class PlanError(ValueError):
    """A step plan that contradicts the executor's state; the step is refused (gRPC
    INVALID_ARGUMENT) and the executor drops every request the plan names."""


def check_new_request(req: NewRequest, max_model_len: int, num_blocks: int, max_blocks_per_req: int) -> None:
    num_tokens = len(req.token_ids)
    if not 0 < req.num_prompt_tokens <= num_tokens <= max_model_len:
        raise PlanError(
            f"request {req.req_id!r}: {num_tokens} tokens ({req.num_prompt_tokens} prompt) "
            f"for max_model_len {max_model_len}"
        )
    if not 0 <= req.num_computed_tokens < num_tokens:
        raise PlanError(f"request {req.req_id!r}: bad num_computed_tokens")
    check_block_ids(req.req_id, req.block_ids, 0, num_blocks, max_blocks_per_req)


def check_joining(plan: StepPlan) -> None:
    """A step taken into another's passes (`StepPlan.joins_running`) only admits requests (the
    codec refuses any other from the wire; this guards a runner's callers in process)."""
    if not admits_only(plan):
        raise PlanError(f"step {plan.step_id} joins the running one but does more than admit requests")


def check_block_copies(copies: list[BlockCopy], num_blocks: int, num_host_blocks: int) -> None:
    """Copies between device blocks (1..num_blocks-1) and host blocks (0..num_host_blocks-1)."""
    for copy in copies:
        device, host = (copy.src, copy.dst) if copy.to_host else (copy.dst, copy.src)
        if not 0 < device < num_blocks or not 0 <= host < num_host_blocks:
            raise PlanError(
                f"block copy {copy}: device block outside 1..{num_blocks - 1} or host block outside "
                f"0..{num_host_blocks - 1}"
            )


def check_kv_pulls(pulls: list[KvPull], num_blocks: int) -> None:
    """Pulls from other executors: each names a source and as many source blocks as blocks
    here, within 1..num_blocks-1 and none written twice in the step (the source checks its own
    ids as it reads them)."""
    written: set[int] = set()
    for pull in pulls:
        dst = pull.dst_block_ids
        if not pull.address or not dst or len(pull.src_block_ids) != len(dst):
            raise PlanError(
                f"kv pull from {pull.address!r}: {len(pull.src_block_ids)} source blocks for "
                f"{len(dst)} blocks here (a pull names a source and one block here per source block)"
            )
        if min(dst) < 1 or max(dst) >= num_blocks:
            raise PlanError(f"kv pull from {pull.address!r}: a block id outside 1..{num_blocks - 1}")
        if written.intersection(dst) or len(set(dst)) != len(dst):
            raise PlanError(f"kv pull from {pull.address!r}: a block is written twice in one step")
        written.update(dst)


def check_read_block_ids(block_ids: list[int], num_blocks: int) -> None:
    """Another executor's read of this one's blocks (`ReadBlocks`): ids within 1..num_blocks-1."""
    if block_ids and not (min(block_ids) > 0 and max(block_ids) < num_blocks):
        raise PlanError(f"read of a block id outside 1..{num_blocks - 1}")


def check_block_ids(
    req_id: str, block_ids: list[int], num_held: int, num_blocks: int, max_blocks_per_req: int
) -> None:
    """New blocks of a request: within 1..num_blocks-1 (0 is the null block), and no more in
    all than its longest possible sequence needs."""
    if num_held + len(block_ids) > max_blocks_per_req:
        raise PlanError(f"request {req_id!r}: more blocks than max_model_len needs")
    if block_ids and not (min(block_ids) > 0 and max(block_ids) < num_blocks):
        raise PlanError(f"request {req_id!r}: block id outside 1..{num_blocks - 1}")


def check_num_steps(
    req_id: str, num_steps: int, samples: bool, seq_len: int, num_slots: int, max_model_len: int
) -> None:
    """A request that runs ``num_steps`` passes in one step (multi-step decoding): it samples in
    the first (``samples``; ``seq_len`` tokens computed after it) and its ``num_slots`` block
    slots and the model's length hold every token the later passes add."""
    if not samples:
        raise PlanError(f"request {req_id!r}: {num_steps} passes, but it samples no token in the first")
    if seq_len + num_steps - 1 > num_slots:
        raise PlanError(f"request {req_id!r}: {num_steps} passes need slots beyond its blocks")
    if seq_len + num_steps > max_model_len:
        raise PlanError(f"request {req_id!r}: {num_steps} passes run past max_model_len {max_model_len}")
