"""The simulated workers run the engine's own radix cache: what they report is what a worker
with that cache and eviction policy would report, and the virtual-time fleet is deterministic."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from bench.simfleet import SimConfig, SimKV, SimWorker, sim_tokenizer_files
from bench.simfleet.http_server import Request as HttpRequest
from bench.simfleet.virtual import FleetModel, Request, simulate
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.tokenization import PromptTokenizer


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


class Answer:
    """Stands in for the HTTP responder: keeps what `/kv_events` answered, and when."""

    def __init__(self) -> None:
        self.status = 0
        self.doc: dict = {}
        self.at = 0.0

    async def send(self, status: int, headers, body: bytes) -> None:
        self.status, self.doc, self.at = status, json.loads(body), time.monotonic()


def test_a_worker_serves_its_kv_events_to_several_long_polling_readers():
    """Two gateways follow one simulated worker. A reader that starts waiting just before a
    prefill lands, while another reader catches up, must be woken by that prefill (it once
    waited out its whole long poll: a shared `asyncio.Event` cleared by every reader)."""
    files = sim_tokenizer_files()
    worker = SimWorker(SimConfig(), PromptTokenizer(files), files)
    worker.cache.prefill(list(range(100, 164)), None)
    seq = worker.cache.seq

    def poll(since: int) -> HttpRequest:
        return HttpRequest("GET", "/kv_events", f"since={since}&timeout=3", {}, b"", True)

    async def scenario() -> tuple[Answer, Answer, float]:
        loop = asyncio.get_running_loop()
        waiting, catching_up = Answer(), Answer()
        start = time.monotonic()
        parked = loop.create_task(worker.kv_events(poll(seq), waiting))
        prefill = loop.create_task(worker._prefill(list(range(200, 264)), None))
        behind = loop.create_task(worker.kv_events(poll(0), catching_up))
        await asyncio.wait_for(asyncio.gather(parked, prefill, behind), 5)
        return waiting, catching_up, start

    waiting, catching_up, start = asyncio.run(scenario())
    assert waiting.status == catching_up.status == 200
    assert waiting.at - start < 1.0, "the parked reader waited out its long poll"
    new = [e["seq"] for e in waiting.doc["events"]]
    assert new and new[0] == seq + 1 and waiting.doc["next"] == worker.cache.seq
    assert [e["seq"] for e in catching_up.doc["events"]] == list(range(1, worker.cache.seq + 1))


def test_a_cursor_the_worker_never_reached_must_resync():
    files = sim_tokenizer_files()
    worker = SimWorker(SimConfig(), PromptTokenizer(files), files)
    worker.cache.prefill(list(range(100, 164)), None)
    answer = Answer()
    request = HttpRequest("GET", "/kv_events", f"since={worker.cache.seq + 5}&timeout=1", {}, b"",
                      True)
    asyncio.run(worker.kv_events(request, answer))
    assert answer.status == 409 and answer.doc["error"]["code"] == "resync_required"
