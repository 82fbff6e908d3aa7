"""The kernel API the model calls. Backends implement it; shapes are asserted here, once."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from npuserve.kernels.metadata import AttentionMetadata
from npuserve.kernels.staging import DeviceTransfers, HostTransfers


class KernelBackend(ABC):
    """Attention, cache and elementwise ops over a flat batch of ``T`` tokens (``TND`` layout)."""

    name: str

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Derive per-step state once (stored in ``metadata.backend_state``) for all layers."""

    def host_transfers(self, device: torch.device) -> HostTransfers | None:
        """Pinned host memory and asynchronous copies to ``device``; None where the device is
        the host (the CPU)."""
        return None if device.type == "cpu" else DeviceTransfers(getattr(torch, device.type))

    def update_graph_attention(  # noqa: B027 - optional hook
        self, captured: list[Any], metadata: AttentionMetadata
    ) -> None:
        """Before a graph replay: gives the attention calls it captured (``captured``, what
        `attention` recorded in ``metadata.graph_attention`` while capturing) the host-side
        arguments of this replay's step (``metadata``: its host lengths). A backend whose
        attention reads every length from device tensors has nothing to do."""

    @abstractmethod
    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> None: ...

    @abstractmethod
    def attention(
        self,
        query: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal attention of each request's query tokens over its whole cached context."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rms_norm(x + residual), x + residual)``."""

    @abstractmethod
    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, H * D]
        key: torch.Tensor,  # [T, Hkv * D]
        head_size: int,
        cos_sin_cache: torch.Tensor,  # [max_positions, D], cos | sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half (GPT-NeoX style) rotary embedding of queries and keys."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * I] laid out ``gate | up``; returns ``silu(gate) * up``: [T, I]."""


def check_attention_shapes(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
) -> tuple[int, int, int]:
    """Asserts the attention contract; returns (num_heads, num_kv_heads, head_size)."""
    assert query.dim() == 3 and query.shape[0] == metadata.num_tokens, query.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[2] == metadata.block_size, (kv_cache.shape, metadata.block_size)
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    assert kv_cache.shape[4] == head_size and num_heads % num_kv_heads == 0
    return num_heads, num_kv_heads, head_size


def check_kv_write_shapes(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
) -> tuple[int, int]:
    """Asserts the cache-write contract; returns (num_kv_heads, head_size)."""
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    assert key.shape == (metadata.num_tokens, num_kv_heads, head_size), key.shape
    assert value.shape == key.shape, value.shape
    return num_kv_heads, head_size
