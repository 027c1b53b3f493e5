"""The per-step page tables of a paged attention kernel, as pure functions of a `ForwardBatch`.

Paged kernels (FlashInfer's wrappers) describe each request's KV as a list of *pages*: request i
reads pages `indices[indptr[i]:indptr[i + 1]]`, every page full except the last, which holds
`last_page_len[i]` tokens (1..page_size). Our pool fits that exactly: slot `s` is row `s %
page_size` of page `s // page_size`, and a request's token i always sits at row `i % page_size`
(`KVPool.alloc_extend` fills the last page before taking a fresh one, the radix cache shares
whole pages), so its pages are `req_to_token[row, 0:kv_len:page_size] // page_size`.

The lengths are known on the host (`prefix_lens`, `extend_lens`), so `indptr`, `last_page_len`
and `qo_indptr` are built there (the kernels' planners read them on the host anyway); only
`indices` is gathered on the device from the request→token table, with no host sync.

Which kernel a step takes:
- DECODE: paged decode over each request's whole sequence (its new token's K/V included).
- EXTEND, no request with a cached prefix: ragged prefill, causal, over the new K/V as computed
  (nothing is read back from the pool).
- EXTEND otherwise: paged prefill over prefix + new tokens, causal aligned to the sequence end
  (query j of a request attends to KV positions ≤ prefix_len + j). This covers radix-cache hits,
  prefill chunks and mixed batches (a decoding request is an extend of one token).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from radixpool.worker.device_copy import to_device
from radixpool.worker.forward_batch import ForwardBatch, ForwardMode


class PlanKind(enum.Enum):
    DECODE = "decode"
    RAGGED_PREFILL = "ragged_prefill"
    PAGED_PREFILL = "paged_prefill"


@dataclass(frozen=True)
class PagedKV:
    indptr: torch.Tensor         # [batch + 1] int32, host
    indices: torch.Tensor        # [indptr[-1]] int32, on the table's device: page ids
    last_page_len: torch.Tensor  # [batch] int32, host, in [1, page_size]


@dataclass(frozen=True)
class StepPlan:
    kind: PlanKind
    qo_indptr: torch.Tensor      # [batch + 1] int32, host: request i's queries are q[qo[i]:qo[i+1]]
    kv: PagedKV | None           # None for RAGGED_PREFILL


def _host_int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def exclusive_cumsum(lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as host int32."""
    out, total = [0], 0
    for n in lengths:
        total += n
        out.append(total)
    return _host_int32(out)


def paged_kv(req_to_token: torch.Tensor, req_rows: torch.Tensor, kv_lens: list[int],
             page_size: int) -> PagedKV:
    """Pages of each request's first `kv_lens[i]` tokens (every kv_len ≥ 1)."""
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = exclusive_cumsum(pages)
    last = _host_int32([(n - 1) % page_size + 1 for n in kv_lens])
    device = req_to_token.device
    total = int(indptr[-1])
    counts = to_device(pages, torch.int64, device)
    # Entry k of `indices` is page j of request r: r repeats once per page, j counts within r.
    owner = torch.repeat_interleave(torch.arange(len(pages), device=device), counts,
                                    output_size=total)
    starts = torch.repeat_interleave(to_device(indptr[:-1], torch.int64, device), counts,
                                     output_size=total)
    page_no = torch.arange(total, device=device) - starts
    first_slots = req_to_token[req_rows[owner], page_no * page_size]
    return PagedKV(indptr, (first_slots // page_size).to(torch.int32), last)


def plan_step(batch: ForwardBatch, page_size: int) -> StepPlan:
    """The one plan every layer of this step shares."""
    qo = exclusive_cumsum(batch.extend_lens)
    kv_lens = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)]
    if batch.mode is ForwardMode.DECODE:
        return StepPlan(PlanKind.DECODE, qo,
                        paged_kv(batch.req_to_token, batch.req_rows, kv_lens, page_size))
    if not any(batch.prefix_lens):
        return StepPlan(PlanKind.RAGGED_PREFILL, qo, None)
    return StepPlan(PlanKind.PAGED_PREFILL, qo,
                    paged_kv(batch.req_to_token, batch.req_rows, kv_lens, page_size))

