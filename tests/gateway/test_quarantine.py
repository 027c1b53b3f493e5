"""Queries of death: a request that two dying engines held is refused for a while, so it cannot
take the rest of the fleet down with it. The rules on their own, then the gateway in front of
simulated workers whose engines "die" on one body."""

from __future__ import annotations

import json

from radixpool.gateway.quarantine import Quarantine, engine_died
from tests.gateway.conftest import words

POISON = {"prompt": "POISON " + words(0, 20), "max_tokens": 4}


def test_two_deaths_under_one_request_quarantine_it_and_no_other():
    q = Quarantine(deaths_to_refuse=2, ttl_s=60.0)
    assert not q.refuses(b"poison", 0.0)
    assert not q.died_holding(b"poison", 1.0)   # one death: an OOM kill ends every request
    assert not q.refuses(b"poison", 1.0)
    assert not q.died_holding(b"innocent", 1.0)
    assert q.died_holding(b"poison", 2.0)
    assert q.refuses(b"poison", 3.0) and not q.refuses(b"innocent", 3.0)


def test_quarantine_ends_ttl_after_the_last_death_and_stays_bounded():
    q = Quarantine(deaths_to_refuse=2, ttl_s=10.0, max_entries=3)
    q.died_holding(b"a", 0.0)
    q.died_holding(b"a", 5.0)
    assert q.refuses(b"a", 14.9) and not q.refuses(b"a", 15.0)
    q.died_holding(b"b", 20.0)
    assert not q.died_holding(b"b", 31.0)   # the first death had expired: this is one again
    for body in (b"c", b"d", b"e", b"f"):
        q.died_holding(body, 32.0)
    assert len(q._deaths) == 3


def test_only_an_engine_that_died_holding_the_request_counts():
    died = json.dumps({"error": {"message": "the engine core process died; this worker cannot "
                                 "serve", "type": "server_error", "code": "engine_core_died"}})
    draining = json.dumps({"error": {"message": "draining", "code": None}})
    assert engine_died(died.encode()) and not engine_died(draining.encode())


def engines_die_on_poison(worker) -> None:
    """The simulated worker's engine 'dies' on the poison prompt: 503 engine_core_died, as a
    real worker answers the requests its dead core held, and /health fails from then on."""
    generate = worker.generate

    async def generate_or_die(request, respond):
        if b"POISON" not in request.body:
            await generate(request, respond)
            return
        worker.fail_health = True
        worker.poisoned = True
        await respond.send(503, [(b"content-type", b"application/json")], json.dumps({
            "error": {"message": "the engine core process died; this worker cannot serve",
                      "type": "server_error", "param": None, "code": "engine_core_died"}
        }).encode())

    worker.generate = generate_or_die
    worker.poisoned = False


def test_a_query_of_death_takes_down_two_workers_at_most(make_stack):
    # Before: the gateway carried the request from each dying worker to the next (3 of 3
    # here), and each client retry went on with the next ones.
    stack = make_stack(4)
    for worker in stack.fleet.workers:
        engines_die_on_poison(worker)
    first = stack.client.post("/v1/completions", json=POISON)
    assert first.status_code == 500, first.text
    assert first.json()["error"]["code"] == "request_quarantined"
    assert first.headers["x-should-retry"] == "false"   # the OpenAI SDKs then do not retry it
    assert sum(w.poisoned for w in stack.fleet.workers) == 2
    again = stack.client.post("/v1/completions", json=POISON)   # e.g. the SDK's own retry
    assert again.json()["error"]["code"] == "request_quarantined"
    assert sum(w.poisoned for w in stack.fleet.workers) == 2
    assert stack.client.post("/v1/completions", json={"prompt": words(0, 20),
                                                      "max_tokens": 4}).status_code == 200
    assert "radixpool_gateway_quarantined_requests_total 2.0" in \
        stack.client.get("/metrics").text


def test_one_death_is_retried_elsewhere_as_before(make_stack):
    # an engine that dies for its own reasons (out of memory, a device fault): the requests it
    # held go to another worker and are answered
    stack = make_stack(3, policy="round_robin")   # the dying worker gets one of the first three
    doomed = stack.fleet.workers[0]
    engines_die_on_poison(doomed)
    answered = [stack.client.post("/v1/completions", json=POISON) for _ in range(3)]
    assert [r.status_code for r in answered] == [200, 200, 200]
    assert doomed.poisoned and all(stack.worker_of(r) != 0 for r in answered)


def test_a_second_death_on_the_last_attempt_is_refused_as_quarantined(make_stack):
    # Before: the worker's 503 engine_core_died went to the client (one the OpenAI SDKs retry)
    # and was not counted; only the client's retry was refused.
    stack = make_stack(2, max_retries=1)
    for worker in stack.fleet.workers:
        engines_die_on_poison(worker)
    answer = stack.client.post("/v1/completions", json=POISON)
    assert answer.status_code == 500, answer.text
    assert answer.json()["error"]["code"] == "request_quarantined"
    assert answer.headers["x-should-retry"] == "false"
    assert sum(w.poisoned for w in stack.fleet.workers) == 2
    metrics = stack.client.get("/metrics").text
    assert "radixpool_gateway_quarantined_requests_total 1.0" in metrics
    assert stack.gateway.metrics.requests == {("gateway", "500"): 1}
    assert not any(w.inflight for w in stack.gateway.workers)
