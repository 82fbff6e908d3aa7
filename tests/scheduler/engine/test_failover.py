"""SIGKILL one of two executors while 32 greedy streams and 12 JSON-schema constrained ones run:
every request completes, every output equals an undisturbed run's (the constrained ones still
valid JSON of their schema: each scheduler worker rebuilds a moved request's matcher from its
constraint and tokens), and no streamed token repeats or goes missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import torch
from harness.serve import complete_over, greedy_request, npuserve_process

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.scheduler.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # executors and a scheduler in processes of their own

NUM_STREAMS = 32
NUM_NEW = 48
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 5}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"words": WORDS}, "required": ["words"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 3, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "pets": {
                "type": "array",
                "items": {"enum": ["cat", "dog", "fish"]},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "pets"],
    },
    {
        "type": "array",
        "items": {"type": "object", "properties": {"w": WORDS}, "required": ["w"]},
        "minItems": 1,
    },
]
NUM_CONSTRAINED = 12


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [
        [1, *torch.randint(3, 512, (int(n),), generator=generator).tolist()]
        for n in torch.randint(4, 40, (NUM_STREAMS,), generator=generator)
    ]


@pytest.mark.parametrize(
    ("api_server_count", "stream_interval", "client_call", "num_scheduler_steps", "scheduler_workers"),
    [(1, 1, "generate", 1, None), (2, 4, "generate-many", 4, None), (1, 1, "generate", 4, 0)],
)
def test_sigkill_one_executor_mid_run(
    stories_dir: Path,
    api_server_count: int,
    stream_interval: int,
    client_call: str,
    num_scheduler_steps: int,
    scheduler_workers: int | None,
) -> None:
    """With API server processes the front's copies lack the tokens its worker sent straight
    to them: a moved request takes its output from the worker first. With `--stream-interval`
    the worker also holds some back: they reach the client before the request moves. The
    streams go as Generate calls (one API process, the defaults), or over one GenerateMany call
    (as the gateway sends them) with `--stream-interval 4` and `--num-scheduler-steps 4`: the dead
    executor may have been several passes into a step. With `--scheduler-workers 0` the front
    runs the lanes on its own event loop, and they fail over alike."""
    model = str(stories_dir)
    requests = [greedy_request(p, NUM_NEW) for p in prompts()]
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(NUM_CONSTRAINED)]
    for prompt, schema in zip(prompts()[:NUM_CONSTRAINED], schemas, strict=True):  # end when whole
        constraint = pb.StructuredOutputs(json_schema=json.dumps(schema))
        requests.append(greedy_request(prompt, NUM_NEW, structured_outputs=constraint))
    executor_flags = ("--model", model, "--port", "0", "--kv-cache-memory", "0.02")
    with (
        npuserve_process("executor", *executor_flags) as (first, first_ready),
        npuserve_process("executor", *executor_flags) as (_, second_ready),
    ):
        addresses = f"{first_ready['address']},{second_ready['address']}"
        scheduler_flags = (
            "--model",
            model,
            "--executors",
            addresses,
            "--port",
            "0",
            "--routing",
            "least-load",
            "--stream-interval",
            str(stream_interval),
            "--num-scheduler-steps",
            str(num_scheduler_steps),
        )
        if scheduler_workers is not None:
            scheduler_flags += ("--scheduler-workers", str(scheduler_workers))
        with npuserve_process("scheduler", *scheduler_flags, "--api-server-count", str(api_server_count)) as (
            scheduler,
            scheduler_ready,
        ):
            address = scheduler_ready["address"]
            stub = pb_grpc.SchedulerStub(grpc.insecure_channel(address))
            undisturbed, _ = complete_over(client_call, address, requests)
            tokenizer = Tokenizer.from_pretrained(stories_dir)
            for tokens, schema in zip(undisturbed[NUM_STREAMS:], schemas, strict=True):
                assert len(tokens) > 8  # still generating when the executor is killed below
                jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)

            for i, request in enumerate(requests[NUM_STREAMS:]):  # named, to find them in the log
                request.request_id = f"constrained-{i}"
            # Half of the streams lose their executor mid-generation.
            outputs, reasons = complete_over(client_call, address, requests, first.kill)
            assert reasons == ["length"] * NUM_STREAMS + ["stop"] * NUM_CONSTRAINED
            assert outputs == undisturbed  # nothing repeated, nothing skipped, same tokens
            moved = [line for line in scheduler.log().splitlines() if "requests moved" in line]
            assert any("constrained-" in line for line in moved), moved  # matchers rebuilt elsewhere
            check = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=True), timeout=10)
            assert check.ok, check.message
            assert (
                len(check.executors) == 1
                and check.executors[0].num_free_blocks == check.executors[0].num_blocks
            )
