"""Graph mode on the emulated NPU: pure-decode passes replay captured graphs, and every greedy
token and every byte of the KV cache equals what the same steps make with --enforce-eager.

A head_dim-128 Llama (bfloat16, 128-token blocks, as on Ascend) runs on two runners in step: one
captures decode graphs of sizes 1, 2, 4, 8, 16 and 24, the other runs eagerly. Batches of 1, 3,
8 and 17 requests replay four buckets (padded rows write only the scratch block past the
scheduler's pool); prefix-cache hits, a preemption by recompute and structured-output bitmasks
go through the same graphs. Without the attention's per-replay update the emulated device
refuses the replay. Two ranks over gloo (tensor parallel) capture and agree the same way.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.npu_emulation import emulate_npu
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.graph_runner import DecodeGraphs
from npuserve.executor.model_runner import ModelRunner
from npuserve.kernels.npu_emulation import graphs as emulated_graphs
from npuserve.kernels.npu_emulation.graphs import GraphReplayError
from npuserve.proto.step_plan import SamplingOptions, StepPlan, StepResult, TokenBitmask, bitmask_words

transformers = pytest.importorskip("transformers")

VOCAB = 256
SIZES = [1, 2, 4, 8, 16, 24]


def save_llama(path: Path, seed: int = 128, **config: Any) -> Path:
    """A random two-layer Llama (head size 128 unless ``config`` says otherwise) saved at ``path``."""
    torch.manual_seed(seed)
    defaults: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "initializer_range": 0.05,
        "tie_word_embeddings": False,
    }
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**(defaults | config))).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama-d128"))


def executor_config(model_dir: Path, **fields: object) -> ExecutorConfig:
    settings: dict[str, object] = {
        "device": "npu",
        "dtype": "bfloat16",
        "kv_cache_memory_gib": 0.02,
        "max_num_seqs": 24,
    }
    return ExecutorConfig(model=str(model_dir), **{**settings, **fields})  # type: ignore[arg-type]


class CountingRunner:
    """A runner whose steps' forward passes are counted by how they ran."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size, self.num_blocks = runner.block_size, runner.num_blocks
        self.passes = {"graph": 0, "eager": 0}

    def execute(self, plan: StepPlan, **kwargs: object) -> StepResult:
        result = self.runner.execute(plan, **kwargs)  # type: ignore[arg-type]
        self.passes["graph"] += result.timings.graph_passes
        self.passes["eager"] += result.timings.eager_passes
        return result


@pytest.fixture(scope="module")
def module_emulated_npu() -> Iterator[None]:
    """`emulated_npu` for the whole module (its runners are built once)."""
    with pytest.MonkeyPatch.context() as patch:
        emulate_npu(patch)
        yield


@pytest.fixture(scope="module")
def runners(model_dir: Path, module_emulated_npu: None) -> tuple[CountingRunner, CountingRunner]:
    """(graph mode, --enforce-eager), kept in step by running the same steps on both."""
    graph = ModelRunner(executor_config(model_dir))
    eager = ModelRunner(executor_config(model_dir, enforce_eager=True))
    assert graph.graphs is not None and graph.graphs.sizes == SIZES and eager.graphs is None
    assert graph.num_blocks == eager.num_blocks
    return CountingRunner(graph), CountingRunner(eager)


def prompts(count: int, seed: int, lengths: tuple[int, int] = (2, 40)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(*lengths, (count,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in sizes]


def greedy(req_id: str, prompt: list[int], num_new: int = 6, **kwargs: object) -> DrivenRequest:
    return DrivenRequest(req_id, prompt, num_new, SamplingOptions(temperature=0), **kwargs)  # type: ignore[arg-type]


def assert_same_kv_cache(graph: ModelRunner, eager: ModelRunner) -> None:
    """Every block of the scheduler's pool, byte for byte (the graph runner's scratch block,
    past the pool, is its own)."""
    num_blocks = eager.num_blocks
    for ours, theirs in zip(graph.kv_caches, eager.kv_caches, strict=True):
        assert ours.shape[1] == num_blocks + 1
        assert torch.equal(ours[:, :num_blocks].view(torch.int16), theirs.view(torch.int16))


def run_both(
    runners: tuple[CountingRunner, CountingRunner], scenario: Callable[[CountingRunner], list[list[int]]]
) -> list[list[int]]:
    outputs = [scenario(runner) for runner in runners]
    assert outputs[0] == outputs[1]
    assert_same_kv_cache(runners[0].runner, runners[1].runner)
    return outputs[0]


@pytest.mark.parametrize("batch_size", [1, 3, 8, 17])
def test_decode_batches_equal_eager_in_every_bucket(
    runners: tuple[CountingRunner, CountingRunner], batch_size: int
) -> None:
    graph, eager = runners
    before = dict(graph.passes)

    def scenario(runner: CountingRunner) -> list[list[int]]:
        requests = [greedy(f"b{batch_size}-{i}", p) for i, p in enumerate(prompts(batch_size, batch_size))]
        return [r.output for r in StepDriver(runner, seed=batch_size).run(requests)]

    run_both(runners, scenario)
    assert graph.runner.graphs is not None
    bucket = graph.runner.graphs.bucket(batch_size)
    assert bucket is not None and bucket.size == {1: 1, 3: 4, 8: 8, 17: 24}[batch_size]
    assert graph.passes["graph"] - before["graph"] >= 5  # the decodes after the prefill
    assert eager.passes["graph"] == 0


def allowed_tokens(req: DrivenRequest) -> np.ndarray:
    """[V] bool: a third of the vocabulary, a different third for each request."""
    return np.arange(VOCAB) % 3 == int(req.req_id[-1]) % 3


def bitmask(sampling: list[DrivenRequest]) -> TokenBitmask | None:
    constrained = [r for r in sampling if r.req_id.startswith("json")]
    if not constrained:
        return None
    words = bitmask_words(VOCAB)
    rows = [np.packbits(allowed_tokens(r), bitorder="little").view("<i4")[:words] for r in constrained]
    return TokenBitmask([r.req_id for r in constrained], np.concatenate(rows).astype("<i4").tobytes())


def test_prefix_hits_preemption_and_structured_outputs_equal_eager(
    runners: tuple[CountingRunner, CountingRunner],
) -> None:
    prefix = prompts(1, 7, (150, 151))[0]

    def scenario(runner: CountingRunner) -> list[list[int]]:
        driver = StepDriver(runner, seed=3, bitmask=bitmask)
        (first,) = driver.run([greedy("first", prefix)])
        shared = first.block_ids[:1]  # one full 128-token block, computed once
        hits = [greedy(f"hit{i}", [*prefix[:140], i + 3], 10, cached_block_ids=shared) for i in range(3)]
        others = [greedy(f"json{i}", p, 10) for i, p in enumerate(prompts(4, 8))]
        requests = hits + others
        for step in range(6):
            driver.step([r for r in requests if not r.done])
            if step == 3:  # preempted mid-decode, then recomputed from its prompt and outputs
                driver.preempt(requests[1])
                driver.preempt(requests[4])
        driver.run(requests)
        for request in others:
            assert all(allowed_tokens(request)[token] for token in request.output)
        return [r.output for r in [first, *requests]]

    run_both(runners, scenario)


def test_a_replay_without_the_attention_update_is_refused(
    model_dir: Path, emulated_npu: pytest.MonkeyPatch
) -> None:
    """The emulated device runs a graph only once its attention was given the step's lengths."""
    from npuserve.kernels.backends.npu_backend import NpuBackend

    runner = ModelRunner(executor_config(model_dir, max_num_seqs=4, graph_capture_sizes=(4,)))
    emulated_npu.setattr(NpuBackend, "update_graph_attention", lambda self, captured, metadata: None)
    driver = StepDriver(runner)
    requests = [greedy(f"r{i}", p) for i, p in enumerate(prompts(3, 1))]
    driver.step(requests)  # the prefill runs eagerly
    with pytest.raises(GraphReplayError, match="not updated since the last replay"):
        driver.step(requests)


# --------------------------------------------------------------------------- the CUDA path


class RecordedGraphs:
    """The emulation's graph recorder in place of torch.cuda's graphs: the torch backend's decode
    (what CUDA graphs capture) captured and replayed on the CPU."""

    def new_graph(self) -> emulated_graphs.NPUGraph:
        return emulated_graphs.NPUGraph()

    def pool_handle(self) -> emulated_graphs.PoolHandle:
        return emulated_graphs.graph_pool_handle()

    def capture(self, graph: emulated_graphs.NPUGraph, pool: object) -> emulated_graphs.graph:
        return emulated_graphs.graph(graph, pool=pool)  # type: ignore[arg-type]

    def memory_reserved(self) -> int:
        return emulated_graphs.reserved_bytes()

    def synchronize(self) -> None:
        pass


def test_the_torch_backends_decode_replays_as_captured(tmp_path: Path) -> None:
    """No host sync, no tensor made from host data, no shape that follows the step: the torch
    backend's decode forward (what CUDA graphs capture on a GPU) replays from its static inputs
    alone, with eager's tokens. NOTE: its attention spans every key position a request may have
    (a graph's shapes are fixed), where eager's spans the step's longest request, and SDPA's
    rounding may differ with the width: the cache is equal within bfloat16 rounding, not byte
    for byte (the npu kernel reads each request's length, and is exact)."""
    save_llama(
        tmp_path,
        seed=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,  # spread logits: no argmax ties for rounding to flip
    )
    runner_config = executor_config(tmp_path, device="cpu", block_size=16, max_num_seqs=8)
    graph, eager = ModelRunner(runner_config), ModelRunner(runner_config)
    # The scratch block past the pool, as graph mode allocates it on a device.
    graph.kv_caches = [torch.cat([kv, torch.zeros_like(kv[:, :1])], dim=1) for kv in graph.kv_caches]
    with torch.inference_mode():
        graph.graphs = DecodeGraphs.capture(
            RecordedGraphs(),  # type: ignore[arg-type]
            graph.model,
            graph.kv_caches,
            graph.backend,
            graph.staging,
            [1, 2, 4, 8],
            graph.block_size,
            graph.batch.max_blocks_per_req,
            scratch_block=graph.num_blocks,
            tensor_device=graph.device,
        )
    counting = CountingRunner(graph), CountingRunner(eager)
    outputs = []
    for runner in counting:
        requests = [greedy(f"t{i}", p, 12) for i, p in enumerate(prompts(5, 21))]
        outputs.append([r.output for r in StepDriver(runner, seed=4).run(requests)])
    assert outputs[0] == outputs[1]
    assert counting[0].passes["graph"] >= 11 and counting[1].passes["graph"] == 0
    for ours, theirs in zip(graph.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(ours[:, : eager.num_blocks], theirs, rtol=0.02, atol=0.02)


# --------------------------------------------------------------------------- tensor parallel


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RANK_SCRIPT = """
import hashlib, json, os, sys
import torch, torch.distributed as dist
from harness.step_driver import DrivenRequest, StepDriver
from npuserve.executor.config import ExecutorConfig, ModelConfig
from npuserve.executor.layers import TensorParallel
from npuserve.executor.model_runner import ModelRunner
from npuserve.proto.step_plan import SamplingOptions

rank, model_dir, prompts = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
dist.init_process_group("gloo", rank=rank, world_size=2)
found = {}
for mode, eager in (("graph", False), ("eager", True)):
    config = ExecutorConfig(model=model_dir, device="npu", dtype="bfloat16", kv_cache_memory_gib=0.02,
                            max_num_seqs=8, enforce_eager=eager)
    runner = ModelRunner(config, ModelConfig.from_pretrained(model_dir), TensorParallel(rank, 2))
    requests = [DrivenRequest(f"r{i}", p, 6, SamplingOptions(temperature=0)) for i, p in enumerate(prompts)]
    StepDriver(runner).run(requests)
    kv = hashlib.sha256()
    for cache in runner.kv_caches:
        kv.update(cache[:, : runner.num_blocks].contiguous().view(torch.int16).numpy().tobytes())
    found[mode] = {"outputs": [r.output for r in requests], "kv": kv.hexdigest(), "graphs": bool(runner.graphs)}
dist.destroy_process_group()
print(json.dumps(found))
"""


@pytest.mark.slow  # two processes
def test_two_ranks_capture_and_equal_eager(model_dir: Path) -> None:
    """Each rank of a TP=2 group (gloo) captures its graphs, whose all-reduces replay in step
    with the other rank's; tokens and each rank's KV cache equal the eager group's."""
    tests_dir = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "NPUSERVE_EMULATE_NPU": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")]),
    }
    batch = json.dumps(prompts(5, 11))
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(model_dir), batch],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    for rank in ranks:
        stdout, stderr = rank.communicate(timeout=240)
        assert rank.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for found in results:
        assert found["graph"]["graphs"] and not found["eager"]["graphs"]
        assert found["graph"]["outputs"] == found["eager"]["outputs"] == results[0]["graph"]["outputs"]
        assert found["graph"]["kv"] == found["eager"]["kv"]
