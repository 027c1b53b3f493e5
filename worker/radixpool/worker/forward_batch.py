"""What one forward pass computes, and the context that carries it to the attention layers.

The scheduler describes a step as a list of (request row, prefix length, new tokens); the
`ForwardBatch` holds that as device tensors. The model's `forward(input_ids, positions)` never sees
it in its signature: `forward_context(batch)` makes it current, and attention layers read it with
`current_batch()` (one small object instead of a parameter threaded through every call).

Modes:
- EXTEND: each request computes `extend_lens[i] >= 1` new tokens on top of `prefix_lens[i]`
  tokens already in the KV pool (prefill, a prefill chunk, a resumed request, forced tokens).
- DECODE: every request computes exactly one new token. Backends may use fixed-shape kernels
  (CUDA graphs) for it: `graph_size` is then the captured batch size this batch was padded to
  (padded lanes: one token at position 0 written to the pool's padding slot; their output is
  dropped).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from radixpool.worker.device_copy import to_device


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor       # [num_tokens] int64: the new tokens, requests concatenated
    positions: torch.Tensor       # [num_tokens] int64: their positions in their sequences
    out_cache_loc: torch.Tensor   # [num_tokens] int64: KV slots their K/V are written to
    req_rows: torch.Tensor        # [batch] int64: rows of req_to_token
    seq_lens: torch.Tensor        # [batch] int64: KV length of each request after this step
    prefix_lens: list[int]        # per request, tokens already in the pool before this step
    extend_lens: list[int]        # per request, new tokens this step (all 1 in DECODE)
    logits_indices: torch.Tensor  # [num_logits] int64: rows of the hidden states to project
    req_to_token: torch.Tensor    # the ReqToTokenPool table (slot of token i of row r)
    kv_pool: Any                  # the KVPool the attention layers read and write
    attn_metadata: Any = field(default=None)  # the attention backend's per-step plan
    graph_size: int | None = None             # the CUDA-graph batch size it is padded to

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, mode: ForwardMode, token_ids: list[list[int] | None], prefix_lens: list[int],
              out_cache_loc: torch.Tensor, req_rows: list[int], logits_rows: list[bool],
              req_to_token: torch.Tensor, kv_pool: Any,
              last_tokens: torch.Tensor | None = None,
              draft_lens: list[int] | None = None) -> ForwardBatch:
        """Build from per-request new token ids.

        `logits_rows[i]` says whether request i needs next-token logits this step (False for a
        prefill chunk that does not reach the end of its prompt); with `draft_lens[i]` = k > 0
        it needs them at its last k + 1 positions (a draft to verify), in order. A `None` entry
        (only after every list entry) is one token read on the device from
        `last_tokens[req_rows[i]]`.
        """
        device = req_to_token.device
        extend_lens = [1 if t is None else len(t) for t in token_ids]
        flat = [t for ids in token_ids if ids is not None for t in ids]
        positions: list[int] = []
        for p, e in zip(prefix_lens, extend_lens):
            positions.extend(range(p, p + e))
        ends, total = [], 0
        for e in extend_lens:
            total += e
            ends.append(total - 1)
        drafts = draft_lens or [0] * len(token_ids)
        logits_indices = [i for end, want, k in zip(ends, logits_rows, drafts) if want
                          for i in range(end - k, end + 1)]
        as_tensor = lambda xs: to_device(xs, torch.int64, device)  # noqa: E731
        input_ids = as_tensor(flat)
        num_known = sum(ids is not None for ids in token_ids)
        if num_known < len(token_ids):
            future = last_tokens[as_tensor(req_rows[num_known:])]
            input_ids = torch.cat([input_ids, future]) if flat else future
        return cls(
            mode=mode,
            input_ids=input_ids,
            positions=as_tensor(positions),
            out_cache_loc=out_cache_loc,
            req_rows=as_tensor(req_rows),
            seq_lens=as_tensor([p + e for p, e in zip(prefix_lens, extend_lens)]),
            prefix_lens=list(prefix_lens),
            extend_lens=extend_lens,
            logits_indices=as_tensor(logits_indices),
            req_to_token=req_to_token,
            kv_pool=kv_pool,
        )


_current: ForwardBatch | None = None


@contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    global _current
    previous, _current = _current, batch
    try:
        yield batch
    finally:
        _current = previous


def current_batch() -> ForwardBatch:
    if _current is None:
        raise RuntimeError("attention called outside forward_context()")
    return _current
