"""The npu kernel backend, on the CPU emulation of torch_npu, against transformers.

The same scenarios run on the torch backend and on the emulated npu backend (bfloat16, 128-token
blocks, as on Ascend) for models with head_dim 64 and 128. The weights are random, so bfloat16
rounding may flip a near-tie that float32 transformers resolves the other way, after which the
texts part: instead of equal tokens, every greedy token (through whole and chunked prefill, paged
decode and a prefix-cache hit) must be within bfloat16 tolerance of the best logit transformers
computes in float32 for the same prefix, and prefill logits must be within that tolerance too.
`npuserve serve --device npu` runs the same way with the emulation switched on, alone and as a
two-rank tensor-parallel group (gloo standing in for HCCL).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.reference import save_random_llama
from harness.serve import generate_concurrently, greedy_request, labelled_metric, serve
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.kernels import build_attention_metadata, slot_mapping
from npuserve.proto.step_plan import SamplingOptions

transformers = pytest.importorskip("transformers")

NUM_NEW = 10
TOLERANCE = 0.03  # of the largest |logit|: bfloat16 activations against float32
BACKENDS = ("torch", "npu-emulated")
HEAD_DIMS = (64, 128)


def save_llama(path: Path, head_dim: int) -> Path:
    torch.manual_seed(head_dim)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=2 * head_dim,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.05,  # unit-gain layers: bfloat16 error stays small
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=HEAD_DIMS, ids=lambda d: f"head_dim{d}")
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp(f"llama-d{request.param}"), request.param)


@pytest.fixture(params=BACKENDS)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "torch":
        return "cpu"
    request.getfixturevalue("emulated_npu")
    return "npu"


def make_runner(model_dir: Path, device: str) -> ModelRunner:
    # NOTE: on the npu, decodes replay captured graphs of batch sizes 1, 2, 4 and 8.
    config = ExecutorConfig(
        model=str(model_dir),
        device=device,
        dtype="bfloat16",
        block_size=128,
        kv_cache_memory_gib=0.05,
        max_num_seqs=8,
    )
    runner = ModelRunner(config)
    assert runner.backend.name == ("npu" if device == "npu" else "torch")
    return runner


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (1, 9, 130, 200)]


def greedy(req_id: str, prompt: list[int], **kwargs: object) -> DrivenRequest:
    return DrivenRequest(req_id, prompt, NUM_NEW, SamplingOptions(temperature=0), **kwargs)


def reference_model(model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def assert_greedy_within_tolerance(reference: torch.nn.Module, request: DrivenRequest) -> None:
    """Each generated token's float32 logit is within tolerance of the best one at its step."""
    assert len(request.output) == NUM_NEW
    tokens = torch.tensor([request.prompt + request.output[:-1]])
    logits = reference(tokens).logits[0, len(request.prompt) - 1 :]  # [NUM_NEW, V]
    chosen = logits.gather(1, torch.tensor(request.output)[:, None])[:, 0]
    slack = TOLERANCE * float(logits.abs().max())
    assert bool((chosen >= logits.max(dim=1).values - slack).all()), (request.req_id, request.output)


@pytest.mark.slow  # runs models for seconds
@pytest.mark.parametrize(
    ("token_budget", "num_steps", "join_new", "join_first_pass"),
    [
        (10_000, 1, False, False),
        (100, 1, False, False),
        (10_000, 4, False, False),
        (10_000, 4, True, False),
        (10_000, 4, True, True),
    ],
    ids=["whole-prefill", "chunked-prefill", "multi-step", "joining-step", "joining-first-pass"],
)
def test_batched_greedy_follows_transformers(
    model_dir: Path, device: str, token_budget: int, num_steps: int, join_new: bool, join_first_pass: bool
) -> None:
    """Multi-step plans run their later passes as paged decodes, a token each; a step that joins
    one runs its prompts in the same forward as that step's decodes (or, joining its first pass,
    as that step's own tokens)."""
    runner = make_runner(model_dir, device)
    requests = [greedy(f"r{i}", p) for i, p in enumerate(prompts())]
    driver = StepDriver(
        runner,
        token_budget=token_budget,
        num_steps=num_steps,
        join_new=join_new,
        join_first_pass=join_first_pass,
    )
    if join_new:  # one request first; the others come while it runs, and join its passes
        driver.step(requests[:1])
    driver.run(requests)
    assert driver.num_joined == join_new
    reference = reference_model(model_dir)
    for request in requests:
        assert_greedy_within_tolerance(reference, request)
    assert runner.batch.num_reqs == 0


def test_prefix_cache_hit_follows_transformers(model_dir: Path, device: str) -> None:
    prefix = prompts()[3][:150]
    runner = make_runner(model_dir, device)
    driver = StepDriver(runner, token_budget=10_000)
    (first,) = driver.run([greedy("first", prefix)])
    shared = first.block_ids[:1]  # one full 128-token block, not computed again
    later = [
        greedy(f"hit{i}", p, cached_block_ids=shared) for i, p in enumerate([[*prefix, 7, 8], prefix[:140]])
    ]
    driver.run(later)
    reference = reference_model(model_dir)
    for request in [first, *later]:
        assert_greedy_within_tolerance(reference, request)


@torch.inference_mode()
def test_prefill_logits_within_bfloat16_tolerance(model_dir: Path, device: str) -> None:
    runner = make_runner(model_dir, device)
    batch = prompts()
    query_lens = np.array([len(p) for p in batch], dtype=np.int32)
    blocks = -(-query_lens // 128)
    table = np.zeros((len(batch), int(blocks.max())), dtype=np.int32)
    next_block = 1
    for row, count in enumerate(blocks):
        table[row, :count] = np.arange(next_block, next_block + count)
        next_block += count
    rows = np.repeat(np.arange(len(batch)), query_lens)
    positions = np.concatenate([np.arange(n) for n in query_lens])
    metadata = build_attention_metadata(
        query_lens, query_lens, table, slot_mapping(table, rows, positions, 128), 128, runner.device
    )
    ids = torch.tensor([t for p in batch for t in p])
    hidden = runner.model(ids, torch.from_numpy(positions), runner.kv_caches, metadata)
    logits = runner.model.compute_logits(hidden).float()  # [T, V]

    reference = reference_model(model_dir)
    expected = torch.cat([reference(torch.tensor([p])).logits[0] for p in batch])
    scale = expected.abs().max()
    torch.testing.assert_close(logits / scale, expected / scale, rtol=0, atol=TOLERANCE)


# --------------------------------------------------------------------------- npuserve serve


@pytest.fixture(scope="module")
def served_model(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    """A head_dim-64 random Llama with the TinyStories tokenizer (vocab 512), for `serve`."""
    return save_random_llama(
        tmp_path_factory.mktemp("served-llama"),
        stories_dir,
        seed=3,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        initializer_range=0.05,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp_size", "enforce_eager"), [(1, False), (2, False), (1, True)], ids=["tp1", "tp2-gloo", "tp1-eager"]
)
def test_serve_on_the_emulated_npu(
    emulated_npu: pytest.MonkeyPatch, served_model: Path, tp_size: int, enforce_eager: bool
) -> None:
    """Decode steps replay captured graphs (every rank's), unless --enforce-eager."""
    generator = torch.Generator().manual_seed(9)
    prompt_ids = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 140, 33)]
    flags = ["--device", "npu", "--dtype", "bfloat16", "--kv-cache-memory", "0.05", "--max-num-seqs", "8"]
    flags += ["--tensor-parallel-size", str(tp_size), "--max-num-batched-tokens", "160"]
    flags += ["--enforce-eager"] if enforce_eager else []
    with serve(served_model, *flags) as served:
        results = generate_concurrently(served.stub(), [greedy_request(p, NUM_NEW) for p in prompt_ids])
        check = served.integrity(expect_idle=True)
        assert check.ok, check.message
        passes = labelled_metric(served.stub(), "npuserve:executor_steps_total", "mode")
    assert passes["eager"] > 0  # the prefills
    assert passes["graph"] == 0 if enforce_eager else passes["graph"] >= NUM_NEW - 1
    log = re.sub(r"\x1b\[[0-9;]*m", "", "".join(served.log))
    assert "block_size=128 device='npu (emulated on cpu)'" in log  # the executor's serving line
    assert log.count("decode graphs captured") == (0 if enforce_eager else tp_size)
    reference = reference_model(served_model)
    for index, (prompt, (tokens, _, _)) in enumerate(zip(prompt_ids, results, strict=True)):
        assert_greedy_within_tolerance(reference, greedy(f"r{index}", prompt, output=tokens))
