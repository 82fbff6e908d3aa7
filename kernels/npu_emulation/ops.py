"""The torch_npu operators npuserve calls, emulated on the CPU: check, then compute.

Every operator first checks its arguments against `contracts` and then computes its result in
plain torch, request by request in float32, the way the operator's documentation defines it.
Nothing here shares code with the torch kernel backend, so comparing the two tests both.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from npuserve.kernels.npu_emulation import contracts


def reshape_and_cache(
    key: torch.Tensor,  # [T, N, D]
    value: torch.Tensor,  # [T, N, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, N, D], written in place
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,  # [T] int32
) -> None:
    contracts.check_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_indices.tolist()):
        if slot < 0:  # ATB-RC test reference: a negative slot is skipped
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[token]
        value_cache[block, offset] = value[token]


def fused_infer_attention_score(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [num_blocks, block_size, Hkv * D]
    value: torch.Tensor,
    **kwargs: Any,  # the operator's, with its defaults: `contracts.check_fused_infer_attention`
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(attention_out [T, H, D], softmax_lse)``; softmax_lse is the (1,) zero tensor the
    operator returns without ``softmax_lse_flag`` (FIA "返回值说明")."""
    query_ends, kv_lens = contracts.check_fused_infer_attention(query, key, value, **kwargs)
    out = _paged_attention(query, key, value, kwargs, query_ends, kv_lens)
    return out, torch.zeros(1, dtype=query.dtype)


def _paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [num_blocks, block_size, Hkv * D], checked
    value: torch.Tensor,
    kwargs: dict[str, Any],  # the operator's: ``block_table`` [B, max_blocks_per_seq], ``scale``
    query_ends: list[int],
    kv_lens: list[int],
) -> torch.Tensor:  # [T, H, D]
    block_table, scale = kwargs["block_table"], kwargs.get("scale", 1.0)
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size = key.shape[1]
    kv_heads = key.shape[2] // head_size
    group = num_heads // kv_heads
    out = torch.empty_like(query)
    starts = [0, *query_ends[:-1]]
    for req, (start, end, kv_len) in enumerate(zip(starts, query_ends, kv_lens, strict=True)):
        q_len = end - start
        if q_len == 0:
            continue
        blocks = block_table[req, : -(-kv_len // block_size)].long()
        # [kv_len, Hkv, D]: the request's keys and values, block after block.
        k = key[blocks].reshape(-1, kv_heads, head_size)[:kv_len].float()
        v = value[blocks].reshape(-1, kv_heads, head_size)[:kv_len].float()
        q = query[start:end].float()  # [q_len, H, D]
        # Query head h reads kv head h // group (FIA "GQA").
        k = k.repeat_interleave(group, dim=1).permute(1, 2, 0)  # [H, D, kv_len]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv_len, D]
        scores = torch.matmul(q.transpose(0, 1), k) * scale  # [H, q_len, kv_len]
        # sparse_mode 3, right-down causal: query row i (of q_len) sees keys 0..kv_len - q_len + i.
        rows = torch.arange(q_len).unsqueeze(1)
        cols = torch.arange(kv_len).unsqueeze(0)
        masked = cols > rows + (kv_len - q_len)  # [q_len, kv_len]
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)  # [q_len, H, D]
    return out


def fused_infer_attention_score_out(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,
    value: torch.Tensor,
    **kwargs: Any,  # the operator's, ``workspace`` and ``out``
) -> list[torch.Tensor] | tuple[torch.Tensor, torch.Tensor]:
    """``npu_fused_infer_attention_score.out``: the same call, written into ``out =
    [attention_out, softmax_lse]``, with the scratch memory of a workspace query (VA
    ``full_graph_fia``). Returns ``out``."""
    query_ends, kv_lens = check_fused_infer_attention_score_out(query, key, value, **kwargs)
    attention_out, softmax_lse = out = kwargs["out"]
    attention_out.copy_(_paged_attention(query, key, value, kwargs, query_ends, kv_lens))
    softmax_lse.view(-1)[:1].zero_()  # what the operator returns without softmax_lse_flag
    return out


def check_fused_infer_attention_score_out(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    workspace: torch.Tensor | None = None,
    out: list[torch.Tensor] | tuple[torch.Tensor, torch.Tensor],
    **kwargs: Any,
) -> tuple[list[int], list[int]]:
    """The checks of `fused_infer_attention_score_out`: the operator's, and what the ``.out``
    form checks beyond them; returns (cumulative query ends, per-request kv lengths)."""
    op = "npu_fused_infer_attention_score.out"
    contracts.require(len(out) == 2, op, "out must be [attention_out, softmax_lse]")
    attention_out = out[0]
    contracts.require(
        attention_out.shape == query.shape and attention_out.dtype == query.dtype,
        op,
        f"attention_out {tuple(attention_out.shape)} {attention_out.dtype} must be like the query",
    )
    if workspace is not None:
        needed = fused_attention_workspace_bytes(query, kwargs)
        contracts.require(
            workspace.dtype == torch.uint8 and workspace.dim() == 1 and workspace.numel() >= needed,
            op,
            f"workspace of {workspace.numel()} bytes, {needed} needed: query it with "
            "_npu_fused_infer_attention_score_get_max_workspace for the longest lengths",
        )
    return contracts.check_fused_infer_attention(query, key, value, **kwargs)


def fused_infer_attention_score_max_workspace(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """``_npu_fused_infer_attention_score_get_max_workspace``: [bytes] uint8, enough for every
    call like this one whose kv lengths fit its block table (VA ``full_graph_fia``)."""
    contracts.check_fused_infer_attention(query, key, value, **kwargs)
    block_table = kwargs["block_table"]
    capacity = block_table.shape[1] * kwargs["block_size"]
    longest = dict(kwargs, actual_seq_lengths_kv=[capacity] * len(kwargs["actual_seq_lengths_kv"]))
    return torch.empty(fused_attention_workspace_bytes(query, longest), dtype=torch.uint8)


def fused_attention_workspace_bytes(query: torch.Tensor, kwargs: dict[str, Any]) -> int:
    """INFERRED (no source states the size): scratch for split-KV partial results, one float32
    row per query token, head and 128-key tile of the longest request, plus 64 bytes a request."""
    kv_lens = kwargs["actual_seq_lengths_kv"]
    tiles = -(-max(kv_lens) // 128)
    return 4 * query.shape[0] * query.shape[1] * tiles + 64 * len(kv_lens)


def rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS "计算公式": ``y = x / sqrt(mean(x^2) + eps) * gamma``; returns ``(y, rstd)``, rstd float32
    shaped like x with the normalised dims kept as 1."""
    contracts.check_rms_norm(x, gamma)
    return _rms(x.float(), gamma, epsilon, x.dtype)


def _rms(
    x32: torch.Tensor, gamma: torch.Tensor, epsilon: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    dims = tuple(range(x32.dim() - gamma.dim(), x32.dim()))
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(dtype), rstd


def add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ADD-RMS: ``x = x1 + x2``; returns ``(rms_norm(x), rstd, x)``, x in x1's dtype."""
    contracts.check_add_rms_norm(x1, x2, gamma)
    summed32 = x1.float() + x2.float()
    y, rstd = _rms(summed32, gamma, epsilon, x1.dtype)
    return y, rstd, summed32.to(x1.dtype)


def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SWIGLU: the input halved along ``dim`` into ``a | b``; returns ``silu(a) * b``."""
    contracts.check_swiglu(x, dim)
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


class RotaryEmbedding:
    """``_npu_rotary_embedding``, with the operator's process-wide table.

    ATB-ROPE (RopeAtb.cpp): the first call copies ``cos_sin_cache`` into static cos/sin tables
    and every later call reuses them, whatever table it passes; the emulation does the same.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, H * D], rotated in place
        key: torch.Tensor,  # [T, Hkv * D], rotated in place
        head_size: int,
        cos_sin_cache: torch.Tensor,  # [P, D]: cos | sin
        is_neox_style: bool,
    ) -> None:
        contracts.check_rotary_embedding(positions, query, key, head_size, cos_sin_cache)
        with self._lock:
            if self._cos_sin is None:
                cos, sin = cos_sin_cache.chunk(2, dim=-1)
                self._cos_sin = (cos.clone(), sin.clone())
            cos, sin = self._cos_sin
        index = positions.flatten().long()
        cos_t, sin_t = cos[index].float(), sin[index].float()  # [T, D/2]
        for tensor in (query, key):
            heads = tensor.view(tensor.shape[0], -1, head_size)
            rotated = _rotate(heads.float(), cos_t.unsqueeze(1), sin_t.unsqueeze(1), is_neox_style)
            heads.copy_(rotated.to(tensor.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x: [T, N, D] float32; cos, sin: [T, 1, D/2]."""
    if neox:  # halves: (x1, x2) = (x[:D/2], x[D/2:])
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # GPT-J style: interleaved pairs
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
