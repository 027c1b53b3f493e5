"""RadixAttention's prefix cache: a radix tree over token ids whose edges own KV slots.

Each node's edge is a run of token ids (`key`) and the KV slots that hold them (`value`), so a
root-to-node path spells a prefix and its KV. The tree is the *ground truth* of what this worker
can reuse; the gateway learns it through the events every change emits.

Ownership and locking (the invariants `check` verifies):
- every KV slot is free in the pool, owned by exactly one tree node, or owned by one request;
- a node with `lock_ref > 0` is on the path of an in-flight request and is never evicted;
  `lock(node)` pins the whole path to the root, so `evictable_size + protected_size == total`;
- `insert` returns how many leading tokens were already present: the caller still owns its
  duplicate slots for that range and must free them; the tree takes the rest.

Namespaces (a cache salt, an adapter id) get separate roots: requests that must not share KV never
match each other. Keys are page-aligned when `page_size > 1`.

Eviction frees unlocked leaves in the order a policy gives (`radixpool.worker.mem.eviction`:
LRU by default, LFU with ageing, probation for never-reused leaves); the policy never changes
which nodes may go, only which go first. Of the last leaf it takes, eviction frees only the tail
it still needs: the head stays cached.

Slot runs are int64 tensors on the pool's device in the engine; `SlotRuns` is the seam that lets
the simulated workers of the routing benchmark run this same class over plain `range`s, without
torch (the gateway's environment does not have it).

Events: every store / remove / clear appends a `KVEvent` (monotonic `seq`) naming the whole
blocks of `block_size` tokens that appeared or vanished, as chained hashes
(`radixpool.protocol.kv_blocks`).
Each node keeps the chain states of the blocks that *end* inside its edge, so a split partitions
them and a store hashes only the new blocks. `block_hashes` maps every present block to its node
(the scheduler's incremental longest-prefix-match ordering reads it).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from radixpool.protocol.kv_blocks import (
    KVEvent,
    as_token_array,
    chain_states,
    namespace_seed,
    prefix_block_hashes,
    publish,
)
from radixpool.worker.mem.eviction import EvictionPolicy, make_eviction_policy

if TYPE_CHECKING:
    import torch

_EMPTY_STATES = np.empty(0, dtype=np.uint64)
# An eviction orders every unlocked leaf (O(leaves)), so each one frees at least this share of
# the pool: a full pool in decode, where every step needs a few pages, then pays for that once
# in many steps instead of at every step (5,000 leaves: ~12 ms on a slow CPU core).
EVICT_AT_LEAST = 1 / 256


class SlotRuns(Protocol):
    """How the cache makes, joins and keeps runs of KV slot indices (sliceable, `len`-able)."""

    def empty(self) -> Any: ...

    def concat(self, runs: Sequence[Any]) -> Any: ...

    def own(self, run: Any) -> Any:
        """A copy the tree may keep (not a view into the caller's buffer)."""


class TensorSlotRuns:
    """The engine's slot runs: int64 tensors on the KV pool's device."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = device

    def empty(self) -> torch.Tensor:
        return self._torch.empty(0, dtype=self._torch.int64, device=self.device)

    def concat(self, runs: Sequence[torch.Tensor]) -> torch.Tensor:
        return runs[0] if len(runs) == 1 else self._torch.cat(list(runs))

    def own(self, run: torch.Tensor) -> torch.Tensor:
        return run.clone()


class TreeNode:
    __slots__ = ("born", "children", "hits", "key", "last_access", "lock_ref", "namespace",
                 "parent", "priority", "seed", "start", "states", "value")

    def __init__(self, key: list[int], value: Any, parent: TreeNode | None,
                 start: int, states: np.ndarray = _EMPTY_STATES, seed: int = 0,
                 namespace: str | None = None) -> None:
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.key = key
        self.value = value
        self.parent = parent
        self.start = start            # absolute position of key[0] in the prefix
        self.states = states          # chain states of blocks ending in (start, start+len(key)]
        self.seed = seed              # the namespace's chain seed (roots only)
        self.namespace = namespace    # the cache salt it belongs to (roots only)
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0                 # matches that reused this node (eviction policies)
        self.born = 0                 # tick of the insert that created this prefix
        self.priority = 0.0           # the eviction policy's own score (LFU)

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def chain_state(self) -> int:
        """Chain state after the last whole block ending at or before this node's end."""
        node = self
        while node.parent is not None and len(node.states) == 0:
            node = node.parent
        return node.seed if node.parent is None else int(node.states[-1])


@dataclass
class MatchResult:
    slots: Any            # KV slots of the matched prefix, in order
    node: TreeNode        # deepest matched node (the one to lock)

    @property
    def length(self) -> int:
        return len(self.slots)


class RadixCache:
    def __init__(self, pool, page_size: int = 1, block_size: int = 16,
                 eviction_policy: str | EvictionPolicy = "lru",
                 slot_runs: SlotRuns | None = None) -> None:
        if block_size % page_size:
            raise ValueError(f"block_size ({block_size}) must be a multiple of page_size")
        self.pool = pool
        self.page_size = page_size
        self.block_size = block_size
        self.policy = make_eviction_policy(eviction_policy)
        self.runs = slot_runs or TensorSlotRuns(pool.device)
        self._tick = itertools.count(1)
        self._seq = 0
        self.events: list[KVEvent] = []
        self.block_hashes: dict[int, TreeNode] = {}
        self.evicted_tokens_total = 0
        self.evict_floor = self._aligned(int(pool.capacity * EVICT_AT_LEAST))
        self.reset(emit=False)

    # ------------------------------------------------------------------ accounting
    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def reset(self, emit: bool = True) -> None:
        """Drop everything (only when no request holds a lock). Frees every cached slot."""
        roots = getattr(self, "_roots", {})
        for root in roots.values():
            for node in _walk(root):
                if node is not root:
                    self.pool.free(node.value)
        self._roots: dict[str | None, TreeNode] = {}
        self._leaves: set[TreeNode] = set()
        self.block_hashes.clear()
        self.evictable_size = 0
        self.protected_size = 0
        if emit:
            self._emit("cleared")

    def _root(self, namespace: str | None, create: bool) -> TreeNode:
        """The namespace's root. Only an insert keeps a new one (`create`): a match, probe or
        discard in a namespace with nothing cached gets a detached empty root, and a root goes
        when its last child is removed, so cache salts that come and go (one per user) leave
        nothing behind."""
        # "" is no salt, as in the block hashes (`namespace_seed`): one tree per chain seed, or
        # two trees would hold the same hashes and `block_hashes` lose track of them
        namespace = namespace or None
        root = self._roots.get(namespace)
        if root is None:
            root = TreeNode([], self.runs.empty(), None, 0, seed=namespace_seed(namespace),
                            namespace=namespace)
            root.lock_ref = 1  # roots are never evicted
            if create:
                self._roots[namespace] = root
        return root

    def _child_key(self, key: list[int], offset: int) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return key[offset]
        return tuple(key[offset:offset + self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchResult:
        """Longest cached prefix of `key`; splits the last edge if the match ends inside it."""
        node, _, values = self._walk(key, namespace, split=True, touch=True, hit=True)
        return MatchResult(self.runs.concat(values) if values else self.runs.empty(), node)

    def probe(self, key: list[int], namespace: str | None = None) -> int:
        """How many leading tokens of `key` are cached: no split, no LRU update."""
        return self._walk(key, namespace, split=False, touch=False)[1]

    def _walk(self, key: list[int], namespace: str | None, split: bool, touch: bool,
              hit: bool = False, create: bool = False):
        node = self._root(namespace, create)
        tick = next(self._tick) if touch else 0
        limit = self._aligned(len(key))
        offset, values = 0, []
        while offset < limit:
            child = node.children.get(self._child_key(key, offset))
            if child is None:
                break
            n = self._aligned(_common_len(child.key, key, offset, limit))
            if touch:
                child.last_access = tick
            if n < len(child.key):
                if n and split:
                    child = self._split(child, n)
                    values.append(child.value)
                    node = child
                    if hit:
                        self._reused(child)
                offset += n
                break
            values.append(child.value)
            node, offset = child, offset + n
            if hit:
                self._reused(child)
        return node, offset, values

    def _reused(self, node: TreeNode) -> None:
        node.hits += 1
        self.policy.reused(node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node."""
        cut = child.start + n
        # Blocks are attributed to the node their last token is in: (start, cut] vs (cut, end].
        num_upper_blocks = cut // self.block_size - child.start // self.block_size
        upper = TreeNode(child.key[:n], child.value[:n], child.parent, child.start,
                         child.states[:num_upper_blocks])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hits, upper.priority, upper.born = child.hits, child.priority, child.born
        upper.children[self._child_key(child.key, n)] = child
        child.parent.children[self._child_key(child.key, 0)] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:]
        child.states = child.states[num_upper_blocks:]
        child.start = cut
        for h in publish(upper.states).tolist():
            self.block_hashes[h] = upper
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, key: list[int], slots: Any, namespace: str | None = None) -> int:
        """Cache `key[:len(slots)]` (page-aligned). Returns the length that was already present.

        The caller keeps ownership of `slots[:returned]` (duplicates to free, or its own locked
        prefix) and hands the tree `slots[returned:aligned_len]`.
        """
        return self.insert_path(key, slots, namespace)[0]

    def insert_path(self, key: list[int], slots: Any, namespace: str | None = None
                    ) -> tuple[int, TreeNode, list[Any]]:
        """`insert`, also returning the node now ending at the aligned end of `key` (the one to
        lock) and the tree's slot tensors for the already-present part, edge by edge."""
        length = self._aligned(min(len(key), len(slots)))
        node, present, values = self._walk(key[:length], namespace, split=True, touch=True,
                                           create=True)
        if present < length:
            node = self._add_leaf(node, key, slots, present, length)
        return present, node, values

    def _add_leaf(self, parent: TreeNode, key: list[int], slots: Any,
                  start: int, end: int) -> TreeNode:
        bs = self.block_size
        first_block = start // bs  # first block that ends after `start`
        tokens = as_token_array(key[first_block * bs:end])
        states = chain_states(tokens, bs, parent.chain_state())
        leaf = TreeNode(key[start:end], self.runs.own(slots[start:end]), parent, start, states)
        leaf.last_access = leaf.born = next(self._tick)
        self.policy.created(leaf)
        parent.children[self._child_key(key, start)] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self.evictable_size += end - start
        if len(states):
            hashes = publish(states)
            for h in hashes.tolist():
                self.block_hashes[h] = leaf
            parent_hash = None if first_block == 0 else \
                int(publish(np.array([parent.chain_state()], dtype=np.uint64))[0])
            self._emit("stored", tuple(hashes.tolist()), parent_hash)
        return leaf

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """Pin the path root→node: none of it can be evicted until `unlock`."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                if not node.children:
                    self._leaves.add(node)
            node = node.parent

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` cached slots if possible: unlocked leaves, in the eviction
        policy's order (a parent whose last child goes becomes a candidate at once).

        The last leaf taken loses only the tail that is still needed, rounded up to whole
        pages; its head stays cached (and first in line next time). Freeing the whole leaf
        would drop tokens nobody needed the room of yet: a 512-token question would cost a
        whole 8,192-token system prompt, which the next request of that group computes again.
        A policy with `trims_leaves` False (SGLang's orders, for comparison) frees whole
        leaves. Asked for any, it frees at least `evict_floor` tokens (1/256 of the pool).
        Returns what was freed.
        """
        if num_tokens <= 0:
            return 0
        num_tokens = max(num_tokens, self.evict_floor)
        now = next(self._tick)
        policy = self.policy
        heap = [(policy.key(n, now), id(n), n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            keep = self._aligned(len(leaf.key) - (num_tokens - freed))
            if keep > 0 and policy.trims_leaves:
                freed += self._trim_leaf(leaf, keep)
                break
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            if self._became_leaf(parent):
                heapq.heappush(heap, (policy.key(parent, now), id(parent), parent))
        self.evicted_tokens_total += freed
        return freed

    def discard(self, key: list[int], start: int, namespace: str | None = None) -> int:
        """Drop the cached KV of `key` from token `start` on (from the page it is in), and of
        every prefix continuing it, whose values were computed attending to it: the nodes
        below that point that no request holds locked. Returns the tokens freed."""
        start -= start % self.page_size
        node, offset, _ = self._walk(key[:start], namespace, split=True, touch=False)
        top = node.children.get(self._child_key(key, offset)) if offset == start < len(key) \
            else None
        if top is None:
            return 0
        freed, stack = 0, [top]
        below: list[TreeNode] = []
        while stack:   # parents before children; removed in reverse, leaves first
            below.append(stack.pop())
            stack.extend(below[-1].children.values())
        for n in reversed(below):
            if n.lock_ref == 0 and not n.children:
                freed += self._remove_leaf(n)
        self._became_leaf(node)
        self.evicted_tokens_total += freed
        return freed

    def _became_leaf(self, node: TreeNode) -> bool:
        """After its children went: an unlocked node other than a root is now an eviction
        candidate."""
        if node.parent is None or node.children or node.lock_ref:
            return False
        self._leaves.add(node)
        return True

    def _trim_leaf(self, leaf: TreeNode, keep: int) -> int:
        """Free the edge of `leaf` past its first `keep` tokens (page-aligned); the leaf stays.
        Costs only the freed part (no new node, no rehashing of the kept blocks)."""
        num_kept_blocks = (leaf.start + keep) // self.block_size - leaf.start // self.block_size
        self.policy.evicted(leaf)
        self.pool.free(leaf.value[keep:])
        freed = len(leaf.key) - keep
        gone = leaf.states[num_kept_blocks:]
        leaf.key, leaf.value = leaf.key[:keep], leaf.value[:keep]
        leaf.states = leaf.states[:num_kept_blocks]
        self.evictable_size -= freed
        if len(gone):
            hashes = publish(gone).tolist()
            for h in hashes:
                self.block_hashes.pop(h, None)
            self._emit("removed", tuple(hashes))
        return freed

    def _remove_leaf(self, leaf: TreeNode) -> int:
        self.policy.evicted(leaf)
        self.pool.free(leaf.value)
        parent = leaf.parent
        del parent.children[self._child_key(leaf.key, 0)]
        if parent.parent is None and not parent.children \
                and self._roots.get(parent.namespace) is parent:
            # A request that matched nothing here may still hold this root: locks skip roots,
            # and its insert walks from the namespace's root of that moment.
            del self._roots[parent.namespace]
        self._leaves.discard(leaf)
        self.evictable_size -= len(leaf.key)
        if len(leaf.states):
            hashes = publish(leaf.states).tolist()
            for h in hashes:
                self.block_hashes.pop(h, None)
            self._emit("removed", tuple(hashes))
        return len(leaf.key)

    # ------------------------------------------------------------------ events
    def announce(self, tokens: list[int], namespace: str | None) -> np.ndarray:
        """A request joined the queue: say which whole blocks its prompt names (`queued`), so
        that every gateway following the events knows where it went before its prefill ends.
        The tree does not change. Returns the hashes (the waiting queue ranks by them)."""
        hashes = prefix_block_hashes(tokens, self.block_size, namespace)
        if len(hashes):
            self._emit("queued", tuple(hashes.tolist()))
        return hashes

    def _emit(self, kind: str, blocks: tuple[int, ...] = (), parent: int | None = None) -> None:
        self._seq += 1
        self.events.append(KVEvent(self._seq, kind, blocks, parent))  # type: ignore[arg-type]

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> tuple[int, list[int]]:
        """(seq, every block hash held) — consistent with the events up to `seq`."""
        return self._seq, list(self.block_hashes)

    # ------------------------------------------------------------------ invariants
    def nodes(self) -> Iterator[TreeNode]:
        for root in self._roots.values():
            yield from (n for n in _walk(root) if n.parent is not None)

    def check(self) -> None:
        """Assert the tree's own invariants (sizes, leaves, hashes). O(tree)."""
        evictable = protected = 0
        hashes = 0
        for node in self.nodes():
            assert len(node.key) == len(node.value) > 0, "edge key/value length mismatch"
            assert node.start == node.parent.end, "edge offsets out of order"
            assert node.parent.parent is None or node.parent.hits >= node.hits, \
                "a child reused more often than its parent"
            if node.lock_ref:
                protected += len(node.key)
                assert node.parent.parent is None or node.parent.lock_ref >= node.lock_ref
            else:
                evictable += len(node.key)
            is_leaf = not node.children and node.lock_ref == 0
            assert is_leaf == (node in self._leaves), "leaf set out of date"
            hashes += len(node.states)
        assert evictable == self.evictable_size, (evictable, self.evictable_size)
        assert protected == self.protected_size, (protected, self.protected_size)
        assert hashes == len(self.block_hashes), "block hash index out of date"


def _walk(root: TreeNode) -> Iterator[TreeNode]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _common_len(edge: list[int], key: list[int], offset: int, limit: int) -> int:
    """Length of the common prefix of `edge` and `key[offset:limit]` (list compares run in C)."""
    n = min(len(edge), limit - offset)
    if edge[:n] == key[offset:offset + n]:
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo:mid] == key[offset + lo:offset + mid]:
            lo = mid
        else:
            hi = mid
    return lo
