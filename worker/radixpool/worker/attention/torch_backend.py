"""The reference attention backend: plain PyTorch over the paged KV pool, CPU or GPU.

Inputs per layer: q `[num_tokens, num_heads, head_dim]`, k and v `[num_tokens, num_kv_heads,
head_dim]` (flat `[num_tokens, heads * head_dim]` is accepted too). The caller has already written
`req_to_token[row, prefix_len:seq_len]` with this step's `out_cache_loc`, so a request's whole
sequence is `req_to_token[row, :seq_len]` once this layer's K/V are stored.

- EXTEND: one `scaled_dot_product_attention` per request over its gathered prefix + new K/V, with
  a causal mask shifted by the prefix length. Prefill is compute-bound and lengths vary widely,
  so a per-request call wastes nothing on padding.
- Short EXTEND (every request adds a few tokens, as in a verify step of exact jump-forward, or
  when padding costs little): one batched call like DECODE, queries padded to the longest extend.
  A per-request call costs far more than the few rows it computes once a batch has dozens of
  requests; padded rows attend to slot 0 and are dropped.
- DECODE: one batched call. Every request's K/V is gathered into `[batch, max_seq_len]`
  (positions past a request's length point at valid but unused slots and are masked out).

Sliding window (`shape.sliding_window` = W): every mask also drops the keys W or more positions
behind its query, so a request attends as transformers' sliding-window models do, whatever part
of its prefix came from the cache.

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
class PaddedExtendPlan:
    kv_slots: torch.Tensor     # [batch, max_seq_len]
    mask: torch.Tensor         # [batch, 1, group * max_extend, max_seq_len]
    rows: torch.Tensor         # [num_tokens]: each token's row in the padded [batch * max_extend]
    max_extend: int


# Extends of at most this many tokens per request are batched whatever the padding (as decode
# is); longer ones only when padding at most doubles the attention work.
SHORT_EXTEND = 16


def worth_padding(prefix_lens: list[int], extend_lens: list[int]) -> bool:
    """Whether one padded call beats a call per request for this extend step."""
    if len(extend_lens) < 2:
        return False
    longest = max(extend_lens)
    if longest <= SHORT_EXTEND:
        return True
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    exact = sum(e * s for e, s in zip(extend_lens, seq_lens))
    return len(extend_lens) * longest * max(seq_lens) <= 2 * exact


@dataclass
class DecodePlan:
    kv_slots: torch.Tensor    # [batch, max_seq_len]
    mask: torch.Tensor        # [batch, 1, 1, max_seq_len]


def _own_slots(batch: ForwardBatch, own: torch.Tensor) -> torch.Tensor:
    """Each request's KV slots, `[batch, max_len]`, with the columns past its own length (`own`
    False) on the pool's padding slot 0, which is never allocated and stays zero. Past its
    length a row of `req_to_token` still names slots of the row's earlier requests, and a
    masked column weighs 0 but its value still counts: 0 x NaN is NaN. A request whose model
    gave NaN K/V left them in its freed slots, and the next batch's shorter rows read them."""
    slots = batch.req_to_token[batch.req_rows, :own.shape[1]]
    return torch.where(own, slots, torch.zeros((), dtype=slots.dtype, device=slots.device))


class TorchAttentionBackend(AttentionBackend):
    supports_sliding_window = True

    def _within_window(self, mask: torch.Tensor, cols: torch.Tensor, query_pos: torch.Tensor
                       ) -> torch.Tensor:
        """`mask` less the keys at `cols` a sliding window or more behind their query at
        `query_pos` (broadcast); `mask` itself for a model without one."""
        window = self.shape.sliding_window
        return mask if window is None else mask & (cols > query_pos - window)

    def plan(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = self._plan_decode(batch)
        elif worth_padding(batch.prefix_lens, batch.extend_lens):
            batch.attn_metadata = self._plan_padded_extend(batch)
        else:
            batch.attn_metadata = self._plan_extend(batch)

    def _plan_decode(self, batch: ForwardBatch) -> DecodePlan:
        max_len = max(batch.prefix_lens) + 1
        cols = torch.arange(max_len, device=batch.req_to_token.device)
        own = cols[None, :] < batch.seq_lens[:, None]
        mask = self._within_window(own, cols[None, :], batch.seq_lens[:, None] - 1)
        return DecodePlan(_own_slots(batch, own), mask[:, None, None, :])

    def _plan_padded_extend(self, batch: ForwardBatch) -> PaddedExtendPlan:
        device = batch.req_to_token.device
        group = self.shape.num_heads // self.shape.num_kv_heads
        longest, max_len = max(batch.extend_lens), int(batch.seq_lens.max())
        prefix = torch.tensor(batch.prefix_lens, device=device)
        query_pos = prefix[:, None] + torch.arange(longest, device=device)[None, :]
        # Padded queries sit past their request's end; they see slot 0 only (no empty softmax).
        extend = torch.tensor(batch.extend_lens, device=device)
        real = torch.arange(longest, device=device)[None, :] < extend[:, None]
        cols = torch.arange(max_len, device=device)
        mask = self._within_window(
            (cols[None, None, :] <= query_pos[:, :, None]) & real[:, :, None],
            cols[None, None, :], query_pos[:, :, None])
        mask[:, :, 0] |= ~real
        # Queries are laid [kv_heads, group * max_extend]: the mask repeats for every group.
        mask = mask[:, None].expand(-1, group, -1, -1).reshape(len(extend), 1, -1, max_len)
        rows = torch.arange(real.numel(), device=device)[real.flatten()]
        own = cols[None, :] < batch.seq_lens[:, None]
        return PaddedExtendPlan(_own_slots(batch, own), mask, rows, longest)

    def _plan_extend(self, batch: ForwardBatch) -> list[ExtendSpan]:
        device = batch.req_to_token.device
        spans, start = [], 0
        for row, prefix, extend in zip(batch.req_rows.tolist(), batch.prefix_lens,
                                       batch.extend_lens):
            seq_len = prefix + extend
            mask = None
            window = self.shape.sliding_window
            if prefix or (window is not None and seq_len > window):
                query_pos = torch.arange(prefix, seq_len, device=device)[:, None]
                cols = torch.arange(seq_len, device=device)[None, :]
                mask = self._within_window(cols <= query_pos, cols, query_pos)
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
        plan = batch.attn_metadata
        if batch.mode is ForwardMode.DECODE:
            return self._decode(q, k_cache, v_cache, plan)
        if isinstance(plan, PaddedExtendPlan):
            return self._padded_extend(q, k_cache, v_cache, plan)
        return self._extend(q, k_cache, v_cache, plan)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                plan: DecodePlan) -> torch.Tensor:
        batch_size = q.shape[0]
        kv_heads, dim = self.shape.num_kv_heads, self.shape.head_dim
        q = q.view(batch_size, kv_heads, -1, dim)             # [B, kv_heads, group, dim]
        k = k_cache[plan.kv_slots].transpose(1, 2).to(q.dtype)  # [B, kv_heads, max_len, dim]
        v = v_cache[plan.kv_slots].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=self.shape.scale)
        return out.reshape(batch_size, -1)

    def _padded_extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       plan: PaddedExtendPlan) -> torch.Tensor:
        heads, kv_heads, dim = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        batch_size, longest = plan.kv_slots.shape[0], plan.max_extend
        padded = q.new_zeros(batch_size * longest, heads, dim)
        padded[plan.rows] = q
        # [B, max_extend, kv_heads, group, dim] → [B, kv_heads, group * max_extend, dim]
        qs = padded.view(batch_size, longest, kv_heads, -1, dim).permute(0, 2, 3, 1, 4)
        qs = qs.reshape(batch_size, kv_heads, -1, dim)
        k = k_cache[plan.kv_slots].transpose(1, 2).to(q.dtype)  # [B, kv_heads, max_len, dim]
        v = v_cache[plan.kv_slots].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=plan.mask, scale=self.shape.scale)
        o = o.view(batch_size, kv_heads, -1, longest, dim).permute(0, 3, 1, 2, 4)
        return o.reshape(batch_size * longest, heads * dim)[plan.rows]

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
