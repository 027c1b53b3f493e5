"""One step's prefill admission: continuing chunked prompts, then waiting requests.

Limits, all checked here: the step's token budget, the running-request cap, one partly
prefilled (chunked) prompt admitted at a time, and KV room in pages. Two rooms are kept:
- `hard`: pages the step can really take (free + evictable, less decode's and what was taken);
- `soft`: `hard` less the reservation for running requests' decode growth. A newly admitted
  request must fit in `soft` and then reserves its own growth; a prompt already mid-prefill is
  only charged its pages against `hard` (its growth is in the reservation already: charging it
  again is what once starved a long prompt's next chunk forever).
A waiting request admitted into an empty engine may use the whole `hard` room, chunked to fit,
so an engine with work always makes progress.
Requests whose uncached prefix is being computed by a request admitted this step, or by a prompt
mid-prefill, are held back (in-batch de-duplication): their queue group is parked under that
request until its prefill is done, and then they hit the cache it filled.
"""

from __future__ import annotations

import math

from radixpool.worker.request import Req
from radixpool.worker.scheduler.kv_manager import KVManager
from radixpool.worker.scheduler.waiting_queue import Verdict, WaitingQueue

# In-batch de-duplication holds a request back when it shares at least this many uncached
# blocks with one admitted in the same step.
DEDUP_MIN_BLOCKS = 2
# Decode reservation: admission keeps room for `ratio * remaining new tokens` of every running
# request (capped per request).
RESERVE_CAP = 256


def reservation_pages(remaining_tokens: int, ratio: float, page_size: int) -> int:
    return math.ceil(remaining_tokens * ratio / page_size)


class PrefillAdder:
    def __init__(self, kv: KVManager, waiting: WaitingQueue, *, token_budget: int, room: int,
                 reserved: int, chunk: int, max_running: int, num_running: int, ratio: float,
                 now: float) -> None:
        self.kv = kv
        self.waiting = waiting
        self.token_budget = token_budget
        self.hard = room
        self.soft = room - reserved
        self.chunk = chunk
        self.max_running = max_running
        self.num_running = num_running
        self.ratio = ratio
        self.now = now
        self.reqs: list[Req] = []
        self.takes: list[int] = []
        self.chunked = False
        self.pending_blocks: dict[int, str] = {}   # uncached block hash -> rid computing it

    def _take(self, req: Req, take: int, pages: int) -> None:
        self.reqs.append(req)
        self.takes.append(take)
        self.token_budget -= take
        self.hard -= pages
        self.soft -= pages

    def continue_chunks(self, chunking: list[Req]) -> None:
        """Prompts being prefilled chunk by chunk go first, limited by the hard room only. A
        draft (after the one uncomputed token) is optional: the limits may shorten it."""
        for req in chunking:
            if self.token_budget <= 0:
                return
            take = min(req.uncomputed + len(req.draft), self.chunk, self.token_budget,
                       self.kv.tokens_within(req.kv_len, self.hard))
            if take > 0:
                self.chunked = self.chunked or take < req.uncomputed
                self._take(req, take, self.kv.pages_for(req.kv_len, take))
                self._computing(req, req.kv_len // self.waiting.cache.block_size)

    def may_admit(self) -> bool:
        """Whether a waiting request could be admitted at all this step."""
        return self.num_running + len(self.reqs) < self.max_running and self.token_budget > 0

    def decide(self, req: Req) -> Verdict:
        """The waiting queue's callback: admit `req` now, skip it, or stop admitting."""
        blocker = self._blocker(req)
        if blocker is not None:   # before any STOP: parked, it costs nothing in later steps
            self.waiting.park(req, blocker)
            return Verdict.SKIP
        if self.num_running + len(self.reqs) >= self.max_running or self.token_budget <= 0:
            return Verdict.STOP
        match, locked = self.kv.match_and_lock(req)
        need = req.seq_len - match.length
        take = min(need, self.chunk, self.token_budget)
        if self.num_running == 0 and not self.reqs:
            take = min(take, self.kv.tokens_within(match.length, self.hard - locked))
        elif self.kv.pages_for(match.length, take) > self.soft - locked:
            take = 0
        if take <= 0 or (take < need and self.chunked) or not self.kv.attach(req, match):
            self.kv.unlock(match)
            return Verdict.STOP
        self.hard -= locked
        self.soft -= locked + reservation_pages(min(req.remaining_new_tokens(), RESERVE_CAP),
                                                self.ratio, self.kv.page_size)
        self.chunked = take < need
        if req.cached_tokens < 0:
            req.cached_tokens = min(match.length, len(req.input_ids))
            req.queue_time = max(0.0, self.now - req.arrival_time)
        self._computing(req, req.match_blocks)
        self._take(req, take, self.kv.pages_for(match.length, take))
        return Verdict.ADMIT

    def _computing(self, req: Req, first_block: int) -> None:
        if self.waiting.lpm and req.block_hashes is not None:
            self.pending_blocks.update(
                dict.fromkeys(req.block_hashes[first_block:].tolist(), req.rid))

    def _blocker(self, req: Req) -> str | None:
        """The request computing `req`'s next uncached blocks in this step, if any."""
        if not (self.waiting.lpm and self.pending_blocks):
            return None
        ahead = self.waiting.uncached_blocks(req, req.match_blocks, DEDUP_MIN_BLOCKS)
        if len(ahead) < DEDUP_MIN_BLOCKS or not all(int(h) in self.pending_blocks
                                                    for h in ahead):
            return None
        return self.pending_blocks[int(ahead[0])]
