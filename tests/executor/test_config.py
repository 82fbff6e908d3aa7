"""`ModelConfig.from_pretrained` and `ExecutorConfig`: what they accept, and how they refuse.

Every refusal is a `ConfigError` raised before anything is loaded, and its message must name both
the cause (the field, the value, the file) and the fix (the flag to change, the values accepted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from npuserve.executor.config import ARCHITECTURES, ConfigError, ExecutorConfig, ModelConfig
from npuserve.kernels.rope import RopeScaling

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "hidden_act": "silu",
    "eos_token_id": 2,
}
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


def write_model_dir(
    path: Path, overrides: dict[str, Any] | None = None, generation: dict[str, Any] | None = None
) -> Path:
    """A model directory holding config.json (BASE with overrides; None values delete a key)."""
    raw = {**BASE, **(overrides or {})}
    raw = {k: v for k, v in raw.items() if v is not None}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def load(tmp_path: Path, overrides: dict[str, Any] | None = None, **kwargs: Any) -> ModelConfig:
    return ModelConfig.from_pretrained(write_model_dir(tmp_path / "model", overrides, **kwargs))


def config_error(tmp_path: Path, overrides: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, overrides)
    return str(info.value)


# ------------------------------------------------------------------------------- refusals


def test_missing_directory_names_path_and_flag(tmp_path: Path) -> None:
    """A --model path that does not exist names the path and says what --model must hold."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match="does not exist") as info:
        ModelConfig.from_pretrained(missing)
    assert str(missing) in str(info.value)
    assert "--model" in str(info.value) and "config.json" in str(info.value)


def test_directory_without_config_json(tmp_path: Path) -> None:
    """An existing directory without config.json names the missing file and the layout needed."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"config\.json is missing") as info:
        ModelConfig.from_pretrained(tmp_path)
    assert "Hugging Face layout" in str(info.value)


def test_malformed_config_json(tmp_path: Path) -> None:
    """Truncated JSON names the file, the parse error and the fix (re-download or fix it)."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ConfigError, match="not valid JSON") as info:
        ModelConfig.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    assert "re-download or fix" in str(info.value)


def test_malformed_generation_config_json(tmp_path: Path) -> None:
    """The optional generation_config.json is validated too when present."""
    write_model_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text("{eos_token_id: 2}")
    with pytest.raises(ConfigError, match=r"generation_config\.json is not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], [], None])
def test_unsupported_architecture_lists_supported(tmp_path: Path, architectures: list[str] | None) -> None:
    """An unknown (or absent) architecture is named, and every supported one is listed."""
    message = config_error(tmp_path, {"architectures": architectures})
    assert "is not supported" in message
    assert ("GPT2LMHeadModel" if architectures else "(none given)") in message
    for name in ARCHITECTURES:
        assert name in message


def test_first_supported_architecture_wins(tmp_path: Path) -> None:
    """A config listing several architectures is served by the first one npuserve knows."""
    config = load(tmp_path, {"architectures": ["FancyNewForCausalLM", "MistralForCausalLM"]})
    assert config.architecture == "MistralForCausalLM"


def test_hidden_act_not_silu(tmp_path: Path) -> None:
    """A non-SiLU MLP names the activation found and the only one supported."""
    message = config_error(tmp_path, {"hidden_act": "gelu"})
    assert "hidden_act 'gelu'" in message
    assert "'silu'" in message


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_lists_supported(tmp_path: Path, key: str) -> None:
    """An unknown rope type (either spelling of the key) is named with the supported types."""
    message = config_error(tmp_path, {key: {"rope_type": "yarn", "factor": 4.0}})
    assert "rope type 'yarn'" in message
    assert ", ".join(RopeScaling.SUPPORTED) in message


def test_heads_not_multiple_of_kv_heads(tmp_path: Path) -> None:
    """Grouped-query attention needs heads % kv_heads == 0; both counts and the fix are named."""
    message = config_error(tmp_path, {"num_attention_heads": 6, "num_key_value_heads": 4})
    assert "num_attention_heads (6)" in message and "num_key_value_heads (4)" in message
    assert "fix" in message or "re-download" in message


@pytest.mark.parametrize("name", REQUIRED_FIELDS)
@pytest.mark.parametrize("value", [None, 0, -4, "32", 1.5, True], ids=repr)
def test_required_field_must_be_positive_integer(tmp_path: Path, name: str, value: Any) -> None:
    """A missing, zero, negative, string, float or bool size names the field, value and rule."""
    message = config_error(tmp_path, {name: value})
    assert f"field {name!r} must be a positive integer" in message
    assert f"got {value!r}" in message


def test_num_key_value_heads_zero_is_refused(tmp_path: Path) -> None:
    """num_key_value_heads is optional (defaults to the head count) but must be positive if set."""
    message = config_error(tmp_path, {"num_key_value_heads": 0})
    assert "'num_key_value_heads' must be a positive integer" in message
    assert load(tmp_path / "default", {"num_key_value_heads": None}).num_kv_heads == 4


def test_max_model_len_beyond_model_context(tmp_path: Path) -> None:
    """--max-model-len above max_position_embeddings names both lengths and the flag to lower."""
    model = load(tmp_path)
    with pytest.raises(ConfigError) as info:
        ExecutorConfig(model=str(model.model_dir), max_model_len=256).resolve_max_model_len(model)
    message = str(info.value)
    assert "--max-model-len 256" in message and "1..128" in message
    assert "lower --max-model-len" in message


def test_max_model_len_defaults_and_sliding_window_limit(tmp_path: Path) -> None:
    """Unset --max-model-len is the model's context, capped at a sliding window when one is used."""
    model = load(tmp_path / "plain")
    assert ExecutorConfig(model="m").resolve_max_model_len(model) == 128
    assert ExecutorConfig(model="m", max_model_len=100).resolve_max_model_len(model) == 100
    windowed = load(tmp_path / "windowed", {"sliding_window": 64})
    assert ExecutorConfig(model="m").resolve_max_model_len(windowed) == 64
    with pytest.raises(ConfigError, match=r"outside 1\.\.64"):
        ExecutorConfig(model="m", max_model_len=100).resolve_max_model_len(windowed)
    unused = load(tmp_path / "unused", {"sliding_window": 64, "use_sliding_window": False})
    assert unused.sliding_window is None
    assert ExecutorConfig(model="m").resolve_max_model_len(unused) == 128


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"block_size": 24}, "--block-size must be a positive multiple of 16, got 24"),
        ({"block_size": 0}, "--block-size must be a positive multiple of 16, got 0"),
        ({"block_size": -16}, "--block-size must be a positive multiple of 16, got -16"),
        ({"max_num_seqs": 0}, "--max-num-seqs must be >= 1, got 0"),
        ({"cpu_threads": -1}, "--cpu-threads must be auto or >= 1, got -1"),
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be >= 1, got 0"),
        ({"kv_cache_memory_gib": 0.0}, "--kv-cache-memory must be > 0 GiB, got 0.0"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be in (0, 1], got 1.5"),
        ({"gpu_memory_utilization": 0.0}, "--gpu-memory-utilization must be in (0, 1], got 0.0"),
        ({"load_format": "pt"}, "--load-format 'pt' is unknown (choose auto, safetensors, dummy)"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_bad_executor_config_values(kwargs: dict[str, Any], expected: str) -> None:
    """Each bad flag value names the flag, the value given and the values accepted."""
    with pytest.raises(ConfigError) as info:
        ExecutorConfig(model="m", **kwargs)
    assert expected in str(info.value)


def test_good_executor_config_values() -> None:
    """The boundary values that are allowed construct without error."""
    config = ExecutorConfig(
        model="m", block_size=128, max_num_seqs=1, gpu_memory_utilization=1.0, load_format="dummy"
    )
    assert config.block_size == 128 and config.max_num_seqs == 1


# ------------------------------------------------------------------------------ accepted


def test_stories260k_config(stories_dir: Path) -> None:
    """The bundled TinyStories checkpoint's config.json parses to the documented shape."""
    config = ModelConfig.from_pretrained(stories_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert config.served_name == "stories260K"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (512, 64, 172)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (5, 8, 4, 8)
    assert config.max_position_embeddings == 512
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.rope_theta == 10000.0
    assert config.rope_scaling == RopeScaling()
    assert config.tie_word_embeddings is True
    assert (config.qkv_bias, config.mlp_bias, config.qk_norm) == (False, False, False)
    assert config.torch_dtype == "float32"
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.sliding_window is None


def test_rope_parameters_llama3(tmp_path: Path) -> None:
    """transformers 5 `rope_parameters` carries rope_theta and the llama3 scaling together."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = load(tmp_path, {"rope_parameters": rope, "rope_theta": None})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_legacy_rope_scaling_with_top_level_theta(tmp_path: Path) -> None:
    """Older configs keep rope_theta at the top level and spell the type `type`."""
    config = load(tmp_path, {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.rope_theta == 1e6
    assert config.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    default = load(tmp_path / "default", {"rope_scaling": None})
    assert default.rope_theta == 10000.0 and default.rope_scaling == RopeScaling()


@pytest.mark.parametrize(
    ("config_eos", "generation_eos", "expected"),
    [
        (2, {"eos_token_id": [2, 7, 9]}, (2, 7, 9)),
        ([5, 2], {"eos_token_id": 2}, (5, 2)),
        (None, {"eos_token_id": 3}, (3,)),
        (2, None, (2,)),
        (None, None, ()),
    ],
)
def test_eos_ids_merged_from_both_files(
    tmp_path: Path, config_eos: Any, generation_eos: dict[str, Any] | None, expected: tuple[int, ...]
) -> None:
    """EOS ids come from config.json then generation_config.json, in order, without repeats."""
    config = load(tmp_path, {"eos_token_id": config_eos}, generation=generation_eos)
    assert config.eos_token_ids == expected


def test_qwen2_forces_qkv_bias(tmp_path: Path) -> None:
    """Qwen2 checkpoints have q/k/v biases whether or not config.json says attention_bias."""
    config = load(tmp_path, {"architectures": ["Qwen2ForCausalLM"], "attention_bias": False})
    assert config.qkv_bias is True and config.qk_norm is False


def test_llama_reads_attention_bias(tmp_path: Path) -> None:
    """Llama and Mistral take attention_bias from config.json (absent means no bias)."""
    assert load(tmp_path / "a", {"attention_bias": True}).qkv_bias is True
    assert load(tmp_path / "b").qkv_bias is False
    assert load(tmp_path / "c", {"mlp_bias": True}).mlp_bias is True


def test_qwen3_qk_norm_and_explicit_head_dim(tmp_path: Path) -> None:
    """Qwen3 normalises q and k per head and may set a head_dim unrelated to hidden/heads."""
    config = load(tmp_path, {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16})
    assert config.qk_norm is True and config.qkv_bias is False
    assert config.head_dim == 16


def test_dtype_key_of_transformers_5(tmp_path: Path) -> None:
    """transformers 5 writes `dtype` where older versions wrote `torch_dtype`; both are read."""
    assert load(tmp_path / "new", {"dtype": "bfloat16"}).torch_dtype == "bfloat16"
    assert load(tmp_path / "old", {"torch_dtype": "float16"}).torch_dtype == "float16"
    assert load(tmp_path / "none").torch_dtype is None


@pytest.mark.parametrize("head_dim", [8, 80, 96, 256])
def test_npu_refuses_head_sizes_the_attention_kernel_lacks(tmp_path: Path, head_dim: int) -> None:
    from npuserve.executor.config import check_npu_model

    raw = {**BASE, "hidden_size": 4 * head_dim, "num_attention_heads": 4, "num_key_value_heads": 4}
    model = ModelConfig.from_dict(raw, tmp_path)
    with pytest.raises(ConfigError, match=rf"head_dim {head_dim} does not run on npu.*--device cpu"):
        check_npu_model(model, 128)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_npu_accepts_its_head_sizes_and_needs_block_128(tmp_path: Path, head_dim: int) -> None:
    from npuserve.executor.config import check_npu_model

    raw = {**BASE, "hidden_size": 4 * head_dim, "num_attention_heads": 4, "num_key_value_heads": 4}
    model = ModelConfig.from_dict(raw, tmp_path)
    check_npu_model(model, 128)
    with pytest.raises(ConfigError, match=r"--block-size 16 does not run on npu.*--block-size 128"):
        check_npu_model(model, 16)
