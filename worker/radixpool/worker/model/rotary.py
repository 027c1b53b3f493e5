"""Rotary position embeddings (the rotate-half layout of Hugging Face checkpoints).

Supported `rope_type`s: `default`, `linear` (positions divided by `factor`), `llama3` (Meta's
piecewise frequency scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend
in between) and `yarn` (the same idea with the blend set by rotations over the original context,
plus an attention factor that scales cos and sin). Dynamic NTK and LongRoPE are rejected on
purpose: their frequencies depend on the length of the whole sequence, so K already in the paged
cache would have been rotated with different frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_type(params: dict[str, Any]) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling (rope_parameters): rope_type must be one of "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}, got {rope_type!r}")
    return rope_type


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (float32) for a `rope_parameters` dict."""
    rope_type = _rope_type(params)
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base_powers = base ** exponents
    inv_freq = 1.0 / base_powers
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    if rope_type == "yarn":
        return _yarn_scale(inv_freq, base_powers, head_dim, base, params)
    return inv_freq


def rope_attention_factor(params: dict[str, Any]) -> float:
    """What cos and sin are multiplied by: 1, except for YaRN (its `attention_factor`, else
    derived from `factor` and the optional `mscale` / `mscale_all_dim`)."""
    if _rope_type(params) != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(params["mscale"]) / mscale(params["mscale_all_dim"])
    return mscale(1.0)


def _yarn_scale(inv_freq: torch.Tensor, base_powers: torch.Tensor, head_dim: int,
                base: float, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    original_len = float(params["original_max_position_embeddings"])

    def dim_turning(rotations: float) -> float:
        """The (fractional) dimension whose pair turns `rotations` times over original_len."""
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = dim_turning(params.get("beta_fast") or 32)
    high = dim_turning(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    # Pairs below `low` turn often over the original context and keep their frequency; those
    # above `high` are interpolated (divided by `factor`); a linear ramp blends the ones between.
    # (Written as transformers writes it, so the float32 frequencies are the same bits.)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    interpolated = 1.0 / (factor * base_powers)
    return interpolated * (1 - kept) + inv_freq * kept


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
        self.attention_factor = rope_attention_factor(params)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
        """cos, sin of shape `[num_tokens, 1, head_dim]`, computed in float32 then cast."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` of shape `[num_tokens, num_heads, head_dim]`."""
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin
