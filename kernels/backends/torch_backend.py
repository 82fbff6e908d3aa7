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

from dataclasses import dataclass, field

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
        query_lens = metadata.query_lens_host
        if metadata.is_decode_only:
            metadata.backend_state["batches"] = [_padded_batch(metadata, None)]
            metadata.backend_state["chunks"] = []
            return
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        metadata.backend_state["batches"] = [_padded_batch(metadata, decodes)] if decodes else []
        metadata.backend_state["chunks"] = _query_chunks(metadata)

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
        batches: list[_PaddedBatch] = metadata.backend_state["batches"]
        chunks: list[_QueryChunk] = metadata.backend_state["chunks"]
        if not chunks:
            return _attend(query, kv_cache, batches[0], num_kv_heads, scale)
        out = torch.empty_like(query)  # [T, H, D]
        for batch in batches:
            assert batch.token_rows is not None
            rows = query.index_select(0, batch.token_rows)  # [T_b, H, D]
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


@dataclass
class _PaddedBatch:
    """Some requests of a step padded into one SDPA batch: ``B`` requests, ``Q`` query rows and
    ``S`` key positions each."""

    token_rows: torch.Tensor | None  # [T_b] the step's token rows of these requests (None: all)
    context_slots: torch.Tensor  # [B, S] cache slot of every key position
    mask: torch.Tensor  # [B, Q, S] query i of request b sees key j
    token_index: tuple[torch.Tensor, torch.Tensor] | None  # ([T_b], [T_b]): request, query row
    gqa_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> [B, 1, Q * G, S]

    @property
    def num_reqs(self) -> int:
        return self.mask.shape[0]

    @property
    def max_q(self) -> int:
        return self.mask.shape[1]

    @property
    def max_s(self) -> int:
        return self.mask.shape[2]


def _padded_batch(metadata: AttentionMetadata, requests: list[int] | None) -> _PaddedBatch:
    """The batch of ``requests`` (indices into the step's requests; None: every request)."""
    device = metadata.seq_lens.device
    block_size = metadata.block_size
    query_start = metadata.query_start_loc.long()  # [B + 1]
    seq_lens = metadata.seq_lens.long()  # [B]
    query_lens = query_start[1:] - query_start[:-1]  # [B]
    block_table = metadata.block_table.long()  # [B, NB]
    token_rows = None
    if requests is None:
        max_q, max_s = metadata.max_query_len, metadata.max_seq_len
    else:
        max_q = max(metadata.query_lens_host[i] for i in requests)
        max_s = max(metadata.seq_lens_host[i] for i in requests)
        index = torch.tensor(requests, device=device)  # [B_b]
        starts, query_lens, seq_lens = query_start[index], query_lens[index], seq_lens[index]
        block_table = block_table[index, : -(-max_s // block_size)]
    num_reqs = int(seq_lens.shape[0])
    padded = max_q > 1 and num_reqs > 1
    if padded or requests is not None:
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens)  # [T_b]
        token_query_pos = torch.arange(token_req.shape[0], device=device) - _starts(query_lens)[token_req]
        if requests is not None:  # [T_b]: the step's token rows of these requests, in order
            token_rows = starts[token_req] + token_query_pos
    key_pos = torch.arange(max_s, device=device)  # [S]
    # [B, S]: cache slot of every context position. NOTE: positions past a request's length
    # read slot 0 of the null block, which is zeroed at allocation and never written: the
    # unwritten tail of a request's last block may hold anything (NaN included), and a NaN
    # value would survive SDPA's mask (0 * NaN), while the null block is always finite.
    slots = block_table[:, key_pos // block_size] * block_size + key_pos % block_size
    context_slots = torch.where(key_pos < seq_lens[:, None], slots, 0)
    query_pos = torch.arange(max_q, device=device)  # [Q]
    context_lens = seq_lens - query_lens  # [B]
    # [B, Q, S]: query i of request b sees key j iff j <= context_len + i and j < seq_len.
    last_visible = context_lens[:, None, None] + query_pos[None, :, None]  # [B, Q, 1]
    mask = (key_pos <= last_visible) & (key_pos < seq_lens[:, None, None])
    token_index = (token_req, token_query_pos) if padded else None
    return _PaddedBatch(token_rows, context_slots, mask, token_index)


@dataclass(slots=True)
class _QueryChunk:
    """One request's query of more than one token (a prefill chunk), attended on its own."""

    row_start: int  # its first row among the step's query tokens
    num_rows: int  # Q: its query tokens
    context_slots: torch.Tensor  # [S] cache slot of every key position, its new tokens' included
    mask: torch.Tensor | None  # [Q, S] causal from the bottom right; None when Q == S (no context)


def _query_chunks(metadata: AttentionMetadata) -> list[_QueryChunk]:
    """Every request of the step whose query is longer than one token."""
    block_size = metadata.block_size
    block_table = metadata.block_table.long()  # [B, NB]
    device = block_table.device
    chunks = []
    row_start = 0
    for index, (num_rows, seq_len) in enumerate(
        zip(metadata.query_lens_host, metadata.seq_lens_host, strict=True)
    ):
        if num_rows > 1:
            key_pos = torch.arange(seq_len, device=device)  # [S]
            slots = block_table[index, key_pos // block_size] * block_size + key_pos % block_size
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


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B] where each begins in their concatenation."""
    return torch.cumsum(lengths, 0) - lengths


def _attend(
    query: torch.Tensor, kv_cache: torch.Tensor, batch: _PaddedBatch, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """query: [T_b, H, D], the batch's query rows -> [T_b, H, D]."""
    num_heads, head_size = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    num_reqs, max_q, max_s = batch.num_reqs, batch.max_q, batch.max_s
    padded = _pad_query(query, batch)  # [B, Q, H, D]
    # [B, Hkv, Q * G, D]: the G query heads of one KV head become extra query rows.
    q = (
        padded.view(num_reqs, max_q, num_kv_heads, group, head_size)
        .permute(0, 2, 1, 3, 4)
        .reshape(num_reqs, num_kv_heads, max_q * group, head_size)
    )
    slots = batch.context_slots.reshape(-1)  # [B * S]
    k = kv_cache[0].view(-1, num_kv_heads, head_size).index_select(0, slots)
    v = kv_cache[1].view(-1, num_kv_heads, head_size).index_select(0, slots)
    k = k.view(num_reqs, max_s, num_kv_heads, head_size).transpose(1, 2)  # [B, Hkv, S, D]
    v = v.view(num_reqs, max_s, num_kv_heads, head_size).transpose(1, 2)
    mask = batch.gqa_masks.get(group)
    if mask is None:
        mask = batch.mask.repeat_interleave(group, dim=1).unsqueeze(1)  # [B, 1, Q * G, S]
        batch.gqa_masks[group] = mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = (
        out.view(num_reqs, num_kv_heads, max_q, group, head_size)
        .permute(0, 2, 1, 3, 4)
        .reshape(num_reqs, max_q, num_heads, head_size)
    )
    return _unpad_output(out, batch)  # [T_b, H, D]


def _pad_query(query: torch.Tensor, batch: _PaddedBatch) -> torch.Tensor:
    """[T_b, H, D] -> [B, Q, H, D]."""
    if batch.token_index is None:  # one request, or decodes only: no padding at all
        return query.view(batch.num_reqs, batch.max_q, *query.shape[1:])
    token_req, token_query_pos = batch.token_index
    padded = query.new_zeros(batch.num_reqs, batch.max_q, *query.shape[1:])
    padded[token_req, token_query_pos] = query
    return padded


def _unpad_output(out: torch.Tensor, batch: _PaddedBatch) -> torch.Tensor:
    """[B, Q, H, D] -> [T_b, H, D]."""
    if batch.token_index is None:
        return out.reshape(batch.num_reqs * batch.max_q, *out.shape[2:])
    token_req, token_query_pos = batch.token_index
    return out[token_req, token_query_pos]
