"""End to end with real `radixpool worker` processes (tiny model, CPU) behind the gateway, driven
by the official `openai` SDK: group affinity vs round robin, a flushed worker, what both expose
on `/metrics` against the metric specs, a killed worker."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixpool.fleet.process import ChildProcess, free_port, radixpool_argv
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.server import GatewayServer
from radixpool.protocol.metrics import GATEWAY_METRICS, WORKER_METRICS

pytest.importorskip("torch", reason="the real worker needs the `worker` extra (torch)")
pytestmark = pytest.mark.slow

_TEXT = ("the of and to in is was for on that with as by at from his her it an were are which "
         "this be or has had not first one their its new after but who they been have also two "
         "time year city school world group music state house water light river stone paper "
         "cache token prefix model serve request worker gateway radix tree memory batch")
VOCAB = _TEXT.split()


@pytest.fixture(scope="module")
def real_workers(tiny_model, tmp_path_factory):
    """Two real workers, each in its own process group, stopped (with their engine cores)
    by PID even when startup fails."""
    logs = tmp_path_factory.mktemp("real-workers")
    workers = []
    for i in range(2):
        port = free_port()
        workers.append(ChildProcess(f"worker {i}", radixpool_argv(
            "worker", "--model", str(tiny_model), "--served-model-name", "tiny", "--port",
            str(port), "--kv-cache-tokens", "4096", "--log-level", "warning"), port,
            logs / f"worker-{i}.log"))
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(150)
        yield [w.proc for w in workers], [w.url for w in workers]
    finally:
        for w in workers:
            w.reap()


@pytest.fixture
def gateway(loop_thread, real_workers):
    servers = []

    def make(**config) -> str:
        urls = real_workers[1]
        for url in urls:
            httpx.post(url + "/flush_cache")  # each run starts from cold caches
        config.setdefault("health_interval", 3600.0)
        server = GatewayServer(GatewayConfig(worker_urls=tuple(urls), host="127.0.0.1", port=0,
                                             **config))
        loop_thread.run(server.start())
        for worker in server.gateway.workers:
            loop_thread.run(server.monitor.check(worker))
        servers.append(server)
        return server

    yield make
    for server in servers:
        loop_thread.run(server.stop())


def group_prompt(group: int) -> str:
    rng = random.Random(group)
    return " ".join(rng.choice(VOCAB) for _ in range(160))


def ask(client: openai.OpenAI, group: int, question: int):
    return client.chat.completions.with_raw_response.create(
        model="tiny", max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": group_prompt(group)},
                  {"role": "user", "content": f"question {question} about {VOCAB[question]}"}])


def run(server: GatewayServer, per_group: int = 3, groups: int = 3) -> tuple[float, dict]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                           max_retries=0)
    prompt = cached = 0
    homes: dict[int, set[str]] = {g: set() for g in range(groups)}
    for q in range(per_group):
        for g in range(groups):
            raw = ask(client, g, q)
            usage = raw.parse().usage
            prompt += usage.prompt_tokens
            cached += usage.prompt_tokens_details.cached_tokens
            if q:
                homes[g].add(raw.http_response.headers["x-radixpool-worker"])
    return cached / prompt, homes


def test_groups_stay_on_one_real_worker_and_beat_round_robin(gateway, loop_thread):
    server = gateway()
    aware_rate, homes = run(server)
    assert all(len(h) == 1 for h in homes.values()), homes
    # token-exact: the gateway's tokenizer and block hashes are the worker's, so every predicted
    # hit happened, and the worker (page size 1) reused less than a block more than predicted
    loop_thread.run(asyncio.sleep(0))
    workers = list(server.gateway.workers)
    predicted = sum(w.predicted_tokens for w in workers)
    actual = sum(w.cached_tokens for w in workers)
    assert server.gateway.keys.tokenizer is not None
    assert 0 <= actual - predicted < 16 * sum(w.requests for w in workers), (predicted, actual)
    assert not any(w.corrections.get("cached_tokens") for w in workers)
    rr_rate, _ = run(gateway(policy="round_robin"))
    assert aware_rate > 0.5 and aware_rate > rr_rate + 0.2, (aware_rate, rr_rate)


def test_a_flushed_real_worker_is_noticed_and_the_hit_rate_recovers(gateway, loop_thread):
    server = gateway()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                           max_retries=0)
    owner = ask(client, 0, 0).http_response.headers["x-radixpool-worker"]
    assert ask(client, 0, 1).parse().usage.prompt_tokens_details.cached_tokens > 100
    httpx.post(owner + "/flush_cache")
    worker = server.gateway.workers.get(owner)
    loop_thread.run(server.monitor.check(worker))
    assert sum(worker.corrections.values()) >= 1  # new instance id (or the KV-event resync)
    assert server.gateway.index.size(owner) == 0
    predicted = sum(w.predicted_tokens for w in server.gateway.workers)
    cold = ask(client, 0, 2)
    assert cold.parse().usage.prompt_tokens_details.cached_tokens < 20
    loop_thread.run(asyncio.sleep(0))  # let the gateway finish its bookkeeping
    assert sum(w.predicted_tokens for w in server.gateway.workers) == predicted  # no false hit
    recovered = ask(client, 0, 3)
    assert recovered.http_response.headers["x-radixpool-worker"] == \
        cold.http_response.headers["x-radixpool-worker"]
    assert recovered.parse().usage.prompt_tokens_details.cached_tokens > 100


def aborted_on(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('radixpool_requests_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_its_request_on_the_real_worker(gateway, real_workers,
                                                                    stream):
    server = gateway(policy="round_robin")
    urls = real_workers[1]
    before = {url: aborted_on(url) for url in urls}
    body = {"model": "tiny", "prompt": "the cache", "max_tokens": 1800, "ignore_eos": True,
            "stream": stream}
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    with httpx.Client(timeout=1.0) as c:
        if stream:   # read a few events, then hang up
            with c.stream("POST", url, json=body) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i == 4:
                        break
        else:        # the answer never comes within the client's patience
            with pytest.raises(httpx.TimeoutException):
                c.post(url, json=body)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and all(aborted_on(u) == before[u] for u in urls):
        time.sleep(0.1)
    assert any(aborted_on(u) == before[u] + 1 for u in urls)   # the worker stopped generating
    assert all(w.inflight == 0 for w in server.gateway.workers)


def exposed(url: str) -> dict[str, tuple[str, set[tuple[str, ...]]]]:
    """`/metrics` of one server: each radixpool family's name -> (type, label name sets), in
    Prometheus' text format (counters named with `_total`; an info metric is a gauge there)."""
    families: dict[str, tuple[str, set[tuple[str, ...]]]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if not family.name.startswith("radixpool_"):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        families[name] = (family.type, {
            tuple(sorted(set(sample.labels) - {"le"})) for sample in family.samples})
    return families


def spec_view(specs) -> dict[str, tuple[str, set[tuple[str, ...]]]]:
    return {s.series[0] if s.kind == "info" else s.name:
            ("gauge" if s.kind == "info" else s.kind, {tuple(sorted(s.labels))}) for s in specs}


def test_what_real_workers_and_the_gateway_expose_is_what_the_specs_say(gateway, real_workers):
    server = gateway(policy="round_robin")   # every worker serves, so every series has samples
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                        max_retries=0)
    for i in range(2):
        ask(sdk, 5, i)
        for _ in sdk.completions.create(model="tiny", prompt="the cache", max_tokens=4,
                                        stream=True):
            pass
    for url in real_workers[1]:
        assert exposed(url) == spec_view(WORKER_METRICS), url
    # Labelled gateway counters nobody bumped yet (timeouts, corrections, wait queue outcomes)
    # have a TYPE line and no sample: only their type can be compared.
    gateway_families = exposed(f"http://127.0.0.1:{server.port}")
    specs = spec_view(GATEWAY_METRICS)
    assert set(gateway_families) == set(specs)
    for name, (kind, label_sets) in gateway_families.items():
        assert kind == specs[name][0] and label_sets <= specs[name][1], (name, label_sets)
    assert sum(len(label_sets) for _, label_sets in gateway_families.values()) >= 14


def test_a_generate_batch_is_counted_whole_and_checked_on_its_first_prompt(gateway, loop_thread):
    """A `/generate` batch routes on its first prompt and is answered with one result per
    prompt: the gateway counts every result's tokens (as the worker does), and checks its
    prediction against the first result (it once took the last result for both: a third of
    the tokens counted, and a warm first prompt "missed" when the last one was cold)."""
    server = gateway(kv_events=False)   # predictions are checked against cached_tokens alone
    url = f"http://127.0.0.1:{server.port}"
    warm = group_prompt(7)
    first = httpx.post(url + "/generate", json={
        "text": warm, "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    owner = server.gateway.workers.get(first.headers["x-radixpool-worker"])
    loop_thread.run(asyncio.sleep(0))  # let the gateway finish its bookkeeping
    before = (owner.prompt_tokens, owner.cached_tokens)
    batch = httpx.post(url + "/generate", json={
        "text": [warm + " again", group_prompt(8), group_prompt(9)],
        "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    assert batch.status_code == 200 and batch.headers["x-radixpool-worker"] == owner.url
    reports = [result["meta_info"] for result in batch.json()]
    loop_thread.run(asyncio.sleep(0))  # let the gateway finish its bookkeeping
    assert reports[0]["cached_tokens"] > 100 and reports[-1]["cached_tokens"] < 20
    assert (owner.prompt_tokens - before[0], owner.cached_tokens - before[1]) == (
        sum(r["prompt_tokens"] for r in reports), sum(r["cached_tokens"] for r in reports))
    assert owner.corrections.get("cached_tokens", 0) == 0   # the first prompt did hit


def test_killing_a_real_worker_mid_run_loses_no_request(gateway, real_workers):
    server = gateway()
    procs, urls = real_workers
    statuses: list[int] = []
    errors: list[str] = []

    def client(t: int) -> None:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                            max_retries=0)
        for i in range(4):
            try:
                ask(sdk, t, i)
                statuses.append(200)
            except openai.OpenAIError as exc:
                errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    while len(statuses) + len(errors) < 4:
        time.sleep(0.01)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].wait(10)
    for t in threads:
        t.join(120)
    assert errors == [] and len(statuses) == 16
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                        max_retries=0)
    served = {ask(sdk, 9, i).http_response.headers["x-radixpool-worker"] for i in range(4)}
    assert urls[1] not in served


def test_the_hits_predicted_on_a_paged_real_worker_are_the_ones_it_reuses(loop_thread,
                                                                          tiny_model, tmp_path):
    # A worker with 16-token pages reuses a prompt it holds whole only up to the page holding
    # its last token: 48 tokens of a 64-token prompt. The gateway predicted 63 (all but the last
    # token), so its predicted hit rate ran above the real one on every such repeat.
    port = free_port()
    worker = ChildProcess("paged worker", radixpool_argv(
        "worker", "--model", str(tiny_model), "--served-model-name", "tiny", "--port", str(port),
        "--kv-cache-tokens", "4096", "--page-size", "16", "--log-level", "warning"), port,
        tmp_path / "worker.log")
    try:
        worker.start().wait_ready(150)
        server = GatewayServer(GatewayConfig(worker_urls=(worker.url,), host="127.0.0.1",
                                             port=0, health_interval=3600.0))
        loop_thread.run(server.start())
        try:
            row = server.gateway.workers.get(worker.url)
            loop_thread.run(server.monitor.check(row))   # its tokenizer and page size
            sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                max_retries=0)
            reused = []
            for length in (64, 70):   # whole pages, and a partial last page
                prompt = [100 + (7 * i + length) % 200 for i in range(length)]
                for _ in range(2):
                    usage = sdk.completions.create(model="tiny", prompt=prompt,
                                                   max_tokens=1).usage
                reused.append(usage.prompt_tokens_details.cached_tokens)
            assert reused == [48, 64]
            loop_thread.run(asyncio.sleep(0))   # let the gateway finish its bookkeeping
            assert (row.predicted_tokens, row.cached_tokens) == (48 + 64, 48 + 64)
        finally:
            loop_thread.run(server.stop())
    finally:
        worker.reap()
