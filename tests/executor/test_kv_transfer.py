"""KV blocks pulled from one executor into another (`StepPlan.kv_pulls`, `kv_transfer`), between
two real executor processes on loopback that require a cluster token: a prompt prefilled on A
continues on B, as a new request whose prompt B does not compute, from A's blocks pulled into
B's own, and B's greedy tokens are those of the whole request on one runner. `ReadBlocks`
needs the token and refuses ids out of range and a puller of another tensor-parallel size; both
executors serve on after any refusal."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from harness.blocking_client import BlockingClient
from harness.cluster import processes
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.kv_cache import block_bytes
from npuserve.executor.kv_transfer import ReadBlocksClient
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.rpc_status import KvPullFailed
from npuserve.proto import executor_pb2 as pb
from npuserve.proto import executor_pb2_grpc as pb_grpc
from npuserve.proto.kv_layout import cdiv
from npuserve.proto.step_plan import (
    KV_TRANSFER_EXECUTOR,
    KvPull,
    NewRequest,
    SamplingOptions,
    StepPlan,
    StepResult,
)
from npuserve.scheduler.lanes.executor_client import ExecutorError

pytestmark = pytest.mark.slow  # executors in processes of their own

TOKEN = "kv-transfer-token"
PROMPT = [1, *random.Random(46).choices(range(5, 500), k=39)]  # 40 tokens: 2 full blocks and a part
MAX_NEW_TOKENS = 12
GREEDY = SamplingOptions(temperature=0)
KV_CACHE_GIB = 0.01
A_BLOCKS = [9, 4, 17]  # the prompt's blocks on A
B_BLOCKS = [30, 2, 11, 6]  # B's: the prompt's three, and one for the tokens after it
_step_ids = itertools.count(1)


@dataclass
class Pair:
    a: str  # where prompts are prefilled: the source
    b: str  # where they continue: the puller


@pytest.fixture(scope="module")
def pair(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    flags = [
        "--model",
        str(stories_dir),
        "--port",
        "0",
        "--kv-cache-memory",
        str(KV_CACHE_GIB),
        "--no-warmup",
    ]
    with processes(tmp_path_factory.mktemp("kv-transfer")) as procs:
        a = procs.start("a", "executor", *flags, env={"NPUSERVE_CLUSTER_TOKEN": TOKEN})
        b = procs.start("b", "executor", *flags, "--cluster-token", TOKEN)
        yield Pair(a.wait_ready()["address"], b.wait_ready()["address"])


@pytest.fixture(scope="module")
def local(stories_dir: Path) -> ModelRunner:
    """An in-process runner: the reference, and a puller that presents no cluster token."""
    return ModelRunner(ExecutorConfig(str(stories_dir), kv_cache_memory_gib=KV_CACHE_GIB, warmup=False))


def run(client: BlockingClient, **plan: object) -> StepResult:
    return client.step(StepPlan(step_id=next(_step_ids), **plan))  # type: ignore[arg-type]


def prefill(client: BlockingClient, req_id: str) -> int:
    """The prompt's whole prefill on A, into `A_BLOCKS`; the first token it samples."""
    request = NewRequest(req_id, PROMPT, len(PROMPT), GREEDY, A_BLOCKS, 0)
    return run(client, new_requests=[request], num_scheduled_tokens={req_id: len(PROMPT)}).sampled_token_ids[
        0
    ]


def continued(req_id: str, first: int, block_ids: list[int]) -> NewRequest:
    """The request from its first token on, as a new request whose prompt is computed."""
    return NewRequest(req_id, [*PROMPT, first], len(PROMPT), GREEDY, block_ids, len(PROMPT))


def first_decode(client: BlockingClient, request: NewRequest, pulls: list[KvPull]) -> StepResult:
    """The continued request's first step, which computes its first token (``pulls``: bring its
    prompt's KV first)."""
    return run(client, new_requests=[request], num_scheduled_tokens={request.req_id: 1}, kv_pulls=pulls)


def decode(
    client: BlockingClient, req_id: str, first: int, block_ids: list[int], pulls: list[KvPull]
) -> tuple[list[int], StepResult]:
    """The request continued from its first token (``pulls`` bring its prompt's KV): its tokens,
    and the result of the step that pulled."""
    pulled = first_decode(client, continued(req_id, first, block_ids), pulls)
    tokens = [first, *pulled.sampled_token_ids]
    while len(tokens) < MAX_NEW_TOKENS:
        tokens += run(client, num_scheduled_tokens={req_id: 1}).sampled_token_ids
    run(client, finished_req_ids=[req_id])
    return tokens, pulled


def read(
    address: str,
    block_ids: list[int],
    token: str | None = TOKEN,
    instance_id: str = "",
    tensor_parallel_size: int = 0,
) -> list[pb.BlockChunk]:
    """`ReadBlocks` called directly, presenting ``token``, for a puller of
    ``tensor_parallel_size`` ranks (0: unsaid)."""
    with grpc.insecure_channel(address) as channel:
        metadata = [("authorization", f"Bearer {token}")] if token else None
        request = pb.ReadBlocksRequest(
            block_ids=block_ids, instance_id=instance_id, tensor_parallel_size=tensor_parallel_size
        )
        return list(pb_grpc.ExecutorStub(channel).ReadBlocks(request, timeout=10, metadata=metadata))


def refused(code: grpc.StatusCode, call: Callable[..., object], *args: object, **kwargs: object) -> str:
    """The details of the status ``code`` that ``call(*args, **kwargs)`` fails with."""
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    error: grpc.Call = caught.value  # type: ignore[assignment]
    assert error.code() == code, error
    return error.details() or ""


def failed(code: str, call: Callable[..., object], *args: object) -> str:
    """The message of the step failure ``code`` that ``call(*args)`` ends in."""
    with pytest.raises(ExecutorError) as caught:
        call(*args)
    assert caught.value.code == code, caught.value
    return caught.value.message


@pytest.fixture(scope="module")
def expected(local: ModelRunner) -> list[int]:
    """The request's greedy tokens, the whole of it on one runner."""
    return StepDriver(local).run([DrivenRequest("whole", PROMPT, MAX_NEW_TOKENS, GREEDY)])[0].output


def test_a_request_prefilled_on_one_executor_continues_on_another_from_its_pulled_blocks(
    pair: Pair, local: ModelRunner, expected: list[int]
) -> None:
    with BlockingClient(pair.a, token=TOKEN) as on_a, BlockingClient(pair.b, token=TOKEN) as on_b:
        info = on_a.info()
        assert on_b.info() == info
        num_prompt_blocks = cdiv(len(PROMPT), info.block_size)
        assert len(A_BLOCKS) == num_prompt_blocks
        assert len(B_BLOCKS) * info.block_size >= len(PROMPT) + MAX_NEW_TOKENS
        first = prefill(on_a, "prefill")
        pull = KvPull(pair.a, on_a.instance_id, A_BLOCKS, B_BLOCKS[:num_prompt_blocks])
        tokens, pulled = decode(on_b, "decode", first, B_BLOCKS, [pull])
        # The same plan without its pull reads blocks that B never wrote: other tokens.
        unpulled, _ = decode(on_b, "unpulled", first, [40, 41, 42, 43], [])
        run(on_a, finished_req_ids=["prefill"])  # once B holds the blocks, A may free its own
    assert tokens == expected
    assert unpulled != expected
    (transfer,) = pulled.timings.kv_transfers
    assert transfer.kind == KV_TRANSFER_EXECUTOR and transfer.seconds > 0
    assert transfer.num_bytes == num_prompt_blocks * block_bytes(
        local.model_config, local.block_size, local.dtype, local.tp
    )


def test_reads_need_the_cluster_token(pair: Pair, local: ModelRunner) -> None:
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    assert "requires the cluster token" in refused(unauthenticated, read, pair.a, [1], token=None)
    assert "does not match" in refused(unauthenticated, read, pair.a, [1], token="wrong")
    # A puller without the token fails that pull: its step runs on, and names the request.
    pull = KvPull(pair.a, "", A_BLOCKS[:1], [5], "tokenless")
    with pytest.raises(KvPullFailed, match="UNAUTHENTICATED"):
        list(ReadBlocksClient().read(pull))
    plan = StepPlan(
        step_id=next(_step_ids),
        new_requests=[NewRequest("tokenless", PROMPT[:17], 16, GREEDY, [5, 6], 16)],
        num_scheduled_tokens={"tokenless": 1},
        kv_pulls=[pull],
    )
    result = local.execute(plan)
    assert result.failed_pull_req_ids == ["tokenless"] == result.sampled_req_ids
    local.execute(StepPlan(step_id=next(_step_ids), finished_req_ids=["tokenless"]))
    assert local.num_requests == 0


def test_bad_reads_are_refused_and_both_executors_serve_on(pair: Pair, expected: list[int]) -> None:
    with BlockingClient(pair.a, token=TOKEN) as on_a, BlockingClient(pair.b, token=TOKEN) as on_b:
        num_blocks = on_a.info().num_blocks
        on_b.info()
        for outside in (0, num_blocks):
            details = refused(grpc.StatusCode.INVALID_ARGUMENT, read, pair.a, [3, outside])
            assert f"outside 1..{num_blocks - 1}" in details
        assert "restarted" in refused(grpc.StatusCode.UNAVAILABLE, read, pair.a, [3], instance_id="gone")
        chunks = read(pair.a, [3, num_blocks - 1], instance_id=on_a.instance_id)
        assert [(c.layer, c.first, c.shape[1]) for c in chunks] == [
            (layer, 0, 2) for layer in range(len(chunks))
        ]

        # A refused pull fails its request only: the step runs on and names it, and B serves on.
        first = prefill(on_a, "source")
        request = continued("refused", first, [5, 6, 7])
        for src, instance_id in (([3, num_blocks], on_a.instance_id), ([3, 4], "gone")):
            pull = KvPull(pair.a, instance_id, src, [5, 6], "refused")
            assert first_decode(on_b, request, [pull]).failed_pull_req_ids == ["refused"]
            run(on_b, finished_req_ids=["refused"])
        # A pull into a block B does not have is B's plan error, refused before anything moves.
        pull = KvPull(pair.a, on_a.instance_id, A_BLOCKS, [5, 6, num_blocks])
        message = failed("INVALID_ARGUMENT", first_decode, on_b, request, [pull])
        assert f"outside 1..{num_blocks - 1}" in message
        assert on_a.health() and on_b.health()
        pull = KvPull(pair.a, on_a.instance_id, A_BLOCKS, [5, 6, 7])
        tokens, _ = decode(on_b, "after-refusals", first, [5, 6, 7, 8], [pull])
        run(on_a, finished_req_ids=["source"])
    assert tokens == expected


def test_a_source_refuses_a_puller_of_another_tensor_parallel_size(pair: Pair) -> None:
    """Each rank of a group holds a shard of every block (tests/executor/test_kv_transfer_group.py
    moves them rank to rank): a pull between executors of two sizes fails, with the reason."""
    details = refused(grpc.StatusCode.INVALID_ARGUMENT, read, pair.a, [3], tensor_parallel_size=2)
    assert "tensor-parallel size 2 from one of size 1" in details
    client = ReadBlocksClient(TOKEN)
    with pytest.raises(
        KvPullFailed, match=f"kv pull from {pair.a}: INVALID_ARGUMENT: .* same --tensor-parallel-size"
    ):
        list(client.read(KvPull(pair.a, "", [3], [5]), tensor_parallel_size=2))
    client.close()
    assert len(read(pair.a, [3], tensor_parallel_size=1)) == len(read(pair.a, [3]))
