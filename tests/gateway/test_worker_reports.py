"""What several gateways learn of each other's traffic from the workers' KV streams: a worker's
load (each gateway's own requests there as they come and go, plus the others' as of the worker's
last report) and the prompts it queued (`queued` events)."""

from __future__ import annotations

import pytest

from bench.simfleet.virtual import FleetModel, percentile, simulate, virtual_workload
from radixpool.gateway.breaker import CircuitBreaker
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.health import HealthHysteresis
from radixpool.gateway.monitor import _reported_load
from radixpool.gateway.route_key import MAX_SEQUENCES, KeyBuilder
from radixpool.gateway.workers import Worker, candidates


def worker(url: str = "http://w:1") -> Worker:
    return Worker(url, HealthHysteresis(1, 1), CircuitBreaker(5, 10.0), kv_events_live=True)


def test_the_others_requests_are_the_report_less_this_gateways_own_then():
    w = worker()
    w.take(None)
    w.take(None)
    assert w.load == 2                         # no report yet: its own count
    w.observe_load(5)                          # the worker holds 5: 3 are other gateways'
    assert (w.reported_load, w.load) == (5, 5)
    w.take(None)                               # its own count moves at once
    assert w.load == 6
    for _ in range(3):
        w.give_back(None)
    assert w.load == 3                         # the others' 3 until the next report
    w.observe_load(1)                          # a report lagging its own count: never below it
    assert w.load == 1 and w.others_load == 1
    w.observe_load(0)
    assert w.load == 0
    for _ in range(4):
        w.take(None)
    w.observe_load(None)                       # the stream stopped: its own count alone
    assert (w.reported_load, w.load) == (None, 4)


def test_the_choices_of_its_own_n_requests_are_not_taken_for_another_gateways():
    """A worker's report counts sequences, each choice of an `n` > 1 request: with one gateway,
    its own `n=8` request must not look like 7 requests of other gateways."""
    w = worker()
    key = KeyBuilder(64, 8).build("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "w1 w2"}], "n": 8})
    w.take(None, key.sequences)
    w.observe_load(8)
    assert (w.load, w.others_load) == (1, 0)
    w.observe_load(11)                         # 3 sequences are another gateway's
    assert (w.load, w.others_load) == (4, 3)
    w.give_back(None, key.sequences)
    assert (w.inflight, w.inflight_sequences) == (0, 0)


@pytest.mark.parametrize("path, body, sequences", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 1),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, 6),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "n": 2}, 4),
    ("/v1/completions", {"prompt": [1, 2, 3], "n": 2}, 2),            # one prompt of ids
    ("/v1/completions", {"prompt": "a", "n": True}, 1),              # the worker refuses these
    ("/v1/completions", {"prompt": "a", "n": -4}, 1),
    ("/v1/completions", {"prompt": "a", "n": 10**9}, MAX_SEQUENCES),
    ("/generate", {"text": "a", "sampling_params": {"n": 4}}, 4),
    ("/generate", {"text": ["a", "b", "c"], "sampling_params": {"n": 2}}, 6),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {}]}, 3),
    ("/generate", {"input_ids": [1, 2, 3]}, 1),
])
def test_a_route_key_counts_the_sequences_its_body_asks_for(path, body, sequences):
    assert KeyBuilder(64, 8).build(path, body).sequences == sequences
def test_a_policy_sees_the_load_the_worker_reported():
    busy, idle = worker("http://a:1"), worker("http://b:1")
    busy.observe_load(3)
    key = KeyBuilder(64, 8).build("/generate", {"input_ids": list(range(40))})
    assert [c.load for c in candidates([busy, idle], key)] == [3, 0]


def test_a_kv_stream_answer_is_read_for_a_count_and_nothing_else():
    assert _reported_load({"load": {"requests": 7}}) == 7
    for doc in ({}, {"load": None}, {"load": {"requests": -1}}, {"load": {"requests": True}},
                {"load": {"requests": "3"}}, {"load": [3]}, {"load": {"requests": 2.5}}):
        assert _reported_load(doc) is None, doc


def test_with_three_gateways_no_worker_is_left_without_requests():
    """8 workers, 16 groups of a shared prefix, light load (bench/routing.py gateways): each
    gateway counting only its own requests placed the groups as if at random, and one worker got
    none at all; with the workers' reported load every worker gets some. (A new group now also
    prefers a worker that holds nothing, which alone mends this seed: the load reports' own
    effect is in bench/results/routing_capacity_2cpu.txt 000m.)"""
    requests = virtual_workload("shared-prefix", 8, 3200, 10.0, 0)
    config = GatewayConfig(late_binding=True)
    model = FleetModel(8, 8192, "lru", prefill_us_per_token=100.0, decode_ms_per_token=1.0,
                       schedule="engine")
    out = simulate(requests, model, "cache_aware", gateways=3, seed=0, gateway_config=config)
    assert min(out.per_worker) >= 100, out.per_worker


@pytest.mark.parametrize("seed", [1, 4])
def test_a_new_group_goes_to_a_worker_that_holds_nothing_before_one_that_holds_the_common_prompt(
        seed):
    """8 workers, 16 groups behind a common system prompt, 10 req/s per worker, 2 gateways: a
    new group's placement broke load ties towards the workers already holding the common prompt
    until it counted as hot, which each gateway decides from its own share of the traffic; the
    groups were all placed on 7 workers, and at that load they stayed there (seeds 1 and 4)."""
    requests = virtual_workload("shared-prefix", 8, 3200, 10.0, seed)
    model = FleetModel(8, 8192, "lru", prefill_us_per_token=100.0, decode_ms_per_token=1.0,
                       schedule="engine")
    out = simulate(requests, model, "cache_aware", gateways=2, seed=seed,
                   gateway_config=GatewayConfig(late_binding=True))
    assert min(out.per_worker) >= 100, out.per_worker


def test_with_queued_events_a_second_gateway_does_not_start_a_prompt_another_just_placed():
    """30 req/s per worker, 8 workers, 3 gateways: without `queued` events a gateway learns
    where another sent a new group's prompt only when its prefill ends, and meanwhile sends
    the group's next request elsewhere cold. Sent as the engine takes the request in, they
    bring the extra cold decisions of 3 gateways down to a few; sent with the output of the
    step after that (the engine before), they came with the prefill's own `stored` event and
    changed nothing for a prompt computed in one step."""
    requests = virtual_workload("shared-prefix", 8, 3200, 30.0, 0)
    config = GatewayConfig(late_binding=True)
    cold = {}
    for gateways, announce, at in ((1, True, "intake"), (3, True, "intake"), (3, True, "step"),
                                   (3, False, "intake")):
        model = FleetModel(8, 8192, "lru", prefill_us_per_token=100.0, decode_ms_per_token=1.0,
                           schedule="engine", announcements=announce, announce_at=at)
        out = simulate(requests, model, "cache_aware", gateways=gateways, seed=0,
                       gateway_config=config)
        cold[gateways, announce, at] = out.reasons.get("cache_miss", 0)
    one, blind = cold[1, True, "intake"], cold[3, False, "intake"]
    assert cold[3, True, "step"] == blind, cold
    assert cold[3, True, "intake"] - one < (blind - one) / 3, cold


def test_once_the_caches_are_warm_three_gateways_keep_the_tail_of_one():
    """30 req/s per worker, 8 workers: several gateways cost tail latency only in the cold start
    (two of them, each blind to the other's placement for a step, can put two new groups on one
    idle worker); after the first tenth of the run p99 stays within 5% of one gateway's."""
    requests = virtual_workload("shared-prefix", 8, 3200, 30.0, 0)
    model = FleetModel(8, 8192, "lru", prefill_us_per_token=100.0, decode_ms_per_token=1.0,
                       schedule="engine")
    config = GatewayConfig(late_binding=True)
    steady = {}
    for gateways in (1, 3):
        out = simulate(requests, model, "cache_aware", gateways=gateways, seed=0,
                       gateway_config=config)
        steady[gateways] = percentile(out.steady_latencies(), 0.99)
        assert percentile(out.latencies, 0.99) > 5 * steady[gateways]   # the cold start's
    assert steady[3] <= 1.05 * steady[1], steady
