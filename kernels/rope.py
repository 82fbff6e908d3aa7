"""Rotary position embedding tables, shared by every backend.

The table layout is the one Ascend's ``_npu_rotary_embedding`` reads: ``[max_positions,
rotary_dim]`` with the cosines in the first half of each row and the sines in the second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Hugging Face ``rope_scaling`` (``rope_parameters``): default, linear or llama3."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    SUPPORTED = ("default", "linear", "llama3")


def inverse_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[rotary_dim // 2] float32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "default":
        return inv_freq
    assert scaling.rope_type == "llama3", scaling.rope_type
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    s = scaling
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(max_positions: int, rotary_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[max_positions, rotary_dim] float32: cos in the first half of a row, sin in the second."""
    inv_freq = inverse_frequencies(rotary_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [P, rotary_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
