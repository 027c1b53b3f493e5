"""The reference attention backend: plain PyTorch over the paged KV pool, CPU or GPU.

Inputs per layer: q `[num_tokens, num_heads, head_dim]`, k and v `[num_tokens, num_kv_heads,
head_dim]` (flat `[num_tokens, heads * head_dim]` is accepted too). The caller has already written
`req_to_token[row, prefix_len:seq_len]` with this step's `out_cache_loc`, so a request's whole
sequence is `req_to_token[row, :seq_len]` once this layer's K/V are stored.

- EXTEND: one `scaled_dot_product_attention` per request over its gathered prefix + new K/V, with
  a causal mask shifted by the prefix length. Prefill is compute-bound and lengths vary widely,
  so a per-request call wastes nothing on padding.
- DECODE: one batched call. Every request's K/V is gathered into `[batch, max_seq_len]`
  (positions past a request's length point at valid but unused slots and are masked out).

GQA: the `group = num_heads // num_kv_heads` query heads that share a KV head are laid out under
it (`[kv_heads, group, ...]`), and that head's K/V are broadcast to them as a view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixpool.worker.attention.base import AttentionBackend
from radixpool.worker.forward_batch import ForwardBatch, ForwardMode


@dataclass
class ExtendSpan:
    start: int                # first token of the request in the step's flat token order
    end: int
    kv_slots: torch.Tensor    # [seq_len] slots of the request's whole sequence
    # [extend_len, seq_len], True where a query may attend; None when there is no prefix
    # (plain causal attention, which SDPA's fused kernels do without a mask).
    mask: torch.Tensor | None


@dataclass
class DecodePlan:
    kv_slots: torch.Tensor    # [batch, max_seq_len]
    mask: torch.Tensor        # [batch, 1, 1, max_seq_len]


class TorchAttentionBackend(AttentionBackend):
    def plan(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = self._plan_decode(batch)
        else:
            batch.attn_metadata = self._plan_extend(batch)

    def _plan_decode(self, batch: ForwardBatch) -> DecodePlan:
        max_len = max(batch.prefix_lens) + 1
        cols = torch.arange(max_len, device=batch.req_to_token.device)
        kv_slots = batch.req_to_token[batch.req_rows, :max_len]
        mask = cols[None, :] < batch.seq_lens[:, None]
        return DecodePlan(kv_slots, mask[:, None, None, :])

    def _plan_extend(self, batch: ForwardBatch) -> list[ExtendSpan]:
        device = batch.req_to_token.device
        spans, start = [], 0
        for row, prefix, extend in zip(batch.req_rows.tolist(), batch.prefix_lens,
                                       batch.extend_lens):
            seq_len = prefix + extend
            mask = None
            if prefix:
                query_pos = torch.arange(prefix, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
            spans.append(ExtendSpan(start, start + extend, batch.req_to_token[row, :seq_len],
                                    mask))
            start += extend
        return spans

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        heads, kv_heads, dim = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        q = q.reshape(-1, heads, dim)
        k_cache, v_cache = batch.kv_pool.k_buffers[layer_id], batch.kv_pool.v_buffers[layer_id]
        k_cache[batch.out_cache_loc] = k.reshape(-1, kv_heads, dim).to(k_cache.dtype)
        v_cache[batch.out_cache_loc] = v.reshape(-1, kv_heads, dim).to(v_cache.dtype)
        if batch.mode is ForwardMode.DECODE:
            return self._decode(q, k_cache, v_cache, batch.attn_metadata)
        return self._extend(q, k_cache, v_cache, batch.attn_metadata)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                plan: DecodePlan) -> torch.Tensor:
        batch_size = q.shape[0]
        kv_heads, dim = self.shape.num_kv_heads, self.shape.head_dim
        q = q.view(batch_size, kv_heads, -1, dim)             # [B, kv_heads, group, dim]
        k = k_cache[plan.kv_slots].transpose(1, 2).to(q.dtype)  # [B, kv_heads, max_len, dim]
        v = v_cache[plan.kv_slots].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=self.shape.scale)
        return out.reshape(batch_size, -1)

    def _extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                spans: list[ExtendSpan]) -> torch.Tensor:
        kv_heads, dim = self.shape.num_kv_heads, self.shape.head_dim
        group = self.shape.num_heads // kv_heads
        out = torch.empty_like(q)
        for span in spans:
            n = span.end - span.start
            # [n, heads, dim] → [kv_heads, group, n, dim]; each KV head serves its group.
            qs = q[span.start:span.end].view(n, kv_heads, group, dim).permute(1, 2, 0, 3)
            k = k_cache[span.kv_slots].transpose(0, 1).to(q.dtype)  # [kv_heads, seq_len, dim]
            v = v_cache[span.kv_slots].transpose(0, 1).to(q.dtype)
            k, v = (t.unsqueeze(1).expand(-1, group, -1, -1) for t in (k, v))
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=span.mask,
                                               is_causal=span.mask is None,
                                               scale=self.shape.scale)
            out[span.start:span.end] = o.permute(2, 0, 1, 3).reshape(n, -1, dim)
        return out.reshape(q.shape[0], -1)
