"""Reference backend in plain PyTorch: runs on CPU and on any torch device.

Paged attention gathers each request's context from the cache into a padded batch and runs
``scaled_dot_product_attention`` with one boolean mask that encodes both the context lengths and
causality within the query. Grouped-query attention folds the query heads that share a KV head
into the query-length axis, so keys and values are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from npuserve.kernels.backends.base import KernelBackend, check_attention_shapes, check_kv_write_shapes
from npuserve.kernels.metadata import AttentionMetadata


class TorchBackend(KernelBackend):
    name = "torch"

    def __init__(self) -> None:
        # (positions, table, dtype, cos, sin) of the last rotary lookup.
        self._rope_cache: (
            tuple[torch.Tensor, torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None
        ) = None

    def prepare(self, metadata: AttentionMetadata) -> None:
        state = metadata.backend_state
        device = metadata.seq_lens.device
        block_size = metadata.block_size
        seq_lens = metadata.seq_lens.long()  # [B]
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()  # [B]
        key_pos = torch.arange(metadata.max_seq_len, device=device)  # [S]
        block_table = metadata.block_table.long()  # [B, NB]
        # [B, S]: cache slot of every context position. NOTE: positions past a request's length
        # read slot 0 of the null block, which is zeroed at allocation and never written: the
        # unwritten tail of a request's last block may hold anything (NaN included), and a NaN
        # value would survive SDPA's mask (0 * NaN), while the null block is always finite.
        slots = block_table[:, key_pos // block_size] * block_size + key_pos % block_size
        state["context_slots"] = torch.where(key_pos < seq_lens[:, None], slots, 0)
        query_pos = torch.arange(metadata.max_query_len, device=device)  # [Q]
        context_lens = seq_lens - query_lens  # [B]
        # [B, Q, S]: query i of request b sees key j iff j <= context_len + i and j < seq_len.
        last_visible = context_lens[:, None, None] + query_pos[None, :, None]  # [B, Q, 1]
        state["mask"] = (key_pos <= last_visible) & (key_pos < seq_lens[:, None, None])
        if metadata.max_query_len > 1 and metadata.num_reqs > 1:
            token_req = torch.repeat_interleave(
                torch.arange(metadata.num_reqs, device=device), query_lens
            )  # [T]
            token_query_pos = (
                torch.arange(metadata.num_tokens, device=device)
                - (metadata.query_start_loc.long()[token_req])
            )  # [T]
            state["token_index"] = (token_req, token_query_pos)
        state["gqa_masks"] = {}

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        num_kv_heads, head_size = check_kv_write_shapes(key, value, kv_cache, metadata)
        slots = metadata.slot_mapping.long()
        kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slots, key)
        kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(0, slots, value)

    def attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_heads, num_kv_heads, head_size = check_attention_shapes(query, kv_cache, metadata)
        if "mask" not in metadata.backend_state:
            self.prepare(metadata)
        state = metadata.backend_state
        group = num_heads // num_kv_heads
        num_reqs, max_q, max_s = metadata.num_reqs, metadata.max_query_len, metadata.max_seq_len

        padded = self._pad_query(query, metadata)  # [B, Q, H, D]
        # [B, Hkv, Q * G, D]: the G query heads of one KV head become extra query rows.
        q = (
            padded.view(num_reqs, max_q, num_kv_heads, group, head_size)
            .permute(0, 2, 1, 3, 4)
            .reshape(num_reqs, num_kv_heads, max_q * group, head_size)
        )
        slots = state["context_slots"].reshape(-1)  # [B * S]
        k = kv_cache[0].view(-1, num_kv_heads, head_size).index_select(0, slots)
        v = kv_cache[1].view(-1, num_kv_heads, head_size).index_select(0, slots)
        k = k.view(num_reqs, max_s, num_kv_heads, head_size).transpose(1, 2)  # [B, Hkv, S, D]
        v = v.view(num_reqs, max_s, num_kv_heads, head_size).transpose(1, 2)
        mask = state["gqa_masks"].get(group)
        if mask is None:
            mask = state["mask"].repeat_interleave(group, dim=1).unsqueeze(1)  # [B, 1, Q * G, S]
            state["gqa_masks"][group] = mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out = (
            out.view(num_reqs, num_kv_heads, max_q, group, head_size)
            .permute(0, 2, 1, 3, 4)
            .reshape(num_reqs, max_q, num_heads, head_size)
        )
        return self._unpad_output(out, metadata)  # [T, H, D]

    @staticmethod
    def _pad_query(query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """[T, H, D] -> [B, Q, H, D]."""
        num_reqs, max_q = metadata.num_reqs, metadata.max_query_len
        if num_reqs == 1 or max_q == 1:  # one request, or decode only: no padding at all
            return query.view(num_reqs, max_q, *query.shape[1:])
        token_req, token_query_pos = metadata.backend_state["token_index"]
        padded = query.new_zeros(num_reqs, max_q, *query.shape[1:])
        padded[token_req, token_query_pos] = query
        return padded

    @staticmethod
    def _unpad_output(out: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """[B, Q, H, D] -> [T, H, D]."""
        if metadata.num_reqs == 1 or metadata.max_query_len == 1:
            return out.reshape(metadata.num_tokens, *out.shape[2:])
        token_req, token_query_pos = metadata.backend_state["token_index"]
        return out[token_req, token_query_pos]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Same arithmetic as Hugging Face's LlamaRMSNorm: normalise in float32, scale in x.dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions, cos_sin_cache, query.dtype)
        return _rotate(query, cos, sin, head_size), _rotate(key, cos, sin, head_size)

    def _cos_sin(
        self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D/2] cos and sin of the step's positions, gathered once and reused by every
        layer (the same ``positions`` tensor comes back in each layer of one forward)."""
        cached = self._rope_cache
        if (
            cached is not None
            and cached[0] is positions
            and cached[1] is cos_sin_cache
            and cached[2] == dtype
        ):
            return cached[3], cached[4]
        cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
        # Like Hugging Face, rotate in the activations' dtype even when the table is float32.
        cos, sin = cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)
        self._rope_cache = (positions, cos_sin_cache, dtype, cos, sin)
        return cos, sin

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> torch.Tensor:
    """x: [T, N * D]; cos, sin: [T, 1, D/2]. Returns [T, N * D]."""
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_size)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.view(num_tokens, -1)
