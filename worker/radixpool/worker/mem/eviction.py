"""Which unreferenced leaf of the radix cache is freed first (`--eviction-policy`).

The cache only ever evicts leaves with no lock (a parent becomes a candidate once its last child
is gone), so every policy keeps the tree's invariants; a policy only orders the candidates. Each
node carries `last_access` (a tick, bumped by every match and insert that walks through it) and
`hits` (how many `match_prefix` calls reused it: a request that found it cached) and `born` (the
tick of the insert that created it; a split keeps it). A parent's
`hits` is never below a child's, since every match reaching the child passes through the parent.

- `lru`: least recently used first (the default, as in SGLang).
- `lfu`: least frequently reused first, with dynamic ageing (LFU-DA): a node's priority is set
  when it is reused to `hits + 1 + age`, where `age` is the priority of the last node evicted.
  A prefix that was hot long ago ages out; a new leaf starts at `age + 1`, level with the
  coldest survivors, instead of below everything ever reused. Ties: least recently used.
- `probation`: a leaf nobody has reused yet (a question asked once, a prompt seen once) is on
  probation and goes first, oldest first; prefixes that were reused go after, least recently
  used first. A stream of one-off requests then churns through the probation space instead of
  pushing out the shared prefixes (system prompts, conversation histories) that pay for the
  cache. A reused prefix that has gone unused for more than `STALE_AFTER_INTERVALS` of its own
  mean reuse intervals (ticks since it was created / hits) is stale and goes back among the
  probation leaves, by recency: without this, histories of finished conversations stay
  protected forever and fresh conversation tails are evicted before them.
"""

from __future__ import annotations

from typing import Protocol

from radixpool.worker.config import EVICTION_POLICIES

# probation: a reused node idle for more than this many of its own mean reuse intervals is stale
# (a finished conversation's history) and competes with the probation leaves again, by recency.
STALE_AFTER_INTERVALS = 8


class EvictableNode(Protocol):
    last_access: int
    born: int
    hits: int
    priority: float


class EvictionPolicy:
    """Orders eviction candidates: the leaf with the smallest `key` goes first."""

    name = "lru"
    # Eviction may free only the tail of the last leaf it takes (`RadixCache.evict`).
    trims_leaves = True

    def key(self, node: EvictableNode, now: int) -> tuple:
        return (node.last_access,)

    def created(self, node: EvictableNode) -> None:
        """A new leaf entered the tree."""

    def reused(self, node: EvictableNode) -> None:
        """`node.hits` was just incremented by a match."""

    def evicted(self, node: EvictableNode) -> None:
        """`node` (or the tail of its edge) is leaving the tree."""


class LFUWithAgeing(EvictionPolicy):
    name = "lfu"

    def __init__(self) -> None:
        self.age = 0.0

    def key(self, node: EvictableNode, now: int) -> tuple:
        return (node.priority, node.last_access)

    def created(self, node: EvictableNode) -> None:
        node.priority = self.age + 1

    def reused(self, node: EvictableNode) -> None:
        node.priority = self.age + 1 + node.hits

    def evicted(self, node: EvictableNode) -> None:
        self.age = max(self.age, node.priority)


class Probation(EvictionPolicy):
    name = "probation"

    def key(self, node: EvictableNode, now: int) -> tuple:
        if not node.hits:
            return (False, node.last_access)
        interval = max(1.0, (node.last_access - node.born) / node.hits)
        return (now - node.last_access <= STALE_AFTER_INTERVALS * interval, node.last_access)


def make_eviction_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """The policy called `name`, or `name` itself when it is already a policy (a benchmark's
    own ordering, e.g. `bench/simfleet/sglang_eviction.py`)."""
    if isinstance(name, EvictionPolicy):
        return name
    if name == "lru":
        return EvictionPolicy()
    if name == "lfu":
        return LFUWithAgeing()
    if name == "probation":
        return Probation()
    raise ValueError(f"eviction_policy must be one of {' | '.join(EVICTION_POLICIES)}, "
                     f"got {name!r}")
