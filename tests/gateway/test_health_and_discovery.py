"""Health hysteresis and EndpointSlice discovery (plain dicts, no cluster)."""

from __future__ import annotations

import time

import pytest

from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.discovery import EndpointSliceState, slice_endpoints, slice_pods
from radixpool.gateway.health import HealthHysteresis
from radixpool.gateway.proxy import Gateway


def test_hysteresis_needs_n_failures_down_and_m_successes_up():
    h = HealthHysteresis(failures=3, successes=2)
    assert not h.record(True) and h.proven   # its first check passed
    assert [h.record(ok) for ok in (False, False, True, False, False)] == [False] * 5
    assert h.healthy  # a success in between reset the run
    assert h.record(False) and not h.healthy
    assert not h.record(True) and not h.healthy
    assert h.record(True) and h.healthy


def test_until_a_check_passes_each_check_decides_at_once():
    h = HealthHysteresis(failures=3, successes=2)
    assert h.healthy and not h.proven        # listed: tried before its first check
    assert h.record(False) and not h.healthy   # never answered: down at once, not after 3
    assert not h.record(False)
    assert h.record(True) and h.healthy and h.proven   # came up: one good check is enough
    assert not h.record(False) and h.healthy   # from now on, the hysteresis


def eps(name, endpoints, port=8000, port_name="http"):
    return {"metadata": {"name": name},
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": endpoints}


def ep(address, ready=True, terminating=False, pod=None):
    conditions = {"ready": ready, "serving": ready or terminating, "terminating": terminating}
    endpoint = {"addresses": [address], "conditions": conditions}
    if pod is not None:
        endpoint["targetRef"] = {"kind": "Pod", "namespace": "llm", "name": pod, "uid": "u"}
    return endpoint


def test_slice_splits_ready_terminating_and_not_ready():
    s = eps("svc-1", [ep("10.0.0.1"), ep("10.0.0.2", ready=False, terminating=True),
                      ep("10.0.0.3", ready=False), {"addresses": ["10.0.0.4"]},
                      ep("fd00::5")])
    ready, terminating = slice_endpoints(s)
    assert ready == {"http://10.0.0.1:8000", "http://10.0.0.4:8000", "http://[fd00::5]:8000"}
    assert terminating == {"http://10.0.0.2:8000"}
    assert slice_endpoints(s, port_name="metrics") == (set(), set())


def test_watch_events_maintain_the_worker_set_across_slices():
    state = EndpointSliceState()
    state.replace([eps("a", [ep("10.0.0.1")]), eps("b", [ep("10.0.0.2")])])
    assert state.workers() == ({"http://10.0.0.1:8000", "http://10.0.0.2:8000"}, set())
    state.apply("MODIFIED", eps("a", [ep("10.0.0.1", ready=False, terminating=True)]))
    assert state.workers() == ({"http://10.0.0.2:8000"}, {"http://10.0.0.1:8000"})
    state.apply("ADDED", eps("c", [ep("10.0.0.3")]))
    state.apply("DELETED", eps("a", []))
    assert state.workers() == ({"http://10.0.0.2:8000", "http://10.0.0.3:8000"}, set())
    assert not state.apply("BOOKMARK", {"metadata": {"name": "x"}})


def test_endpoints_name_their_pods_and_the_gateway_keeps_them_per_worker():
    # Gateway series named a worker by its address only: on the dashboards an SRE could not
    # tell which pod a line was. The EndpointSlice says it, in each endpoint's targetRef.
    s = eps("svc-1", [ep("10.0.0.1", pod="pool-worker-0"),
                      ep("10.0.0.2", ready=False, terminating=True, pod="pool-worker-1"),
                      {"addresses": ["10.0.0.3"], "targetRef": {"kind": "Node", "name": "n1"}},
                      ep("10.0.0.4")])
    assert slice_pods(s) == {"http://10.0.0.1:8000": "pool-worker-0",
                             "http://10.0.0.2:8000": "pool-worker-1"}
    state = EndpointSliceState("http")
    state.replace([s, eps("svc-2", [ep("10.0.0.5", pod="pool-worker-2")])])
    assert state.pods() == {"http://10.0.0.1:8000": "pool-worker-0",
                            "http://10.0.0.2:8000": "pool-worker-1",
                            "http://10.0.0.5:8000": "pool-worker-2"}

    gw = Gateway(GatewayConfig(k8s_service="pool-workers"))
    gw.workers.reconcile(*state.workers(), state.pods())
    pods = {w.url: (w.pod, w.pod_label) for w in gw.workers}
    # an endpoint that names no pod keeps its host:port as its label
    assert pods == {"http://10.0.0.1:8000": ("pool-worker-0", "pool-worker-0"),
                    "http://10.0.0.3:8000": (None, "10.0.0.3:8000"),
                    "http://10.0.0.4:8000": (None, "10.0.0.4:8000"),
                    "http://10.0.0.5:8000": ("pool-worker-2", "pool-worker-2")}
    # the address is reused by a new pod: the worker takes the new name
    state.apply("MODIFIED", eps("svc-2", [ep("10.0.0.5", pod="pool-worker-3")]))
    gw.workers.reconcile(*state.workers(), state.pods())
    assert gw.workers.get("http://10.0.0.5:8000").pod == "pool-worker-3"


def test_discovered_set_drains_terminating_and_removes_vanished_workers():
    gw = Gateway(GatewayConfig(k8s_service="pool-workers"))
    gw.workers.reconcile({"http://10.0.0.1:8000", "http://10.0.0.2:8000"}, set())
    assert {w.url for w in gw.workers.eligible(0)} == {"http://10.0.0.1:8000",
                                                       "http://10.0.0.2:8000"}
    w1 = gw.workers.get("http://10.0.0.1:8000")
    w1.inflight = 1  # a stream in progress
    gw.workers.reconcile({"http://10.0.0.2:8000"}, {"http://10.0.0.1:8000"})
    assert w1.terminating and not w1.removed and [w.url for w in gw.workers.eligible(0)] == \
        ["http://10.0.0.2:8000"]
    gw.workers.reconcile({"http://10.0.0.2:8000"}, set())
    assert w1.removed and gw.workers.get("http://10.0.0.1:8000") is None
    assert w1.inflight == 1  # its stream is untouched and finishes on its own connection


def test_one_worker_spelled_several_ways_is_added_once():
    gw = Gateway(GatewayConfig(worker_urls=["127.0.0.1:9000"]))
    added: list[str] = []
    gw.workers.membership_hooks.append(lambda worker, joined: added.append(worker.url))
    for url in ("127.0.0.1:9000", "http://127.0.0.1:9000/", "http://127.0.0.1:9000"):
        gw.workers.add(url)
    assert added == [] and [w.url for w in gw.workers] == ["http://127.0.0.1:9000"]


def test_config_validation_names_the_field():
    import pytest

    for kwargs, field in (({"cache_threshold": 2}, "cache_threshold"),
                          ({"policy": "fastest"}, "policy"),
                          ({"worker_urls": ("ftp://x:1",)}, "only http"),
                          ({"worker_urls": ("http://x",)}, "HOST:PORT"),
                          ({"balance_rel_threshold": 0.5}, "balance_rel_threshold")):
        with pytest.raises(ValueError, match=field):
            GatewayConfig(**kwargs)
    assert GatewayConfig(worker_urls=("127.0.0.1:9/",)).worker_urls == ("http://127.0.0.1:9",)


def test_the_drain_on_sigterm_is_set_from_the_command_line():
    """The operator gives a pool's gateways the drain its workers get (long streams finish
    through a gateway rollout too), so it has to be a flag."""
    import argparse

    import pytest

    from radixpool.gateway.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["gateway", "--drain-timeout", "600"])
    assert config_from_args(args, {})[0].drain_timeout == 600
    assert config_from_args(parser.parse_args(["gateway"]), {})[0].drain_timeout == 30
    with pytest.raises(ValueError, match="drain_timeout"):
        GatewayConfig(drain_timeout=-1)


class FakeDiscoveryApi:
    """LIST answers; the watch double below plays the events."""

    def __init__(self, stop):
        self.lists = 0
        self.stop = stop

    def list_namespaced_endpoint_slice(self, namespace, label_selector, **_):
        from types import SimpleNamespace

        assert (namespace, label_selector) == ("llm", "kubernetes.io/service-name=pool")
        self.lists += 1
        if self.lists == 2:
            self.stop.set()  # second LIST (after the watch expired): enough
        items = [eps("a", [ep("10.0.0.1", pod="w-1")]), eps("b", [ep("10.0.0.2")])]
        return SimpleNamespace(items=items, metadata=SimpleNamespace(resource_version="7"))


class FakeWatch:
    def stream(self, func, namespace, label_selector, resource_version, timeout_seconds, **_):
        assert resource_version == "7"
        yield {"type": "MODIFIED",
               "raw_object": eps("a", [ep("10.0.0.1", ready=False, terminating=True)])}
        yield {"type": "ADDED", "raw_object": eps("c", [ep("10.0.0.3")])}
        yield {"type": "ERROR", "raw_object": {"code": 410}}
        raise AssertionError("the shell must re-list after an ERROR event")


def test_watch_shell_lists_then_follows_events_and_relists_on_expiry():
    import threading

    from radixpool.gateway.kubernetes_watch import watch_endpoint_slices

    stop = threading.Event()
    seen = []
    api = FakeDiscoveryApi(stop)
    watch_endpoint_slices(api, "pool", "llm", None, lambda r, t, p: seen.append((r, t, p)),
                          stop, watcher=FakeWatch())
    both = {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    pod = {"http://10.0.0.1:8000": "w-1"}
    assert seen[0] == (both, set(), pod)
    assert seen[1] == ({"http://10.0.0.2:8000"}, {"http://10.0.0.1:8000"}, {})
    assert seen[2] == ({"http://10.0.0.2:8000", "http://10.0.0.3:8000"}, {"http://10.0.0.1:8000"},
                       {})
    assert seen[3] == (both, set(), pod) and api.lists == 2   # the re-list replaced everything


def test_a_silently_dropped_watch_connection_is_relisted(monkeypatch):
    """An API server (here: a loopback stand-in) that answers the LIST, then accepts the WATCH and
    never sends a byte, as a connection a middlebox forgot looks from the client. Discovery must
    not freeze: the watch read times out and the shell lists again."""
    import json as _json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kubernetes import client

    from radixpool.gateway import kubernetes_watch

    monkeypatch.setattr(kubernetes_watch, "WATCH_SECONDS", 1)
    monkeypatch.setattr(kubernetes_watch, "WATCH_SLACK_SECONDS", 1)
    lists, release = [], threading.Event()

    class Silent(BaseHTTPRequestHandler):
        def do_GET(self):
            if "watch=true" in self.path:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                release.wait(30)   # the dropped connection: open, silent
                return
            lists.append(self.path)
            body = _json.dumps({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                "metadata": {"resourceVersion": str(len(lists))},
                                "items": [{"addressType": "IPv4", "metadata": {"name": "a"},
                                           "ports": [{"name": "http", "port": 8000}],
                                           "endpoints": [{"addresses": ["10.0.0.1"],
                                                          "conditions": {"ready": True},
                                                          "targetRef": {"kind": "Pod",
                                                                        "name": "w-1"}}]}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    api = client.DiscoveryV1Api(client.ApiClient(cfg))
    stop, seen = threading.Event(), []
    shell = threading.Thread(target=kubernetes_watch.watch_endpoint_slices,
                             args=(api, "pool", "llm", None,
                                   lambda r, t, p: seen.append((r, p)), stop),
                             daemon=True)
    shell.start()
    try:
        deadline = time.monotonic() + 20
        while len(lists) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(lists) >= 2, "the watch hung on a silent connection and never re-listed"
        # through the official client's models: the pod's name survives (as `targetRef`)
        assert seen[0] == ({"http://10.0.0.1:8000"}, {"http://10.0.0.1:8000": "w-1"})
    finally:
        stop.set()
        release.set()
        server.shutdown()
        server.server_close()


def test_a_new_instance_id_empties_that_workers_tree_at_once():
    from radixpool.gateway.monitor import Monitor
    from radixpool.protocol.server_info import ServerInfo

    gw = Gateway(GatewayConfig(worker_urls=("http://10.0.0.1:8000", "http://10.0.0.2:8000")))
    monitor = Monitor(gw.workers, gw.fetch, gw.metrics)
    a, b = gw.workers.get("http://10.0.0.1:8000"), gw.workers.get("http://10.0.0.2:8000")

    def info(instance: str) -> ServerInfo:
        return ServerInfo("m", "m", 4096, 65536, 1, 16, instance, "test")

    for worker in (a, b):
        monitor.observe_identity(worker, info(f"{worker.url}-1"))
        gw.index.insert(worker.url, [1, 2, 3])
    monitor.observe_identity(a, info(f"{a.url}-1"))          # same instance: nothing happens
    assert gw.index.size(a.url) == 3
    monitor.observe_identity(a, info(f"{a.url}-2"))          # restarted or flushed
    assert gw.index.size(a.url) == 0 and gw.index.size(b.url) == 3
    assert a.corrections == {"instance_id": 1}
    assert gw.index.capacity(a.url) == 65536 // 16              # sized from its KV capacity


def test_requests_naming_a_model_go_to_workers_serving_it():
    from radixpool.protocol.server_info import ServerInfo

    gw = Gateway(GatewayConfig(worker_urls=("http://10.0.0.1:8000", "http://10.0.0.2:8000")))
    for url, model in (("http://10.0.0.1:8000", "llama"), ("http://10.0.0.2:8000", "qwen")):
        gw.workers.set_info(gw.workers.get(url), ServerInfo(model, model, 1, 1, 1, 16, "i", "v"))
    assert [w.url for w in gw.workers.eligible(0, "qwen")] == ["http://10.0.0.2:8000"]
    assert len(gw.workers.eligible(0, "unknown")) == 2  # nobody serves it: the worker says 404


def test_a_local_tokenizer_hashes_in_the_block_size_the_workers_report(tiny_model):
    from radixpool.gateway.monitor import Monitor
    from radixpool.protocol.server_info import ServerInfo
    from radixpool.tokenization import PromptTokenizer

    gw = Gateway(GatewayConfig(worker_urls=("http://10.0.0.1:8000",)),
                 PromptTokenizer.from_dir(tiny_model))   # as `--tokenizer DIR` does
    monitor = Monitor(gw.workers, gw.fetch, gw.metrics)
    worker = gw.workers.get("http://10.0.0.1:8000")
    monitor.observe_identity(worker, ServerInfo("m", "m", 4096, 65536, 1, 32, "i-1", "test"))
    assert gw.keys.block_size == 32 == worker.info.kv_block_size   # KV events now line up


def test_the_admin_api_and_the_monitor_stand_without_the_proxy():
    import subprocess
    import sys

    code = ("import sys, radixpool.gateway.admin, radixpool.gateway.monitor; "
            "sys.exit('radixpool.gateway.proxy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_monitor_needs_only_a_worker_set_and_a_way_to_fetch():
    import asyncio
    import json

    from radixpool.gateway.metrics import GatewayMetrics
    from radixpool.gateway.monitor import Monitor
    from radixpool.gateway.prefix_index import PrefixIndex
    from radixpool.gateway.route_key import KeyBuilder
    from radixpool.gateway.workers import WorkerSet

    config = GatewayConfig(health_failures=1, health_successes=1)
    fleet = WorkerSet(config, PrefixIndex(), KeyBuilder(config.text_block_bytes, 256))
    answers = {"/health": (503, b"{}"), "/server_info": (404, b""),
               "/get_server_info": (200, json.dumps({"max_total_num_tokens": 6400}).encode())}

    async def fetch(worker, path):
        if path not in answers:
            raise ConnectionRefusedError(path)
        return answers[path]

    async def scenario():
        worker = fleet.add("http://10.0.0.9:30000")
        monitor = Monitor(fleet, fetch, GatewayMetrics())   # not started: checks run by hand
        await monitor.check(worker)
        assert worker.draining and not worker.eligible(0)
        answers["/health"] = (200, b"")
        await monitor.check(worker)
        assert worker.eligible(0) and worker.info.kv_capacity_tokens == 6400
        assert worker.info_path == "/get_server_info"

    asyncio.run(scenario())


@pytest.mark.parametrize("field,value", [("kv_capacity_tokens", "65536"), ("kv_capacity_tokens", 0),
                                         ("kv_block_size", True), ("instance_id", 7),
                                         ("page_size", None), ("kv_events", "yes")])
def test_a_server_info_field_of_the_wrong_type_leaves_the_worker_checked(field, value):
    """A worker whose /server_info has a field of the wrong type is not sized from it, and its
    health is still checked every round (before, the first bad answer ended its checks)."""
    import asyncio
    import json

    from radixpool.gateway.metrics import GatewayMetrics
    from radixpool.gateway.monitor import Monitor
    from radixpool.gateway.prefix_index import PrefixIndex
    from radixpool.gateway.route_key import KeyBuilder
    from radixpool.gateway.workers import WorkerSet

    config = GatewayConfig(health_failures=1, health_successes=1, health_interval=0.01)
    fleet = WorkerSet(config, PrefixIndex(), KeyBuilder(config.text_block_bytes, 256))
    info = {"model": "m", "served_model_name": "m", "context_length": 4096,
            "kv_capacity_tokens": 65536, "page_size": 1, "kv_block_size": 16,
            "instance_id": "i-1", "version": "test", field: value}
    answers = {"/health": (200, b""), "/server_info": (200, json.dumps(info).encode()),
               "/get_server_info": (404, b"")}
    health_checks = []

    async def fetch(worker, path):
        if path == "/health":
            health_checks.append(path)
        if path not in answers:
            raise ConnectionRefusedError(path)
        return answers[path]

    async def scenario():
        worker = fleet.add("http://10.0.0.9:8000")
        monitor = Monitor(fleet, fetch, GatewayMetrics())
        monitor.start()
        try:
            for _ in range(500):
                await asyncio.sleep(0.01)
                if len(health_checks) >= 3:
                    break
            assert len(health_checks) >= 3, "the health checks stopped after a bad /server_info"
            assert worker.info is None          # nothing was sized from the bad document
            answers["/health"] = (503, b"{}")   # and a later answer is still seen
            count = len(health_checks)
            for _ in range(500):
                await asyncio.sleep(0.01)
                if worker.draining and len(health_checks) > count:
                    break
            assert worker.draining
        finally:
            await monitor.stop()

    asyncio.run(scenario())


def test_server_info_names_the_field_it_refuses():
    from radixpool.protocol.server_info import ServerInfo

    good = {"model": "m", "served_model_name": "m", "context_length": 4096,
            "kv_capacity_tokens": 65536, "page_size": 1, "kv_block_size": 16,
            "instance_id": "i-1", "version": "test", "extra": "ignored"}
    assert ServerInfo.from_json(good).kv_capacity_tokens == 65536
    for field, value, says in (("kv_capacity_tokens", "65536", "must be int, not str"),
                               ("page_size", 0, "must be > 0"),
                               ("kv_events", 1, "must be bool, not int")):
        with pytest.raises(ValueError, match=f"{field} {says}"):
            ServerInfo.from_json({**good, field: value})
    with pytest.raises(ValueError, match="instance_id is missing"):
        ServerInfo.from_json({k: v for k, v in good.items() if k != "instance_id"})


def test_a_rollout_to_another_model_gives_the_gateway_its_tokenizer(tiny_model_factory):
    """The gateway takes its tokenizer from the first worker that answers; once no healthy worker
    serves that model in that block size (a rollout changed the model and the page size), the
    next worker checked supplies it again: keys in the new units, trees emptied. Before, the
    gateway kept the first one until it restarted, and the new workers' KV events never lined
    up with its keys."""
    import asyncio
    import json

    from radixpool.gateway.metrics import GatewayMetrics
    from radixpool.gateway.monitor import Monitor
    from radixpool.gateway.prefix_index import PrefixIndex
    from radixpool.gateway.route_key import KeyBuilder
    from radixpool.gateway.workers import WorkerSet
    from radixpool.tokenization import PromptTokenizer

    config = GatewayConfig(health_failures=1, health_successes=1, kv_events=False)
    fleet = WorkerSet(config, PrefixIndex(), KeyBuilder(config.text_block_bytes, 256))
    models = {"old": (tiny_model_factory("llama", 0, "bpe"), 16),
              "new": (tiny_model_factory("llama", 0, "sentencepiece"), 32)}
    serves = {"http://10.0.0.1:8000": "old", "http://10.0.0.2:8000": "old"}

    async def fetch(worker, path):
        model = serves[worker.url]
        directory, block = models[model]
        if path == "/health":
            return 200, b""
        if path == "/server_info":
            return 200, json.dumps({
                "model": model, "served_model_name": "pool", "context_length": 4096,
                "kv_capacity_tokens": 65536, "page_size": block, "kv_block_size": block,
                "instance_id": f"{worker.url}-{model}", "version": "test"}).encode()
        if path == "/tokenizer":
            return 200, json.dumps({"files": PromptTokenizer.from_dir(directory).files}).encode()
        raise ConnectionRefusedError(path)

    prompt = {"prompt": "the same words in both tokenizers " * 8}

    def key_ids():
        return fleet.keys.build("/v1/completions", prompt).hashes

    async def scenario():
        a, b = fleet.add("http://10.0.0.1:8000"), fleet.add("http://10.0.0.2:8000")
        monitor = Monitor(fleet, fetch, GatewayMetrics())   # not started: checks run by hand
        await monitor.check(a)
        await monitor.check(b)
        assert fleet.keys.block_size == 16
        old_keys = key_ids()
        fleet.index.insert(b.url, old_keys, 0)
        serves[b.url] = "new"   # b rolled to the new model: a still serves the old one
        await monitor.check(b)
        assert fleet.keys.block_size == 16 and key_ids() == old_keys
        fleet.remove(a.url)     # the rollout ends
        await monitor.check(b)
        assert fleet.keys.block_size == 32
        new_tokenizer = PromptTokenizer.from_dir(models["new"][0])
        assert fleet.keys.tokenizer.files == new_tokenizer.files
        assert key_ids() != old_keys and not fleet.index.size(b.url)

    asyncio.run(scenario())


def test_after_a_tokenizer_change_each_kv_stream_resyncs_in_the_new_units(tiny_model_factory):
    """A rollout changed only the tokenizer (same block size): a worker's KV stream, followed
    all along, starts again from the worker's snapshot when the gateway's keys change, since
    emptying the trees dropped what the stream had told before."""
    import asyncio
    import json

    from radixpool.gateway.metrics import GatewayMetrics
    from radixpool.gateway.monitor import Monitor
    from radixpool.gateway.prefix_index import PrefixIndex
    from radixpool.gateway.route_key import KeyBuilder
    from radixpool.gateway.workers import WorkerSet
    from radixpool.protocol.kv_blocks import to_hex
    from radixpool.tokenization import PromptTokenizer

    config = GatewayConfig(health_failures=1, health_successes=1, health_interval=0.05)
    fleet = WorkerSet(config, PrefixIndex(), KeyBuilder(config.text_block_bytes, 256))
    dirs = {"old": tiny_model_factory("llama", 0, "bpe"),
            "new": tiny_model_factory("llama", 0, "sentencepiece")}
    serves = {"http://10.0.0.1:8000": "old", "http://10.0.0.2:8000": "new"}
    prompt = {"prompt": "a system prompt the new workers have cached " * 8}
    new_keys = KeyBuilder(config.text_block_bytes, 256)
    new_keys.use_tokenizer(PromptTokenizer.from_dir(dirs["new"]), 16)
    cached = new_keys.build("/v1/completions", prompt).hashes   # in b's cache all along

    async def fetch(worker, path):
        model = serves.get(worker.url)
        if model is None:
            raise ConnectionRefusedError(worker.url)
        instance = f"{worker.url}-{model}"
        if path == "/health":
            return 200, b""
        if path == "/server_info":
            return 200, json.dumps({
                "model": model, "served_model_name": "pool", "context_length": 4096,
                "kv_capacity_tokens": 65536, "page_size": 16, "kv_block_size": 16,
                "instance_id": instance, "version": "test"}).encode()
        if path == "/tokenizer":
            files = PromptTokenizer.from_dir(dirs[model]).files
            return 200, json.dumps({"files": files}).encode()
        if path == "/kv_events/snapshot":
            blocks = cached if model == "new" else []
            return 200, json.dumps({"blocks": to_hex(blocks), "instance_id": instance,
                                    "seq": 7}).encode()
        if path.startswith("/kv_events?"):
            await asyncio.sleep(0.02)
            return 200, json.dumps({"instance_id": instance, "events": [], "next": 7}).encode()
        raise ConnectionRefusedError(path)

    async def scenario():
        a = fleet.add("http://10.0.0.1:8000")
        monitor = Monitor(fleet, fetch, GatewayMetrics())
        await monitor.check(a)                   # the old tokenizer, from a
        b = fleet.add("http://10.0.0.2:8000")
        monitor.start()
        try:
            for _ in range(200):                 # b's stream is followed in the old units
                await asyncio.sleep(0.02)
                if b.kv_events_live:
                    break
            assert b.kv_events_live and fleet.keys.tokenizer.files != new_keys.tokenizer.files
            del serves[a.url]                    # a goes
            fleet.remove(a.url)
            for _ in range(200):
                await asyncio.sleep(0.02)
                if (fleet.keys.tokenizer.files == new_keys.tokenizer.files
                        and fleet.index.match(cached).get(b.url)):
                    break
            assert fleet.keys.tokenizer.files == new_keys.tokenizer.files
            assert fleet.index.match(cached).get(b.url) == len(cached)
        finally:
            await monitor.stop()

    asyncio.run(scenario())
