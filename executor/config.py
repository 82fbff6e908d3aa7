"""Model and executor configuration, read from a Hugging Face model directory and validated.

Every problem a user can cause (a wrong path, an unsupported architecture, a budget that cannot
hold one sequence) raises `ConfigError` with the cause and the fix, before anything is served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from npuserve.kernels.layout import NPU_ATTENTION_HEAD_DIMS, NPU_BLOCK_SIZE
from npuserve.kernels.rope import RopeScaling
from npuserve.proto.step_plan import EXECUTOR_ROLE_MIXED, EXECUTOR_ROLES


class ConfigError(ValueError):
    """A configuration the user must change; the message names the cause and the fix."""


@dataclass(frozen=True, slots=True)
class ArchitectureSpec:
    """What sets one Llama-family architecture apart from the others; architectures are data."""

    qkv_bias: bool | None = None  # None: read `attention_bias` from config.json
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": ArchitectureSpec(),
    "MistralForCausalLM": ArchitectureSpec(),
    "Qwen2ForCausalLM": ArchitectureSpec(qkv_bias=True),
    "Qwen3ForCausalLM": ArchitectureSpec(qk_norm=True),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_dir: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str | None  # the checkpoint's dtype name, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None
    initializer_range: float = 0.02
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def served_name(self) -> str:
        return self.model_dir.name

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"model directory {str(path)!r} does not exist; pass --model with a local "
                "Hugging Face model directory (config.json, *.safetensors, tokenizer files)"
            )
        raw = _read_json(path / "config.json")
        if raw is None:
            raise ConfigError(
                f"{path / 'config.json'} is missing: the model directory must be in Hugging Face layout "
                "(config.json, *.safetensors, tokenizer.json)"
            )
        generation = _read_json(path / "generation_config.json")
        return cls.from_dict(raw, path, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], model_dir: Path, generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        architecture = _architecture(raw, model_dir)
        spec = ARCHITECTURES[architecture]
        get = partial(_positive_int, raw, model_dir)
        hidden_size = get("hidden_size")
        num_heads = get("num_attention_heads")
        num_kv_heads = get("num_key_value_heads", default=num_heads)
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"{model_dir}/config.json: num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads}); fix the head counts or re-download the checkpoint"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(
                f"{model_dir}/config.json: hidden_act {hidden_act!r} is unsupported; npuserve serves "
                "Llama-family models with hidden_act 'silu' (SwiGLU) only"
            )
        rope_theta, rope_scaling = _rope(raw, model_dir)
        qkv_bias = spec.qkv_bias if spec.qkv_bias is not None else bool(raw.get("attention_bias"))
        eos = [raw.get("eos_token_id"), (generation or {}).get("eos_token_id")]
        sliding_window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            model_dir=model_dir,
            architecture=architecture,
            vocab_size=get("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=_token_ids(eos),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=sliding_window,
            initializer_range=float(raw.get("initializer_range", 0.02)),
            raw=raw,
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); re-download or fix the file") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _architecture(raw: dict[str, Any], model_dir: Path) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ConfigError(
        f"{model_dir}: architecture {names or '(none given)'} is not supported; npuserve serves "
        f"{', '.join(sorted(ARCHITECTURES))}"
    )


def _rope(raw: dict[str, Any], model_dir: Path) -> tuple[float, RopeScaling]:
    # transformers 5 folds rope_theta into `rope_parameters`; older configs use `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in RopeScaling.SUPPORTED:
        raise ConfigError(
            f"{model_dir}/config.json: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(RopeScaling.SUPPORTED)})"
        )
    known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    kwargs = {k: v for k, v in params.items() if k in known}
    return theta, RopeScaling(rope_type=rope_type, **kwargs)


def _token_ids(values: list[Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _positive_int(raw: dict[str, Any], model_dir: Path, name: str, default: int | None = None) -> int:
    value = raw.get(name)
    if value is None:  # absent, or an explicit null
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(
            f"{model_dir}/config.json: field {name!r} must be a positive integer, got {value!r}"
        )
    return value


LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(slots=True)
class ExecutorConfig:
    """How one executor runs a model; flag names follow vLLM's."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    block_size: int | None = None  # None: 128 on Ascend, 16 elsewhere
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # KV cache budget: an explicit size (the only option on CPU), or a fraction of device memory.
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    # Host memory for KV blocks evicted from the device's prefix cache (vLLM's --kv-offloading-size).
    kv_host_memory_gib: float = 0.0
    load_format: str = "auto"
    seed: int = 0
    warmup: bool = True  # dummy steps before serving, so the first requests are not the slow ones
    profile_dir: Path | None = None  # None: profiling refused; else traces are written there
    # Torch's threads where the model computes on the host's CPU (the cpu device, or the npu
    # backend emulated on it): a number, `AUTO_CPU_THREADS` (`cpu_threads`: chosen after the
    # warm-up) or None (torch's own, one per core). Ignored on a device.
    cpu_threads: int | None = None
    # Graph mode (`graph_runner`): pure-decode passes replay captured graphs on npu and cuda
    # unless enforce_eager; the batch sizes captured (None: the default ladder, `graph_sizes`).
    enforce_eager: bool = False
    graph_capture_sizes: tuple[int, ...] | None = None
    # What the scheduler places on it (`ExecutorInfo.role`): long prompts on a prefill
    # executor, their decode on a decode executor; a mixed one does both.
    role: str = EXECUTOR_ROLE_MIXED

    def __post_init__(self) -> None:
        if self.role not in EXECUTOR_ROLES:
            raise ConfigError(f"--role must be one of {', '.join(EXECUTOR_ROLES)}, got {self.role!r}")
        if self.block_size is not None and (self.block_size <= 0 or self.block_size % 16):
            raise ConfigError(f"--block-size must be a positive multiple of 16, got {self.block_size}")
        if self.cpu_threads is not None and self.cpu_threads < 0:
            raise ConfigError(f"--cpu-threads must be auto or >= 1, got {self.cpu_threads}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"--kv-cache-memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        if not self.kv_host_memory_gib >= 0:
            raise ConfigError(f"--kv-host-memory must be >= 0 GiB, got {self.kv_host_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.graph_capture_sizes is not None and any(size < 1 for size in self.graph_capture_sizes):
            raise ConfigError(f"--graph-capture-sizes must be positive, got {list(self.graph_capture_sizes)}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"--load-format {self.load_format!r} is unknown (choose {', '.join(LOAD_FORMATS)})"
            )

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        if model.sliding_window:
            # NOTE: no sliding-window attention kernel yet; stay inside the window so results
            # are exact rather than silently attend past it.
            limit = min(limit, model.sliding_window)
        if self.max_model_len is None:
            return limit
        if not 0 < self.max_model_len <= limit:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} is outside 1..{limit}, the longest "
                f"context {model.model_dir.name} supports; lower --max-model-len"
            )
        return self.max_model_len


def check_npu_model(model: ModelConfig, block_size: int) -> None:
    """Refuses, before any weight loads, what the Ascend attention kernel cannot run."""
    if model.head_dim not in NPU_ATTENTION_HEAD_DIMS:
        raise ConfigError(
            f"{model.model_dir.name}: head_dim {model.head_dim} does not run on npu: Ascend's "
            f"npu_fused_infer_attention_score takes head sizes {' or '.join(map(str, NPU_ATTENTION_HEAD_DIMS))} "
            "in npuserve's paged layout (it fails with error 561002 otherwise). Serve this model "
            "with --device cpu (or cuda)."
        )
    if block_size != NPU_BLOCK_SIZE:
        raise ConfigError(
            f"--block-size {block_size} does not run on npu: Ascend's paged attention needs "
            f"{NPU_BLOCK_SIZE}-token blocks. Drop --block-size (the npu default is "
            f"{NPU_BLOCK_SIZE}) or pass --block-size {NPU_BLOCK_SIZE}."
        )
