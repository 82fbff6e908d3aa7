"""Linear and embedding layers whose weight loaders place each checkpoint tensor in its shard.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id)``: fused projections
(q|k|v, gate|up) are filled piece by piece from the checkpoint's separate tensors, and each rank
of a tensor-parallel group narrows a tensor to its own slice while loading, so no rank ever
holds the full model. A loaded weight is a tensor or a lazy `CheckpointSlice`, which reads only
the narrowed part from disk. With ``TensorParallel()`` (one rank) the slices are whole tensors.

Sharding over ``N`` ranks: column-parallel layers split their output features, row-parallel
layers their input features (then all-reduce); the vocabulary is split into ``ceil(V / N)`` rows
per rank (the last rank's tail padded with zeros); KV heads are split, or, with fewer KV heads
than ranks, each rank keeps the one KV head its query heads use (rank ``r``: ``r * Hkv // N``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class CheckpointSlice(Protocol):
    """A checkpoint tensor not yet read: its shape, and reads of all of it or of one slice."""

    @property
    def shape(self) -> torch.Size: ...

    def read(self) -> torch.Tensor: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


LoadedWeight = torch.Tensor | CheckpointSlice
WeightLoader = Callable[[nn.Parameter, LoadedWeight, "int | str | None"], None]


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in its tensor-parallel group (the default process group)."""

    rank: int = 0
    size: int = 1

    def shard(self, size: int, what: str) -> int:
        if size % self.size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor parallel size {self.size}")
        return size // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds, out of ``num_kv_heads``.

        NOTE: with fewer KV heads than ranks each KV head is replicated on ``size / Hkv``
        consecutive ranks, whose query heads are exactly that head's group.
        """
        if num_kv_heads >= self.size:
            count = self.shard(num_kv_heads, "num_key_value_heads")
            return self.rank * count, count
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor parallel size {self.size} is not a multiple of num_key_value_heads "
                f"({num_kv_heads}), so KV heads cannot be replicated evenly"
            )
        return self.rank * num_kv_heads // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # in place: the sum over ranks
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [..., n] -> [..., size * n]
        """Every rank's ``x`` concatenated along the last dim, in rank order, on every rank.

        NOTE: the list form of all_gather, which gloo, nccl and hccl all implement.
        """
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x)
        return torch.cat(parts, dim=-1)


def _new_parameter(shape: Sequence[int], dtype: torch.dtype, loader: WeightLoader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def copy_checked(target: torch.Tensor, loaded: LoadedWeight) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} into {tuple(target.shape)}")
    target.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded.read())


def narrow_checked(loaded: LoadedWeight, dim: int, full_size: int, start: int, length: int) -> torch.Tensor:
    """``loaded[start : start + length]`` along ``dim`` of a tensor that must be ``full_size`` there."""
    if len(loaded.shape) <= dim or loaded.shape[dim] != full_size:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} where {full_size} along dim {dim} is expected"
        )
    return loaded.narrow(dim, start, length)


def default_weight_loader(param: nn.Parameter, loaded: LoadedWeight, shard_id: object = None) -> None:
    copy_checked(param.data, loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features of every part split across ranks.

    ``output_sizes`` lists the parts fused into one matmul (e.g. gate | up); the checkpoint
    tensor of part ``i`` is loaded with ``shard_id=i``. ``local_parts`` overrides the even
    split: (first checkpoint row, rows) of each part on this rank.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallel,
        local_parts: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        if local_parts is None:
            sizes = [tp.shard(size, "output size") for size in output_sizes]
            local_parts = [(tp.rank * size, size) for size in sizes]
        self.output_sizes = list(output_sizes)
        self.source_starts = [start for start, _ in local_parts]
        self.local_sizes = [size for _, size in local_parts]
        self.weight = _new_parameter((sum(self.local_sizes), input_size), dtype, self.weight_loader)
        self.bias = _new_parameter((sum(self.local_sizes),), dtype, self.weight_loader) if bias else None

    def _part(self, shard_id: int | str | None) -> int:
        return int(shard_id or 0)

    def weight_loader(
        self, param: nn.Parameter, loaded: LoadedWeight, shard_id: int | str | None = None
    ) -> None:
        index = self._part(shard_id)
        start, size = sum(self.local_sizes[:index]), self.local_sizes[index]
        # This rank's rows of the checkpoint tensor, into this part's rows of the fused weight.
        rows = narrow_checked(loaded, 0, self.output_sizes[index], self.source_starts[index], size)
        copy_checked(param.data.narrow(0, start, size), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out_local]
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Queries, keys and values in one matmul; shard ids "q", "k", "v".

    Query heads are split across ranks; KV heads are split too, or replicated (`kv_heads`).
    """

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
        q_size = tp.shard(num_heads, "num_attention_heads") * head_dim
        first_kv, num_local_kv = tp.kv_heads(num_kv_heads)
        kv_part = (first_kv * head_dim, num_local_kv * head_dim)
        parts = [(tp.rank * q_size, q_size), kv_part, kv_part]
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, dtype, tp, parts)

    def _part(self, shard_id: int | str | None) -> int:
        return self.SHARDS[str(shard_id)]


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input features split across ranks and the partial sums reduced."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.local_input_size = tp.shard(input_size, "input size")
        self.weight = _new_parameter((output_size, self.local_input_size), dtype, self.weight_loader)
        self.bias = _new_parameter((output_size,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: object = None) -> None:
        start, size = self.tp.rank * self.local_input_size, self.local_input_size
        columns = narrow_checked(loaded, 1, self.input_size, start, size)
        default_weight_loader(param, columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_local] -> [T, out]
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Token embeddings split by vocabulary rows; also the LM head (`logits`), tied or not.

    Rank ``r`` holds rows ``[r * Vr, (r + 1) * Vr)`` with ``Vr = ceil(V / N)``; rows past ``V``
    are zero padding. A lookup gives zeros for ids outside the rank's rows and the all-reduce
    fills them in; the LM head computes its rows' logits and all-gathers the full vocabulary.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab_size = -(-vocab_size // self.tp.size)  # Vr
        self.vocab_start = self.tp.rank * self.local_vocab_size
        # Rows of this rank that are real tokens (fewer than Vr on the last ranks when padded).
        self.num_real_rows = max(0, min(self.local_vocab_size, vocab_size - self.vocab_start))
        self.weight = _new_parameter((self.local_vocab_size, hidden_size), dtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: object = None) -> None:
        real = self.num_real_rows
        copy_checked(param.data[:real], narrow_checked(loaded, 0, self.vocab_size, self.vocab_start, real))
        param.data[real:].zero_()

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local_ids = token_ids - self.vocab_start  # [T]
        outside = (local_ids < 0) | (local_ids >= self.local_vocab_size)  # [T]
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)  # [T, hidden]
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, V]
        """The full vocabulary's logits on every rank."""
        local = F.linear(hidden, self.weight)  # [B, Vr]
        return self.tp.all_gather(local)[:, : self.vocab_size]


class RMSNormWeight(nn.Module):
    """Holds an RMSNorm's scale; the kernel backend applies it."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _new_parameter((size,), dtype, default_weight_loader)
