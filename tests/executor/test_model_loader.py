"""Loading checkpoints: one file, shards with an index, tied embeddings, random weights, bf16.

A random-weight transformers Llama is saved in each layout and must give transformers' greedy
tokens. Broken checkpoints (no weights, a missing shard, a malformed index, a corrupt file, a
missing tensor) must be refused with a `ConfigError` naming the cause and the fix.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from harness.reference import transformers_greedy
from harness.step_driver import DrivenRequest, StepDriver
from safetensors.torch import load_file, save_file

from npuserve.executor.config import ConfigError, ExecutorConfig, ModelConfig
from npuserve.executor.model_loader import safetensors_files
from npuserve.executor.model_runner import ModelRunner
from npuserve.proto.step_plan import SamplingOptions

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 6
PROMPTS = [[5, 17, 99, 3], [200, 1, 42, 42, 42, 7, 150, 33, 90, 12, 64, 8, 250, 31, 77, 2, 19], [11]]
VARIANTS = ("single", "sharded", "tied")


def build_model(path: Path, tie: bool, max_shard_size: str | None = None) -> Path:
    """Saves a seeded random Llama (2 layers, hidden 64, vocab 256) in Hugging Face layout."""
    torch.manual_seed(4321)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        # NOTE: a wide init spreads the logits so float32 rounding order cannot flip an argmax.
        initializer_range=0.2,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "single": build_model(root / "single", tie=False),
        "sharded": build_model(root / "sharded", tie=False, max_shard_size="50KB"),
        "tied": build_model(root / "tied", tie=True),
    }


def make_runner(model_dir: Path, **kwargs: object) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(model_dir), kv_cache_memory_gib=0.005, **kwargs))


def run_greedy(runner: ModelRunner, num_logprobs: int | None = None) -> list[DrivenRequest]:
    options = SamplingOptions(temperature=0, num_logprobs=num_logprobs)
    requests = [DrivenRequest(f"r{i}", p, NUM_NEW_TOKENS, options) for i, p in enumerate(PROMPTS)]
    return StepDriver(runner, token_budget=8).run(requests)


def copy_model(source: Path, target: Path) -> Path:
    return Path(shutil.copytree(source, target))


# --------------------------------------------------------------------------- good layouts


@pytest.mark.parametrize("variant", VARIANTS)
def test_layout_gives_transformers_greedy_tokens(model_dirs: dict[str, Path], variant: str) -> None:
    """Each checkpoint layout loads completely and reproduces transformers' greedy tokens."""
    model_dir = model_dirs[variant]
    runner = make_runner(model_dir, dtype="float32")
    assert [r.output for r in run_greedy(runner)] == transformers_greedy(model_dir, PROMPTS, NUM_NEW_TOKENS)


def test_sharded_checkpoint_reads_files_from_index(model_dirs: dict[str, Path]) -> None:
    """A sharded save has an index; the loader takes exactly the shards the index names."""
    model_dir = model_dirs["sharded"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert [f.name for f in safetensors_files(model_dir)] == shards


def test_tied_checkpoint_has_no_lm_head_and_shares_embedding(model_dirs: dict[str, Path]) -> None:
    """With tie_word_embeddings the file lacks lm_head.weight and the head is the embedding."""
    model_dir = model_dirs["tied"]
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors")
    runner = make_runner(model_dir)
    assert runner.model.lm_head is runner.model.model.embed_tokens


# ----------------------------------------------------------------------------- refusals


def test_directory_without_safetensors(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """No weight files: the message names the directory and offers conversion or dummy weights."""
    shutil.copy(model_dirs["single"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match=r"holds no \*\.safetensors weights") as info:
        make_runner(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "convert the checkpoint to safetensors" in str(info.value)
    assert "--load-format dummy" in str(info.value)


def test_index_naming_missing_shard(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A shard the index names but the directory lacks is named, with the fix."""
    model_dir = copy_model(model_dirs["sharded"], tmp_path / "model")
    shard = sorted(model_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ConfigError, match="are missing") as info:
        make_runner(model_dir)
    assert shard.name in str(info.value)
    assert "re-download" in str(info.value)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": [1, 2]}'])
def test_malformed_index(model_dirs: dict[str, Path], tmp_path: Path, text: str) -> None:
    """An index that is not JSON, or lacks a usable weight_map, is refused with the fix."""
    model_dir = copy_model(model_dirs["sharded"], tmp_path / "model")
    (model_dir / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json is malformed") as info:
        make_runner(model_dir)
    assert "re-download the checkpoint" in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_file(model_dirs: dict[str, Path], tmp_path: Path, damage: str) -> None:
    """A file that is not safetensors, or is cut short, is named with the reason and the fix."""
    model_dir = copy_model(model_dirs["single"], tmp_path / "model")
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x00not a safetensors file" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ConfigError, match="is not a readable safetensors file") as info:
        make_runner(model_dir)
    assert str(weights) in str(info.value)
    assert "re-download" in str(info.value)


@pytest.mark.parametrize(
    "removed", ["model.norm.weight", "model.layers.1.self_attn.k_proj.weight", "lm_head.weight"]
)
def test_checkpoint_missing_a_tensor(model_dirs: dict[str, Path], tmp_path: Path, removed: str) -> None:
    """A checkpoint without one tensor is refused, naming that tensor as the checkpoint names it."""
    model_dir = copy_model(model_dirs["single"], tmp_path / "model")
    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)
    del tensors[removed]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="the checkpoint lacks 1 tensors") as info:
        make_runner(model_dir)
    assert removed in str(info.value)
    assert "LlamaForCausalLM" in str(info.value)


# ----------------------------------------------------------------------- dummy and bf16


def test_dummy_weights_need_no_files(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """--load-format dummy runs from config.json alone, gives finite logits, repeats per seed."""
    shutil.copy(model_dirs["single"] / "config.json", tmp_path / "config.json")
    outputs = []
    for _ in range(2):
        runner = make_runner(tmp_path, load_format="dummy", seed=3)
        requests = run_greedy(runner, num_logprobs=5)
        for request in requests:
            for logprobs in request.logprobs:
                assert logprobs is not None
                assert all(math.isfinite(x) for x in [logprobs.logprob, *logprobs.top_logprobs])
            assert all(0 <= t < 256 for t in request.output)
        outputs.append([r.output for r in requests])
        norm = runner.model.model.norm.weight
        assert torch.equal(norm, torch.ones_like(norm))
        assert runner.model.model.embed_tokens.weight.std() > 0
    assert outputs[0] == outputs[1]


def test_bfloat16_loads_and_runs(model_dirs: dict[str, Path]) -> None:
    """--dtype bfloat16 casts the float32 checkpoint exactly and serves finite logprobs."""
    model_dir = model_dirs["single"]
    runner = make_runner(model_dir, dtype="bfloat16")
    assert runner.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters())
    assert all(cache.dtype == torch.bfloat16 for cache in runner.kv_caches)
    checkpoint = load_file(model_dir / "model.safetensors")
    expected = checkpoint["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(runner.model.model.embed_tokens.weight, expected)
    assert ModelConfig.from_pretrained(model_dir).torch_dtype == "float32"
    for request in run_greedy(runner, num_logprobs=2):
        assert len(request.output) == NUM_NEW_TOKENS
        assert all(lp is not None and math.isfinite(lp.logprob) for lp in request.logprobs)
