"""The simulated workers run the engine's own radix cache: what they report is what a worker
with that cache and eviction policy would report, and the virtual-time fleet is deterministic."""

from __future__ import annotations

import random

import pytest

from bench.simfleet import SimKV
from bench.simfleet.virtual import FleetModel, Request, simulate
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
