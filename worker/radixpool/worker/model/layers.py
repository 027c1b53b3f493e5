"""Building blocks of the decoder: linear layers that know how to load their checkpoint tensors,
RMSNorm, the SiLU-gated MLP activation, token embeddings.

Every parameter carries `weight_loader(param, tensor, shard_id)`. A fused layer (`qkv_proj`,
`gate_up_proj`) stacks several checkpoint tensors along its output dimension; its parameters list
the checkpoint names they are made of in `shard_ids` (e.g. ("q_proj", "k_proj", "v_proj")), and
the loader passes the one it read. Parameters are allocated uninitialised: the checkpoint fills
them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, "
                         f"the model expects {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor,
                          shard_id: str | None = None) -> None:
    _copy_checked(param.data, loaded)


def _new_param(*shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _new_param(out_features, in_features)
        self.bias = _new_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several projections of the same input in one matmul; `shards` maps checkpoint name → rows."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards.items():
            self.offsets[name] = (start, rows)
            start += rows
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_ids = tuple(shards)
                param.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        start, rows = self.offsets[shard_id]
        _copy_checked(param.data.narrow(0, start, rows), loaded)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([rows for _, rows in self.offsets.values()], dim=-1))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _new_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (the reference implementations' order).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = _new_param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
