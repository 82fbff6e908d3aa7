"""An executor that dies, with no other to take over, fails its requests promptly and with a
clear status; the scheduler keeps running, holds no block, and serves again once it rejoins."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from harness.serve import collect, greedy_request, npuserve_process

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # an executor and a scheduler in processes of their own


def test_killed_executor_fails_its_requests_and_returns_blocks(stories_dir: Path) -> None:
    model = str(stories_dir)
    with (
        npuserve_process("executor", "--model", model, "--port", "0", "--kv-cache-memory", "0.02") as (
            executor,
            executor_ready,
        ),
        npuserve_process(
            "scheduler",
            "--model",
            model,
            "--executors",
            executor_ready["address"],
            "--port",
            "0",
            "--step-timeout",
            "5",
        ) as (_, scheduler_ready),
    ):
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(scheduler_ready["address"]))
        # Healthy first: a request completes.
        tokens, _, _ = collect(stub, greedy_request([1, 403, 407, 261, 378], 8))
        assert len(tokens) == 8

        outcomes: list[tuple[str, str]] = []
        first_tokens = threading.Barrier(9)

        def stream(seed: int) -> None:
            request = greedy_request([1, 403, 407 + seed], 450)
            started = False
            for response in stub.Generate(request, timeout=60):
                for completion in response.completions:
                    if not started:
                        started = True
                        first_tokens.wait(30)
                    if completion.finish_reason:
                        outcomes.append((completion.finish_reason, completion.error_message))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        first_tokens.wait(30)  # every stream is producing tokens
        executor.kill()
        for thread in threads:
            thread.join(60)  # a hang guard: each stream ends with an error, not at max_tokens
        assert len(outcomes) == 8
        assert all(reason == "error" and "executor" in message for reason, message in outcomes), outcomes

        # The scheduler is still up, says it has no executor, and holds no block.
        health = stub.Health(pb.HealthRequest(), timeout=10)
        assert not health.serving and health.ready_executors == 0 and health.message
        check = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=True), timeout=10)
        assert check.ok, check.message
        # A new request is refused at once with UNAVAILABLE rather than left hanging.
        with pytest.raises(grpc.RpcError) as refused:
            collect(stub, greedy_request([1, 403], 4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        # An executor restarted at the same address rejoins with a fresh pool; serving resumes.
        port = executor_ready["address"].rsplit(":", 1)[1]
        with npuserve_process("executor", "--model", model, "--port", port, "--kv-cache-memory", "0.02"):
            deadline = time.monotonic() + 30
            while not stub.Health(pb.HealthRequest(), timeout=10).serving:
                assert time.monotonic() < deadline, "the restarted executor did not rejoin"
                time.sleep(0.2)
            tokens, _, _ = collect(stub, greedy_request([1, 403, 407, 261, 378], 8))
            assert len(tokens) == 8
            check = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=True), timeout=10)
            assert check.ok and all(e.num_free_blocks == e.num_blocks for e in check.executors)
