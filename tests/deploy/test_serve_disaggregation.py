"""`npuserve serve --prefill-executors 1`: prefill/decode disaggregation in real processes, the
KV of every prompt pulled over gRPC from the prefill executor by the decode one; greedy outputs
equal transformers' (as colocated serving's do: tests/deploy/test_serve.py), and a constrained
request's equal its colocated run's."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
import jsonschema
import pytest
import torch
from harness.cluster import processes, wait_until
from harness.pools import idle_pools, pools
from harness.reference import transformers_greedy
from harness.serve import (
    generate_concurrently,
    greedy_request,
    metric_by_role,
    run_streams,
    serve,
    serve_child,
    start_executors,
    start_scheduler,
    worker_pids,
)

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.scheduler.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # `npuserve serve` in processes of its own

transformers = pytest.importorskip("transformers")

NUM_STREAMS = 32
NUM_NEW = 12
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 3, "maxLength": 12},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "pets"],
}


def test_every_prompt_prefills_on_the_prefill_executor_and_decodes_on_the_other(stories_dir: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 61, (NUM_STREAMS,), generator=generator).tolist()
    prompt_ids = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]
    expected = transformers_greedy(stories_dir, prompt_ids, NUM_NEW)
    flags = ("--kv-cache-memory", "0.02", "--num-executors", "2", "--prefill-executors", "1")
    with serve(stories_dir, *flags, "--max-local-prefill-length", "0") as served:
        stub = served.stub()
        results = generate_concurrently(stub, [greedy_request(p, NUM_NEW) for p in prompt_ids])
        assert [tokens for tokens, _, _ in results] == expected
        text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10).text
        prompt_tokens = metric_by_role(text, "npuserve:executor_prompt_tokens_total")
        cached = served.metric("vllm:prefix_cache_hits_total")
        assert prompt_tokens["decode"] == 0 and prompt_tokens["prefill"] + cached >= sum(lengths)
        sampled = metric_by_role(text, "npuserve:executor_generation_tokens_total")
        assert sampled == {"prefill": NUM_STREAMS, "decode": NUM_STREAMS * (NUM_NEW - 1)}
        pulled = metric_by_role(text, "npuserve:kv_transfer_bytes_total", kind="executor")
        assert pulled["decode"] > 0 and not pulled.get("prefill")

        # A JSON-schema constrained request, greedy: its first token sampled under its grammar on
        # the prefill executor, the rest on the decode executor's matcher (rebuilt by its scheduler
        # worker). Asked with n=2, it runs colocated there (siblings share one prefill on the lane
        # that decodes them): each choice is what colocated serving gives.
        constraint = pb.StructuredOutputs(json_schema=json.dumps(SCHEMA))
        prompt = torch.randint(3, 512, (40,), generator=generator).tolist()
        (handed_off,) = choices(stub, greedy_request(prompt, 64, structured_outputs=constraint))
        colocated = choices(stub, greedy_request(prompt, 64, structured_outputs=constraint, n=2))
        assert colocated == [handed_off, handed_off]
        jsonschema.validate(json.loads(Tokenizer.from_pretrained(stories_dir).decode(handed_off)), SCHEMA)
        text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10).text
        assert metric_by_role(text, "npuserve:executor_generation_tokens_total")["prefill"] == NUM_STREAMS + 1
        check = served.integrity(expect_idle=True)
        assert check.ok, check.message
        assert all(e.num_requests == 0 and e.num_free_blocks == e.num_blocks for e in check.executors)


def choices(stub: pb_grpc.SchedulerStub, request: pb.GenerateRequest) -> list[list[int]]:
    """Each choice's tokens, the request streamed to its end (each ends as its constraint stops it)."""
    tokens: dict[int, list[int]] = {}
    for response in stub.Generate(request, timeout=120):
        for completion in response.completions:
            tokens.setdefault(completion.index, []).extend(completion.token_ids)
            assert completion.finish_reason in ("", "stop"), completion
    return [tokens[index] for index in sorted(tokens)]


@pytest.mark.parametrize("killed", ["executor-0", "executor-1"])
def test_a_killed_prefill_or_decode_executor_costs_no_stream(stories_dir: Path, killed: str) -> None:
    """One prefill executor (executor-0) and two decode ones under 32 streams; one of them is
    SIGKILLed once a few streams have their first token, with prompts prefilling, pulled and
    decoding: every stream completes with the undisturbed tokens, and no block stays held."""
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(20, 61, (NUM_STREAMS,), generator=generator).tolist()
    prompt_ids = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]
    expected = transformers_greedy(stories_dir, prompt_ids, NUM_NEW)
    flags = ("--kv-cache-memory", "0.02", "--num-executors", "3", "--prefill-executors", "1")
    with serve(stories_dir, *flags, "--max-local-prefill-length", "0") as served:
        threads, outputs, reasons = run_streams(
            served.stub(), [greedy_request(p, NUM_NEW) for p in prompt_ids], None
        )
        deadline = time.monotonic() + 60
        while sum(bool(tokens) for tokens in outputs) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        found = serve_child(served.process.pid, killed)  # type: ignore[union-attr]
        assert found is not None
        os.kill(found[0], signal.SIGKILL)
        for thread in threads:
            thread.join(120)
        assert outputs == expected
        assert reasons == ["length"] * NUM_STREAMS
        check = served.integrity(expect_idle=True, timeout_s=10)
        assert check.ok, check.message


@pytest.mark.slow
def test_a_killed_scheduler_worker_of_the_prefill_executor_costs_no_stream(
    stories_dir: Path, tmp_path: Path
) -> None:
    """The prefill executor's lane runs in one scheduler worker, the decode executor's in the
    other. The first worker is SIGKILLed once a few streams have their first token, with
    prompts prefilling, held and pulled: it restarts, the prefills it ran run again, and every
    stream completes with transformers' tokens; no block stays held on either executor."""
    generator = torch.Generator().manual_seed(4)
    lengths = torch.randint(20, 61, (NUM_STREAMS,), generator=generator).tolist()
    prompt_ids = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]
    expected = transformers_greedy(stories_dir, prompt_ids, NUM_NEW)
    with processes(tmp_path) as procs:
        roles = {"e0": "prefill", "e1": "decode"}
        # NOTE: a prefill step of at most 64 tokens takes one or two prompts, so the 32 prefills
        # take many steps and the kill finds prompts still to prefill there.
        small_steps = {"e0": ("--max-num-batched-tokens", "64")}
        addresses = start_executors(procs, stories_dir, ["e0", "e1"], roles, small_steps)
        flags = ("--scheduler-workers", "2", "--max-local-prefill-length", "0")
        scheduler = start_scheduler(procs, stories_dir, addresses, *flags)
        address = scheduler.wait_ready()["address"]
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(address))
        first_pids = worker_pids(scheduler)
        # NOTE: each executor's lane goes to the worker with the fewest lanes, in joining order.
        joined = [e["executor"] for e in scheduler.events() if e["event"] == "executor joined"]
        prefill_worker = joined.index("e0")
        threads, outputs, reasons = run_streams(stub, [greedy_request(p, NUM_NEW) for p in prompt_ids], None)
        wait_until(lambda: sum(bool(tokens) for tokens in outputs) >= 4, 60, "a few first tokens")
        os.kill(first_pids[prefill_worker], signal.SIGKILL)
        for thread in threads:
            thread.join(120)
        assert outputs == expected
        assert reasons == ["length"] * NUM_STREAMS
        # NOTE: the kill caught prompts prefilling there, which prefilled again (on the decode
        # executor while the worker restarted, or on the prefill executor once it was back).
        assert any(e["event"] == "prefill moved" for e in scheduler.events())
        wait_until(
            lambda: worker_pids(scheduler)[prefill_worker] != first_pids[prefill_worker],
            30,
            "the worker to restart",
        )
        wait_until(lambda: set(pools(stub)) == {"e0", "e1"}, 30, "both executors to be served again")
        final = idle_pools(stub)
        assert all(p.num_requests == 0 and p.num_free_blocks == p.num_blocks for p in final.values())
