"""A simulated worker serves its KV events as the worker does (the worker's own `KVEventLog`):
one log, a cursor per reader, so several gateways can follow one worker."""

from __future__ import annotations

import asyncio
import json
import time

from bench.simfleet import SimConfig, SimWorker, sim_tokenizer_files
from bench.simfleet.http_server import Request
from radixpool.tokenization import PromptTokenizer


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

    def poll(since: int) -> Request:
        return Request("GET", "/kv_events", f"since={since}&timeout=3", {}, b"", True)

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
    request = Request("GET", "/kv_events", f"since={worker.cache.seq + 5}&timeout=1", {}, b"",
                      True)
    asyncio.run(worker.kv_events(request, answer))
    assert answer.status == 409 and answer.doc["error"]["code"] == "resync_required"
