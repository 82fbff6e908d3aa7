"""The torch backend's fused ops against Hugging Face's Llama modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from npuserve.kernels.backends.torch_backend import TorchBackend
from npuserve.kernels.rope import RopeScaling, cos_sin_cache, inverse_frequencies

BACKEND = TorchBackend()
BF16_TOL: dict[str, float] = {"atol": 2e-2, "rtol": 1.6e-2}


def _hf_rms_norm(hidden: int, eps: float, weight: torch.Tensor) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 128), (1, 4096)], ids=str)
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_float32_bit_exact(shape: tuple[int, ...], eps: float) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    weight = torch.rand(shape[-1], generator=gen) + 0.5
    with torch.no_grad():
        expected = _hf_rms_norm(shape[-1], eps, weight)(x)
    assert torch.equal(BACKEND.rms_norm(x, weight, eps), expected)


@pytest.mark.parametrize("shape", [(7, 64), (2, 4096)], ids=str)
def test_rms_norm_bf16(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * 3).bfloat16()
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).bfloat16()
    with torch.no_grad():
        expected = _hf_rms_norm(shape[-1], 1e-5, weight)(x)
    got = BACKEND.rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, **BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    hidden, eps = 256, 1e-6
    x = torch.randn(9, hidden, generator=gen).to(dtype)
    residual = (torch.randn(9, hidden, generator=gen) * 4).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    # Hugging Face's decoder layer: hidden = residual + hidden, then the next norm.
    expected_residual = residual + x
    with torch.no_grad():
        expected = _hf_rms_norm(hidden, eps, weight)(expected_residual)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = BACKEND.add_rms_norm(x, residual, weight, eps)
    assert normed.dtype == dtype and new_residual.dtype == dtype
    assert torch.equal(new_residual, expected_residual)
    if dtype == torch.float32:
        assert torch.equal(normed, expected)
    else:
        torch.testing.assert_close(normed, expected, **BF16_TOL)
    # Inputs are not modified in place.
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    inter = 96
    x = (torch.randn(11, 2 * inter, generator=gen) * 2).to(dtype)
    gate, up = x[:, :inter], x[:, inter:]
    got = BACKEND.silu_and_mul(x)
    assert got.shape == (11, inter) and got.dtype == dtype
    assert torch.equal(got, F.silu(gate) * up)


# --- rotary embedding ------------------------------------------------------------------------

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
ROPES: dict[str, tuple[dict[str, object], RopeScaling]] = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, RopeScaling()),
    "llama3": (
        LLAMA3,
        RopeScaling(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "linear": (
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        RopeScaling(rope_type="linear", factor=4.0),
    ),
}
MAX_POSITIONS = 4096


def _hf_rotary(rope: str, head_size: int, num_heads: int, num_kv_heads: int) -> LlamaRotaryEmbedding:
    # transformers 5 reads RoPE from `rope_parameters` (theta included); `rope_scaling` is legacy.
    config = LlamaConfig(
        hidden_size=head_size * num_heads,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_size,
        max_position_embeddings=131072,
        rope_parameters=dict(ROPES[rope][0]),
    )
    rotary = LlamaRotaryEmbedding(config)
    assert rotary.rope_type == rope and rotary.attention_scaling == 1.0
    return rotary


def _theta(rope: str) -> float:
    return float(ROPES[rope][0]["rope_theta"])  # type: ignore[arg-type]


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("rope", list(ROPES))
def test_inverse_frequencies_match_hf(rope: str, head_size: int) -> None:
    rotary = _hf_rotary(rope, head_size, 4, 2)
    ours = inverse_frequencies(head_size, _theta(rope), ROPES[rope][1])
    torch.testing.assert_close(ours, rotary.inv_freq, atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_embedding_matches_hf(rope: str, head_size: int, dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, num_tokens = 4, 2, 37
    gen = torch.Generator().manual_seed(head_size)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen)
    positions[:3] = torch.tensor([0, 1, MAX_POSITIONS - 1])
    query = torch.randn(num_tokens, num_heads * head_size, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads * head_size, generator=gen).to(dtype)

    rotary = _hf_rotary(rope, head_size, num_heads, num_kv_heads)
    cos, sin = rotary(query, positions[None])  # [1, T, D] each, in the query dtype
    q_hf = query.view(1, num_tokens, num_heads, head_size).transpose(1, 2)
    k_hf = key.view(1, num_tokens, num_kv_heads, head_size).transpose(1, 2)
    q_hf, k_hf = apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    q_hf = q_hf.transpose(1, 2).reshape(num_tokens, -1)
    k_hf = k_hf.transpose(1, 2).reshape(num_tokens, -1)

    table = cos_sin_cache(MAX_POSITIONS, head_size, _theta(rope), ROPES[rope][1])
    assert table.shape == (MAX_POSITIONS, head_size) and table.dtype == torch.float32
    # The table straight from `cos_sin_cache` and one cast to the model dtype both work.
    for cache in (table, table.to(dtype)):
        q, k = BACKEND.rotary_embedding(positions, query, key, head_size, cache)
        assert q.shape == query.shape and k.shape == key.shape
        assert q.dtype == dtype and k.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(q, q_hf, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(k, k_hf, atol=1e-6, rtol=1e-6)
        else:
            torch.testing.assert_close(q, q_hf, **BF16_TOL)
            torch.testing.assert_close(k, k_hf, **BF16_TOL)


def test_rotary_embedding_position_zero_is_identity() -> None:
    table = cos_sin_cache(16, 8, 10000.0, RopeScaling())
    query, key = torch.randn(3, 16), torch.randn(3, 8)
    q, k = BACKEND.rotary_embedding(torch.zeros(3, dtype=torch.long), query, key, 8, table)
    assert torch.equal(q, query) and torch.equal(k, key)
