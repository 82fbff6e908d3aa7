"""A client of the scheduler's gRPC API that stops reading its stream: once a response has waited
`--stream-stall-timeout` to be written, the stream's requests are aborted (every pool is idle and
whole again while the call is still open), and the call ends ABORTED when the client reads again.

Over real processes (an executor, a scheduler whose API is served by two API processes), for a
`Generate` call and for a `GenerateMany` call of two generations; the scheduler serves a plain
request after each.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from harness.cluster import processes
from harness.pools import idle_pools
from harness.serve import collect, greedy_request, metric_total, start_executors, start_scheduler
from prometheus_client.parser import text_string_to_metric_families

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts npuserve processes

STALL_TIMEOUT_S = 2
N = 32
MAX_TOKENS = 480  # the demo model's context is 512 tokens
PROMPT = [1, 403, 407, 409]
# NOTE: no BDP probing: the client's flow-control window stays at its first 64 KiB, so the
# scheduler's writes wait as soon as the client stops reading.
UNREAD_OPTIONS = [("grpc.http2.bdp_probe", 0)]
GIVE_UP_S = 120  # far beyond what aborting takes: only guards against a hang


@pytest.fixture(scope="module")
def address(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with processes(tmp_path_factory.mktemp("stall")) as procs:
        executors = start_executors(procs, stories_dir, ["e0"])
        flags = ["--api-server-count", "2", "--stream-stall-timeout", str(STALL_TIMEOUT_S)]
        yield start_scheduler(procs, stories_dir, executors, *flags).wait_ready()["address"]


GENERATIONS = {"generate": 1, "generate-many": 2}  # generations of N requests in one call


def unread_call(stub: pb_grpc.SchedulerStub, kind: str) -> Iterator[object]:
    """A call of ``kind`` whose responses are not read (until the caller iterates them)."""
    request = greedy_request(PROMPT, MAX_TOKENS, n=N)
    if kind == "generate":
        return stub.Generate(request)
    actions = [pb.GenerateManyAction(stream_id=i + 1, generate=request) for i in range(GENERATIONS[kind])]
    return stub.GenerateMany(iter([pb.GenerateManyRequest(actions=actions)]))


def counts(stub: pb_grpc.SchedulerStub) -> tuple[float, float]:
    """Tokens generated and requests finished as aborted, so far."""
    text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10).text
    aborted = sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:request_success_total" and sample.labels.get("finished_reason") == "abort"
    )
    return metric_total(text, "vllm:generation_tokens_total"), aborted


def wait_for_pools(stub: pb_grpc.SchedulerStub, busy: bool) -> None:
    """Waits until some request holds blocks (``busy``), or until every pool is idle and whole."""
    deadline = time.monotonic() + GIVE_UP_S
    while True:
        check = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=not busy), timeout=10)
        reached = any(e.num_requests for e in check.executors) if busy else check.ok
        if reached:
            return
        assert time.monotonic() < deadline, check.message or "no request was ever admitted"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["generate", "generate-many"])
def test_a_stream_left_unread_has_its_requests_aborted_and_ends_aborted(address: str, kind: str) -> None:
    stub = pb_grpc.SchedulerStub(grpc.insecure_channel(address))
    tokens_before, aborted_before = counts(stub)
    with grpc.insecure_channel(address, options=UNREAD_OPTIONS) as channel:
        responses = unread_call(pb_grpc.SchedulerStub(channel), kind)
        wait_for_pools(stub, busy=True)
        wait_for_pools(stub, busy=False)  # while the call is open and unread
        tokens_after, aborted_after = counts(stub)
        generated = tokens_after - tokens_before
        full = GENERATIONS[kind] * N * MAX_TOKENS  # had every request run to its end
        assert generated < full, "the requests ran to their end instead of being aborted"
        assert aborted_after > aborted_before, "no request finished as aborted"
        with pytest.raises(grpc.RpcError) as ended:
            for _ in responses:
                pass
    assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value
    assert "--stream-stall-timeout" in ended.value.details()
    tokens, _, _ = collect(stub, greedy_request(PROMPT, 8))
    assert len(tokens) == 8
    idle_pools(stub)
