"""Linear and embedding layers whose weight loaders place each checkpoint tensor in its shard.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id)``: fused projections
(q|k|v, gate|up) are filled piece by piece from the checkpoint's separate tensors, and each rank
of a tensor-parallel group narrows a tensor to its own slice while loading, so no rank ever
holds the full model. With ``TensorParallel()`` (one rank) the slices are whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

WeightLoader = Callable[[nn.Parameter, torch.Tensor, "int | str | None"], None]


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def shard(self, size: int, what: str) -> int:
        if size % self.size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor parallel size {self.size}")
        return size // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x)
        return x


def _new_parameter(shape: Sequence[int], dtype: torch.dtype, loader: WeightLoader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} into {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    copy_checked(param.data, loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features of every part split across ranks.

    ``output_sizes`` lists the parts fused into one matmul (e.g. gate | up); the checkpoint
    tensor of part ``i`` is loaded with ``shard_id=i``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.local_sizes = [tp.shard(size, "output size") for size in output_sizes]
        self.weight = _new_parameter((sum(self.local_sizes), input_size), dtype, self.weight_loader)
        self.bias = _new_parameter((sum(self.local_sizes),), dtype, self.weight_loader) if bias else None

    def _local_range(self, shard_id: int | str | None) -> tuple[int, int]:
        index = int(shard_id or 0)
        start = sum(self.local_sizes[:index])
        return start, self.local_sizes[index]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        start, size = self._local_range(shard_id)
        # This rank's rows of the checkpoint tensor, into this part's rows of the fused weight.
        rows = loaded.narrow(0, self.tp.rank * size, size)
        copy_checked(param.data.narrow(0, start, size), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out_local]
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Queries, keys and values in one matmul; shard ids "q", "k", "v"."""

    SHARDS: ClassVar[dict[str, int]] = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallel,
    ) -> None:
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, dtype, tp)

    def _local_range(self, shard_id: int | str | None) -> tuple[int, int]:
        return super()._local_range(self.SHARDS[str(shard_id)])


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input features split across ranks and the partial sums reduced."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.tp = tp
        self.local_input_size = tp.shard(input_size, "input size")
        self.weight = _new_parameter((output_size, self.local_input_size), dtype, self.weight_loader)
        self.bias = _new_parameter((output_size,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        columns = loaded.narrow(1, self.tp.rank * self.local_input_size, self.local_input_size)
        default_weight_loader(param, columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_local] -> [T, out]
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Token embeddings; also serves as the LM head when the checkpoint ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _new_parameter((vocab_size, hidden_size), dtype, default_weight_loader)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(token_ids, self.weight)


class RMSNormWeight(nn.Module):
    """Holds an RMSNorm's scale; the kernel backend applies it."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _new_parameter((size,), dtype, default_weight_loader)
