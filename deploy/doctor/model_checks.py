"""Checks of a model against the device: architecture, head_dim, dtype, weights and KV cache.

Nothing is loaded: the shapes come from config.json and the safetensors headers, and the KV
arithmetic is the executor's own (`executor.kv_cache`). On an NPU the free memory is what
`npu-smi` reports now; the step activations the executor measures at start-up are not known
here, so the KV figure is an upper bound.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from npuserve.deploy.doctor.report import Check, fail, ok, warn
from npuserve.deploy.flag_table import same_named
from npuserve.executor.config import ConfigError, ExecutorConfig, ModelConfig
from npuserve.executor.kv_cache import CPU_DEFAULT_KV_CACHE_GIB, GIB, block_bytes, num_blocks_for_budget
from npuserve.executor.layers import TensorParallel
from npuserve.executor.model_loader import safetensors_files
from npuserve.executor.platform import DTYPE_NAMES
from npuserve.kernels.layout import NPU_ATTENTION_HEAD_DIMS, NPU_BLOCK_SIZE

MIB = 1 << 20
UNDOCUMENTED_HEAD_DIM = 64  # in NPU_ATTENTION_HEAD_DIMS: runs, by vllm-ascend's CI, but no doc says so


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What the model may use on the device, in bytes (None: unknown)."""

    total: int | None
    free: int | None
    what: str  # "NPU 0 memory", "host memory"
    is_310: bool = False


def model_checks(args: argparse.Namespace, device: str, memory: DeviceMemory) -> list[Check]:
    """``--model`` on ``device`` ("cpu", "cuda" or "npu": auto already resolved), as the doctor's
    flags would serve it."""
    try:
        named = same_named(ExecutorConfig, args)  # the executor's flags the doctor takes
        config = ExecutorConfig(**{**named, "device": device, "kv_cache_memory_gib": args.kv_cache_memory})
        model = ModelConfig.from_pretrained(config.model)
        max_model_len = config.resolve_max_model_len(model)
    except ConfigError as exc:
        return [fail("model", str(exc), _fix_of(str(exc)))]
    checks = [ok("model", f"{model.architecture}, {model.num_layers} layers, max_model_len {max_model_len}")]
    checks.append(_head_dim_check(model, device))
    dtype_check, dtype_name = _dtype_check(model, config, memory.is_310)
    checks.append(dtype_check)
    if dtype_name is None:
        return checks
    itemsize = DTYPE_NAMES[dtype_name].itemsize
    weights = _weight_check(model, itemsize, memory)
    checks.append(weights[0])
    if weights[1] is not None:
        checks.append(_kv_check(model, config, max_model_len, DTYPE_NAMES[dtype_name], weights[1], memory))
    return checks


def _fix_of(message: str) -> str:
    """ConfigError messages end with their fix after a ';' (or name it); repeat the last clause."""
    return message.rsplit(";", 1)[-1].strip() if ";" in message else "see the message"


def _head_dim_check(model: ModelConfig, device: str) -> Check:
    detail = f"head_dim {model.head_dim} ({model.num_heads} query / {model.num_kv_heads} KV heads)"
    if device == "npu" and model.head_dim not in NPU_ATTENTION_HEAD_DIMS:
        allowed = " or ".join(map(str, NPU_ATTENTION_HEAD_DIMS))
        return fail(
            "head_dim",
            f"{detail}: the NPU fused attention (npu_fused_infer_attention_score, TND layout) takes "
            f"head_dim {allowed} only; the first request would fail with error 561002",
            f"serve a model with head_dim {allowed} on the NPU, or this one with --device cpu",
        )
    if device == "npu" and model.head_dim == UNDOCUMENTED_HEAD_DIM:
        return warn(
            "head_dim",
            f"{detail}: served, but not in the NPU fused attention's docs: op-plugin's "
            "npu_fused_infer_attention_score doc allows head_dim 128 (or 192) for the TND layout without "
            "rope, its _v2 doc 64 for MHA only; vllm-ascend's CI serves Qwen2.5-0.5B-Instruct "
            "(head_dim 64, GQA) through it (v0.13.0 tests/e2e/doctests/001-quickstart-test.sh)",
            "if the first request fails with error 561002, serve a head_dim-128 model on the NPU",
        )
    return ok("head_dim", detail)


def _dtype_check(model: ModelConfig, config: ExecutorConfig, is_310: bool) -> tuple[Check, str | None]:
    checkpoint = (model.torch_dtype or "float32").removeprefix("torch.")
    choice = config.dtype.strip().lower().removeprefix("torch.")
    name = checkpoint if choice == "auto" else choice
    if name not in DTYPE_NAMES:
        return fail("dtype", f"unknown dtype {name!r}", "pass --dtype bfloat16 | float16 | float32"), None
    name = str(DTYPE_NAMES[name]).removeprefix("torch.")
    half = "float16" if is_310 else "bfloat16"
    if config.device == "npu" and name == "float32":
        if choice == "auto":
            return ok("dtype", f"checkpoint float32, served as {half} on the NPU"), half
        return fail("dtype", "float32 does not run on the NPU kernels", f"--dtype {half}"), None
    if config.device == "npu" and is_310 and name == "bfloat16":
        return fail("dtype", "Ascend 310P has no bfloat16", "--dtype float16"), None
    if config.device == "cpu" and name == "float16" and choice == "auto":
        return ok("dtype", "checkpoint float16, served as bfloat16 on the CPU"), "bfloat16"
    return ok("dtype", f"{name} (checkpoint {checkpoint})"), name


def checkpoint_numel(model_dir: Path) -> int:
    """Elements of every tensor in the checkpoint, from the safetensors headers only."""
    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                total += math.prod(handle.get_slice(name).get_shape())
    return total


def _weight_check(model: ModelConfig, itemsize: int, memory: DeviceMemory) -> tuple[Check, int | None]:
    try:
        weights = checkpoint_numel(model.model_dir) * itemsize
    except ConfigError as exc:
        return fail("weights", str(exc), "convert the checkpoint to safetensors"), None
    room = "unknown" if memory.free is None else f"{_gib(memory.free)} free of {_gib(memory.total)}"
    detail = f"{_gib(weights)} of weights; {memory.what}: {room}"
    if memory.free is not None and weights > memory.free:
        return (
            fail(
                "weights",
                detail,
                "free the device (other processes hold its memory), use a smaller model or a "
                "lower-precision --dtype, or split it with --tensor-parallel-size",
            ),
            weights,
        )
    return ok("weights", detail), weights


def _kv_check(
    model: ModelConfig,
    config: ExecutorConfig,
    max_model_len: int,
    dtype: object,
    weights: int,
    memory: DeviceMemory,
) -> Check:
    device = config.device
    block_size = config.block_size or (NPU_BLOCK_SIZE if device == "npu" else 16)
    per_block = block_bytes(model, block_size, dtype, TensorParallel())  # type: ignore[arg-type]
    if config.kv_cache_memory_gib is not None:
        budget, how = int(config.kv_cache_memory_gib * GIB), f"--kv-cache-memory {config.kv_cache_memory_gib}"
    elif device == "cpu":
        budget, how = CPU_DEFAULT_KV_CACHE_GIB * GIB, f"the CPU default {CPU_DEFAULT_KV_CACHE_GIB} GiB"
    elif memory.total is None or memory.free is None:
        return warn(
            "kv cache",
            f"{memory.what} is unknown: cannot size the KV cache",
            "run where `npu-smi info` works",
        )
    else:
        in_use = memory.total - memory.free + weights
        budget = int(memory.total * config.gpu_memory_utilization) - in_use
        how = f"--gpu-memory-utilization {config.gpu_memory_utilization} of {_gib(memory.total)}, before activations"
    try:
        num_blocks = num_blocks_for_budget(budget, per_block, block_size, max_model_len)
    except ConfigError as exc:
        return fail("kv cache", str(exc), _fix_of(str(exc)))
    tokens = (num_blocks - 1) * block_size
    detail = (
        f"{_gib(budget)} ({how}) holds {tokens} tokens in {num_blocks - 1} blocks of {block_size}: "
        f"{tokens / max_model_len:.1f} sequences of --max-model-len {max_model_len}"
    )
    if device == "cpu" and memory.free is not None and budget + weights > memory.free:
        return warn(
            "kv cache",
            f"{detail}; more than the {_gib(memory.free)} of free host memory",
            "lower --kv-cache-memory",
        )
    return ok("kv cache", detail)


def _gib(value: int | None) -> str:
    if value is None:
        return "unknown"
    return f"{value / GIB:.2f} GiB" if abs(value) >= GIB // 10 else f"{value / MIB:.2f} MiB"
