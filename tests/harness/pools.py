"""The scheduler's block pools seen through `CheckIntegrity`, and the prefix-routing check."""

from __future__ import annotations

import torch

from harness.cluster import wait_until
from harness.serve import collect, greedy_request
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc


def random_ids(count: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, 512, (count,), generator=generator).tolist()


def pools(stub: pb_grpc.SchedulerStub, expect_idle: bool = False) -> dict[str, pb.ExecutorPoolState]:
    check = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=expect_idle), timeout=10)
    assert check.ok, check.message
    return {e.executor_id: e for e in check.executors}


def idle_pools(stub: pb_grpc.SchedulerStub) -> dict[str, pb.ExecutorPoolState]:
    """The pools once they pass the idle check (a finished request's blocks return a moment later)."""

    def check() -> pb.CheckIntegrityResponse | None:
        response = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=True), timeout=10)
        return response if response.ok else None

    response = wait_until(check, 5, "every pool to be idle and intact")
    return {e.executor_id: e for e in response.executors}


def busiest(stub: pb_grpc.SchedulerStub) -> str:
    """The executor that holds the most requests now (it holds some)."""
    busy = pools(stub)
    victim = max(busy, key=lambda n: busy[n].num_requests)
    assert busy[victim].num_requests > 0
    return victim


def check_prefix_routing(stub: pb_grpc.SchedulerStub, names: list[str], generator: torch.Generator) -> None:
    """A prompt sharing 5 full blocks (80 tokens) with an earlier one goes where they are cached."""
    prefix = [1, *random_ids(79, generator)]
    first, second = prefix + random_ids(10, generator), prefix + random_ids(12, generator)
    before = pools(stub)
    collect(stub, greedy_request(first, 4))
    middle = pools(stub)
    (holder,) = [n for n in names if middle[n].prefix_cache_queries > before[n].prefix_cache_queries]
    collect(stub, greedy_request(second, 4))
    after = pools(stub)
    hits = {n: after[n].prefix_cache_hits - middle[n].prefix_cache_hits for n in names}
    assert hits == {n: 80 if n == holder else 0 for n in names}
