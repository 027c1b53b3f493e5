"""Routing decisions: thresholds, the imbalance switch, owners and ties, hot prefixes, the other
policies, and the corrections that ground truth makes."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixpool.gateway import policies
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.feedback import first_missing_block, is_usage_only_event, usage_in
from radixpool.gateway.policies import (
    CacheAware,
    Candidate,
    PowerOfTwo,
    PrefixHash,
    RandomChoice,
    RoundRobin,
    make_policy,
)
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.route_key import KeyBuilder
from radixpool.protocol.kv_blocks import DEFAULT_BLOCK_SIZE

BLOCK = DEFAULT_BLOCK_SIZE


def key_of(tokens: list[int], salt: str | None = None):
    return KeyBuilder(64, 256).build("/generate", {"input_ids": tokens, "cache_salt": salt})


def cache_aware(workers=("a", "b", "c"), **config) -> CacheAware:
    index = PrefixIndex()
    for w in workers:
        index.add_worker(w, 10_000)
    return CacheAware(index, GatewayConfig(**config))


def idle(*names: str, load: int = 0) -> list[Candidate]:
    return [Candidate(n, load) for n in names]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_long_match_goes_to_its_owner_short_match_to_least_loaded():
    policy = cache_aware()
    prompt = tokens(0, 20 * BLOCK)
    first = policy.select(idle("a", "b", "c"), key_of(prompt))
    assert first.reason == "cache_miss"
    again = policy.select(idle("a", "b", "c"), key_of(prompt + tokens(999, BLOCK)))
    assert (again.worker, again.reason) == (first.worker, "cache_hit")
    assert again.predicted_blocks == 20
    # 2 of 20 blocks shared: below the 0.3 threshold, so least loaded (the owner is busier)
    short = prompt[: 2 * BLOCK] + tokens(5000, 18 * BLOCK)
    loads = [Candidate(n, 0 if n != first.worker else 3) for n in ("a", "b", "c")]
    miss = policy.select(loads, key_of(short))
    assert miss.reason == "cache_miss" and miss.worker != first.worker


def test_threshold_is_the_match_ratio():
    prompt = tokens(0, 10 * BLOCK)
    for threshold, expected in ((0.35, "cache_hit"), (0.45, "cache_miss")):
        policy = cache_aware(cache_threshold=threshold)
        owner = policy.select(idle("a", "b"), key_of(prompt[: 4 * BLOCK])).worker
        loads = [Candidate(n, 1 if n == owner else 0) for n in ("a", "b")]
        assert policy.select(loads, key_of(prompt)).reason == expected


def test_imbalance_needs_both_the_absolute_and_the_relative_gap():
    prompt = tokens(0, 10 * BLOCK)
    for loads, reason in (((70, 2), "imbalance"),      # gap 68 > 64 and 70 > 1.5 * 2
                          ((130, 90), "cache_hit"),     # gap 40: not enough
                          ((200, 140), "cache_hit")):   # gap 60 <= 64, ratio 1.43 <= 1.5
        policy = cache_aware(("a", "b"))
        policy.index.insert("a", key_of(prompt).hashes)
        decision = policy.select([Candidate("a", loads[0]), Candidate("b", loads[1])],
                                 key_of(prompt))
        assert decision.reason == reason
        assert decision.worker == ("b" if reason == "imbalance" else "a")


def test_a_swamped_worker_elsewhere_does_not_break_affinity():
    policy = cache_aware(("a", "b", "c"))
    prompt = tokens(0, 10 * BLOCK)
    policy.index.insert("a", key_of(prompt).hashes)
    cands = [Candidate("a", 5), Candidate("b", 100), Candidate("c", 0)]
    assert policy.select(cands, key_of(prompt)).worker == "a"
    cands = [Candidate("a", 100), Candidate("b", 5), Candidate("c", 0)]
    assert policy.select(cands, key_of(prompt)).reason == "imbalance"


def test_a_busy_owner_spills_to_an_idle_worker_only_when_its_queue_costs_more():
    policy = cache_aware(("a", "b"))
    prompt = tokens(0, 20 * BLOCK)
    policy.index.insert("a", key_of(prompt).hashes)
    key = key_of(prompt + tokens(900, 2 * BLOCK))   # 22 blocks, 20 cached on a
    short_queue = [Candidate("a", 3, backlog=3 * 40.0), Candidate("b", 0)]
    assert policy.select(short_queue, key).reason == "cache_hit"      # 120 + 32 < 352 cold
    long_queue = [Candidate("a", 3, backlog=3 * 150.0), Candidate("b", 0)]
    spilled = policy.select(long_queue, key)
    assert (spilled.worker, spilled.reason) == ("b", "spill")          # 450 > 352 cold
    assert policy.index.match(key.hashes) == {"a": 22, "b": 22}        # b now owns it too
    both = [Candidate("a", 3, backlog=450.0), Candidate("b", 1, backlog=40.0)]
    assert policy.select(both, key).worker == "b"  # two owners: the less loaded


def test_a_held_request_spills_only_with_twice_the_cold_prefill_waiting_at_its_owner():
    """Late binding offers a held request again at every drain: it would catch some idle
    worker far more often than an arrival does, so it copies a group only for a clear gain."""
    policy = cache_aware(("a", "b"))
    prompt = tokens(0, 20 * BLOCK)
    policy.index.insert("a", key_of(prompt).hashes)
    key = key_of(prompt + tokens(900, 2 * BLOCK))   # 22 blocks, 20 cached on a: 352 cold on b

    def standing(backlog: float) -> list[Candidate]:
        return [Candidate("a", 3, backlog=backlog, queued=backlog), Candidate("b", 0)]

    assert policy.select(standing(450.0), key).reason == "spill"      # 352 < 450 + 32
    policy.index.remove("b", key.hashes)
    assert policy.place(standing(450.0), key, threshold=100, force=False) is None  # 704 > 482
    spilled = policy.place(standing(700.0), key, threshold=100, force=False)      # 704 < 732
    assert (spilled.worker, spilled.reason) == ("b", "spill")
    policy.index.remove("b", key.hashes)
    placed = policy.place(standing(450.0), key, threshold=500, force=False)
    assert (placed.worker, placed.reason) == ("a", "late")  # the owner is no longer saturated


def test_several_owners_the_least_loaded_wins():
    policy = cache_aware(("a", "b", "c"))
    prompt = tokens(0, 8 * BLOCK)
    for w in ("a", "b"):
        policy.index.insert(w, key_of(prompt).hashes)
    cands = [Candidate("a", 5), Candidate("b", 2), Candidate("c", 0)]
    decision = policy.select(cands, key_of(prompt + tokens(900, BLOCK)))
    assert (decision.worker, decision.reason) == ("b", "cache_hit")


def test_ties_among_equally_loaded_workers_rotate():
    policy = cache_aware(("a", "b", "c", "d"))
    picks = Counter(policy.select(idle("a", "b", "c", "d"), key_of(tokens(i * 1000, 3 * BLOCK)))
                    .worker for i in range(40))
    assert set(picks) == {"a", "b", "c", "d"}
    assert max(picks.values()) - min(picks.values()) <= 1


def test_a_prefix_every_worker_holds_does_not_count():
    """Everyone holds the system prompt: the session's own history decides."""
    policy = cache_aware(("a", "b"))
    system = tokens(0, 30 * BLOCK)
    for w in ("a", "b"):
        policy.index.insert(w, key_of(system).hashes)
    history = system + tokens(5000, 4 * BLOCK)
    policy.index.insert("b", key_of(history).hashes)
    decision = policy.select([Candidate("a", 0), Candidate("b", 1)],
                             key_of(history + tokens(7000, 2 * BLOCK)))
    # 34 of 36 blocks match on b but 30 are shared: b's own 4 of the remaining 6 still count
    assert (decision.worker, decision.reason) == ("b", "cache_hit")


def sessions_per_worker(policy: CacheAware, system: list[int]) -> Counter:
    chosen: Counter = Counter()
    inflight: Counter = Counter()
    for session in range(60):
        cands = [Candidate(w, inflight[w]) for w in "abcd"]
        d = policy.select(cands, key_of(system + tokens(10_000 + 50 * session, 2 * BLOCK)))
        chosen[d.worker] += 1
        inflight[d.worker] += 1
        if session % 4 == 3:
            inflight.clear()  # requests finish
    return chosen


def test_a_hot_system_prompt_does_not_pin_new_sessions_to_one_worker():
    system = tokens(0, 40 * BLOCK)
    policy = cache_aware(("a", "b", "c", "d"))
    chosen = sessions_per_worker(policy, system)
    assert set(chosen) == {"a", "b", "c", "d"}
    assert max(chosen.values()) <= 2 * min(chosen.values())
    assert policy.hot_blocks(key_of(system).hashes, 4) == 40
    # what the plain router does (no hot-prefix base): everyone piles onto the first owner
    pinned = sessions_per_worker(cache_aware(("a", "b", "c", "d"), hot_prefix_factor=1e9), system)
    assert max(pinned.values()) >= 55


def test_demand_counting_stays_bounded_under_long_unique_prompts_and_still_sees_a_hot_prefix(
        monkeypatch):
    """Hot-prefix demand counted every block of the last 1,024 requests: long unique prompts
    (RAG over long documents) made it hundreds of MB. A window now also ends at a count of
    distinct blocks (here 2,000 instead of 262,144)."""
    monkeypatch.setattr(policies, "DEMAND_MAX_BLOCKS", 2_000, raising=False)
    policy = cache_aware(("a", "b", "c", "d"))
    system = tokens(0, 40 * BLOCK)
    for q in range(200):   # half share the system prompt, half are 300 blocks of their own
        prompt = system + tokens(10_000 + 100 * q, BLOCK) if q % 2 else \
            tokens(100_000 + 10_000 * q, 300 * BLOCK)
        policy.select(idle("a", "b", "c", "d"), key_of(prompt))
        demand = policy._demand[None]
        assert len(demand.new) < 2_000 + 300 and len(demand.old) < 2_000 + 300
    assert policy.hot_blocks(key_of(system).hashes, 4) == 40


def test_at_low_traffic_new_sessions_spread_instead_of_following_the_system_prompt():
    """Sequential sessions (every worker idle) sharing a hot system prompt: each new session
    starts on the next worker, so no worker collects every conversation's history."""
    policy = cache_aware(("a", "b", "c", "d"))
    system = tokens(0, 40 * BLOCK)
    firsts = Counter()
    for session in range(40):
        first = policy.select(idle("a", "b", "c", "d"),
                              key_of(system + tokens(10_000 + 100 * session, 3 * BLOCK)))
        firsts[first.worker] += 1
    assert min(firsts.values()) >= 8, firsts


def test_a_prefix_is_hot_by_the_traffic_of_its_own_model():
    """Two models behind one gateway share a system prompt (an A/B test): only model a's own
    traffic decides whether the prompt is hot on a's workers. Model b's requests once counted
    too, so a's sessions on it were spread over a's workers as a common prompt, and missed."""
    policy = cache_aware(("a1", "a2", "a3", "a4", "b1"))
    system = tokens(0, 40 * BLOCK)

    def key(model: str, prompt: list[int]):
        return KeyBuilder(64, 256).build("/generate", {"input_ids": prompt, "model": model})

    for q in range(40):   # all of b's traffic is on the prompt
        policy.select(idle("b1"), key("b", system + tokens(10_000 + 100 * q, BLOCK)))
    a_workers = idle("a1", "a2", "a3", "a4")
    for q in range(12):   # a quarter of a's traffic is: below the hot share for 4 workers
        prompt = system if q % 4 == 0 else tokens(50_000 + 1000 * q, 40 * BLOCK)
        policy.select(a_workers, key("a", prompt + tokens(20_000 + 100 * q, BLOCK)))
    follow = key("a", system + tokens(30_000, BLOCK))
    assert policy.hot_blocks(follow.hashes, 4, "a") == 0
    assert policy.select(a_workers, follow).reason == "cache_hit"


def test_failed_dispatch_removes_the_phantom_affinity():
    policy = cache_aware(("a", "b"))
    prompt = tokens(0, 10 * BLOCK)
    d = policy.select(idle("a", "b"), key_of(prompt))
    policy.failed(d, key_of(prompt))
    assert policy.index.match(key_of(prompt).hashes) == {}


def test_reported_miss_trims_the_tree_and_matching_report_does_not():
    policy = cache_aware(("a",))
    old = tokens(10_000, 6 * BLOCK)
    policy.select(idle("a"), key_of(old))
    prompt = tokens(0, 10 * BLOCK)
    policy.select(idle("a"), key_of(prompt))
    key = key_of(prompt + tokens(500, BLOCK))
    d = policy.select(idle("a"), key)
    assert d.predicted_blocks == 10
    n = len(prompt) + BLOCK
    assert first_missing_block(d, key, n, 10 * BLOCK) is None
    assert first_missing_block(d, key, n, 10 * BLOCK - 1) == 9
    missing = first_missing_block(d, key, n, 4 * BLOCK)
    assert missing == 4
    policy.index.trim_through("a", d.prior_epochs[missing])
    # the worker lost block 4 of the prompt, so (LRU) the older prompt is gone as well
    assert policy.index.match(key_of(old).hashes) == {}
    assert policy.index.match(key.hashes) == {"a": 11}  # just recomputed: now really cached


@pytest.mark.parametrize("events", [False, True])
def test_a_short_report_counts_a_correction_only_where_it_trims(events):
    # A tree the worker's KV events keep is never trimmed by cached_tokens, yet each short
    # report counted a correction there: tree_corrections_total{source="cached_tokens"} rose
    # on a fleet whose trees it never touched.
    from radixpool.gateway.breaker import CircuitBreaker
    from radixpool.gateway.feedback import learn
    from radixpool.gateway.health import HealthHysteresis
    from radixpool.gateway.metrics import GatewayMetrics
    from radixpool.gateway.workers import Worker

    policy = cache_aware(("a",))
    old, prompt = tokens(10_000, 6 * BLOCK), tokens(0, 10 * BLOCK)
    for earlier in (old, prompt):
        policy.select(idle("a"), key_of(earlier))
    if events:
        policy.index.load_snapshot("a", key_of(old).hashes + key_of(prompt).hashes)
    key = key_of(prompt + tokens(500, BLOCK))
    decision = policy.select(idle("a"), key)
    worker = Worker("a", HealthHysteresis(1, 1), CircuitBreaker(5, 10.0))
    metrics = GatewayMetrics()
    learn(worker, policy.index, metrics, decision, key, len(prompt) + BLOCK, 4 * BLOCK, True)
    # the worker lost block 4 of the prompt: by LRU the older prompt went too, unless the
    # events keep the tree
    assert policy.index.match(key_of(old).hashes) == ({"a": 6} if events else {})
    assert worker.corrections == ({} if events else {"cached_tokens": 1})
    assert dict(metrics.corrections) == ({} if events else {("a", "cached_tokens"): 1})


def test_a_whole_prompt_prediction_tolerates_the_unreusable_last_token():
    policy = cache_aware(("a",))
    prompt = tokens(0, 4 * BLOCK)
    policy.select(idle("a"), key_of(prompt))
    d = policy.select(idle("a"), key_of(prompt))
    assert first_missing_block(d, key_of(prompt), len(prompt), len(prompt) - 1) is None


def test_round_robin_random_and_power_of_two():
    key = key_of(tokens(0, 40))
    rr = RoundRobin()
    assert Counter(rr.select(idle("a", "b", "c"), key).worker for _ in range(30)) == \
        {"a": 10, "b": 10, "c": 10}
    rnd = RandomChoice(random.Random(1))
    assert {rnd.select(idle("a", "b", "c"), key).worker for _ in range(50)} == {"a", "b", "c"}
    p2 = PowerOfTwo(random.Random(1))
    loads = [Candidate("a", 9), Candidate("b", 0), Candidate("c", 9)]
    picks = Counter(p2.select(loads, key).worker for _ in range(60))
    assert picks["b"] > 30 and "b" in picks
    assert all(p2.select([Candidate("a", 0), Candidate("b", 5)], key).worker == "a"
               for _ in range(10))


def test_prefix_hash_is_sticky_and_bounded():
    policy = PrefixHash(load_factor=1.25)
    names = ("a", "b", "c", "d")
    owners = {policy.select(idle(*names), key_of(tokens(i * 1000, 300))).worker
              for i in range(40)}
    assert len(owners) >= 3  # keys spread over the ring
    key = key_of(tokens(0, 300))
    owner = policy.select(idle(*names), key).worker
    assert policy.select(idle(*names), key_of(tokens(0, 256) + [7] * 50)).worker == owner
    busy = [Candidate(n, 10 if n == owner else 0) for n in names]
    d = policy.select(busy, key)
    assert d.worker != owner and d.reason == "overflow"


@pytest.mark.parametrize("name", ["cache_aware", "round_robin", "random", "power_of_two",
                                  "prefix_hash"])
def test_every_policy_is_constructible_by_name(name):
    policy = make_policy(GatewayConfig(policy=name), PrefixIndex())
    assert policy.name == name


def test_usage_is_read_from_bodies_and_streams():
    assert usage_in(b'{"usage": {"prompt_tokens": 12, "prompt_tokens_details": '
                    b'{"cached_tokens": 8}}}') == (12, 8)
    assert usage_in(b'{"meta_info": {"prompt_tokens": 5, "cached_tokens": 0}}') == (5, 0)
    assert usage_in(b'{"choices": []}') is None
    assert is_usage_only_event(b'data: {"choices": [], "usage": {"prompt_tokens": 1}}')
    assert not is_usage_only_event(b'data: {"choices": [{"delta": {}}], "usage": null}')


@settings(max_examples=80, deadline=None)
@given(loads=st.lists(st.integers(0, 200), min_size=1, max_size=6),
       held=st.lists(st.integers(0, 12), min_size=6, max_size=6),
       abs_gap=st.integers(0, 80), rel_gap=st.floats(1.0, 3.0))
def test_cache_aware_decisions_respect_load_whatever_the_trees(loads, held, abs_gap, rel_gap):
    names = [f"w{i}" for i in range(len(loads))]
    policy = cache_aware(names, balance_abs_threshold=abs_gap, balance_rel_threshold=rel_gap)
    prompt = tokens(0, 12 * BLOCK)
    for name, blocks in zip(names, held):
        policy.index.insert(name, key_of(prompt).hashes[:blocks])
    cands = [Candidate(n, load) for n, load in zip(names, loads)]
    d = policy.select(cands, key_of(prompt))
    chosen = loads[names.index(d.worker)]
    low = min(loads)
    if d.reason in ("imbalance", "cache_miss", "spill"):
        assert chosen == low
    else:
        assert d.reason == "cache_hit"
        assert not (chosen - low > abs_gap and chosen > low * rel_gap)
    assert policy.index.match(key_of(prompt).hashes)[d.worker] == 12  # learned at selection


def capacity_bound(reused_on_a: int, policy_name: str = "probation") -> CacheAware:
    """Two workers of 64 blocks each; `a` holds a reused system prompt of `reused_on_a` blocks,
    `b` one of 40 blocks."""
    policy = cache_aware(("a", "b"))
    for w, size in (("a", reused_on_a), ("b", 40)):
        policy.index.set_capacity(w, 64)
        policy.index.set_eviction_policy(w, policy_name)
        system = key_of(tokens(5000 * (w == "a"), size * BLOCK)).hashes
        policy.index.insert(w, system)
        policy.index.insert(w, system, matched=size)  # a second request reused it
    return policy


def test_a_prompt_no_worker_holds_goes_where_it_evicts_no_reused_prefix():
    policy = capacity_bound(reused_on_a=10)
    cold = key_of(tokens(90_000, 30 * BLOCK))  # fits beside a's 10 reused blocks, not b's 40
    assert policy.select(idle("a", "b"), cold).worker == "a"
    # a's queue against b's damage, in tokens to compute: 6 of b's reused blocks would go (96
    # tokens computed again later), so a prefill queued at a that costs more sends it to b.
    queued_a = [Candidate("a", 2, queued=960.0), Candidate("b", 0)]   # 960 + 480 > 480 + 96
    assert policy.select(queued_a, key_of(tokens(95_000, 30 * BLOCK))).worker == "b"
    decoding_a = [Candidate("a", 2, queued=50.0), Candidate("b", 0)]  # 50 + 480 < 480 + 96
    policy = capacity_bound(reused_on_a=10)  # (b's tree took the last prompt: start afresh)
    assert policy.select(decoding_a, key_of(tokens(95_000, 30 * BLOCK))).worker == "a"


def test_with_lru_workers_a_cold_prompt_just_goes_to_the_least_loaded():
    policy = capacity_bound(reused_on_a=10, policy_name="lru")
    picks = Counter(policy.select(idle("a", "b"), key_of(tokens(90_000 + 1000 * i, 30 * BLOCK)))
                    .worker for i in range(10))
    assert picks == {"a": 5, "b": 5}  # ties rotate, as without capacity awareness


def test_sessions_of_a_question_and_a_follow_up_spread_over_an_even_number_of_workers():
    """Sequential sessions on idle workers, each a new prompt then a follow-up that hits the
    cache. Only true ties may advance the rotation: when the follow-up (one owner, no tie) moved
    it too, every new session on 2 workers landed on the same one, a restarted worker got none."""
    for workers in (("a", "b"), ("a", "b", "c", "d")):
        policy = cache_aware(workers)
        firsts = Counter()
        for session in range(12):
            prompt = tokens(20_000 + 1000 * session, 8 * BLOCK)
            first = policy.select(idle(*workers), key_of(prompt))
            follow = policy.select(idle(*workers), key_of(prompt + tokens(900, BLOCK)))
            assert (follow.worker, follow.reason) == (first.worker, "cache_hit")
            firsts[first.worker] += 1
        assert set(firsts) == set(workers) and max(firsts.values()) - min(firsts.values()) <= 1, \
            firsts


def test_new_sessions_that_fit_anywhere_spread_whatever_the_room():
    """Short cold prompts (new conversations) fit in every probation worker's room: nothing
    reused is at stake, so ties rotate as with lru workers. Preferring the worker with the most
    room herded them onto one worker, since its room shrinks only once a later turn reuses."""
    policy = capacity_bound(reused_on_a=10)  # a: 54 blocks of room, b: 24
    picks = Counter(policy.select(idle("a", "b"), key_of(tokens(90_000 + 1000 * i, 3 * BLOCK)))
                    .worker for i in range(10))
    assert picks == {"a": 5, "b": 5}


def test_a_busy_owner_does_not_spill_onto_a_worker_it_would_evict_a_group_from():
    policy = capacity_bound(reused_on_a=40)
    hot = key_of(tokens(0, 40 * BLOCK) + tokens(900, 2 * BLOCK))  # b's group
    queued = [Candidate("a", 0), Candidate("b", 3, backlog=3 * 2000.0)]
    assert policy.select(queued, hot).worker == "b"  # a has no room for 42 more blocks
    policy.index.set_eviction_policy("a", "lru")
    assert policy.select(queued, hot).reason == "spill"  # the old rule, for an lru worker


@pytest.mark.parametrize(("reused_on_a", "spills"), [(20, True), (36, False)])
def test_a_spill_copies_a_prompt_only_onto_a_worker_whose_kv_is_mostly_unreserved(
        reused_on_a, spills):
    """The copy would fit beside a's reused prefix either way (no damage now), but it is reused
    afterwards, so a worker already half full of reused prefixes would lose a group to it."""
    policy = cache_aware(("a", "b"))
    for w, start, size in (("a", 5000, reused_on_a), ("b", 0, 20)):
        policy.index.set_capacity(w, 64)
        policy.index.set_eviction_policy(w, "probation")
        system = key_of(tokens(start, size * BLOCK)).hashes
        policy.index.insert(w, system)
        policy.index.insert(w, system, matched=size)
    hot = key_of(tokens(0, 20 * BLOCK) + tokens(900, 2 * BLOCK))  # b's group, 22 blocks
    queued = [Candidate("a", 0), Candidate("b", 3, backlog=3 * 2000.0)]
    decision = policy.select(queued, hot)
    assert (decision.worker, decision.reason) == (("a", "spill") if spills else ("b", "cache_hit"))
