"""Reference backend in plain PyTorch: runs on CPU and on any torch device.

Paged attention gathers each request's context from the cache. The decodes of a step (one query
token each) run as one padded batch: ``scaled_dot_product_attention`` with one boolean mask
that encodes the context lengths; grouped-query attention folds the query heads that share a KV
head into the query-length axis there, so keys and values are never repeated. Longer queries
(prefill chunks) run one request at a time, causal from the bottom right of their context
(SDPA's own causal kernel for a prompt's first chunk): padded together they would cost
B * Q_max * S_max of masked scores, where alone they cost the sum of their Q * S.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        """The step's decodes as one padded batch, and each longer query on its own.

        NOTE: padding requests to the longest query costs B * Q_max * S_max in SDPA, all of it
        materialized as masked scores: a decode next to a 300-token prefill chunk would be padded
        to 300 query rows, and 32 prompts of 128-384 tokens cost 110 ms a layer on 2 cores
        (stories260K) against about 18 ms one by one.
        """
        block_table = metadata.block_table.long()  # [B, NB]
        if metadata.is_decode_only:
            metadata.backend_state["batches"] = [_decode_batch(metadata, block_table, None)]
            metadata.backend_state["chunks"] = []
            return
        decodes = [i for i, n in enumerate(metadata.query_lens_host) if n == 1]
        metadata.backend_state["batches"] = [_decode_batch(metadata, block_table, decodes)] if decodes else []
        metadata.backend_state["chunks"] = _query_chunks(metadata, block_table)

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
        _, num_kv_heads, _ = check_attention_shapes(query, kv_cache, metadata)
        if "batches" not in metadata.backend_state:
            self.prepare(metadata)
        batches: list[_DecodeBatch] = metadata.backend_state["batches"]
        chunks: list[_QueryChunk] = metadata.backend_state["chunks"]
        if not chunks:
            return _attend(query, kv_cache, batches[0], num_kv_heads, scale)
        out = torch.empty_like(query)  # [T, H, D]
        for batch in batches:
            assert batch.token_rows is not None
            rows = query.index_select(0, batch.token_rows)  # [B_d, H, D]
            out.index_copy_(0, batch.token_rows, _attend(rows, kv_cache, batch, num_kv_heads, scale))
        for chunk in chunks:
            end = chunk.row_start + chunk.num_rows
            out[chunk.row_start : end] = _attend_chunk(
                query[chunk.row_start : end], kv_cache, chunk, num_kv_heads, scale
            )
        return out

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
        # [T, 1, D/2] cos and sin of the step's positions, gathered once and reused by every
        # layer (the same ``positions`` tensor comes back in each layer of one forward).
        cached, dtype = self._rope_cache, query.dtype
        if (
            cached is not None
            and cached[0] is positions
            and cached[1] is cos_sin_cache
            and cached[2] == dtype
        ):
            cos, sin = cached[3], cached[4]
        else:
            cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
            # Like Hugging Face, rotate in the activations' dtype even when the table is float32.
            cos, sin = cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)
            self._rope_cache = (positions, cos_sin_cache, dtype, cos, sin)
        return _rotate(query, cos, sin, head_size), _rotate(key, cos, sin, head_size)

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


@dataclass
class _DecodeBatch:
    """The decodes of a step (one query token each) padded into one SDPA batch: ``B`` requests
    and ``S`` key positions each."""

    token_rows: torch.Tensor | None  # [B] the step's query row of each (None: every row, in order)
    context_slots: torch.Tensor  # [B, S] cache slot of every key position
    mask: torch.Tensor  # [B, S] key j is in request b's context


def _key_slots(block_table: torch.Tensor, key_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_table: [..., NB], key_pos: [S] -> [..., S], the cache slot of each key position."""
    return block_table[..., key_pos // block_size] * block_size + key_pos % block_size


def _decode_batch(
    metadata: AttentionMetadata, block_table: torch.Tensor, requests: list[int] | None
) -> _DecodeBatch:
    """The batch of the decodes ``requests`` (indices into the step's requests; None: every
    request, a step of decodes alone); ``block_table``: [B, NB] the step's, as int64."""
    device = metadata.seq_lens.device
    block_size = metadata.block_size
    seq_lens = metadata.seq_lens.long()  # [B]
    token_rows = None
    max_s = metadata.max_seq_len
    if requests is not None:
        max_s = max(metadata.seq_lens_host[i] for i in requests)
        index = torch.tensor(requests, device=device)  # [B_d]
        token_rows = metadata.query_start_loc.long()[index]  # a decode's one query row
        seq_lens = seq_lens[index]
        block_table = block_table[index, : -(-max_s // block_size)]
    key_pos = torch.arange(max_s, device=device)  # [S]
    mask = key_pos < seq_lens[:, None]  # [B, S]
    # NOTE: positions past a request's length read slot 0 of the null block, which is zeroed at
    # allocation and never written: the unwritten tail of a request's last block may hold
    # anything (NaN included), and a NaN value would survive SDPA's mask (0 * NaN), while the
    # null block is always finite.
    context_slots = torch.where(mask, _key_slots(block_table, key_pos, block_size), 0)
    return _DecodeBatch(token_rows, context_slots, mask)


@dataclass(slots=True)
class _QueryChunk:
    """One request's query of more than one token (a prefill chunk), attended on its own."""

    row_start: int  # its first row among the step's query tokens
    num_rows: int  # Q: its query tokens
    context_slots: torch.Tensor  # [S] cache slot of every key position, its new tokens' included
    mask: torch.Tensor | None  # [Q, S] causal from the bottom right; None when Q == S (no context)


def _query_chunks(metadata: AttentionMetadata, block_table: torch.Tensor) -> list[_QueryChunk]:
    """Every request of the step whose query is longer than one token; ``block_table``: [B, NB]
    the step's, as int64."""
    block_size = metadata.block_size
    device = block_table.device
    chunks = []
    row_start = 0
    for index, (num_rows, seq_len) in enumerate(
        zip(metadata.query_lens_host, metadata.seq_lens_host, strict=True)
    ):
        if num_rows > 1:
            key_pos = torch.arange(seq_len, device=device)  # [S]
            slots = _key_slots(block_table[index], key_pos, block_size)
            mask = None
            if num_rows < seq_len:  # query i sees keys up to its own position, context + i
                mask = torch.ones(num_rows, seq_len, dtype=torch.bool, device=device).tril(seq_len - num_rows)
            chunks.append(_QueryChunk(row_start, num_rows, slots, mask))
        row_start += num_rows
    return chunks


def _attend_chunk(
    query: torch.Tensor, kv_cache: torch.Tensor, chunk: _QueryChunk, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """query: [Q, H, D], one request's query rows -> [Q, H, D]."""
    head_size = query.shape[2]
    k = kv_cache[0].view(-1, num_kv_heads, head_size).index_select(0, chunk.context_slots)  # [S, Hkv, D]
    v = kv_cache[1].view(-1, num_kv_heads, head_size).index_select(0, chunk.context_slots)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, H, Q, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, S, D]
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=query.shape[1] != num_kv_heads,
    )  # [1, H, Q, D]
    return out[0].transpose(0, 1)


def _attend(
    query: torch.Tensor, kv_cache: torch.Tensor, batch: _DecodeBatch, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """query: [B, H, D], the batch's query rows -> [B, H, D]."""
    num_heads, head_size = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    num_reqs, max_s = batch.mask.shape
    # [B, Hkv, G, D]: the G query heads of one KV head are its query rows, so keys and values
    # are never repeated.
    q = query.view(num_reqs, num_kv_heads, group, head_size)
    slots = batch.context_slots.reshape(-1)  # [B * S]
    k = kv_cache[0].view(-1, num_kv_heads, head_size).index_select(0, slots)
    v = kv_cache[1].view(-1, num_kv_heads, head_size).index_select(0, slots)
    k = k.view(num_reqs, max_s, num_kv_heads, head_size).transpose(1, 2)  # [B, Hkv, S, D]
    v = v.view(num_reqs, max_s, num_kv_heads, head_size).transpose(1, 2)
    mask = batch.mask[:, None, None, :]  # [B, 1, 1, S]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G, D]
    return out.reshape(num_reqs, num_heads, head_size)
