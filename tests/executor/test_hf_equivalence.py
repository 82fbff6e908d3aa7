"""Greedy tokens of the ModelRunner equal transformers' `generate` on the same weights.

Small random-weight models of each supported family are built here with transformers and saved
in Hugging Face layout; the runner loads that directory like any checkpoint. Requests run
batched, through chunked prefill and through a prefix-cache hit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness.reference import transformers_greedy
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.proto.step_plan import SamplingOptions

pytestmark = pytest.mark.slow  # greedy runs of transformers models, tens of seconds

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 12
BLOCK_SIZE = 16
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # NOTE: a wide init spreads the logits so float32 rounding order cannot flip an argmax.
    initializer_range=0.2,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
}
FAMILY_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    torch.manual_seed(1234)
    config = FAMILIES[family]()
    model = getattr(transformers, FAMILY_CLASSES[family])(config).eval()
    if family == "qwen2":  # q/k/v biases start at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return path


def make_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        ExecutorConfig(model=str(model_dir), dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory_gib=0.02)
    )


def prompts_of_many_lengths() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = [1, 3, 15, 16, 17, 31, 40, 77]
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]


def greedy(req_id: str, prompt: list[int], **kwargs: object) -> DrivenRequest:
    return DrivenRequest(req_id, prompt, NUM_NEW_TOKENS, SamplingOptions(temperature=0), **kwargs)


@pytest.mark.parametrize("token_budget", [10_000, 13], ids=["whole-prefill", "chunked-prefill"])
def test_batched_greedy_matches_transformers(model_dir: Path, token_budget: int) -> None:
    prompts = prompts_of_many_lengths()
    expected = transformers_greedy(model_dir, prompts, NUM_NEW_TOKENS)
    runner = make_runner(model_dir)
    requests = [greedy(f"r{i}", p) for i, p in enumerate(prompts)]
    StepDriver(runner, token_budget=token_budget).run(requests)
    assert [r.output for r in requests] == expected
    assert runner.batch.num_reqs == 0


def test_prefix_cache_hit_matches_transformers(model_dir: Path) -> None:
    generator = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 256, (2 * BLOCK_SIZE + 5,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, 256, (n,), generator=generator).tolist() for n in (4, 20)]
    expected = transformers_greedy(model_dir, [prefix, *prompts], NUM_NEW_TOKENS)
    runner = make_runner(model_dir)
    driver = StepDriver(runner, token_budget=10_000)
    (first,) = driver.run([greedy("first", prefix)])
    # Later requests take over the first request's two full blocks and compute only the rest.
    shared = first.block_ids[:2]
    later = [greedy(f"hit{i}", p, cached_block_ids=shared) for i, p in enumerate(prompts)]
    driver.run(later)
    assert [first.output] + [r.output for r in later] == expected
