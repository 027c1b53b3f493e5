"""The late-binding wait queue: its pure core (order, bounds, each held request leaves exactly
once) and the placement it shares with the proxy and the virtual fleet."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixpool.gateway.breaker import CircuitBreaker
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.health import HealthHysteresis
from radixpool.gateway.policies import Decision, make_policy
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.route_key import KeyBuilder
from radixpool.gateway.wait_queue import LateBinding, WaitQueue
from radixpool.gateway.workers import Worker
from radixpool.protocol.server_info import ServerInfo

BLOCK = 16


def key_of(tokens: list[int]):
    keys = KeyBuilder(64, 256)
    keys.block_size = BLOCK
    return keys.build("/generate", {"input_ids": tokens})


KEY = key_of(list(range(64)))


def test_release_offers_the_oldest_first_and_keeps_what_it_cannot_place():
    queue = WaitQueue(max_held=10, max_wait=5.0)
    held = [queue.hold(KEY, now=float(i)) for i in range(4)]
    offered = []

    def place(h, overdue):
        offered.append(h)
        return h is not held[0] or len(offered) > 4   # the oldest's worker is saturated

    placed = queue.release(10.0, place)
    assert offered == held                 # oldest first
    assert placed == held[1:]              # younger ones are not blocked behind the oldest
    assert len(queue) == 1
    assert queue.release(10.0, place) == [held[0]]
    assert not queue


def test_only_requests_held_past_the_deadline_are_offered_as_overdue():
    queue = WaitQueue(max_held=10, max_wait=5.0)
    old, young = queue.hold(KEY, 0.0), queue.hold(KEY, 3.0)
    seen = {}
    queue.release(6.0, lambda h, overdue: seen.setdefault(h, overdue) and False)
    assert seen == {old: True, young: False}
    assert queue.next_deadline() == 5.0


def test_a_withdrawn_request_is_never_placed_and_a_placed_one_cannot_be_withdrawn():
    queue = WaitQueue(max_held=10, max_wait=5.0)
    gone, stays = queue.hold(KEY, 0.0), queue.hold(KEY, 0.0)
    assert queue.withdraw(gone)
    assert queue.release(1.0, lambda h, overdue: True) == [stays]
    assert not queue.withdraw(stays)       # the caller owns its worker now
    assert not queue.withdraw(gone)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "withdraw", "release"]),
                          st.integers(0, 1 << 16)), max_size=60))
def test_every_held_request_leaves_exactly_once(ops):
    queue = WaitQueue(max_held=8, max_wait=2.0)
    rng = random.Random(0)
    live, placed, withdrawn, now = [], [], [], 0.0
    for op, n in ops:
        now += n / 1e4
        if op == "hold" and queue.admits():
            live.append(queue.hold(KEY, now))
        elif op == "withdraw" and live:
            h = live[n % len(live)]
            if queue.withdraw(h):
                withdrawn.append(h)
            live.remove(h)
        elif op == "release":
            out = queue.release(now, lambda h, overdue: overdue or rng.random() < 0.5)
            placed += out
            for h in out:
                live.remove(h)
        assert len(queue) == len(live) <= 8
    placed += queue.release(now + 10.0, lambda h, overdue: overdue)
    assert not queue
    everyone = placed + withdrawn
    assert len(everyone) == len(set(map(id, everyone)))        # none twice
    assert all(h in everyone for h in live)                    # none lost


def test_holds_only_behind_a_saturated_pick_then_first_come_first_placed_up_to_the_bound():
    binding = LateBinding(make_policy(GatewayConfig(), PrefixIndex()), threshold=100,
                          max_held=2, max_wait=5.0)
    (worker,) = fleet(1)[1]
    miss = Decision(worker.url, "cache_miss")
    worker.prefill_sent(1, 100.0)
    assert not binding.holds(worker, miss, KEY)    # the fast path: nothing held, not saturated
    worker.prefill_sent(2, 1.0)
    assert binding.holds(worker, miss, KEY)
    binding.queue.hold(KEY, 0.0)
    worker.prefill_stored((1, 2))
    assert binding.holds(worker, miss, KEY)        # something held: later arrivals queue behind it
    binding.queue.hold(KEY, 0.0)
    worker.prefill_sent(3, 10_000.0)
    assert not binding.holds(worker, miss, KEY)    # full: bind at once (early binding)


def test_a_cache_hit_is_not_held_on_a_worker_that_runs_cached_prompts_first():
    # Behind a cold 8,000-token prefill a worker that runs the longest cached prefix first
    # (ours: /server_info schedule_policy lpm) computes a hit in its next step; held at the
    # gateway it would wait out the whole cold prefill, its prefix unlocked. An arrival-order
    # worker (fcfs, or one that does not say) makes it wait there too: held as before.
    binding = LateBinding(make_policy(GatewayConfig(), PrefixIndex()), threshold=1024,
                          max_held=8, max_wait=5.0)
    lpm, fcfs = fleet(2)[1]
    lpm.info = ServerInfo("m", "m", 4096, 65536, 1, BLOCK, "i", "v", schedule_policy="lpm")
    for worker in (lpm, fcfs):
        worker.prefill_sent(1, 8000.0)
    assert lpm.cached_first and not fcfs.cached_first
    key = key_of(list(range(2048)))                       # 128 blocks
    hit = Decision(lpm.url, "cache_hit", predicted_blocks=64)  # 1,024 tokens left to compute
    assert not binding.holds(lpm, hit, key)
    assert binding.holds(fcfs, Decision(fcfs.url, "cache_hit", predicted_blocks=64), key)
    # a prompt cold there, or with more than the threshold left to compute, still waits
    assert binding.holds(lpm, Decision(lpm.url, "cache_miss"), key)
    assert binding.holds(lpm, Decision(lpm.url, "cache_hit", predicted_blocks=63), key)
    binding.queue.hold(KEY, 0.0)
    assert not binding.holds(lpm, hit, key)               # nor behind held ones


def fleet(n: int, policy: str = "cache_aware"):
    index = PrefixIndex()
    workers = []
    for i in range(n):
        w = Worker(f"http://w{i}:1", HealthHysteresis(1, 1), CircuitBreaker(5, 10.0),
                   kv_events_live=True)
        index.add_worker(w.url, 4096)
        workers.append(w)
    return index, workers


def test_a_held_request_waits_for_its_cache_holder_rather_than_going_cold_elsewhere():
    index, (holder, other) = fleet(2)
    binding = LateBinding(make_policy(GatewayConfig(), index), threshold=0,
                          max_held=8, max_wait=5.0)
    prompt = list(range(640))
    index.insert(holder.url, key_of(prompt).hashes, 0)
    holder.prefill_sent(123, 64.0)             # busy with a short prefill
    holder.inflight = 1
    holder.observe_uncached(64)
    held = binding.queue.hold(key_of(prompt + list(range(1000, 1032))), 0.0)
    assert binding.release(0.1, lambda model: [holder, other]) == []   # other is idle but cold
    holder.prefill_stored((123,))
    assert binding.release(0.2, lambda model: [holder, other]) == [held]
    assert held.worker is holder and held.decision.reason == "late"
    assert holder.inflight == 2 and holder.queued(0) == 32      # taken: its uncached part


def test_placing_takes_the_worker_so_the_next_held_request_goes_elsewhere():
    index, workers = fleet(2)
    binding = LateBinding(make_policy(GatewayConfig(), index), threshold=0,
                          max_held=8, max_wait=5.0)
    a = binding.queue.hold(key_of(list(range(320))), 0.0)
    b = binding.queue.hold(key_of(list(range(5000, 5320))), 0.0)
    c = binding.queue.hold(key_of(list(range(9000, 9320))), 0.0)
    placed = binding.release(0.0, lambda model: workers)
    assert placed == [a, b]                    # one each: both idle, then both saturated
    assert {a.worker.url, b.worker.url} == {w.url for w in workers}
    assert binding.release(6.0, lambda model: workers) == [c]   # overdue: sent anyway
    assert binding.release(6.0, lambda model: []) == []


def test_no_eligible_worker_places_nothing_and_other_policies_pick_among_unsaturated():
    index, (busy, idle) = fleet(2)
    busy.prefill_sent(1, 500.0)
    binding = LateBinding(make_policy(GatewayConfig(policy="round_robin"), index),
                          threshold=0, max_held=8, max_wait=5.0)
    held = binding.queue.hold(KEY, 0.0)
    assert binding.release(0.0, lambda model: []) == []
    assert binding.release(0.0, lambda model: [busy, idle]) == [held]
    assert held.worker is idle


def test_a_half_open_worker_is_sent_one_held_request_its_probe_not_all_of_them():
    # Placing a held request did not take the half-open breaker's probe slot (the proxy did,
    # later, when the request went): every held request released in the same pass saw the
    # worker let traffic through and went there, each failing while the worker still failed.
    index, (worker,) = fleet(1)
    worker.breaker = CircuitBreaker(1, 10.0)
    worker.breaker.record_failure("server_error", now=0.0)
    binding = LateBinding(make_policy(GatewayConfig(), index), threshold=1 << 20,
                          max_held=8, max_wait=5.0)
    first = binding.queue.hold(key_of(list(range(320))), 10.0)
    second = binding.queue.hold(key_of(list(range(5000, 5320))), 10.0)
    eligible = lambda now: lambda model: [w for w in (worker,) if w.eligible(now)]  # noqa: E731
    assert binding.release(10.0, eligible(10.0)) == [first]
    assert worker.breaker.state(10.0) == "half_open" and not worker.breaker.allows(10.0)
    worker.breaker.record_success(11.0)        # the probe answered: the worker is back
    assert binding.release(11.0, eligible(11.0)) == [second]
