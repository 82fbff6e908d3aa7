"""KV pulls beside the steps (`pulls_beside_steps`): what results say of them, and a real
`ModelRunner` (stories260K) whose steps go on while a pull waits for its source.

The source is another in-process runner, read through a client whose `ReadBlocks` waits for the
test to open a gate: the puller's steps return while the pull is held, a later result names it
landed, and the pulled blocks then hold the source's KV, from which the request decodes the
tokens the source itself decodes.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.pulls_beside_steps import BackgroundPulls, PullOutcomes, named_blocks
from npuserve.executor.rpc_status import KvPullFailed
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_plan import (
    KV_TRANSFER_EXECUTOR,
    BlockCopy,
    CachedRequest,
    KvPull,
    NewRequest,
    SamplingOptions,
    StepPlan,
    StepResult,
)

GREEDY = SamplingOptions(temperature=0)
PROMPT = [1, *random.Random(7).choices(range(5, 500), k=39)]  # 40 tokens: 3 blocks of 16
A_BLOCKS = [9, 4, 17]  # the prompt's blocks on the source
B_BLOCKS = [30, 2, 11, 6]  # the puller's: the prompt's three, and one for the tokens after it


def test_an_outcome_is_named_until_a_plan_names_its_request_after_a_result_did() -> None:
    outcomes = PullOutcomes()
    outcomes.settle("a", landed=True)
    outcomes.settle("b", landed=False)
    # A plan that names "a" before any result named its outcome takes nothing.
    outcomes.acknowledge(StepPlan(1, finished_req_ids=["a"]))
    first = StepResult(1)
    outcomes.report(first)
    assert (first.landed_pull_req_ids, first.failed_pull_req_ids) == (["a"], ["b"])
    assert not outcomes.fresh
    again = StepResult(2)
    outcomes.report(again)  # a result lost on the way costs no outcome
    assert (again.landed_pull_req_ids, again.failed_pull_req_ids) == (["a"], ["b"])
    outcomes.acknowledge(StepPlan(3, num_scheduled_tokens={"a": 1}))
    outcomes.acknowledge(StepPlan(4, kv_pulls=[KvPull("source:1", "", [1], [2], "b")]))
    taken = StepResult(4)
    outcomes.report(taken)
    assert (taken.landed_pull_req_ids, taken.failed_pull_req_ids) == ([], [])
    outcomes.settle("c", landed=True)
    assert outcomes.fresh
    outcomes.acknowledge(StepPlan(5, reset=True))
    cleared = StepResult(5)
    outcomes.report(cleared)
    assert not cleared.landed_pull_req_ids


def test_pulls_run_in_order_on_their_thread_and_a_step_waits_for_those_that_write_its_blocks() -> None:
    gates = {"a": threading.Event(), "b": threading.Event()}
    ran: list[str] = []

    def run_pull(pull: KvPull) -> bool:
        assert gates[pull.req_id].wait(timeout=30)
        ran.append(pull.req_id)
        return pull.req_id == "a"

    outcomes = PullOutcomes()
    pulls = BackgroundPulls(run_pull, outcomes)
    pulls.start([KvPull("s:1", "", [1], [5], "a"), KvPull("s:1", "", [2, 3], [6, 7], "b")])
    assert pulls.busy
    gates["b"].set()  # "b" still waits for "a", which runs first
    pulls.wait_for_outcome(StepPlan(0), timeout_s=0.01)
    assert not outcomes.fresh and ran == []
    named = StepPlan(
        1,
        new_requests=[NewRequest("c", [1, 2], 2, GREEDY, [8], 0)],
        cached_requests=[CachedRequest("d", [7])],
        block_copies=[BlockCopy(True, 9, 0), BlockCopy(False, 1, 10)],
    )
    assert list(named_blocks(named)) == [8, 7, 9, 10]
    gates["a"].set()
    pulls.wait_for_blocks(named)  # block 7 is "b"'s, which runs after "a"
    assert ran == ["a", "b"] and not pulls.busy
    result = StepResult(1)
    outcomes.report(result)
    assert (result.landed_pull_req_ids, result.failed_pull_req_ids) == (["a"], ["b"])


class GatedReads:
    """A source runner's `ReadBlocks`, in process, that waits for ``gate`` before its first chunk."""

    def __init__(self, source: ModelRunner) -> None:
        self.source = source
        self.gate = threading.Event()
        self.started = threading.Event()

    def read(self, pull: KvPull, tensor_parallel_size: int = 1) -> Iterator[pb.BlockChunk]:
        self.started.set()
        if not self.gate.wait(timeout=30):
            raise KvPullFailed("the test never opened the gate")
        yield from self.source.read_blocks(pull.src_block_ids)


@pytest.fixture(scope="module")
def runners(stories_dir: Path) -> tuple[ModelRunner, ModelRunner]:
    config = ExecutorConfig(str(stories_dir), kv_cache_memory_gib=0.01, warmup=False)
    return ModelRunner(config), ModelRunner(config)


def test_the_steps_go_on_while_a_pull_waits_and_a_later_result_says_it_landed(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    source, puller = runners
    assert source.block_size == 16
    reads = GatedReads(source)
    puller.kv_puller.client = reads  # type: ignore[assignment]
    prefill = source.execute(
        StepPlan(
            1,
            [NewRequest("p", PROMPT, len(PROMPT), GREEDY, A_BLOCKS, 0)],
            num_scheduled_tokens={"p": len(PROMPT)},
        )
    )
    (first,) = prefill.sampled_token_ids

    # The step that starts the pull runs another request's prompt and returns, the pull held.
    other = NewRequest("other", PROMPT[:8], 8, GREEDY, [40], 0)
    pull = KvPull("source:1", "", A_BLOCKS, B_BLOCKS[:3], "p")
    started = puller.execute(StepPlan(1, [other], num_scheduled_tokens={"other": 8}, kv_pulls=[pull]))
    assert started.sampled_req_ids == ["other"]
    assert reads.started.wait(timeout=30)  # the pull runs on: its read waits at the gate
    for step_id in (2, 3):
        decoded = puller.execute(StepPlan(step_id, num_scheduled_tokens={"other": 1}))
        assert decoded.sampled_req_ids == ["other"]
        assert not (decoded.landed_pull_req_ids or decoded.failed_pull_req_ids)
    assert not reads.gate.is_set()

    # Once the source answers, a step with nothing to run says the pull landed.
    reads.gate.set()
    step_id = 4
    landed = StepResult(0)
    while not landed.landed_pull_req_ids:
        step_id += 1
        landed = puller.execute(StepPlan(step_id, finished_req_ids=["other"] if step_id == 5 else []))
        assert not landed.failed_pull_req_ids and step_id < 1000
    assert landed.landed_pull_req_ids == ["p"]
    moved = [t for t in landed.timings.kv_transfers if t.kind == KV_TRANSFER_EXECUTOR]
    assert moved and moved[0].num_bytes > 0
    for source_cache, puller_cache in zip(source.kv_caches, puller.kv_caches, strict=True):
        assert torch.equal(source_cache[:, A_BLOCKS], puller_cache[:, B_BLOCKS[:3]])

    # The request continues from the pulled blocks with the source's own greedy tokens.
    continued = NewRequest("p", [*PROMPT, first], len(PROMPT), GREEDY, B_BLOCKS, len(PROMPT))
    tokens = puller.execute(
        StepPlan(step_id + 1, [continued], num_scheduled_tokens={"p": 1})
    ).sampled_token_ids
    expected = source.execute(StepPlan(2, num_scheduled_tokens={"p": 1})).sampled_token_ids
    for k in range(3):
        tokens += puller.execute(StepPlan(step_id + 2 + k, num_scheduled_tokens={"p": 1})).sampled_token_ids
        expected += source.execute(StepPlan(3 + k, num_scheduled_tokens={"p": 1})).sampled_token_ids
    assert tokens == expected
    named_again = puller.execute(StepPlan(step_id + 5, finished_req_ids=["p"]))
    assert not named_again.landed_pull_req_ids  # the plans named "p" since the result that said it
    source.execute(StepPlan(6, finished_req_ids=["p"]))
    assert puller.num_requests == source.num_requests == 0
