"""The attention backend contract and its registry.

A backend computes attention for the tokens of a `ForwardBatch` against the paged KV pool:
- `plan(batch)` runs once per step before the layers (index building, FlashInfer planning, CUDA
  graph buffer updates) and stores what it needs in `batch.attn_metadata`;
- `forward(q, k, v, layer_id, batch)` first writes this step's K/V into the pool at
  `batch.out_cache_loc`, then attends each new token to its request's whole prefix (causal within
  the new tokens) and returns `[num_tokens, num_heads * head_dim]`.
Backends that need a GPU import their libraries inside their own module, so every backend's
registration is importable on a CPU-only machine.

CUDA-graph decode (`supports_cuda_graph`): `init_cuda_graph(max_batch, max_kv_pages)` allocates
fixed buffers once; a DECODE batch with `graph_size` set is padded to that captured size and
`plan` must write its metadata into that size's fixed buffers (captured kernels read them), never
allocate new ones. `forward` then must not depend on host values that change between steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from radixpool.worker.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    # A query at position i sees keys at positions > i - sliding_window (Mistral's window, as
    # transformers applies it); None: the whole prefix.
    sliding_window: int | None = None


class AttentionBackend(ABC):
    supports_cuda_graph: ClassVar[bool] = False
    # Whether it honours `shape.sliding_window`; for one that does not, the model runner caps
    # the context at the window, where full attention computes the same.
    supports_sliding_window: ClassVar[bool] = False

    def __init__(self, shape: AttentionShape, device: torch.device) -> None:
        self.shape = shape
        self.device = device

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor: ...

    def init_cuda_graph(self, max_batch: int, max_kv_pages: int) -> None:
        """Allocate the fixed buffers that graph-sized decode steps plan into (none here: a
        backend without them still runs padded batches eagerly, it cannot be captured)."""
        return


_REGISTRY: dict[str, Callable[[], type[AttentionBackend]]] = {}


def register_backend(name: str, loader: Callable[[], type[AttentionBackend]]) -> None:
    """Register a backend by name; `loader` imports and returns its class on first use."""
    _REGISTRY[name] = loader


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def create_backend(name: str, shape: AttentionShape, device: torch.device) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {', '.join(backend_names())}, "
                         f"got {name!r}")
    return _REGISTRY[name]()(shape, device)
