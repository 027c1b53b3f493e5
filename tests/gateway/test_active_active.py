"""Several gateways in front of one fleet (active-active replicas behind one Service): each
routes only its share of the traffic, but every one follows every worker's KV events, so a
prefix cached through one gateway is routed to its holder by the others."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

import openai

from bench.simfleet import SimConfig, SimFleet
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.server import GatewayServer
from tests.gateway.conftest import words


def start_gateway(loop_thread, urls: list[str]) -> GatewayServer:
    server = GatewayServer(GatewayConfig(worker_urls=tuple(urls), host="127.0.0.1", port=0,
                                         health_interval=3600.0))
    loop_thread.run(server.start())
    for worker in server.gateway.workers:
        loop_thread.run(server.monitor.check(worker))
    return server


def wait_until(loop_thread, condition, seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.02)):
        if loop_thread.call(condition):
            return True
        loop_thread.run(asyncio.sleep(0.02))
    return loop_thread.call(condition)


def client(server: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused",
                         max_retries=0)


@contextlib.contextmanager
def two_gateways(loop_thread, workers: int, config: SimConfig):
    """A simulated fleet with gateways A and B in front, both following every worker's KV
    stream: (fleet, B, a client of A, a client of B). The tests look into B."""
    fleet = SimFleet(workers, config)
    loop_thread.run(fleet.start())
    a, b = start_gateway(loop_thread, fleet.urls), start_gateway(loop_thread, fleet.urls)
    try:
        assert wait_until(loop_thread, lambda: all(
            w.kv_events_live for g in (a, b) for w in g.gateway.workers))
        yield fleet, b, client(a), client(b)
    finally:
        for server in (a, b):
            loop_thread.run(server.stop())
        loop_thread.run(fleet.stop())


def chat(client: openai.OpenAI, system: str, question: str):
    return client.chat.completions.with_raw_response.create(
        model="sim-model", max_tokens=2,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])


def test_a_prefix_cached_through_one_gateway_is_routed_to_its_holder_by_another(loop_thread):
    with two_gateways(loop_thread, 3, SimConfig()) as (fleet, b, via_a, via_b):
        systems = [words(g * 500, 300) for g in range(3)]
        holders = [fleet.urls.index(chat(via_a, system, words(3000 + g, 6))
                                    .http_response.headers["x-radixpool-worker"])
                   for g, system in enumerate(systems)]
        assert len(set(holders)) > 1, holders  # A spread the prefixes over the fleet

        def b_tree_matches_the_workers() -> bool:
            return all(b.gateway.index.size(url) == len(sim.cache.blocks) > 0
                       for url, sim in zip(fleet.urls, fleet.workers, strict=True)
                       if url in {fleet.urls[h] for h in holders})

        assert wait_until(loop_thread, b_tree_matches_the_workers)
        assert all(w.requests == 0 for w in b.gateway.workers)  # B learnt it from events only
        # in reverse: in A's order, a gateway that knew nothing would happen to place them as A did
        for g in reversed(range(3)):
            raw = chat(via_b, systems[g], words(3500 + g, 6))
            assert fleet.urls.index(raw.http_response.headers["x-radixpool-worker"]) \
                == holders[g], g
            assert raw.parse().usage.prompt_tokens_details.cached_tokens >= 300
        # (counted once the answer has left: the client may see it first)
        assert wait_until(loop_thread, lambda: sum(w.requests for w in b.gateway.workers) == 3)


def test_each_gateway_counts_the_requests_another_sent_from_the_workers_kv_stream(loop_thread):
    """A gateway counts the requests it sent itself; the ones another replica sent reach it as
    each worker's load on the KV stream. While A's long request runs on one worker, B sends
    every new conversation to the other one: without the stream's load both look idle to B,
    and it would alternate between them."""
    config = SimConfig(decode_ms_per_token=10.0)
    with two_gateways(loop_thread, 2, config) as (fleet, b, via_a, via_b):
        stream = via_a.chat.completions.with_raw_response.create(
            model="sim-model", max_tokens=400, stream=True,
            messages=[{"role": "user", "content": words(0, 40)}])
        busy = stream.http_response.headers["x-radixpool-worker"]
        chunks = stream.parse()
        next(iter(chunks))
        seen_by_b = next(w for w in b.gateway.workers if w.url == busy)
        assert wait_until(loop_thread, lambda: seen_by_b.reported_load == 1)
        assert seen_by_b.inflight == 0 and seen_by_b.load == 1
        placed = [chat(via_b, words(1000 * (i + 1), 30), words(5000 + i, 6))
                  .http_response.headers["x-radixpool-worker"] for i in range(4)]
        assert placed == [u for u in fleet.urls if u != busy] * 4, placed
        for _ in chunks:   # A's request ends: the stream says so
            pass
        assert wait_until(loop_thread, lambda: seen_by_b.reported_load == 0)
        assert seen_by_b.load == 0


def test_a_gateway_learns_where_another_sent_a_prompt_before_its_prefill_ends(loop_thread):
    """The worker names each prompt it queues (`queued` on its KV stream): while A's request
    is still in its (slow) prefill, B already counts its blocks on that worker, and sends a
    request sharing the prompt there instead of starting the same prefill elsewhere."""
    config = SimConfig(prefill_us_per_token=4000.0)   # 300 tokens: ~1.2 s
    with two_gateways(loop_thread, 2, config) as (fleet, b, via_a, via_b):
        system = words(700, 300)
        first = ThreadPoolExecutor(1).submit(chat, via_a, system, words(9000, 6))

        def b_knows_the_prompt() -> bool:
            return any(b.gateway.index.size(url) > 10 for url in fleet.urls)

        assert wait_until(loop_thread, b_knows_the_prompt, 1.0), "not before the prefill ended"
        assert all(w.cache.blocks == [] for w in fleet.workers), "the prefill already ended"
        holder = next(url for url in fleet.urls if b.gateway.index.size(url) > 10)
        second = chat(via_b, system, words(9100, 6))
        assert second.http_response.headers["x-radixpool-worker"] == holder
        assert first.result(10).http_response.headers["x-radixpool-worker"] == holder
        assert second.parse().usage.prompt_tokens_details.cached_tokens >= 290
