"""`/metrics`: every name in the spec is exported, and the series move with the traffic."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixpool.protocol.metrics import WORKER_METRICS

pytestmark = pytest.mark.slow


def scrape(http) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_every_specified_series_is_exported(http):
    http.post("/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 2}})
    names = {name for name, _ in scrape(http)}
    for spec in WORKER_METRICS:
        for series in spec.series:
            if spec.kind == "counter" and spec.labels:
                assert any(n == series for n in names), series
            else:
                assert series in names, f"{series} missing from /metrics"


def test_metrics_move_with_requests(http, client):
    before = scrape(http)
    text = " ".join(uuid.uuid4().hex for _ in range(6))
    kw = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 5,
          "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    after = scrape(http)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    prompt = first.usage.prompt_tokens + second.usage.prompt_tokens
    cached = (first.usage.prompt_tokens_details.cached_tokens
              + second.usage.prompt_tokens_details.cached_tokens)
    assert delta("radixpool_prompt_tokens_total") == prompt
    assert delta("radixpool_cached_prompt_tokens_total") == cached > 0
    assert delta("radixpool_generation_tokens_total") == 10
    assert delta("radixpool_requests_total", finish_reason="length") == 2
    for hist in ("radixpool_time_to_first_token_seconds", "radixpool_e2e_request_latency_seconds",
                 "radixpool_queue_time_seconds"):
        assert delta(f"{hist}_count") == 2, hist
    assert delta("radixpool_inter_token_latency_seconds_count") == 8   # 4 gaps a request
    assert 0 < value(after, "radixpool_cache_hit_rate") <= 1
    assert value(after, "radixpool_kv_cache_capacity_tokens") > 0
    assert value(after, "radixpool_radix_cache_tokens") > 0
    info = [labels for name, labels in after if name == "radixpool_worker_info"]
    instance = http.get("/server_info").json()["instance_id"]
    assert dict(info[0])["instance_id"] == instance and dict(info[0])["model"] == "tiny"


@pytest.mark.parametrize("stream", [False, True])
def test_inter_token_latency_counts_every_token_after_the_first(http, client, stream):
    # A grammar that forces long literals: jump-forward sends several tokens in one chunk, each
    # of which still followed the one before it (the histogram once counted a chunk as one).
    before = scrape(http)
    kw = {"model": "tiny", "prompt": uuid.uuid4().hex, "max_tokens": 60,
          "extra_body": {"regex": r"the quick brown fox jumps over the lazy dog [0-9]"}}
    if stream:
        chunks = list(client.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) < usage.completion_tokens
    else:
        usage = client.completions.create(**kw).usage
    after = scrape(http)
    gaps = (value(after, "radixpool_inter_token_latency_seconds_count")
            - value(before, "radixpool_inter_token_latency_seconds_count"))
    assert gaps == usage.completion_tokens - 1 > 10
    assert (value(after, "radixpool_generation_tokens_total")
            - value(before, "radixpool_generation_tokens_total")) == usage.completion_tokens


def test_counters_count_each_choice_as_the_docs_say(http, client):
    before = scrape(http)
    r = client.completions.create(model="tiny", prompt=uuid.uuid4().hex, max_tokens=3, n=3,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    after = scrape(http)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("radixpool_requests_total", finish_reason="length") == 3
    assert delta("radixpool_prompt_tokens_total") == 3 * r.usage.prompt_tokens
    assert delta("radixpool_generation_tokens_total") == r.usage.completion_tokens == 9
