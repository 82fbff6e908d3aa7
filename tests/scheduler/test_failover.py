"""SIGKILL one of two executors while 32 greedy streams run: every request completes, every
output equals an undisturbed run's, and no streamed token repeats or goes missing."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from harness.serve import complete_streams, greedy_request, npuserve_process

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # executors and a scheduler in processes of their own

NUM_STREAMS = 32
NUM_NEW = 48


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [
        [1, *torch.randint(3, 512, (int(n),), generator=generator).tolist()]
        for n in torch.randint(4, 40, (NUM_STREAMS,), generator=generator)
    ]


def test_sigkill_one_executor_mid_run(stories_dir: Path) -> None:
    model = str(stories_dir)
    requests = [greedy_request(p, NUM_NEW) for p in prompts()]
    executor_flags = ("--model", model, "--port", "0", "--kv-cache-memory", "0.02")
    with (
        npuserve_process("executor", *executor_flags) as (first, first_ready),
        npuserve_process("executor", *executor_flags) as (_, second_ready),
    ):
        addresses = f"{first_ready['address']},{second_ready['address']}"
        with npuserve_process(
            "scheduler", "--model", model, "--executors", addresses, "--port", "0", "--routing", "least-load"
        ) as (_, scheduler_ready):
            stub = pb_grpc.SchedulerStub(grpc.insecure_channel(scheduler_ready["address"]))
            undisturbed, _ = complete_streams(stub, requests)
            # Half of the streams lose their executor mid-generation.
            outputs, reasons = complete_streams(stub, requests, first.kill)
            assert reasons == ["length"] * NUM_STREAMS
            assert outputs == undisturbed  # nothing repeated, nothing skipped, same tokens
            check = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=True), timeout=10)
            assert check.ok, check.message
            assert (
                len(check.executors) == 1
                and check.executors[0].num_free_blocks == check.executors[0].num_blocks
            )
