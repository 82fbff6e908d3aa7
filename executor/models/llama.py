"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

Forward runs over a flat batch of ``T`` tokens from many requests at once; which tokens belong to
which request, and where their keys and values live in the paged cache, is in the step's
`AttentionMetadata`. Parameter names follow the Hugging Face checkpoints, except the fused
``qkv_proj`` and ``gate_up_proj`` which `load_weights` fills from their separate parts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from npuserve.executor.config import ModelConfig
from npuserve.executor.layers import (
    ColumnParallelLinear,
    LoadedWeight,
    QKVParallelLinear,
    RMSNormWeight,
    RowParallelLinear,
    TensorParallel,
    VocabEmbedding,
    default_weight_loader,
)
from npuserve.kernels import AttentionMetadata, KernelBackend
from npuserve.kernels.rope import cos_sin_cache

# checkpoint name fragment -> (fused parameter name fragment, shard id)
FUSED_PARAMETERS: dict[str, tuple[str, str | int]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: KernelBackend, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.backend = backend
        self.head_dim = config.head_dim
        self.num_heads = tp.shard(config.num_heads, "num_attention_heads")
        _, self.num_kv_heads = tp.kv_heads(config.num_kv_heads)  # split, or one replicated
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.qkv_bias,
            dtype,
            tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, False, dtype, tp
        )
        if config.qk_norm:
            self.q_norm = RMSNormWeight(config.head_dim, dtype)
            self.k_norm = RMSNormWeight(config.head_dim, dtype)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        cos_sin: torch.Tensor,  # [max_positions, D]
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm:
            q = self.backend.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.eps)
            k = self.backend.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.eps)
            q, k = q.view(num_tokens, q_size), k.view(num_tokens, kv_size)
        q, k = self.backend.rotary_embedding(
            positions, q.contiguous(), k.contiguous(), self.head_dim, cos_sin
        )
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.write_kv_cache(k, v, kv_cache, metadata)
        out = self.backend.attention(
            q.view(num_tokens, self.num_heads, self.head_dim), kv_cache, metadata, self.scale
        )
        return self.o_proj(out.reshape(num_tokens, q_size))


class MLP(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: KernelBackend, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.backend = backend
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], config.mlp_bias, dtype, tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: KernelBackend, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.backend = backend
        self.eps = config.rms_norm_eps
        self.self_attn = Attention(config, backend, dtype, tp)
        self.mlp = MLP(config, backend, dtype, tp)
        self.input_layernorm = RMSNormWeight(config.hidden_size, dtype)
        self.post_attention_layernorm = RMSNormWeight(config.hidden_size, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [T, hidden]: this layer's input, before the residual add
        residual: torch.Tensor | None,  # [T, hidden]; None at the first layer
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: the residual add is fused into the next norm (one kernel on Ascend).
        if residual is None:
            residual = hidden
            hidden = self.backend.rms_norm(hidden, self.input_layernorm.weight, self.eps)
        else:
            hidden, residual = self.backend.add_rms_norm(
                hidden, residual, self.input_layernorm.weight, self.eps
            )
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, cos_sin)
        hidden, residual = self.backend.add_rms_norm(
            hidden, residual, self.post_attention_layernorm.weight, self.eps
        )
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: KernelBackend, dtype: torch.dtype, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.backend = backend
        self.eps = config.rms_norm_eps
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, dtype, tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNormWeight(config.hidden_size, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, cos_sin)
        assert residual is not None, "a model has at least one layer"
        hidden, _ = self.backend.add_rms_norm(hidden, residual, self.norm.weight, self.eps)
        return hidden


class CausalLM(nn.Module):
    """Decoder plus LM head; `compute_logits` runs only on the rows that are sampled.

    With ``tp.size > 1`` every layer holds its rank's shard, and `compute_logits` all-gathers
    the vocabulary so every rank sees the full logits.
    """

    cos_sin_cache: torch.Tensor  # [max_positions, head_dim] rotary table (a buffer)

    def __init__(
        self,
        config: ModelConfig,
        backend: KernelBackend,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        self.config = config
        self.model = DecoderModel(config, backend, dtype, tp)
        self.lm_head = (
            self.model.embed_tokens
            if config.tie_word_embeddings
            else VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        )
        self.register_buffer("cos_sin_cache", torch.empty(0, dtype=dtype), persistent=False)

    def init_rotary_cache(self, max_positions: int) -> None:
        """Builds the rotary table in float32 and stores it in the model's dtype (as HF does)."""
        table = cos_sin_cache(
            max_positions, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling
        )
        self.cos_sin_cache = table.to(self.cos_sin_cache.device, self.cos_sin_cache.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, metadata, self.cos_sin_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, V]
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Copies checkpoint tensors (or this rank's slices of them) into their (possibly fused)
        parameters; returns the names set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, shard_id = name, None
            for part, (fused, shard) in FUSED_PARAMETERS.items():
                if part in name:
                    target, shard_id = name.replace(part, fused), shard
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter to load into")
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard_id)
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        return loaded

    def expected_weights(self) -> set[str]:
        """The names `load_weights` must report for the model to be complete."""
        expected: set[str] = set()
        for name, _ in self.named_parameters():
            shards = [shard for fused, shard in FUSED_PARAMETERS.values() if fused in name]
            expected |= {f"{name}#{shard}" for shard in shards} if shards else {name}
        return expected
