"""Rotary position embeddings (the rotate-half layout of Hugging Face checkpoints).

Supported `rope_type`s: `default`, `linear` (positions divided by `factor`) and `llama3` (Meta's
piecewise frequency scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend
in between). Dynamic NTK is rejected on purpose: its frequencies depend on the length of the whole
sequence, so K already in the paged cache would have been rotated with different frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (float32) for a `rope_parameters` dict."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json rope_parameters: rope_type must be one of "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}, got {rope_type!r}")
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than original_len / low are slowed by `factor`; shorter than
    # original_len / high are kept; those in between blend the two linearly in 1 / wavelength.
    slowed = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    blend = (original_len / wavelen - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_between = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_between, blended, slowed)


class RotaryEmbedding(nn.Module):
    """`cos_sin(positions)` once per step; `apply(x, cos, sin)` to q and k of every layer."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, params), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
        """cos, sin of shape `[num_tokens, 1, head_dim]`, computed in float32 then cast."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` of shape `[num_tokens, num_heads, head_dim]`."""
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin
