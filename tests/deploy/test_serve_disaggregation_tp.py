"""`npuserve serve --tensor-parallel-size 2 --prefill-executors 1`: prefill/decode disaggregation
between two tensor-parallel groups (two ranks each, gloo on the CPU), in real processes. Every
prompt's KV is pulled from the prefill group by the decode group, each rank's shard of the
blocks to the same rank (`kv_transfer_group`); greedy outputs equal transformers', and the
decode group's pulled bytes are every rank's: whole blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness.reference import transformers_greedy
from harness.serve import generate_concurrently, greedy_request, metric_by_role, serve

from npuserve.executor.config import ModelConfig
from npuserve.executor.kv_cache import block_bytes
from npuserve.executor.layers import TensorParallel
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto.kv_layout import cdiv

pytestmark = pytest.mark.slow  # `npuserve serve` in processes of its own

transformers = pytest.importorskip("transformers")

NUM_STREAMS = 3
NUM_NEW = 6
BLOCK_SIZE = 16  # the CPU's


def test_two_tensor_parallel_groups_pull_each_rank_its_own_shard(stories_dir: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(17, 61, (NUM_STREAMS,), generator=generator).tolist()
    prompt_ids = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]
    expected = transformers_greedy(stories_dir, prompt_ids, NUM_NEW)
    flags = (
        *("--tensor-parallel-size", "2", "--kv-cache-memory", "0.02", "--no-warmup"),
        *("--num-executors", "2", "--prefill-executors", "1", "--max-local-prefill-length", "0"),
        *("--scheduler-workers", "0"),
    )
    with serve(stories_dir, *flags) as served:
        stub = served.stub()
        results = generate_concurrently(stub, [greedy_request(p, NUM_NEW) for p in prompt_ids])
        assert [tokens for tokens, _, _ in results] == expected
        text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10).text
        assert metric_by_role(text, "npuserve:executor_prompt_tokens_total")["decode"] == 0
        sampled = metric_by_role(text, "npuserve:executor_generation_tokens_total")
        assert sampled == {"prefill": NUM_STREAMS, "decode": NUM_STREAMS * (NUM_NEW - 1)}
        # Each prompt's blocks, whole: both ranks' shards (one rank's would be half).
        model = ModelConfig.from_pretrained(stories_dir)
        whole_block = block_bytes(model, BLOCK_SIZE, torch.float32, TensorParallel())
        pulled = metric_by_role(text, "npuserve:kv_transfer_bytes_total", kind="executor")
        assert pulled["decode"] == sum(cdiv(n, BLOCK_SIZE) for n in lengths) * whole_block
        assert not pulled.get("prefill")
        check = served.integrity(expect_idle=True)
        assert check.ok, check.message
        assert all(e.num_requests == 0 and e.num_free_blocks == e.num_blocks for e in check.executors)
    assert "".join(served.log).count("tensor-parallel group formed") == 4  # two ranks per group
