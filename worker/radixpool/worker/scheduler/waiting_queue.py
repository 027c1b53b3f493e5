"""The waiting queue, ordered by longest cached prefix (lpm) or by arrival (fcfs).

LPM is kept *incrementally*, so it stays LPM at thousands of queued requests (SGLang re-matches
every waiting request every step and falls back to FCFS past 128 of them):
- each request carries the chained block hashes of its sequence (`protocol.kv_blocks`, the same
  hashes the cache's events name) and `match_blocks`, how many leading blocks the cache holds;
- cached blocks of a prefix are downward-closed (a block is cached only with all before it), so
  the exact count is a binary search over the request's hashes against `cache.block_hashes`;
- requests are grouped by their *frontier* hash (their first uncached block). A chained hash
  names a whole prefix, so every member of a group has the same `match_blocks`: the priority
  heap holds groups (members in arrival order inside), and a step costs O(groups looked at +
  requests admitted), not O(queue);
- when the cache stores a group's frontier block, only that group is re-examined (its members
  move to their new frontiers); evictions only lower counts and are caught lazily when a group
  reaches the top of the heap;
- a group whose frontier is being computed by a running request is *parked* under it
  (`park`): it leaves the heap, the stores of that request's chunks leave it alone, and
  `unpark` (the request finished its prefill or left) re-examines it once — with a budget of
  members per step, so thousands of requests behind one shared prefix never make a slow step.
Priority is block-granular; ties go to the earlier request. A request waiting longer than the
starvation bound is offered before anything else, in arrival order. A request alone in the queue
is ranked (hashed) only once another joins it: alone, its rank cannot matter, and on a lightly
loaded server most requests never wait behind another.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Callable

import numpy as np

from radixpool.protocol.kv_blocks import prefix_block_hashes
from radixpool.worker.mem.radix_cache import RadixCache
from radixpool.worker.request import Req, Status

# Members of unparked groups re-examined per `offer` call, earliest first (the rest wait).
UNPARK_BUDGET = 64


class Verdict(enum.Enum):
    ADMIT = "admit"   # taken out of the queue
    SKIP = "skip"     # stays waiting; keep offering others
    STOP = "stop"     # stays waiting; offer nothing more this step


class _Group:
    __slots__ = ("key", "live", "match_blocks", "members", "parked_by", "tick")

    def __init__(self, key: object, match_blocks: int) -> None:
        self.key = key
        self.match_blocks = match_blocks
        self.members: list[tuple[int, int, Req]] = []  # heap of (seq, version, req)
        self.live = 0
        self.tick = 0               # the heap entry with this tick is the group's current one
        self.parked_by: str | None = None


class WaitingQueue:
    def __init__(self, cache: RadixCache, policy: str) -> None:
        self.cache = cache
        self.lpm = policy == "lpm"
        self._members: dict[str, Req] = {}
        self._groups: dict[object, _Group] = {}
        self._heap: list[tuple[int, int, int, _Group]] = []      # (-blocks, seq, tick, group)
        self._by_arrival: list[tuple[float, int, int, Req]] = []  # (arrival, seq, epoch, req)
        self._parked: dict[str, list[_Group]] = {}
        self._unparked: deque[Req] = deque()   # members still to re-examine after an unpark
        self._ticks = itertools.count(1)
        self._unranked: Req | None = None       # the lone member, not hashed yet

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
        self._members[req.rid] = req
        if self.lpm:
            if len(self._members) == 1:
                req.block_hashes, req.match_blocks = None, 0
                self._unranked = req
            else:
                self._rank_unranked()
                self._rank(req)
        self._join(req)
        req.queue_epoch += 1
        heapq.heappush(self._by_arrival, (req.arrival_time, req.seq, req.queue_epoch, req))
        self._compact()

    def remove(self, req: Req) -> None:
        if self._members.pop(req.rid, None) is None:
            return
        self._leave(req)
        if self._unranked is req:
            self._unranked = None

    # ------------------------------------------------------------------ groups
    def _key(self, req: Req) -> object:
        hashes = req.block_hashes
        if self.lpm and hashes is not None and req.match_blocks < len(hashes):
            return int(hashes[req.match_blocks])
        return ("req", req.rid)   # nothing left to wait for: a group of its own

    def _join(self, req: Req) -> None:
        req.version += 1
        key = self._key(req)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key, req.match_blocks)
        req.queue_group = group
        heapq.heappush(group.members, (req.seq, req.version, req))
        group.live += 1
        if group.parked_by is None and group.members[0][2] is req:
            self._push_group(group)

    def _leave(self, req: Req) -> None:
        group = req.queue_group
        req.version += 1   # its member entry is stale now
        req.queue_group = None
        if group is not None:
            group.live -= 1
            if group.live == 0 and self._groups.get(group.key) is group:
                del self._groups[group.key]

    @staticmethod
    def _valid(entry: tuple[int, int, Req], group: _Group) -> bool:
        return entry[1] == entry[2].version and entry[2].queue_group is group

    def _first(self, group: _Group) -> Req | None:
        members = group.members
        while members and not self._valid(members[0], group):
            heapq.heappop(members)
        return members[0][2] if members else None

    def _push_group(self, group: _Group) -> None:
        first = self._first(group)
        if first is not None:
            group.tick = next(self._ticks)
            heapq.heappush(self._heap, (-group.match_blocks, first.seq, group.tick, group))

    def _regroup(self, group: _Group, budget: int | None = None) -> None:
        """Re-rank the group's members (the cache changed under them) into their groups."""
        if self._groups.get(group.key) is group:
            del self._groups[group.key]
        for _, _, req in sorted(e for e in group.members if self._valid(e, group)):
            self._leave(req)
            if budget is None:
                req.match_blocks = self._exact_blocks(req)
                self._join(req)
            else:
                self._unparked.append(req)
        group.members = []

    # ------------------------------------------------------------------ incremental LPM
    def _rank(self, req: Req) -> None:
        size = self.cache.block_size
        hashes = req.prompt_hashes   # the prompt's, hashed once when it was queued
        if hashes is None or len(hashes) != (len(req.input_ids) + len(req.output_ids)) // size:
            hashes = prefix_block_hashes(req.fill_ids, size, req.namespace)   # it has grown
        req.block_hashes = hashes
        req.match_blocks = self._exact_blocks(req)

    def _rank_unranked(self) -> None:
        req, self._unranked = self._unranked, None
        if req is not None and self._members.get(req.rid) is req:
            self._leave(req)
            self._rank(req)
            self._join(req)

    def _exact_blocks(self, req: Req) -> int:
        hashes, present = req.block_hashes, self.cache.block_hashes
        if hashes is None:
            return 0
        lo, hi = 0, len(hashes)  # hashes[:lo] cached; hashes[hi:] not
        while lo < hi:
            mid = (lo + hi) // 2
            if int(hashes[mid]) in present:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def on_stored(self, blocks: tuple[int, ...] | list[int]) -> None:
        """The cache stored these blocks: the groups waiting on them may have moved up."""
        if not self.lpm:
            return
        for h in blocks:
            group = self._groups.get(h)
            if group is not None and group.parked_by is None:
                self._regroup(group)

    # ------------------------------------------------------------------ parking
    def park(self, req: Req, blocker: str) -> None:
        """Hold `req`'s whole group (everyone waiting on the same first uncached block) until
        `blocker`, which is computing that block, calls `unpark`."""
        group = req.queue_group
        if group is not None and group.parked_by is None:
            group.parked_by = blocker
            self._parked.setdefault(blocker, []).append(group)

    def unpark(self, blocker: str) -> None:
        for group in self._parked.pop(blocker, ()):
            group.parked_by = None
            if self._groups.get(group.key) is group:
                self._regroup(group, budget=UNPARK_BUDGET)

    def _rejoin_unparked(self) -> None:
        for _ in range(min(UNPARK_BUDGET, len(self._unparked))):
            req = self._unparked.popleft()
            if self._members.get(req.rid) is req and req.queue_group is None:
                req.match_blocks = self._exact_blocks(req)
                self._join(req)

    # ------------------------------------------------------------------ admission
    def offer(self, now: float, max_wait: float, decide: Callable[[Req], Verdict]) -> None:
        """Offer waiting requests to `decide` in priority order until it says STOP."""
        self._rejoin_unparked()
        offered: set[str] = set()
        for _, _, _, req in self._starving(now, max_wait):
            offered.add(req.rid)
            verdict = decide(req)
            if verdict is Verdict.ADMIT:
                self.remove(req)
            elif verdict is Verdict.STOP:
                return
        # Each group is in the heap under its first member; after that member is offered the
        # group goes back under its next one, so equal priorities interleave in arrival order.
        held: dict[_Group, list[tuple[int, int, Req]]] = {}
        try:
            while self._heap:
                _, _, tick, group = heapq.heappop(self._heap)
                if tick != group.tick or group.parked_by is not None or \
                        self._groups.get(group.key) is not group:
                    continue
                first = self._first(group)
                if first is None:
                    continue
                if self.lpm and group.match_blocks and int(
                        first.block_hashes[group.match_blocks - 1]) not in self.cache.block_hashes:
                    self._regroup(group)  # evicted under it: re-queue at its true rank
                    continue
                entry = heapq.heappop(group.members)
                held.setdefault(group, []).append(entry)
                verdict = Verdict.SKIP if first.rid in offered else decide(first)
                if verdict is Verdict.ADMIT:
                    held[group].pop()
                    self.remove(first)
                if verdict is Verdict.STOP:
                    return
                if group.parked_by is None:
                    self._push_group(group)
        finally:
            for group, entries in held.items():
                for entry in entries:
                    heapq.heappush(group.members, entry)
                if group.parked_by is None and self._groups.get(group.key) is group:
                    self._push_group(group)

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
            self._heap = [e for e in self._heap if e[2] == e[3].tick and e[3].parked_by is None
                          and self._groups.get(e[3].key) is e[3]]
            heapq.heapify(self._heap)
        if len(self._by_arrival) > 2 * live + 64:
            self._by_arrival = [e for e in self._by_arrival if self._arrival_live(e)]
            heapq.heapify(self._by_arrival)

    def uncached_blocks(self, req: Req, start: int, count: int) -> np.ndarray:
        """Hashes of up to `count` blocks of `req` from block `start` (for in-batch dedup)."""
        if req.block_hashes is None:
            return np.empty(0, dtype=np.uint64)
        return req.block_hashes[start:start + count]
