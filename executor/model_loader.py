"""Builds a model on its device and fills it from a local checkpoint (or random weights).

Checkpoint tensors reach the weight loaders as lazy `SafetensorsSlice`s: each rank of a
tensor-parallel group reads only its own slice of each tensor from disk (``get_slice``), so no
rank ever holds a full tensor it does not keep.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from tqdm import tqdm

from npuserve.executor.config import ConfigError, ModelConfig
from npuserve.executor.dtypes import dtype_name
from npuserve.executor.kv_cache import GIB
from npuserve.executor.layers import LoadedWeight, TensorParallel
from npuserve.executor.models.llama import FUSED_PARAMETERS, CausalLM
from npuserve.kernels import KernelBackend

log = structlog.get_logger(__name__)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those of the shard index if there is one, else every file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index} is malformed ({exc}); re-download the checkpoint") from exc
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(
                f"{model_dir}: shards named in {index.name} are missing: {missing}; "
                "re-download the checkpoint"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{model_dir} holds no *.safetensors weights; convert the checkpoint to safetensors "
            "or pass --load-format dummy for random weights"
        )
    return files


class SafetensorsSlice:
    """One tensor of an open safetensors file, read only when (and as far as) it is needed."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle, self._name = handle, name
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def read(self) -> torch.Tensor:
        return self._handle.get_tensor(self._name)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, LoadedWeight]]:
    """Yields every (name, tensor) of the files, with a progress bar over tensors: each a
    `SafetensorsSlice`, read by the weight loaders."""
    handles = []
    total = 0
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:
            raise ConfigError(
                f"{path} is not a readable safetensors file ({exc}); re-download or re-convert it"
            ) from exc
        handles.append(handle)
        total += len(handle.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", leave=False) as progress:
        for handle in handles:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, SafetensorsSlice(handle, name)
                progress.update(1)


def load_model(
    config: ModelConfig,
    backend: KernelBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    tp: TensorParallel | None = None,
) -> CausalLM:
    start = time.perf_counter()
    with torch.device(device):
        model = CausalLM(config, backend, dtype, tp)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        try:
            files = safetensors_files(config.model_dir)
            loaded = model.load_weights(iterate_safetensors(files))
        except ValueError as exc:  # a tensor without a place, or of the wrong shape
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(
                f"{config.model_dir}: {exc}; the checkpoint does not match its config.json "
                f"({config.architecture}): re-download it or fix config.json"
            ) from exc
        missing = sorted(_checkpoint_name(name) for name in model.expected_weights() - loaded)
        if missing:
            raise ConfigError(
                f"{config.model_dir}: the checkpoint lacks {len(missing)} tensors the model needs, "
                f"e.g. {missing[:3]}; is it complete and of architecture {config.architecture}?"
            )
    model.init_rotary_cache(max_positions)
    model.eval()
    log.info(
        "model loaded",
        model=str(config.model_dir),
        architecture=config.architecture,
        dtype=dtype_name(dtype),
        device=str(device),
        load_format=load_format,
        tp_rank=model.tp.rank,
        tp_size=model.tp.size,
        parameters=sum(p.numel() for p in model.parameters()),
        weight_gib=round(weight_bytes(model) / GIB, 4),
        seconds=round(time.perf_counter() - start, 2),
    )
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _checkpoint_name(name: str) -> str:
    """A part of a fused parameter (``...qkv_proj.weight#k``) as the checkpoint names it
    (``...k_proj.weight``), so a user can look for it in the checkpoint."""
    target, _, shard = name.partition("#")
    for part, (fused, shard_id) in FUSED_PARAMETERS.items():
        if shard == str(shard_id) and fused in target:
            return target.replace(fused, part)
    return name


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights for benchmarks: normal(0, initializer_range), norms at one."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    std = model.config.initializer_range
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0, std, generator=generator)
            param.copy_(values)
