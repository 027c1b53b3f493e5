"""The gateway's `/metrics` against what its clients saw (simulated workers, the openai SDK)."""

from __future__ import annotations

import time

import openai
from prometheus_client.parser import text_string_to_metric_families

from bench.simfleet import SimConfig


def scrape(stack) -> dict[tuple[str, tuple], float]:
    stack.settle()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(stack.client.get("/metrics").text)
            for s in family.samples}


def change(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


TTFT = "radixpool_gateway_time_to_first_token_seconds"
DURATION = "radixpool_gateway_request_duration_seconds"


def test_time_to_first_token_is_a_streams_first_event_even_when_the_client_leaves(make_stack):
    # 40 tokens at 25 ms: a whole answer takes a second, a stream's first token comes at once
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=25.0))
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    kw = {"model": "sim-model", "prompt": "w1 w2 w3", "max_tokens": 40}

    before = scrape(stack)
    client.completions.create(**kw)
    after = scrape(stack)
    # a whole answer's first byte is its last: a request duration, not a time to first token
    assert change(before, after, f"{DURATION}_count") == 1
    assert change(before, after, f"{DURATION}_sum") >= 0.9
    assert change(before, after, f"{TTFT}_count") == 0

    before = after
    list(client.completions.create(**kw, stream=True))
    after = scrape(stack)
    assert change(before, after, f"{TTFT}_count") == 1
    assert change(before, after, f"{TTFT}_sum") < 0.5 < change(before, after, f"{DURATION}_sum")

    before = after
    stream = client.completions.create(**kw, stream=True)
    next(iter(stream))
    stream.close()   # the client leaves after its first token
    worker = stack.fleet.urls[0]
    deadline = time.monotonic() + 10
    while change(before, after := scrape(stack), "radixpool_gateway_requests_total",
                 worker=worker, code="499") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert change(before, after, "radixpool_gateway_requests_total", worker=worker,
                  code="499") == 1
    assert change(before, after, f"{TTFT}_count") == 1


def test_a_terminating_worker_is_not_shown_healthy(make_stack, loop_thread):
    # Discovery says the second worker's pod is terminating: it gets no new requests, and the
    # gauge the fleet board counts as "healthy (gateway)" must say so.
    stack = make_stack(2)
    first, second = stack.fleet.urls
    loop_thread.call(stack.gateway.workers.reconcile, {first}, {second})
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    for i in range(4):
        raw = client.completions.with_raw_response.create(model="sim-model", prompt=f"w{i}",
                                                          max_tokens=1)
        assert raw.headers["x-radixpool-worker"] == first
    samples = scrape(stack)
    healthy = {dict(labels)["worker"]: value for (name, labels), value in samples.items()
               if name == "radixpool_gateway_worker_healthy"}
    assert healthy == {first: 1.0, second: 0.0}


def test_in_flight_counts_requests_of_a_removed_worker_until_they_end(make_stack):
    # A worker removed mid-stream still serves that stream through the gateway: the in-flight
    # gauge keeps it until the stream ends (it dropped it at once, showing the gateway idle).
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=40.0), admin_api_key="admin")
    worker = stack.fleet.urls[0]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="sim-model", prompt="w1 w2", max_tokens=50,
                                       stream=True)
    chunks = iter(stream)
    next(chunks)
    removed = stack.client.request("DELETE", "/workers", params={"url": worker},
                                   headers={"authorization": "Bearer admin"})
    assert removed.status_code == 200 and removed.json()["inflight_finishing"] == 1

    def inflight() -> dict[str, float]:
        return {dict(labels)["worker"]: value for (name, labels), value in scrape(stack).items()
                if name == "radixpool_gateway_inflight_requests"}

    assert inflight() == {worker: 1.0}
    assert len(list(chunks)) > 10   # the stream goes on to its end
    assert inflight() == {}
