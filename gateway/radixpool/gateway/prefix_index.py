"""What the gateway believes each worker holds in its radix KV cache.

A prompt is named by its chained block hashes (`radixpool.protocol.kv_blocks`): hash `i` names the
whole prefix up to block `i`, so a *set* of hashes is a radix tree in disguise, and "how much of
this prompt does worker W hold" is "how many leading hashes of the prompt are in W's set". The
worker's KV-event stream speaks the same hashes, so events apply here exactly.

Layout: one shared dict `hash -> bitmask of workers` (one walk answers every worker at once, and the
walk stops where the last owner drops out), plus one LRU `OrderedDict[hash, epoch]` per worker that
bounds its tree to the worker's real KV capacity (in blocks). Inserts touch a prompt's blocks from
the last to the first, so a parent is always at least as recent as any child: evicting from the LRU
front removes leaves first, as the worker's own radix cache does, and every set stays prefix-closed.

Self-correction hooks, all O(blocks changed):
- `insert` returns the epochs the matched blocks had *before* this touch. When the worker later
  reports fewer cached tokens than predicted, the first missing block was evicted by the worker; by
  LRU, so was everything we touched no later than it: `trim_through(worker, epoch)` drops those.
- `remove` undoes an optimistic insert for a request that never reached the worker (retry).
- `apply_event` / `load_snapshot` replay the worker's KV events (`stop_following` when they stop);
  `reset` forgets a worker whose instance id changed (restart or flush).

Once a worker's events arrive, they are the ground truth of what it evicts, whatever its eviction
policy: the tree then keeps what the events say (bounded at `EVENT_FED_SLACK` x capacity, for
optimistic inserts the worker never confirms) instead of guessing by its own LRU, and a short
`cached_tokens` report no longer sweeps the LRU front (`trim_through`): a worker that evicts by
reuse (LFU, probation) keeps old prefixes that an LRU sweep would wrongly forget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from radixpool.protocol.kv_blocks import KVEvent

EVENT_FED_SLACK = 2
# A reused prefix that no request has matched for this many inserts (fleet-wide: routed requests
# and stored KV events) is stale, e.g. a finished conversation's history: the worker's own LFU
# ageing / probation staleness lets it go, so it no longer takes room. Counting it kept room near
# zero on multi-turn traffic that fits easily, and misses were then placed by damage instead of
# load (8 workers, probation: hit 0.729 against lru's 0.767; with this, 0.764).
STALE_EPOCHS = 1024
REUSE_AWARE_EVICTION = ("lfu", "probation", "slru")  # slru: an SGLang worker's segmented LRU


class _WorkerTree:
    __slots__ = ("bit", "capacity", "event_fed", "lru", "protects_reuse", "reused")

    def __init__(self, bit: int, capacity: int) -> None:
        self.bit = bit
        self.capacity = capacity
        self.event_fed = False
        self.protects_reuse = False   # the worker evicts never-reused prefixes first
        self.lru: OrderedDict[int, int] = OrderedDict()
        # blocks a later request matched here (worth keeping; kept when protects_reuse) -> epoch of
        # the last match
        self.reused: OrderedDict[int, int] = OrderedDict()

    @property
    def bound(self) -> int:
        return self.capacity * EVENT_FED_SLACK if self.event_fed else self.capacity


class PrefixIndex:
    def __init__(self) -> None:
        self._owners: dict[int, int] = {}
        self._trees: dict[str, _WorkerTree] = {}
        self._by_bit: dict[int, str] = {}
        self._epoch = 0

    # --- membership ---------------------------------------------------------------------------
    def add_worker(self, worker: str, capacity_blocks: int) -> None:
        if worker in self._trees:
            self.set_capacity(worker, capacity_blocks)
            return
        used = {t.bit for t in self._trees.values()}
        bit = 1
        while bit in used:
            bit <<= 1
        self._trees[worker] = _WorkerTree(bit, max(1, capacity_blocks))
        self._by_bit[bit] = worker

    def remove_worker(self, worker: str) -> None:
        if worker in self._trees:
            self.reset(worker)
            del self._by_bit[self._trees.pop(worker).bit]

    def set_capacity(self, worker: str, capacity_blocks: int) -> None:
        tree = self._trees[worker]
        tree.capacity = max(1, capacity_blocks)
        self._evict(tree)

    def __contains__(self, worker: str) -> bool:
        return worker in self._trees

    def size(self, worker: str) -> int:
        """Blocks currently believed cached on `worker`."""
        tree = self._trees.get(worker)
        return 0 if tree is None else len(tree.lru)

    def capacity(self, worker: str) -> int:
        return self._trees[worker].capacity

    def set_eviction_policy(self, worker: str, policy: str) -> None:
        """What the worker reports (`/server_info`, or SGLang's `radix_eviction_policy`): lfu,
        probation and SGLang's slru protect reused prefixes."""
        tree = self._trees.get(worker)
        if tree is not None:
            tree.protects_reuse = policy in REUSE_AWARE_EVICTION

    def room(self, worker: str) -> int:
        """Blocks `worker` can take without evicting a prefix it protects for reuse: its capacity
        less the blocks requests routed there have matched recently (and it still holds). A
        worker that evicts by recency alone protects nothing: any prompt costs it the same."""
        tree = self._trees.get(worker)
        if tree is None:
            return 0
        if not tree.protects_reuse:
            return tree.capacity
        reused, horizon = tree.reused, self._epoch - STALE_EPOCHS
        while reused and next(iter(reused.values())) < horizon:  # oldest match first
            reused.popitem(last=False)
        return tree.capacity - len(reused)

    # --- queries ------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds; workers holding none are left out."""
        owners = self._owners
        alive = -1
        depth: dict[str, int] = {}
        for i, h in enumerate(hashes):
            held = owners.get(h, 0) & alive
            lost = (alive & ~held) if alive != -1 else 0
            if lost and i:
                self._record(lost, i, depth)
            alive = held
            if not alive:
                return depth
        if alive != -1:
            self._record(alive, len(hashes), depth)
        return depth

    def _record(self, mask: int, value: int, depth: dict[str, int]) -> None:
        by_bit = self._by_bit
        while mask:
            low = mask & -mask
            worker = by_bit.get(low)
            if worker is not None:
                depth[worker] = value
            mask ^= low

    # --- updates ------------------------------------------------------------------------------
    def insert(self, worker: str, hashes: Sequence[int], matched: int = 0) -> list[int]:
        """Mark every block of `hashes` cached on `worker` (most recent), evicting LRU leaves past
        capacity. Returns the epochs the first `matched` blocks had before this touch."""
        tree = self._trees.get(worker)
        if tree is None or not hashes:
            return []
        lru = tree.lru
        before = [lru.get(h, 0) for h in hashes[:matched]]
        self._epoch += 1
        epoch, bit, owners = self._epoch, tree.bit, self._owners
        if tree.protects_reuse:  # only `room` reads it, and only for such workers
            reused = tree.reused
            for h in hashes[:matched]:
                reused[h] = epoch
                reused.move_to_end(h)
        for h in reversed(hashes):  # children first: a parent must end up more recent
            if h in lru:
                lru.move_to_end(h)
            else:
                owners[h] = owners.get(h, 0) | bit
            lru[h] = epoch
        self._evict(tree)
        return before

    def remove(self, worker: str, hashes: Iterable[int]) -> int:
        tree = self._trees.get(worker)
        if tree is None:
            return 0
        removed = 0
        for h in hashes:
            if tree.lru.pop(h, None) is not None:
                tree.reused.pop(h, None)
                self._drop_owner(h, tree.bit)
                removed += 1
        return removed

    def trim_through(self, worker: str, epoch: int) -> int:
        """Forget every block of `worker` last touched at or before `epoch`; returns how many."""
        tree = self._trees.get(worker)
        if tree is None or tree.event_fed:
            return 0
        lru, removed = tree.lru, 0
        while lru:
            h, e = next(iter(lru.items()))
            if e > epoch:
                break
            del lru[h]
            tree.reused.pop(h, None)
            self._drop_owner(h, tree.bit)
            removed += 1
        return removed

    def reset(self, worker: str) -> None:
        tree = self._trees.get(worker)
        if tree is None:
            return
        for h in tree.lru:
            self._drop_owner(h, tree.bit)
        tree.lru.clear()
        tree.reused.clear()

    def apply_event(self, worker: str, event: KVEvent) -> None:
        tree = self._trees.get(worker)
        if tree is not None:
            tree.event_fed = True
        if event.type == "cleared":
            self.reset(worker)
        elif event.type == "removed":
            self.remove(worker, event.blocks)
        elif event.type == "queued":
            # A prompt the worker queued: a prediction, as this gateway's routing makes. One it
            # already predicts there (its own request) changes nothing, not even the clock.
            if tree is not None and event.blocks and event.blocks[-1] not in tree.lru:
                self.insert(worker, event.blocks)
        else:
            self.insert(worker, event.blocks)

    def event_fed(self, worker: str) -> bool:
        """Whether `worker`'s KV events keep its tree (cached_tokens then trims nothing)."""
        tree = self._trees.get(worker)
        return tree is not None and tree.event_fed

    def stop_following(self, worker: str) -> None:
        """The worker's KV events no longer arrive: its tree is kept by its LRU bound and the
        cached_tokens trims again, until events feed it anew."""
        tree = self._trees.get(worker)
        if tree is not None and tree.event_fed:
            tree.event_fed = False
            self._evict(tree)

    def load_snapshot(self, worker: str, blocks: Sequence[int]) -> None:
        self.reset(worker)
        tree = self._trees.get(worker)
        if tree is not None:
            tree.event_fed = True
        self.insert(worker, blocks)

    def _evict(self, tree: _WorkerTree) -> None:
        lru, bound = tree.lru, tree.bound
        while len(lru) > bound:
            h, _ = lru.popitem(last=False)
            tree.reused.pop(h, None)
            self._drop_owner(h, tree.bit)

    def _drop_owner(self, h: int, bit: int) -> None:
        rest = self._owners.get(h, 0) & ~bit
        if rest:
            self._owners[h] = rest
        else:
            self._owners.pop(h, None)
