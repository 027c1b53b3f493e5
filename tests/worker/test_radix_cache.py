"""The radix cache under random workloads: slots accounted for, locks respected, events exact."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.simfleet.sglang_eviction import BENCH_EVICTION_POLICIES
from bench.simfleet.sglang_eviction import eviction_policy as bench_eviction
from radixpool.protocol.kv_blocks import prefix_block_hashes
from radixpool.worker.mem.kv_pool import KVPool
from radixpool.worker.mem.radix_cache import RadixCache

CAPACITY = 256


def make_cache(page_size: int = 1, block_size: int = 4, policy: str = "lru",
               capacity: int = CAPACITY) -> RadixCache:
    """`policy`: a worker's `--eviction-policy`, or one of the benchmark's SGLang orders."""
    pool = KVPool(capacity, page_size, num_layers=1, num_kv_heads=1, head_dim=1,
                  dtype=torch.float32, device="cpu")
    return RadixCache(pool, page_size=page_size, block_size=block_size,
                      eviction_policy=bench_eviction(policy))


class Client:
    """Plays requests against the cache the way the scheduler does, and owns their slots."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self.held: list[tuple[object, torch.Tensor]] = []  # (locked node, request-owned slots)
        self.replayed: set[int] = set()

    def run(self, key: list[int], hold: bool, namespace: str | None = None) -> bool:
        cache, pool = self.cache, self.cache.pool
        match = cache.match_prefix(key, namespace)
        cache.lock(match.node)
        need = len(key) - match.length
        if pool.available_size() < need:
            cache.evict(need - pool.available_size())
        new = pool.alloc(need) if need else torch.empty(0, dtype=torch.int64)
        if new is None:
            cache.unlock(match.node)
            return False
        slots = torch.cat([match.slots, new])
        present = cache.insert(key, slots, namespace)
        aligned = len(key) - len(key) % cache.page_size
        # The request computed [match.length, present) itself although the tree has it: free.
        pool.free(slots[match.length:present])
        tail = slots[aligned:]
        cache.unlock(match.node)
        if hold:
            node = cache.match_prefix(key, namespace).node
            cache.lock(node)
            self.held.append((node, tail))
        else:
            pool.free(tail)
        return True

    def release(self, index: int) -> None:
        node, tail = self.held.pop(index)
        self.cache.unlock(node)
        self.cache.pool.free(tail)

    def check(self) -> None:
        cache = self.cache
        cache.check()
        owned: list[int] = []
        for node in cache.nodes():
            owned.extend(node.value.tolist())
        ps = cache.page_size
        for _, tail in self.held:  # a request owns the whole page its last tokens sit in
            owned.extend(p * ps + i for p in set((tail // ps).tolist()) for i in range(ps))
        free = cache.pool.free_slots_set()
        assert len(owned) == len(set(owned)), "a slot is owned twice"
        assert not free & set(owned), "a slot is both free and owned"
        all_slots = set(range(cache.page_size, (cache.pool.num_pages + 1) * cache.page_size))
        assert free | set(owned) == all_slots, "a slot leaked"
        for node, _ in self.held:  # locked paths are still attached to the tree
            while node.parent is not None:
                assert node.parent.children[cache._child_key(node.key, 0)] is node
                node = node.parent
        # Replaying the event stream gives exactly the blocks the tree holds.
        for event in cache.drain_events():
            if event.type == "stored":
                assert not self.replayed & set(event.blocks)
                self.replayed |= set(event.blocks)
            elif event.type == "removed":
                assert set(event.blocks) <= self.replayed
                self.replayed -= set(event.blocks)
            else:
                self.replayed.clear()
        assert self.replayed == set(cache.block_hashes)


def expected_blocks(cache: RadixCache, namespace: str | None = None) -> set[int]:
    out: set[int] = set()
    for node in cache.nodes():
        path, cur = [], node
        while cur.parent is not None:
            path[:0] = cur.key
            cur = cur.parent
        out |= set(prefix_block_hashes(path, cache.block_size, namespace).tolist())
    return out


keys = st.lists(st.integers(0, 3), min_size=1, max_size=40)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("run"), keys, st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(1, 64)),
        st.tuples(st.just("discard"), keys, st.integers(0, 40)),
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, page_size=st.sampled_from([1, 2, 4]),
       policy=st.sampled_from(BENCH_EVICTION_POLICIES))
def test_random_workload_keeps_every_invariant(ops, page_size, policy):
    cache = make_cache(page_size=page_size, block_size=4, policy=policy)
    client = Client(cache)
    for op in ops:
        if op[0] == "run":
            client.run(op[1], hold=op[2])
        elif op[0] == "release" and client.held:
            client.release(op[1] % len(client.held))
        elif op[0] == "evict":
            locked_before = [node for node, _ in client.held]
            cache.evict(op[1])
            for node in locked_before:
                assert node.lock_ref > 0
        elif op[0] == "discard":
            before = cache.total_size
            freed = cache.discard(op[1], op[2])
            assert cache.total_size == before - freed
            start = op[2] - op[2] % page_size
            if start < len(op[1]) and not client.held:   # nothing locked: nothing past it stays
                assert cache.probe(op[1]) <= start
        client.check()
    assert set(cache.block_hashes) == expected_blocks(cache)
    while client.held:
        client.release(0)
    cache.evict(CAPACITY)
    client.check()
    assert cache.total_size == 0
    assert cache.pool.available_size() == cache.pool.capacity


def test_discard_drops_a_prefix_from_a_token_on_with_every_continuation_not_locked():
    cache = make_cache(block_size=2)
    client = Client(cache)
    client.run([1, 2, 3, 4, 5, 6], hold=False)
    client.run([1, 2, 3, 4, 7, 8], hold=False)   # continues the poisoned part: its KV too
    client.run([1, 2, 9, 9], hold=True)          # branches off before it: kept
    client.run([1, 2, 3, 8, 8, 8], hold=True)    # continues it but is held by a request
    # [4], [5, 6] and [7, 8] go; [3] stays above the held [8, 8, 8]
    assert cache.discard([1, 2, 3, 4, 5, 6], 2) == 1 + 2 + 2
    assert cache.probe([1, 2, 3, 4, 5, 6]) == 3 and cache.probe([1, 2, 3, 4, 7, 8]) == 3
    assert cache.probe([1, 2, 9, 9]) == 4 and cache.probe([1, 2, 3, 8, 8, 8]) == 6
    client.check()   # invariants, and the events removed exactly what went
    while client.held:
        client.release(0)
    assert cache.discard([1, 2, 3], 2) == 1 + 3
    assert cache.probe([1, 2, 3, 8, 8, 8]) == 2 and cache.probe([1, 2, 9, 9]) == 4
    assert cache.discard([7, 7], 0) == 0   # nothing cached there
    client.check()


def test_match_splits_and_reports_shared_length():
    cache = make_cache()
    client = Client(cache)
    client.run([1, 2, 3, 4, 5, 6], hold=False)
    assert cache.probe([1, 2, 3, 9]) == 3
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.length == 3 and match.node.key == [1, 2, 3]
    assert cache.probe([1, 2, 3, 4, 5, 6, 7]) == 6
    client.check()


def test_insert_returns_already_present_length():
    cache = make_cache()
    Client(cache).run([5, 6, 7, 8], hold=False)
    slots = cache.pool.alloc(6)
    assert cache.insert([5, 6, 7, 8, 9, 10], slots) == 4
    cache.pool.free(slots[:4])
    assert cache.probe([5, 6, 7, 8, 9, 10]) == 6


def test_locked_prefix_survives_eviction_and_lru_goes_first():
    cache = make_cache()
    client = Client(cache)
    client.run([1] * 10, hold=True)
    client.run([2] * 10, hold=False)
    client.run([3] * 10, hold=False)
    cache.match_prefix([2] * 10)  # touch: [3]* is now least recently used
    assert cache.evict(10) == 10
    assert cache.probe([3] * 10) == 0 and cache.probe([2] * 10) == 10
    cache.evict(CAPACITY)
    assert cache.probe([1] * 10) == 10  # locked
    client.check()


def test_eviction_frees_only_the_tail_it_needs_and_keeps_the_head_cached():
    cache = make_cache(block_size=4)
    client = Client(cache)
    client.run([1] * 40, hold=False)
    seen = len(cache.events)
    assert cache.evict(10) == 10
    assert cache.probe([1] * 41) == 30  # before: the whole leaf went, and 30 tokens with it
    removed = cache.events[seen:]
    assert [e.type for e in removed] == ["removed"]
    assert set(removed[0].blocks) == (set(prefix_block_hashes([1] * 40, 4).tolist())
                                     - set(prefix_block_hashes([1] * 30, 4).tolist()))
    assert set(cache.block_hashes) == expected_blocks(cache)
    assert cache.match_prefix([1] * 41).length == 30  # the next request reuses the head
    client.check()


def test_a_trimmed_tail_is_whole_pages():
    cache = make_cache(page_size=4, block_size=4)
    client = Client(cache)
    client.run([2] * 40, hold=False)
    assert cache.evict(5) == 8
    assert cache.probe([2] * 40) == 32
    client.check()


def test_each_eviction_frees_at_least_a_share_of_the_pool():
    """Eviction orders every leaf: a full pool in decode asks for a page per step, and paying
    that scan at every step would cost milliseconds each. It frees 1/256 of the pool at least."""
    cache = make_cache(capacity=4096)
    client = Client(cache)
    client.run([3] * 100, hold=False)
    assert cache.evict(1) == cache.evict_floor == 16
    assert cache.probe([3] * 100) == 84
    assert cache.evict(0) == 0
    client.check()


def test_a_shared_prompt_loses_only_the_room_a_full_pool_needs():
    """The issue-18 shape in miniature: the pool holds exactly four 64-token system prompts; a
    question of 8 new tokens used to cost a whole prompt, now it costs 8 tokens of one."""
    for policy in ("lru", "lfu", "probation"):
        cache = make_cache(policy=policy)
        client = Client(cache)
        prompts = [[10 + g] * 64 for g in range(4)]
        for prompt in prompts:
            client.run(prompt, hold=False)
            cache.match_prefix(prompt)  # each reused once
        assert cache.pool.available_size() == 0
        assert client.run(prompts[3] + [99] * 8, hold=False)
        held = sorted(cache.probe(p + [0]) for p in prompts)
        assert held == [56, 64, 64, 64], policy
        client.check()


def test_namespaces_never_share():
    cache = make_cache()
    client = Client(cache)
    client.run([1, 2, 3, 4, 5], hold=False, namespace="tenant-a")
    assert cache.probe([1, 2, 3, 4, 5], "tenant-a") == 5
    assert cache.probe([1, 2, 3, 4, 5], "tenant-b") == 0
    assert cache.probe([1, 2, 3, 4, 5]) == 0
    assert set(cache.block_hashes) == set(prefix_block_hashes([1, 2, 3, 4], 4, "tenant-a").tolist())


def test_an_empty_cache_salt_is_no_salt():
    """`cache_salt: ""` names the blocks as no salt does (`namespace_seed`): it must share their
    KV too. As a namespace of its own it held a second copy under the same block hashes, and
    evicting one copy dropped hashes the other still held (the snapshot and events lied, and
    `--debug-invariants` stopped the engine core)."""
    cache = make_cache()
    client = Client(cache)
    client.run([1, 2, 3, 4, 5, 6, 7, 8, 9], hold=False)
    assert cache.probe([1, 2, 3, 4, 5, 6, 7, 8, 9], "") == 9
    client.run([1, 2, 3, 4, 5, 6, 7, 8, 9], hold=False, namespace="")
    client.check()
    cache.evict(CAPACITY)
    assert cache.probe([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    client.check()


def test_a_cache_salt_per_client_does_not_grow_memory_once_its_prompts_are_evicted():
    """Clients that each send their own `cache_salt` (and probes with salts never stored) churn
    through a small cache: once their prompts are evicted nothing of them stays behind."""
    cache = make_cache()
    client = Client(cache)

    def churn(start: int, count: int) -> None:
        for i in range(start, start + count):
            assert client.run([i % 7, 1, 2, 3, 4, 5, 6, 7], hold=False, namespace=f"user-{i}")
            assert cache.probe([1, 2, 3], f"never-stored-{i}") == 0
            if i % 100 == 0:
                client.check()   # drains the events, as the engine does every step

    tracemalloc.start()
    try:
        churn(0, 2500)   # past the 4,096 salts whose chain seeds are memoized
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        churn(2500, 2000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 << 10, f"{grown:,} bytes kept for 2,000 salts no longer cached"
    assert cache.probe([4498 % 7, 1, 2, 3, 4, 5, 6, 7], "user-4498") == 8   # recent ones still hit
    client.check()


def test_events_carry_monotonic_seq_and_clear():
    cache = make_cache()
    client = Client(cache)
    client.run(list(range(12)), hold=False)
    client.run(list(range(8)) + [99] * 8, hold=False)
    cache.evict(CAPACITY)
    cache.reset()
    events = cache.drain_events()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.type for e in events][-1] == "cleared"
    stored = [e for e in events if e.type == "stored"]
    assert stored[0].parent is None and stored[1].parent is not None


def shared_prompt_then_one_offs(policy: str, one_offs: int) -> RadixCache:
    """A 64-token system prompt reused by four questions spread over other traffic, then a burst
    of one-off prompts that together need more than the rest of the pool."""
    cache = make_cache(policy=policy)
    client = Client(cache)
    system = [7] * 64
    for q in range(4):
        client.run(system + [100 + q] * 8, hold=False)
        for i in range(3):
            client.run([500 + 10 * q + i] * 24, hold=False)
    for i in range(one_offs):
        client.run([200 + i] * 24, hold=False)
        client.check()
    return cache


def test_reuse_aware_policies_keep_a_shared_prompt_that_lru_evicts():
    for policy in BENCH_EVICTION_POLICIES:
        cache = shared_prompt_then_one_offs(policy, one_offs=8)  # 192 one-off tokens
        kept = cache.probe([7] * 64 + [1])
        assert kept == (0 if policy == "lru" else 64), policy


def test_probation_lets_a_prompt_nobody_reuses_any_more_go_stale():
    cache = shared_prompt_then_one_offs("probation", one_offs=60)
    assert cache.probe([7] * 64 + [1]) == 0


def test_probation_evicts_never_reused_leaves_oldest_first():
    cache = make_cache(policy="probation")
    client = Client(cache)
    client.run([1] * 10, hold=False)
    client.run([2] * 10, hold=False)
    client.run([3] * 10, hold=False)
    cache.match_prefix([1] * 10)  # [1]* was reused: it leaves probation
    assert cache.evict(10) == 10
    assert cache.probe([2] * 10) == 0  # the oldest leaf on probation went first
    assert cache.evict(10) == 10
    assert cache.probe([3] * 10) == 0 and cache.probe([1] * 10) == 10
    client.check()


def test_lfu_ages_out_a_prefix_that_was_hot_long_ago():
    cache = make_cache(policy="lfu")
    client = Client(cache)
    client.run([9] * 40, hold=False)
    for _ in range(5):
        cache.match_prefix([9] * 40)  # hot once
    survived = []
    for i in range(60):  # then never asked again, while one-off prompts churn the pool
        client.run([300 + i] * 60, hold=False)
        survived.append(cache.probe([9] * 40) == 40)
    client.check()
    assert survived[0] and survived[2], "a hot prefix outlives the first one-off prompts"
    assert not survived[-1], "without ageing a once-hot prefix would pin its KV forever"


def test_sglang_lfu_has_no_ageing_a_once_hot_prefix_stays_forever():
    """The comparison the benchmark makes: the same churn as above under SGLang's lfu order
    (hit count, then recency) keeps the once-hot prefix to the end, pinning its KV."""
    cache = make_cache(policy="sglang-lfu")
    client = Client(cache)
    client.run([9] * 40, hold=False)
    for _ in range(5):
        cache.match_prefix([9] * 40)
    for i in range(60):
        client.run([300 + i] * 60, hold=False)
    client.check()
    assert cache.probe([9] * 40) == 40


def test_sglang_slru_protects_a_prefix_only_after_two_reuses():
    cache = make_cache(policy="sglang-slru")
    client = Client(cache)
    for tokens in ([1] * 10, [2] * 10, [3] * 10):
        client.run(tokens, hold=False)
    cache.match_prefix([2] * 10)
    cache.match_prefix([2] * 10)      # reused twice: protected
    cache.match_prefix([1] * 10)      # reused once: still probationary, though the most recent
    assert cache.evict(1) == 10 and cache.probe([3] * 10) == 0
    assert cache.evict(1) == 10 and cache.probe([1] * 10) == 0
    assert cache.probe([2] * 10) == 10
    client.check()


def test_an_unknown_eviction_policy_is_refused_naming_the_field():
    from radixpool.worker.config import EngineConfig

    with pytest.raises(ValueError, match=r"eviction_policy must be lru \| lfu \| probation"):
        EngineConfig(model_path="/m", eviction_policy="mru")
