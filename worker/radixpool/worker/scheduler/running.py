"""The running requests: who decodes next, how much KV their growth needs, who is retracted.

A running request either decodes (one token without KV, which it sampled: its input is on the
device) or extends: a prompt mid-prefill (chunked; maybe down to its last prompt token), forced
tokens appended by jump-forward, or its last token followed by a draft to verify. Every
decoding request needs a slot for its next token, which costs a page only when its last page is
full. When even eviction cannot give those pages, the youngest running
requests are retracted (their KV goes into the tree first, so they resume by re-matching it); a
request alone that still lacks a page has outgrown this worker's KV and finishes with "length".
The decode reservation ratio (the share of their remaining tokens that running requests are
expected to grow into) decays while decoding goes well and jumps on retraction.
"""

from __future__ import annotations

from radixpool.worker.request import Req, Status
from radixpool.worker.scheduler.kv_manager import KVManager
from radixpool.worker.scheduler.prefill import RESERVE_CAP, reservation_pages

RATIO_INIT, RATIO_MIN, RATIO_DECAY, RATIO_BUMP = 0.5, 0.1, 0.001, 0.3


class RunningSet:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.reqs: dict[str, Req] = {}
        self.new_token_ratio = RATIO_INIT
        # Running requests whose next sampling reads their own latest tokens on the host
        # (penalties, grammars): the next step is not scheduled ahead of them.
        self.need_host_tokens = 0

    def __len__(self) -> int:
        return len(self.reqs)

    def split(self) -> tuple[list[Req], list[Req]]:
        """(decoding, mid-prefill) requests."""
        decode, chunking = [], []
        for r in self.reqs.values():   # (`uncomputed == 1`, inlined: this runs per request)
            if r.decoding and r.seq_len + r.pending - r.kv_len == 1 and not r.draft:
                decode.append(r)
            else:
                chunking.append(r)
        return decode, chunking

    def reserved_pages(self) -> int:
        growth = sum(min(r.params.max_new_tokens - len(r.output_ids), RESERVE_CAP)
                     for r in self.reqs.values())
        return reservation_pages(growth, self.new_token_ratio, self.kv.page_size)

    def youngest(self) -> Req:
        return max(self.reqs.values(), key=lambda r: r.seq)

    def add(self, req: Req) -> None:
        req.status = Status.RUNNING
        self.reqs[req.rid] = req
        self.need_host_tokens += req.params.needs_host_tokens

    def remove(self, req: Req) -> None:
        """Out of the running set; its KV goes to the tree or back to the pool."""
        del self.reqs[req.rid]
        self.need_host_tokens -= req.params.needs_host_tokens
        self.kv.release(req)

    def on_retract(self) -> None:
        self.new_token_ratio = min(1.0, self.new_token_ratio + RATIO_BUMP)

    def on_decode_step(self) -> None:
        self.new_token_ratio = max(RATIO_MIN, self.new_token_ratio - RATIO_DECAY)
