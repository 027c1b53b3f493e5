"""The gateway's per-worker prefix trees: matching, bounded LRU eviction, corrections, events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixpool.gateway.prefix_index import STALE_EPOCHS, PrefixIndex
from radixpool.protocol.kv_blocks import KVEvent, prefix_block_hashes


def chain(tokens: list[int], block: int = 4, ns: str | None = None) -> list[int]:
    return prefix_block_hashes(tokens, block, ns).tolist()


def test_match_reports_each_workers_leading_blocks():
    index = PrefixIndex()
    index.add_worker("a", 100)
    index.add_worker("b", 100)
    shared = list(range(16))
    index.insert("a", chain(shared + [100] * 8))
    index.insert("b", chain(shared))
    depth = index.match(chain(shared + [100] * 8 + [7] * 4))
    assert depth == {"a": 6, "b": 4}
    assert index.match(chain([9] * 8)) == {}


def test_namespaces_never_share_blocks():
    index = PrefixIndex()
    index.add_worker("a", 100)
    index.insert("a", chain(list(range(16)), ns="tenant-1"))
    assert index.match(chain(list(range(16)), ns="tenant-2")) == {}
    assert index.match(chain(list(range(16)), ns="tenant-1")) == {"a": 4}


def test_tree_is_bounded_and_evicts_least_recent_leaves_first():
    index = PrefixIndex()
    index.add_worker("a", 6)
    old = chain([1] * 16)          # 4 blocks
    new = chain([2] * 16)          # 4 blocks
    index.insert("a", old)
    index.insert("a", new)
    assert index.size("a") == 6
    # the two leaves of the older prompt went first; its first two blocks are still matched
    assert index.match(old) == {"a": 2}
    assert index.match(new) == {"a": 4}


def test_capacity_shrink_evicts_and_removed_worker_disappears():
    index = PrefixIndex()
    index.add_worker("a", 10)
    index.add_worker("b", 10)
    hashes = chain(list(range(32)))
    index.insert("a", hashes)
    index.insert("b", hashes)
    index.set_capacity("a", 3)
    assert index.match(hashes) == {"a": 3, "b": 8}
    index.remove_worker("b")
    assert index.match(hashes) == {"a": 3}
    index.add_worker("c", 10)  # reuses b's slot: must start empty
    assert index.match(hashes) == {"a": 3}


def test_trim_through_forgets_everything_touched_no_later():
    index = PrefixIndex()
    index.add_worker("a", 100)
    first, second, third = chain([1] * 8), chain([2] * 8), chain([3] * 8)
    index.insert("a", first)
    index.insert("a", second)
    epochs = index.insert("a", third, matched=0)
    assert epochs == []
    prior = index.insert("a", second, matched=2)   # re-touch: returns the epochs it had
    removed = index.trim_through("a", prior[0])     # the worker lost block 0 of `second`
    assert removed == 2                              # `first` went with it (older by LRU)
    assert index.match(first) == {}
    assert index.match(second) == {"a": 2}           # re-touched after the trim point
    assert index.match(third) == {"a": 2}


def test_remove_undoes_an_optimistic_insert_and_reset_forgets_all():
    index = PrefixIndex()
    index.add_worker("a", 100)
    hashes = chain(list(range(24)))
    index.insert("a", hashes[:2])
    index.insert("a", hashes, matched=2)
    index.remove("a", hashes[2:])
    assert index.match(hashes) == {"a": 2}
    index.reset("a")
    assert index.match(hashes) == {} and index.size("a") == 0


def test_kv_events_apply_exact_stores_removals_and_clears():
    index = PrefixIndex()
    index.add_worker("a", 100)
    hashes = chain(list(range(24)))
    index.apply_event("a", KVEvent(1, "stored", tuple(hashes[:4]), None))
    index.apply_event("a", KVEvent(2, "stored", tuple(hashes[4:]), hashes[3]))
    assert index.match(hashes) == {"a": 6}
    index.apply_event("a", KVEvent(3, "removed", tuple(hashes[3:])))
    assert index.match(hashes) == {"a": 3}
    index.apply_event("a", KVEvent(4, "cleared"))
    assert index.match(hashes) == {}
    index.load_snapshot("a", hashes[:5])
    assert index.match(hashes) == {"a": 5}


def test_a_queued_prompt_joins_the_tree_unless_it_is_already_predicted_there():
    """A `queued` event names a prompt another gateway sent to the worker: its blocks join that
    worker's tree as a prediction. This gateway's own request, already predicted there, changes
    nothing, not even the clock that ages reused prefixes."""
    index = PrefixIndex()
    index.add_worker("a", 100)
    index.add_worker("b", 100)
    theirs, ours = chain(list(range(24))), chain(list(range(100, 124)))
    index.apply_event("a", KVEvent(1, "queued", tuple(theirs)))
    assert index.match(theirs) == {"a": 6}
    index.insert("b", ours)
    epoch = index._epoch
    index.apply_event("b", KVEvent(2, "queued", tuple(ours)))
    assert index._epoch == epoch and index.match(ours) == {"b": 6}
    index.apply_event("b", KVEvent(3, "queued", tuple(theirs)))   # also queued on b
    assert index.match(theirs) == {"a": 6, "b": 6}


prompts = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(prompts=prompts, capacity=st.integers(1, 20), workers=st.integers(1, 3))
def test_matches_equal_a_naive_model_and_size_stays_bounded(prompts, capacity, workers):
    """Against a plain per-worker list of (hash, last use) kept in LRU order."""
    index = PrefixIndex()
    names = [f"w{i}" for i in range(workers)]
    naive: dict[str, list[int]] = {n: [] for n in names}   # LRU order, most recent last
    for n in names:
        index.add_worker(n, capacity)
    for i, tokens in enumerate(prompts):
        hashes = chain(tokens, block=2)
        name = names[i % workers]
        expected = {}
        for n in names:
            held = set(naive[n])
            k = 0
            while k < len(hashes) and hashes[k] in held:
                k += 1
            if k:
                expected[n] = k
        assert index.match(hashes) == expected
        order = naive[name]
        for h in reversed(hashes):
            if h in order:
                order.remove(h)
            order.append(h)
        del order[: max(0, len(order) - capacity)]
        index.insert(name, hashes)
        assert index.size(name) == len(order) <= capacity


def test_a_worker_with_kv_events_keeps_what_its_events_say_not_the_trees_lru():
    """A worker that evicts by reuse (LFU, probation) keeps an old system prompt that an LRU
    guess would drop: once events flow, a short report does not sweep the tree, and the tree's
    own LRU bound no longer evicts at exactly the capacity."""
    index = PrefixIndex()
    index.add_worker("a", 8)
    system = chain([1] * 16)  # 4 blocks, stored and reused on the worker
    index.apply_event("a", KVEvent(1, "stored", tuple(system), None))
    question = chain([1] * 16 + [2] * 16)[4:]
    epochs = index.insert("a", system + question, matched=4)
    index.insert("a", chain([3] * 16))
    index.insert("a", chain([4] * 16))  # 16 blocks believed held: twice the capacity
    assert index.match(system) == {"a": 4}, "the tree's LRU dropped a prefix events vouch for"
    assert index.trim_through("a", epochs[0]) == 0
    assert index.match(system) == {"a": 4}
    index.apply_event("a", KVEvent(2, "removed", tuple(question), None))
    assert index.match(system + question) == {"a": 4}


def test_a_reused_prefix_takes_room_until_no_request_has_matched_it_for_long():
    index = PrefixIndex()
    for w in ("a", "b"):
        index.add_worker(w, 64)
        index.set_eviction_policy(w, "probation")
    history = chain(list(range(80)))                 # 20 blocks
    index.insert("a", history)
    index.insert("a", history, matched=20)           # the next turn reused it
    assert index.room("a") == 44
    for i in range(STALE_EPOCHS // 2):               # traffic elsewhere
        index.insert("b", chain([10_000 + i] * 4))
    index.insert("a", history[:5], matched=5)        # a shorter prompt reuses its first blocks
    for i in range(STALE_EPOCHS // 2 + 1):
        index.insert("b", chain([20_000 + i] * 4))
    assert index.room("a") == 64 - 5                 # the rest went stale: a finished conversation
    assert index.match(history)["a"] == 20           # still cached as far as routing knows
