"""The gateway's `/metrics` against what its clients saw (simulated workers, the openai SDK)."""

from __future__ import annotations

import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.simfleet import SimConfig
from radixpool.gateway.config import GatewayConfig
from tests.gateway.conftest import words


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


GRACE_S = GatewayConfig().removed_worker_series_seconds   # left at its default here
ADMIN = {"authorization": "Bearer admin"}


def per_worker_series(samples: dict) -> set[str]:
    return {dict(labels)["worker"] for (_, labels), _ in samples.items()
            if "worker" in dict(labels)} - {"all", "gateway"}


def move_clock(stack, seconds: float) -> None:
    """The gateway's clock jumps ahead (the grace period passes without a real wait)."""
    shift = [seconds]
    previous = stack.gateway.clock
    stack.gateway.clock = lambda: previous() + shift[0]


def rollout(stack, loop_thread) -> str:
    """The worker comes back under a new address (a new pod IP): the new one is added, the old
    one removed, as discovery does in a rollout. Returns the new address."""
    from bench.simfleet.fleet import kill
    from bench.simfleet.http_server import serve

    sim = stack.fleet.workers[0]
    old = sim.url

    async def new_address() -> None:
        await kill(sim)
        sim.server = await serve(sim, "127.0.0.1", 0, 1 << 26, connections=sim.connections)

    loop_thread.run(new_address())
    assert stack.client.post("/workers", json={"url": sim.url}, headers=ADMIN).status_code == 200
    assert stack.client.delete("/workers", params={"url": old},
                               headers=ADMIN).status_code == 200
    return sim.url


def test_series_of_churned_workers_go_after_the_grace_period_fleet_totals_stay(
        make_stack, loop_thread):
    # Daily rollouts for months: every one brings the workers under new addresses. /metrics
    # kept every address ever seen (thousands of dead series per scrape, and the gateway's
    # memory with them); now a removed worker's series go once it has been gone for the grace
    # period, while the fleet's hit rate keeps its history.
    stack = make_stack(1, admin_api_key="admin")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    prompt = cached = 0
    seen = []
    for cycle in range(30):
        for _ in range(2):   # the second reuses the first's prompt: the fleet hits
            usage = client.completions.create(model="sim-model", prompt=words(cycle * 50, 40),
                                              max_tokens=1).usage
            prompt += usage.prompt_tokens
            cached += usage.prompt_tokens_details.cached_tokens
        seen.append(rollout(stack, loop_thread))
        move_clock(stack, GRACE_S / 4)
        samples = scrape(stack)
        # bounded by the workers gone within the grace period, not by all ever seen
        assert len(per_worker_series(samples)) <= 6, f"cycle {cycle}: series of every worker"
        fleet_rate = samples["radixpool_gateway_hit_rate", (("kind", "actual"),
                                                            ("worker", "all"))]
        assert fleet_rate == pytest.approx(cached / prompt) and cached > 0
    move_clock(stack, GRACE_S)
    samples = scrape(stack)
    assert per_worker_series(samples) == {seen[-1]}   # the one in the fleet now
    metrics = stack.gateway.metrics   # the counters behind the series went too
    assert {key[0] for counts in (metrics.requests, metrics.decisions, metrics.prompt)
            for key in counts} <= {seen[-1], "gateway"}
    assert set(stack.gateway.pools) <= {seen[-1]}


def test_workers_fleet_totals_keep_removed_workers_history(make_stack, loop_thread):
    # GET /workers "fleet" summed the workers in the fleet now: each rollout reset it to 0,
    # while radixpool_gateway_hit_rate{worker="all"} kept the history. Both are since start.
    stack = make_stack(1, admin_api_key="admin")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    prompt = cached = 0
    for cycle in range(3):
        for _ in range(2):
            usage = client.completions.create(model="sim-model", prompt=words(cycle * 50, 40),
                                              max_tokens=1).usage
            prompt += usage.prompt_tokens
            cached += usage.prompt_tokens_details.cached_tokens
        rollout(stack, loop_thread)
        move_clock(stack, GRACE_S)
        stack.settle()
        fleet = stack.client.get("/workers").json()["fleet"]
        assert (fleet["prompt_tokens"], fleet["cached_tokens"]) == (prompt, cached), \
            "the fleet's totals lost the removed workers' history"
        samples = scrape(stack)
        assert fleet["actual_hit_rate"] == pytest.approx(
            samples["radixpool_gateway_hit_rate", (("kind", "actual"), ("worker", "all"))],
            abs=1e-4)


def test_a_worker_readded_within_the_grace_period_carries_on_its_series(make_stack):
    # An endpoint briefly not ready (removed, then back under the same address): its counters
    # go on from where they were; Prometheus sees no reset, and the fleet's none either.
    stack = make_stack(2, admin_api_key="admin")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    for i in range(6):
        client.completions.create(model="sim-model", prompt=words(i * 50, 40), max_tokens=1)
    before = scrape(stack)
    gone = stack.fleet.urls[0]
    answered = before["radixpool_gateway_requests_total", (("code", "200"), ("worker", gone))]
    assert answered >= 1
    assert stack.client.delete("/workers", params={"url": gone}, headers=ADMIN).status_code == 200
    move_clock(stack, GRACE_S / 2)
    during = scrape(stack)   # scrapes in the grace period read its final values
    assert during["radixpool_gateway_requests_total", (("code", "200"), ("worker", gone))] \
        == answered
    assert stack.client.post("/workers", json={"url": gone}, headers=ADMIN).status_code == 200
    move_clock(stack, GRACE_S)
    after = scrape(stack)
    assert after["radixpool_gateway_requests_total", (("code", "200"), ("worker", gone))] \
        == answered
    for name in ("radixpool_gateway_prompt_tokens_total", "radixpool_gateway_cached_tokens_total"):
        assert after[name, (("worker", gone),)] == before[name, (("worker", gone),)]
    fleet_rate = (("kind", "actual"), ("worker", "all"))
    assert after["radixpool_gateway_hit_rate", fleet_rate] \
        == before["radixpool_gateway_hit_rate", fleet_rate]


def test_a_removed_worker_keeps_its_series_while_its_streams_run(make_stack):
    # Removed mid-stream, past the grace period: the stream still counts there when it ends,
    # so its series stay until it has been idle for the grace period.
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=40.0), admin_api_key="admin")
    worker = stack.fleet.urls[0]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="sim-model", prompt="w1 w2", max_tokens=1)
    chunks = iter(client.completions.create(model="sim-model", prompt="w1 w2", max_tokens=30,
                                            stream=True))
    next(chunks)
    assert stack.client.delete("/workers", params={"url": worker},
                               headers=ADMIN).status_code == 200
    move_clock(stack, GRACE_S * 2)
    assert worker in per_worker_series(scrape(stack))
    assert len(list(chunks)) > 5
    samples = scrape(stack)
    assert samples["radixpool_gateway_requests_total", (("code", "200"), ("worker", worker))] \
        == 2   # the stream's answer, counted after its worker left
    move_clock(stack, GRACE_S)
    assert worker not in per_worker_series(scrape(stack))


def test_a_request_placed_just_before_its_worker_left_leaves_no_connection_pool(
        make_stack, loop_thread):
    # A held request (late binding) placed on a worker that is removed before the request
    # resumes is still sent there (it owns its slot), over a pool made anew: that pool (and its
    # idle keep-alive connection) was kept for the gone address forever, one per such race.
    import threading

    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=20.0), admin_api_key="admin",
                       kv_events=False, hold_queued_tokens=1)
    worker = stack.fleet.urls[0]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    busy = iter(client.completions.create(model="sim-model", prompt=words(0, 20), max_tokens=20,
                                          stream=True))
    next(busy)   # in flight, its prompt counted as queued: the next request is held
    answers = []
    held = threading.Thread(target=lambda: answers.append(client.completions.create(
        model="sim-model", prompt=words(100, 20), max_tokens=1)))
    held.start()
    holding = stack.gateway.holding
    deadline = time.monotonic() + 10
    while not holding and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holding, "the second request was not held"

    def place_then_remove() -> None:   # in one step of the gateway's loop
        holding.offer(stack.gateway.clock() + 3600)   # overdue: placed on the worker
        stack.gateway.workers.remove(worker)

    loop_thread.call(place_then_remove)
    held.join(30)
    assert answers and answers[0].choices[0].text
    list(busy)
    stack.settle()
    assert worker not in stack.gateway.pools


@pytest.mark.parametrize(("stream_error", "code"), [
    ({"type": "server_error"}, "500"),
    ({"type": "service_unavailable", "code": "engine_core_died"}, "503"),
    ({"type": "invalid_request_error", "code": "grammar_failed"}, "400"),
])
def test_a_stream_that_ends_in_an_error_event_is_counted_under_its_errors_status(
        make_stack, stream_error, code):
    """A 200 stream the worker ends with an error event failed: the dashboards' error panel
    (code!~"2..") must see it. It used to count as code="200", a 0% error rate while every
    stream failed mid-way."""
    stack = make_stack(1)
    worker = stack.fleet.urls[0]
    stack.client.post(worker + "/sim/fail", json={"stream_error": stream_error})
    before = scrape(stack)
    for i in range(3):
        r = stack.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": words(i, 4)}], "stream": True})
        assert r.status_code == 200 and "generation failed" in r.text
    after = scrape(stack)
    requests = "radixpool_gateway_requests_total"
    assert change(before, after, requests, worker=worker, code=code) == 3
    assert change(before, after, requests, worker=worker, code="200") == 0



def bucket_of(exposition: str, histogram: str, index: int) -> str:
    """The `le` of the first bucket of `histogram` holding its first `index + 1` observations:
    where histogram_quantile places them (`+Inf`: only "above the top bound")."""
    family = next(f for f in text_string_to_metric_families(exposition) if f.name == histogram)
    return next(s.labels["le"] for s in family.samples
                if s.name.endswith("_bucket") and s.value > index)


def test_latencies_up_to_the_upstream_timeouts_land_in_buckets_that_tell_them_apart():
    """A request may run for `upstream_timeout` (30 min) and wait `upstream_first_byte_timeout`
    (5 min) for its first byte: a p99 that long must read so, not as the top bucket's bound (the
    buckets once stopped at 120 s: a 25-minute p99 showed as 2 minutes)."""
    from prometheus_client import generate_latest

    from radixpool.gateway.metrics import GatewayMetrics

    config = GatewayConfig()
    metrics = GatewayMetrics()
    metrics.answered("http://w", 200, 130.0, 110.0)
    metrics.answered("http://w", 200, config.upstream_timeout, config.upstream_first_byte_timeout)
    text = generate_latest(metrics.registry).decode()
    for histogram, short, longest in ((DURATION, 130.0, config.upstream_timeout),
                                      (TTFT, 110.0, config.upstream_first_byte_timeout)):
        first, second = bucket_of(text, histogram, 0), bucket_of(text, histogram, 1)
        assert second != "+Inf" and float(second) >= longest, (histogram, second)
        assert short <= float(first) < longest, (histogram, first)



def test_without_a_tokenizer_the_tree_size_is_in_prompt_bytes_as_its_help_says():
    """Without a tokenizer the gateway keys prompts by UTF-8 bytes: a 2-byte character counts
    twice. The HELP once said characters, half the size read for such a prompt."""
    from radixpool.gateway.metrics import GatewayMetrics
    from radixpool.gateway.prefix_index import PrefixIndex
    from radixpool.gateway.route_key import KeyBuilder
    from radixpool.gateway.workers import WorkerSet

    config = GatewayConfig()
    index, keys = PrefixIndex(), KeyBuilder(config.text_block_bytes, config.prefix_token_count)
    fleet = WorkerSet(config, index, keys)
    worker = fleet.add("http://10.0.0.9:8000")
    prompt = "é" * 320   # 640 bytes: ten 64-byte blocks
    index.insert(worker.url, keys.build("/v1/completions", {"prompt": prompt}).hashes)
    text = GatewayMetrics().render(fleet, index, 0.0).decode()
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "radixpool_gateway_tree_tokens")
    assert "bytes" in family.documentation and "characters" not in family.documentation
    assert family.samples[0].value == len(prompt.encode())


def test_rare_events_are_exported_at_zero_before_the_first_so_rate_shows_it(make_stack):
    # rate() needs an earlier sample: a worker's first 5xx, 4xx, client gone (499), retry or
    # upstream timeout, the first held request rejected or the first tree correction from a
    # KV resync, each a series born at 1, never showed on the fleet board.
    stack = make_stack(2)
    samples = scrape(stack)
    keys = {(name, labels) for name, labels in samples}
    for worker in stack.fleet.urls:
        assert ("radixpool_gateway_upstream_timeouts_total", (("worker", worker),)) in keys
        assert samples["radixpool_gateway_route_decisions_total",
                       (("reason", "retry"), ("worker", worker))] == 0
        for source in ("cached_tokens", "instance_id", "kv_resync"):
            assert ("radixpool_gateway_tree_corrections_total",
                    (("source", source), ("worker", worker))) in keys, source
    for worker in ("gateway", *stack.fleet.urls):
        # the fleet board's "Gateway errors / s": 5xx by code, and one line for 4xx and 499
        for code in ("500", "502", "503", "504", "400", "404", "413", "499"):
            assert samples["radixpool_gateway_requests_total",
                           (("code", code), ("worker", worker))] == 0, (worker, code)
    for outcome in ("placed", "overdue", "left", "rejected"):
        assert samples["radixpool_gateway_wait_queue_outcomes_total",
                       (("outcome", outcome),)] == 0, outcome


def test_each_workers_pod_is_named_beside_its_series_until_they_go(make_stack, loop_thread):
    # The per-worker series named a worker by its address only: on Grafana an SRE could not
    # tell which pod a line was, nor join it to the worker's own series (labelled `pod`).
    stack = make_stack(2)
    first, second = stack.fleet.urls
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)

    def named(samples: dict) -> dict[str, str]:
        found = {}
        for (name, labels), value in samples.items():
            if name == "radixpool_gateway_worker_info":
                assert value == 1
                found[dict(labels)["worker"]] = dict(labels)["worker_pod"]
        return found

    # workers given by address (--worker-urls): no pod, so their host:port
    assert named(scrape(stack)) == {url: url.removeprefix("http://") for url in (first, second)}
    assert [w["pod"] for w in stack.client.get("/workers").json()["workers"]] == [None, None]
    pods = {first: "pool-worker-0", second: "pool-worker-1"}
    loop_thread.call(stack.gateway.workers.reconcile, {first, second}, set(), pods)
    served = set()
    for i in range(40):   # until both answered (each then has counters)
        raw = client.completions.with_raw_response.create(model="sim-model",
                                                          prompt=words(i * 50, 20), max_tokens=1)
        served.add(raw.headers["x-radixpool-worker"])
        if served == set(pods):
            break
    assert served == set(pods)
    samples = scrape(stack)
    assert named(samples) == pods
    assert per_worker_series(samples) == set(pods)
    assert {w["url"]: w["pod"] for w in stack.client.get("/workers").json()["workers"]} == pods

    # the second's pod goes: its name stays as long as its series (a join keeps their last
    # values), and goes with them
    loop_thread.call(stack.gateway.workers.reconcile, {first}, set(), {first: "pool-worker-0"})
    move_clock(stack, GRACE_S / 2)
    samples = scrape(stack)
    assert second in per_worker_series(samples) and named(samples) == pods
    move_clock(stack, GRACE_S)
    samples = scrape(stack)
    assert per_worker_series(samples) == {first}
    assert named(samples) == {first: "pool-worker-0"}
