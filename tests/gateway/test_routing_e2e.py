"""Routing quality and self-correction, end to end on loopback: a real gateway in front of
simulated workers that speak the worker protocol, driven with the official `openai` SDK."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from bench.simfleet import SimConfig
from tests.gateway.conftest import words


def chat(client: openai.OpenAI, system: str, question: str):
    return client.chat.completions.with_raw_response.create(
        model="sim-model", max_tokens=2,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])


def run_groups(stack, groups: int = 4, per_group: int = 8) -> dict[int, set[int]]:
    """Interleaved shared-prefix traffic; returns group → workers that served it."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    served: dict[int, set[int]] = {g: set() for g in range(groups)}
    for q in range(per_group):
        for g in range(groups):
            raw = chat(client, words(g * 500, 300), words(3000 + q * 7 + g * 100, 6))
            assert raw.parse().usage.prompt_tokens > 300
            if q:  # the first request of a group may land anywhere
                served[g].add(stack.worker_of(raw.http_response))
    return served


def test_shared_prefix_groups_stay_on_one_worker_and_beat_round_robin(make_stack):
    aware = make_stack(3)
    served = run_groups(aware)
    assert all(len(workers) == 1 for workers in served.values()), served
    aware_rate = aware.fleet.stats()["hit_rate"]
    rr = make_stack(3, policy="round_robin")
    run_groups(rr)
    rr_rate = rr.fleet.stats()["hit_rate"]
    aware.settle()
    assert aware_rate > 0.8 and aware_rate > rr_rate + 0.15, (aware_rate, rr_rate)
    doc = aware.client.get("/workers").json()
    assert doc["routing_on"] == "tokens"
    fleet = doc["fleet"]
    # predicted and actual agree closely when nothing disturbs the workers' caches
    assert fleet["actual_hit_rate"] == pytest.approx(aware_rate, abs=0.01)
    assert abs(fleet["predicted_hit_rate"] - fleet["actual_hit_rate"]) < 0.05


def test_a_flushed_worker_is_noticed_and_the_hit_rate_recovers(make_stack):
    stack = make_stack(2, kv_events=False)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    system = words(0, 400)
    first = chat(client, system, words(3000, 5))
    owner = stack.worker_of(first.http_response)
    assert chat(client, system, words(3100, 5)).parse().usage.prompt_tokens_details \
        .cached_tokens >= 384
    stack.settle()
    stack.client.post(stack.fleet.urls[owner] + "/flush_cache")
    stack.check_all()   # the next health round sees the new instance id
    row = stack.client.get("/workers").json()["workers"][owner]
    assert row["tree_corrections"] == {"instance_id": 1} and row["tree_blocks"] == 0
    before = stack.gateway.workers.get(stack.fleet.urls[owner]).predicted_tokens
    cold = chat(client, system, words(3200, 5))
    assert cold.parse().usage.prompt_tokens_details.cached_tokens == 0
    stack.settle()
    # the gateway predicted the miss (its tree was emptied), so nothing needed trimming
    assert stack.gateway.workers.get(stack.fleet.urls[owner]).predicted_tokens == before
    warm = chat(client, system, words(3300, 5))
    assert warm.parse().usage.prompt_tokens_details.cached_tokens >= 384


def test_a_miss_the_tree_did_not_expect_trims_it(make_stack):
    """Another router (or a client going around the gateway) churns a worker's cache; the
    gateway learns it from cached_tokens, not from waiting for its own LRU."""
    stack = make_stack(1, sim=SimConfig(kv_capacity_tokens=1024), kv_events=False)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    system = words(0, 300)
    chat(client, system, words(3000, 5))
    worker_url = stack.fleet.urls[0]
    for i in range(8):  # someone else's traffic evicts our prefix on the worker
        stack.client.post(worker_url + "/generate", json={"text": words(1000 + i * 200, 200)})
    raw = chat(client, system, words(3100, 5))
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == 0
    stack.settle()
    worker = stack.gateway.workers.get(worker_url)
    assert worker.corrections.get("cached_tokens") == 1
    doc = stack.client.get("/metrics").text
    assert ('radixpool_gateway_tree_corrections_total{source="cached_tokens",'
            f'worker="{worker_url}"}} 1.0') in doc


def test_kv_events_keep_the_tree_exact_under_worker_eviction(make_stack):
    stack = make_stack(1, sim=SimConfig(kv_capacity_tokens=1024))
    worker_url = stack.fleet.urls[0]
    sim = stack.fleet.workers[0]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    chat(client, words(0, 300), words(3000, 5))
    for i in range(8):
        stack.client.post(worker_url + "/generate", json={"text": words(1000 + i * 200, 200)})

    def synced() -> bool:
        held = list(sim.cache.blocks)
        index = stack.gateway.index
        return index.size(worker_url) == len(held) and all(
            index.match([h]) == {worker_url: 1} for h in held)

    for _ in range(50):
        if synced():
            break
        stack.loop.run(asyncio.sleep(0.05))
    assert synced()  # the gateway's tree holds exactly what the worker's cache holds
    before = stack.gateway.workers.get(worker_url).predicted_tokens
    raw = chat(client, words(0, 300), words(3100, 5))
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == 0
    stack.settle()
    assert stack.gateway.workers.get(worker_url).predicted_tokens == before  # no false hit


def test_a_flush_the_kv_events_saw_first_keeps_what_the_new_instance_stored(make_stack):
    """After a flush the KV stream resyncs to the new instance at once and follows it; the
    next health round, seeing the new instance id too, must not empty the tree again (it once
    did: prompts cached right after a flush were invisible to routing for good)."""
    stack = make_stack(1)
    url = stack.fleet.urls[0]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    index, worker = stack.gateway.index, stack.gateway.workers.get(url)

    def wait_for(condition, what: str) -> None:
        for _ in range(200):
            if condition():
                return
            stack.loop.run(asyncio.sleep(0.02))
        raise AssertionError(f"never happened: {what}")

    wait_for(lambda: worker.kv_events_live, "the KV events followed")
    old_id = worker.instance_id
    new_id = stack.client.post(url + "/flush_cache").json()["instance_id"]
    wait_for(lambda: worker.corrections, "the KV stream resynced to the new instance")
    chat(client, words(0, 300), words(3000, 5))
    held = len(stack.fleet.workers[0].cache.blocks)
    wait_for(lambda: index.size(url) == held > 0, "the stored prompt's KV event")

    stack.check_all()   # the health round's identity check sees the new instance id too
    assert old_id != worker.instance_id == new_id
    assert index.size(url) == held, "the tree forgot what the new instance holds"
    assert worker.corrections == {"instance_id": 1}
    predicted = worker.predicted_tokens
    again = chat(client, words(0, 300), words(3100, 5))
    assert again.parse().usage.prompt_tokens_details.cached_tokens >= 288
    stack.settle()
    assert worker.predicted_tokens - predicted >= 288   # the gateway expected that hit


def test_a_kv_event_stream_that_keeps_failing_is_retried_calmly_not_in_a_spin(make_stack):
    """`/kv_events` answers 500 while `/kv_events/snapshot` works: the gateway once resynced
    and polled again at once, forever (thousands of snapshots a second, each a walk of the
    worker's whole cache, and its own loop busy). It now waits between tries, and does not
    claim to follow the events meanwhile."""
    import time

    from bench.simfleet.http_server import error_body

    stack = make_stack(1)
    sim = stack.fleet.workers[0]
    worker = stack.gateway.workers.get(sim.url)
    polls = []

    async def broken(request, respond) -> None:
        polls.append(request)
        await respond.send(*error_body(500, "event log unavailable"))

    for _ in range(200):
        if worker.kv_events_live:
            break
        time.sleep(0.02)
    assert worker.kv_events_live
    sim.kv_events = broken
    stack.client.post("/generate", json={"text": words(0, 40), "max_tokens": 1})  # ends the poll
    time.sleep(1.5)
    assert 1 <= len(polls) <= 6, f"{len(polls)} polls in 1.5 s"
    assert worker.tree_source != "kv_events"
    del sim.kv_events
    for _ in range(100):
        if worker.kv_events_live:
            break
        time.sleep(0.02)
    assert worker.kv_events_live   # back to following the events once they work again


def test_a_tree_no_longer_fed_by_kv_events_is_trimmed_by_cached_tokens_again(make_stack):
    """A worker that stops serving KV events (restarted without them, an older version at the
    same address): its tree is kept by cached_tokens again, as `tree_source` says (it was not:
    trimming stayed off for good, and evicted prefixes were predicted as hits)."""
    import time
    from dataclasses import replace

    stack = make_stack(1, sim=SimConfig(kv_capacity_tokens=1024))
    sim = stack.fleet.workers[0]
    worker = stack.gateway.workers.get(sim.url)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    for _ in range(200):
        if worker.kv_events_live:
            break
        time.sleep(0.02)
    assert worker.kv_events_live
    sim.config = replace(sim.config, kv_events=False)
    stack.check_all()   # its /server_info says so now
    stack.client.post(sim.url + "/generate", json={"text": words(2500, 40)})  # ends the poll
    for _ in range(200):
        if not worker.kv_events_live:
            break
        time.sleep(0.02)
    assert worker.tree_source != "kv_events"
    chat(client, words(0, 300), words(3000, 5))      # prefix A, then B
    chat(client, words(500, 300), words(3100, 5))
    for i in range(8):   # traffic around the gateway evicts both on the worker
        stack.client.post(sim.url + "/generate", json={"text": words(1000 + i * 200, 200)})
    assert chat(client, words(500, 300), words(3200, 5)).parse().usage \
        .prompt_tokens_details.cached_tokens < 16
    stack.settle()
    assert worker.tree_source == "cached_tokens"
    predicted = worker.predicted_tokens
    assert chat(client, words(0, 300), words(3300, 5)).parse().usage \
        .prompt_tokens_details.cached_tokens < 16
    stack.settle()
    assert worker.predicted_tokens == predicted   # B's miss trimmed A, older: no false hit


def test_multi_turn_sessions_stick_to_their_worker(make_stack):
    stack = make_stack(3)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    homes: dict[int, set[int]] = {s: set() for s in range(6)}
    history: dict[int, list[dict]] = {s: [] for s in range(6)}
    for turn in range(4):
        for s in range(6):
            history[s].append({"role": "user", "content": words(s * 600 + turn * 40, 40)})
            raw = client.chat.completions.with_raw_response.create(
                model="sim-model", max_tokens=2, messages=history[s])
            history[s].append({"role": "assistant",
                               "content": raw.parse().choices[0].message.content})
            homes[s].add(stack.worker_of(raw.http_response))
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) == 3  # and sessions are spread over the fleet


def test_a_cold_start_burst_on_one_prefix_is_spread_not_queued_on_one_worker(make_stack):
    """Eight clients start at once with the same long system prompt: the first request makes
    one worker its owner, but with nothing answered yet every queued request counts as a full
    prompt of work there, so the burst spills over the idle workers."""
    import threading

    stack = make_stack(4, sim=SimConfig(prefill_us_per_token=300.0))  # cold: ~0.2 s
    system = words(0, 600)
    start = threading.Barrier(8)

    def client(i: int) -> None:
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            c.get("/health")  # connect first, so the eight requests leave together
            start.wait()
            c.post("/v1/chat/completions", json={"model": "sim-model", "max_tokens": 1,
                   "messages": [{"role": "system", "content": system},
                                {"role": "user", "content": words(2000 + 10 * i, 8)}]})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    served = [w.requests for w in stack.fleet.workers]
    assert max(served) <= 4 and sum(served) == 8, served


def test_the_kv_event_of_a_finished_prefill_ends_its_wait_before_the_answer_ends(make_stack):
    """The gateway counts a request's uncached tokens as prefill queued at its worker until the
    worker's KV event stores its prompt (the prefill's end), not until the answer ends."""
    stack = make_stack(1, sim=SimConfig(prefill_us_per_token=1000.0, decode_ms_per_token=400.0))
    worker = stack.gateway.workers.get(stack.fleet.urls[0])
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)

    def wait_for(condition) -> None:
        for _ in range(300):
            if condition():
                return
            stack.loop.run(asyncio.sleep(0.01))
        raise AssertionError("timed out")

    wait_for(lambda: worker.kv_events_live)
    pool = ThreadPoolExecutor(1)
    answer = pool.submit(chat, client, words(0, 300), words(3000, 5))
    wait_for(lambda: worker.inflight == 1)
    assert worker.queued(0) > 250            # ~300 uncached prompt tokens: 0.3 s of prefill
    wait_for(lambda: worker.queued(0) == 0)  # the event came; 4 x 0.4 s of decoding are left
    assert worker.inflight == 1
    assert answer.result(timeout=10).parse().usage.prompt_tokens > 300
    pool.shutdown()
    stack.settle()
    assert worker.inflight == 0 and not worker.awaiting_prefill
