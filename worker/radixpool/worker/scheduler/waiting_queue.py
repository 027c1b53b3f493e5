"""The waiting queue, ordered by longest cached prefix (lpm) or by arrival (fcfs).

LPM is kept *incrementally*, so it stays LPM at thousands of queued requests (SGLang re-matches
every waiting request every step and falls back to FCFS past 128 of them):
- each request carries the chained block hashes of its sequence (`protocol.kv_blocks`, the same
  hashes the cache's events name) and `match_blocks`, how many leading blocks the cache holds;
- cached blocks of a prefix are downward-closed (a block is cached only with all before it), so
  the exact count is a binary search over the request's hashes against `cache.block_hashes`;
- a request is indexed under its *frontier* hash (its first uncached block): when the cache
  stores that block, only the requests waiting on it are re-examined — O(changes), not O(queue);
- evictions only lower counts; they are caught lazily when a request reaches the top of the
  priority heap and its count is re-verified before it is offered.
Priority is block-granular; ties go to the earlier request. A request waiting longer than the
starvation bound is offered before anything else, in arrival order. A request alone in the queue
is ranked (hashed) only once another joins it: alone, its rank cannot matter, and on a lightly
loaded server most requests never wait behind another.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable

import numpy as np

from radixpool.protocol.kv_blocks import prefix_block_hashes
from radixpool.worker.mem.radix_cache import RadixCache
from radixpool.worker.request import Req, Status


class Verdict(enum.Enum):
    ADMIT = "admit"   # taken out of the queue
    SKIP = "skip"     # stays waiting; keep offering others
    STOP = "stop"     # stays waiting; offer nothing more this step


class WaitingQueue:
    def __init__(self, cache: RadixCache, policy: str) -> None:
        self.cache = cache
        self.lpm = policy == "lpm"
        self._members: dict[str, Req] = {}
        self._heap: list[tuple[int, int, int, Req]] = []          # (-blocks, seq, version, req)
        self._by_arrival: list[tuple[float, int, int, Req]] = []  # (arrival, seq, epoch, req)
        self._frontier: dict[int, set[Req]] = {}
        self._unranked: Req | None = None   # the lone member, not hashed yet

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, rid: str) -> bool:
        return rid in self._members

    def get(self, rid: str) -> Req | None:
        return self._members.get(rid)

    def members(self) -> list[Req]:
        return list(self._members.values())

    def push(self, req: Req) -> None:
        req.status = Status.WAITING
        req.version += 1
        self._members[req.rid] = req
        if self.lpm:
            if len(self._members) == 1:
                req.block_hashes, req.match_blocks = None, 0
                self._unranked = req
            else:
                self._rank_unranked()
                self._rank(req)
        heapq.heappush(self._heap, (-req.match_blocks, req.seq, req.version, req))
        req.queue_epoch += 1
        heapq.heappush(self._by_arrival, (req.arrival_time, req.seq, req.queue_epoch, req))
        self._compact()

    def remove(self, req: Req) -> None:
        self._members.pop(req.rid, None)
        self._unindex(req)
        req.version += 1  # heap entries for it are now stale
        if self._unranked is req:
            self._unranked = None

    # ------------------------------------------------------------------ incremental LPM
    def _rank(self, req: Req) -> None:
        req.block_hashes = prefix_block_hashes(req.fill_ids, self.cache.block_size,
                                               req.namespace)
        req.match_blocks = self._exact_blocks(req)
        self._index(req)

    def _rank_unranked(self) -> None:
        req, self._unranked = self._unranked, None
        if req is not None and self._members.get(req.rid) is req:
            self._rank(req)
            req.version += 1
            heapq.heappush(self._heap, (-req.match_blocks, req.seq, req.version, req))
    def _exact_blocks(self, req: Req) -> int:
        hashes, present = req.block_hashes, self.cache.block_hashes
        lo, hi = 0, len(hashes)  # hashes[:lo] cached; hashes[hi:] not
        while lo < hi:
            mid = (lo + hi) // 2
            if int(hashes[mid]) in present:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _index(self, req: Req) -> None:
        if req.match_blocks < len(req.block_hashes):
            self._frontier.setdefault(int(req.block_hashes[req.match_blocks]), set()).add(req)

    def _unindex(self, req: Req) -> None:
        if req.block_hashes is not None and req.match_blocks < len(req.block_hashes):
            waiting = self._frontier.get(int(req.block_hashes[req.match_blocks]))
            if waiting is not None:
                waiting.discard(req)
                if not waiting:
                    del self._frontier[int(req.block_hashes[req.match_blocks])]

    def on_stored(self, blocks: tuple[int, ...] | list[int]) -> None:
        """The cache stored these blocks: requests waiting on them may have moved up."""
        if not self.lpm:
            return
        for h in blocks:
            for req in self._frontier.pop(h, ()):
                self._reprioritise(req)

    def _reprioritise(self, req: Req) -> None:
        self._unindex(req)
        req.match_blocks = self._exact_blocks(req)
        req.version += 1
        self._index(req)
        heapq.heappush(self._heap, (-req.match_blocks, req.seq, req.version, req))

    # ------------------------------------------------------------------ admission
    def offer(self, now: float, max_wait: float, decide: Callable[[Req], Verdict]) -> None:
        """Offer waiting requests to `decide` in priority order until it says STOP."""
        offered: set[str] = set()
        for _, _, _, req in self._starving(now, max_wait):
            offered.add(req.rid)
            verdict = decide(req)
            if verdict is Verdict.ADMIT:
                self.remove(req)
            elif verdict is Verdict.STOP:
                return
        kept: list[tuple[int, int, int, Req]] = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                _, _, version, req = entry
                if version != req.version or req.rid not in self._members:
                    continue
                if req.rid in offered:
                    kept.append(entry)
                    continue
                if self.lpm and req.match_blocks and \
                        int(req.block_hashes[req.match_blocks - 1]) not in self.cache.block_hashes:
                    self._reprioritise(req)  # evicted under it: re-queue at its true rank
                    continue
                verdict = decide(req)
                if verdict is Verdict.ADMIT:
                    self.remove(req)
                    continue
                kept.append(entry)
                if verdict is Verdict.STOP:
                    return
        finally:
            for entry in kept:
                heapq.heappush(self._heap, entry)

    def _arrival_live(self, entry: tuple[float, int, int, Req]) -> bool:
        req = entry[3]
        return entry[2] == req.queue_epoch and self._members.get(req.rid) is req

    def _starving(self, now: float, max_wait: float) -> list[tuple[float, int, int, Req]]:
        while self._by_arrival and not self._arrival_live(self._by_arrival[0]):
            heapq.heappop(self._by_arrival)
        limit = now - max_wait
        if not self._by_arrival or self._by_arrival[0][0] >= limit:
            return []   # the oldest live request is not starving: none is (no O(queue) scan)
        return [e for e in heapq.nsmallest(8, self._by_arrival)
                if e[0] < limit and self._arrival_live(e)]

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber live ones."""
        live = len(self._members)
        if len(self._heap) > 2 * live + 64:
            self._heap = [e for e in self._heap
                          if e[2] == e[3].version and e[3].rid in self._members]
            heapq.heapify(self._heap)
        if len(self._by_arrival) > 2 * live + 64:
            self._by_arrival = [e for e in self._by_arrival if self._arrival_live(e)]
            heapq.heapify(self._by_arrival)

    def uncached_blocks(self, req: Req, start: int, count: int) -> np.ndarray:
        """Hashes of up to `count` blocks of `req` from block `start` (for in-batch dedup)."""
        if req.block_hashes is None:
            return np.empty(0, dtype=np.uint64)
        return req.block_hashes[start:start + count]
