"""Paged-attention and fused ops behind one small API, with a backend per device family."""

from __future__ import annotations

from typing import Protocol

from npuserve.kernels.backends.base import KernelBackend
from npuserve.kernels.layout import NPU_BLOCK_SIZE, kv_cache_block_bytes, kv_cache_shape, slot_mapping
from npuserve.kernels.metadata import AttentionMetadata, build_attention_metadata
from npuserve.proto.kv_layout import NULL_BLOCK_ID, cdiv

__all__ = [
    "NPU_BLOCK_SIZE",
    "NULL_BLOCK_ID",
    "AttentionMetadata",
    "KernelBackend",
    "build_attention_metadata",
    "cdiv",
    "get_backend",
    "kv_cache_block_bytes",
    "kv_cache_shape",
    "slot_mapping",
]


class DeviceKind(Protocol):
    """Anything with a device ``type`` ("npu", "cuda", "cpu"), such as the executor's target."""

    @property
    def type(self) -> str: ...


def get_backend(device: DeviceKind) -> KernelBackend:
    """The backend for a torch.device or the executor's target: torch_npu operators on Ascend
    (emulated ones too: a target's ``type`` is its kind), plain PyTorch elsewhere."""
    if device.type == "npu":
        from npuserve.kernels.backends.npu_backend import NpuBackend

        return NpuBackend()
    from npuserve.kernels.backends.torch_backend import TorchBackend

    return TorchBackend()
