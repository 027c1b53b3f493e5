"""The simulated workers run the engine's own radix cache: what they report is what a worker
with that cache and eviction policy would report, and the virtual-time fleet is deterministic."""

from __future__ import annotations

import random

import pytest

from bench.simfleet import SimKV
from bench.simfleet.virtual import FleetModel, Outcome, Request, simulate
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.prefix_index import PrefixIndex


def test_sim_kv_reports_cached_tokens_and_events_the_gateway_can_replay():
    kv = SimKV(capacity_tokens=256, block_size=16)
    index = PrefixIndex()
    index.add_worker("w", 16)
    system = list(range(100, 200))
    assert kv.prefill(system + [1] * 20, None) == 0
    assert kv.prefill(system + [2] * 20, None) == 100  # the shared prompt, not the question
    assert kv.prefill(system + [2] * 20, None) == 119  # all but the last token
    for i in range(10):  # one-off prompts push the cache past its capacity
        kv.prefill([1000 + i] * 64, None)
    assert kv.pool.free_slots >= 0 and kv.cache.total_size <= 256
    kv.cache.check()
    for event in kv.events_since(0):
        index.apply_event("w", event)
    assert index.size("w") == len(kv.blocks)


@pytest.mark.parametrize("policy", ["lru", "probation"])
def test_a_reused_system_prompt_survives_one_off_prompts_only_with_reuse_aware_eviction(policy):
    kv = SimKV(capacity_tokens=256, block_size=16, eviction_policy=policy)
    system = list(range(100, 164))
    for q in range(4):  # reused by a question now and then, among other traffic
        kv.prefill(system + [q] * 16, None)
        kv.prefill([2000 + q] * 48, None)
    for i in range(5):  # then a burst of one-off prompts
        kv.prefill([1000 + i] * 48, None)
    assert kv.probe(system + [3], None) == (64 if policy == "probation" else 0)


def test_the_virtual_fleet_is_deterministic():
    rng = random.Random(1)
    prompts = [rng.choices(range(5000), k=300) for _ in range(6)]
    t, requests = 0.0, []
    for _ in range(120):
        t += rng.expovariate(20.0)
        g = rng.randrange(6)
        requests.append(Request(t, prompts[g] + rng.choices(range(5000), k=20), g, 4))
    model = FleetModel(2, 1024, "probation", prefill_us_per_token=50.0, decode_ms_per_token=1.0)
    runs = [simulate(requests, model, "cache_aware", gateways=2, seed=3) for _ in range(2)]
    assert runs[0].latencies == runs[1].latencies and runs[0].reasons == runs[1].reasons
    assert 0 < runs[0].hit_rate < 1


def test_the_steady_tail_leaves_out_the_first_tenth_of_the_arrivals():
    """`st99` in bench/routing.py: the latencies of the requests that arrived once the caches
    had warmed up, whatever order they finished in."""
    out = Outcome(latencies=[9.0, 1.0, 2.0] + [0.5] * 17, arrivals=[0.0, 1.0, 1.5] + [2.0] * 17)
    assert out.steady_latencies() == [2.0] + [0.5] * 17   # the first two arrivals are the tenth
    assert out.steady_latencies(0.0) == out.latencies
    assert Outcome().steady_latencies() == []


def test_idleness_is_avoidable_only_when_an_idle_worker_would_serve_a_waiting_request_sooner():
    model = FleetModel(2, 4096, "lru", prefill_us_per_token=1000.0, decode_ms_per_token=0.0)
    system = list(range(100, 1100))   # 1,000 tokens: 1 s cold, 16 ms after the first
    warm, a, b = (Request(0.0, system + [i] * 16, 0, 1) for i in (1, 2, 3))
    # Two cold prompts on worker 0 at once: the second waits 1.016 s while worker 1 idles, which
    # would have given it its first token at 1.016 s instead of 2.032 s.
    cold = simulate([warm, Request(0.0, list(range(5000, 6016)), 1, 1)], model, sticky=lambda r: 0)
    assert cold.idle_while_queued == pytest.approx(1.016)
    assert cold.idle_avoidable == pytest.approx(1.016)
    # Hits queued behind a hit: waiting 16 ms beats 1.016 s cold on the idle worker.
    later = [Request(2.0, a.tokens, 0, 1), Request(2.0, b.tokens, 0, 1)]
    hits = simulate([warm, *later], model, sticky=lambda r: 0)
    assert hits.idle_while_queued == pytest.approx(0.016)
    assert hits.idle_avoidable == 0.0


def test_the_work_conserving_reference_never_idles_a_worker_while_a_request_waits():
    """`ref:conserving` in bench/routing.py: a hit waiting out its owner's short prefill goes cold
    to the idle worker instead, and a worker that falls idle takes what it holds most of."""
    model = FleetModel(2, 4096, "lru", prefill_us_per_token=1000.0, decode_ms_per_token=0.0)
    system = list(range(100, 1100))   # 1,000 tokens: 1 s cold, 16 ms after the first
    warm, a, b = (Request(0.0, system + [i] * 16, 0, 1) for i in (1, 2, 3))
    later = [Request(2.0, a.tokens, 0, 1), Request(2.0, b.tokens, 0, 1)]
    sticky = simulate([warm, *later], model, sticky=lambda r: 0)
    conserving = simulate([warm, *later], model, conserving=True)
    assert sticky.idle_while_queued == pytest.approx(0.016)
    assert conserving.idle_while_queued == 0.0
    assert sorted(conserving.per_worker) == [1, 2]   # one hit stays; the other goes cold
    assert conserving.cached_tokens == 1000 < sticky.cached_tokens == 2000
    assert sorted(conserving.ttfts) == [pytest.approx(0.016), pytest.approx(1.016),
                                        pytest.approx(1.016)]
    # Both workers busy: the requests wait in one queue; the worker that falls idle first takes
    # the one it holds a prefix of, though another arrived before it.
    other = list(range(5000, 5500))   # 516 ms cold
    busy = [Request(0.0, system + [1] * 16, 0, 1), Request(0.0, other + [1] * 16, 1, 1),
            Request(0.3, list(range(7000, 7100)), 2, 1), Request(0.4, other + [2] * 16, 1, 1)]
    out = simulate(busy, model, conserving=True)
    assert out.idle_while_queued == 0.0
    assert out.cached_tokens == 500   # taken at 0.516 s by the worker holding `other`
    # (first tokens in finishing order) it ends 16 ms later; the older request runs after it
    assert out.ttfts[:3] == [pytest.approx(0.516), pytest.approx(0.532 - 0.4),
                             pytest.approx(0.632 - 0.3)]


def test_late_binding_leaves_no_worker_idle_while_a_request_waits_that_it_could_serve_sooner():
    model = FleetModel(2, 65536, "lru", prefill_us_per_token=20.0, decode_ms_per_token=5.0)
    # A long prefill (160 ms) on one worker, then short prompts (2 ms each) while it runs: early
    # binding commits one of them behind the long prefill (the in-flight counts tie), though
    # the other worker is idle after a few milliseconds.
    requests = [Request(0.0, list(range(8000)), 0)]
    requests += [Request(0.001 * i, list(range(10_000 * i, 10_000 * i + 100)), i)
                 for i in (1, 2, 3)]
    early = simulate(requests, model, "cache_aware",
                     gateway_config=GatewayConfig(late_binding=False))
    late = simulate(requests, model, "cache_aware",
                    gateway_config=GatewayConfig(late_binding=True, hold_queued_tokens=0))
    assert early.idle_avoidable > 0.1
    assert late.idle_avoidable == 0.0
    assert late.reasons.get("late", 0) >= 1
    # the short prompts' first tokens: one at 160 ms with early binding, all within 5 ms late
    assert sorted(early.ttfts)[-2] > 0.15 and sorted(late.ttfts)[-2] < 0.005


def test_engine_schedule_batches_a_hit_past_a_long_prefill_and_deduplicates_a_shared_one():
    # 1 ms per token: a 4,096-token cold prompt is two 2,048-token chunks (2.048 s each), a
    # cached prompt 16 ms. Both schedules on one worker, sticky.
    def run(schedule: str, requests: list[Request]):
        model = FleetModel(1, 1 << 20, "lru", prefill_us_per_token=1000.0,
                           decode_ms_per_token=0.0, schedule=schedule)
        return simulate(requests, model, sticky=lambda r: 0)

    system = list(range(100, 1100))
    warm = Request(0.0, system + [1] * 16, 0, 1)
    cold = Request(2.0, list(range(5000, 9096)), 1, 1)
    hit = Request(2.5, system + [2] * 16, 0, 1)
    fifo, engine = run("fifo", [warm, cold, hit]), run("engine", [warm, cold, hit])
    # fifo: the hit waits out the whole cold prefill (ends at 6.096 s); engine: it joins the
    # cold prompt's second chunk, the step from 4.048 s to 6.112 s (ttfts in finishing order)
    assert fifo.ttfts[2] == pytest.approx(6.096 + 0.016 - 2.5)
    assert engine.ttfts[1:] == [pytest.approx(6.112 - 2.0), pytest.approx(6.112 - 2.5)]
    assert engine.cached_tokens == fifo.cached_tokens == 1000
    # the same cold prompt asked again mid-prefill waits for it, then hits (in-batch
    # de-duplication), instead of computing it a second time beside it
    again = Request(2.5, cold.tokens[:-1] + [7], 1, 1)
    dedup = run("engine", [warm, cold, again])
    assert dedup.cached_tokens == 4095
    assert dedup.ttfts[2] == pytest.approx(6.096 + 0.001 - 2.5)
    # a prompt mid-prefill is cut into chunks of at most 2,048 tokens, one step each
    alone = run("engine", [Request(0.0, list(range(5000, 10000)), 1, 1)])
    assert alone.ttfts == [pytest.approx(5.0)]
    with pytest.raises(ValueError, match="schedule"):
        FleetModel(1, 1024, schedule="lifo")


def test_a_cache_hit_goes_straight_to_an_engine_that_runs_cached_prompts_first():
    # Late binding on, one worker. A long continuation of a cached system prompt (8,000
    # uncached tokens, 1 ms each) is being computed when a short question on the same prompt
    # arrives. Our engine (`engine`, reporting schedule_policy lpm) computes the question in its
    # next step: the gateway sends it at once. Before, the gateway held it until the long
    # prefill ended, as it still does for arrival-order workers (`fifo`).
    system = list(range(100, 1100))
    requests = [Request(0.0, system + [1] * 16, 0, 1),
                Request(2.0, system + list(range(5000, 13000)), 0, 1),
                Request(2.5, system + [2] * 16, 0, 1)]

    def run(schedule: str):
        model = FleetModel(1, 1 << 20, "lru", prefill_us_per_token=1000.0,
                           decode_ms_per_token=0.0, schedule=schedule)
        return simulate(requests, model, "cache_aware",
                        gateway_config=GatewayConfig(late_binding=True))

    engine, fifo = run("engine"), run("fifo")
    # (one worker: every prefix is on every worker, so no request has an owner)
    assert engine.reasons == {"cache_miss": 3}
    # its 16 tokens join the long prompt's second chunk: the step 4.048 s - 6.112 s
    assert engine.ttfts[1] == pytest.approx(6.112 - 2.5)
    assert fifo.reasons == {"cache_miss": 2, "late": 1}
    assert fifo.ttfts[2] == pytest.approx(10.0 + 0.016 - 2.5)
    assert engine.cached_tokens == fifo.cached_tokens == 2000
