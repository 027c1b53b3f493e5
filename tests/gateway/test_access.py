"""Access: the client key never changes the worker set (only the admin key does); keys come from
the environment or files; workers keep their control paths for the control key the gateway
holds, out of reach of clients holding the serving key."""

from __future__ import annotations

import argparse
import time

import httpx
import openai
import pytest

from bench.simfleet import SimConfig, SimFleet
from radixpool.fleet.process import ChildProcess, free_port, radixpool_argv
from radixpool.gateway.cli import config_from_args, register
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.server import GatewayServer

CLIENT = {"authorization": "Bearer client-key"}
ADMIN = {"authorization": "Bearer admin-key"}


def test_the_client_key_never_changes_the_worker_set(make_stack):
    stack = make_stack(1, api_key="client-key", admin_api_key="admin-key")
    intruder = SimFleet(1, SimConfig())
    stack.loop.run(intruder.start())
    try:
        url = intruder.urls[0]
        refused = stack.client.post("/workers", json={"url": url}, headers=CLIENT)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "admin_key_required"
        assert stack.client.delete("/workers", params={"url": stack.fleet.urls[0]},
                                   headers=CLIENT).status_code == 403
        assert stack.client.post("/workers", json={"url": url}).status_code == 401
        assert len(stack.client.get("/workers", headers=CLIENT).json()["workers"]) == 1
        # the admin key does, and reads the view; it is no client key
        assert stack.client.post("/workers", json={"url": url}, headers=ADMIN).status_code == 200
        assert len(stack.client.get("/workers", headers=ADMIN).json()["workers"]) == 2
        assert stack.client.post("/generate", json={"text": "w1"}, headers=ADMIN) \
            .status_code == 401
        assert stack.client.delete("/workers", params={"url": url}, headers=ADMIN) \
            .status_code == 200
    finally:
        stack.loop.run(intruder.stop())


def test_without_an_admin_key_nobody_changes_the_worker_set(make_stack):
    keyed = make_stack(1, api_key="client-key")
    refused = keyed.client.post("/workers", json={"url": "http://127.0.0.1:9"}, headers=CLIENT)
    assert refused.status_code == 403
    assert "RADIXPOOL_ADMIN_API_KEY" in refused.json()["error"]["message"]
    open_gateway = make_stack(1)
    assert open_gateway.client.post("/workers", json={"url": "http://127.0.0.1:9"}) \
        .status_code == 403
    assert open_gateway.client.get("/workers").status_code == 200
    assert len(open_gateway.gateway.workers) == 1


def gateway_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["gateway", "--worker-urls", "http://127.0.0.1:1", *argv])


def test_keys_come_from_the_environment_or_files_and_argv_draws_a_warning(tmp_path):
    env = {"RADIXPOOL_API_KEY": "c", "RADIXPOOL_WORKER_API_KEY": "w",
           "RADIXPOOL_ADMIN_API_KEY": "a"}
    config, warnings = config_from_args(gateway_args(), env)
    assert (config.api_key, config.worker_api_key, config.admin_api_key) == ("c", "w", "a")
    assert warnings == []
    admin_file = tmp_path / "admin"
    admin_file.write_text("from-file\n")
    config, _ = config_from_args(gateway_args("--admin-api-key-file", str(admin_file)), env)
    assert config.admin_api_key == "from-file"   # a file wins over the environment
    config, warnings = config_from_args(gateway_args("--api-key", "on-argv"), {})
    assert config.api_key == "on-argv"
    assert any("process list" in w for w in warnings)
    assert any("RADIXPOOL_WORKER_API_KEY" in w for w in warnings)  # it falls back to the client's
    with pytest.raises(ValueError, match="--worker-api-key-file"):
        config_from_args(gateway_args("--worker-api-key-file", str(tmp_path / "missing")), {})
    with pytest.raises(ValueError, match="RADIXPOOL_ADMIN_API_KEY"):
        config_from_args(gateway_args(), {"RADIXPOOL_ADMIN_API_KEY": ""})
    with pytest.raises(ValueError, match="admin_api_key"):
        config_from_args(gateway_args(), {"RADIXPOOL_API_KEY": "same",
                                          "RADIXPOOL_ADMIN_API_KEY": "same"})


@pytest.fixture(scope="module")
def keyed_worker(tiny_model, tmp_path_factory):
    """A real worker with a serving key and a separate control key, both from its environment."""
    pytest.importorskip("torch", reason="the real worker needs the `worker` extra (torch)")
    port = free_port()
    worker = ChildProcess("keyed worker", radixpool_argv(
        "worker", "--model", str(tiny_model), "--served-model-name", "tiny", "--port", str(port),
        "--kv-cache-tokens", "4096", "--log-level", "warning"), port,
        tmp_path_factory.mktemp("keyed") / "worker.log",
        env={"RADIXPOOL_API_KEY": "serving-key", "RADIXPOOL_CONTROL_API_KEY": "control-key"})
    try:
        worker.start()
        worker.wait_ready(150)
        yield worker.url
    finally:
        worker.reap()


CONTROL_CALLS = [("POST", "/flush_cache", None), ("GET", "/kv_events?since=0&timeout=0", None),
                 ("GET", "/kv_events/snapshot", None),
                 ("POST", "/prefix_probe", {"text": "hello"})]


@pytest.mark.slow
def test_the_serving_key_cannot_reach_a_workers_control_paths(keyed_worker):
    serving = {"authorization": "Bearer serving-key"}
    control = {"authorization": "Bearer control-key"}
    for method, path, body in CONTROL_CALLS:
        r = httpx.request(method, keyed_worker + path, json=body, headers=serving)
        assert r.status_code == 403, path
        assert r.json()["error"]["code"] == "control_key_required"
        assert httpx.request(method, keyed_worker + path, json=body).status_code == 401, path
        assert httpx.request(method, keyed_worker + path, json=body, headers=control) \
            .status_code == 200, path
    for headers in (serving, control):  # both serve generation and the model list
        assert httpx.get(keyed_worker + "/v1/models", headers=headers).status_code == 200
        assert httpx.post(keyed_worker + "/generate", headers=headers, json={
            "text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


@pytest.mark.slow
def test_the_gateway_presents_the_control_key_and_follows_kv_events(keyed_worker, loop_thread):
    server = GatewayServer(GatewayConfig(
        worker_urls=(keyed_worker,), host="127.0.0.1", port=0, health_interval=0.2,
        api_key="client-key", worker_api_key="control-key", admin_api_key="admin-key"))
    loop_thread.run(server.start())
    try:
        base = f"http://127.0.0.1:{server.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = httpx.get(base + "/workers", headers=CLIENT).json()["workers"][0]
            if row["tree_source"] == "kv_events":
                break
            time.sleep(0.1)
        assert row["tree_source"] == "kv_events"  # it may read /kv_events: the control key
        client = openai.OpenAI(base_url=base + "/v1", api_key="client-key", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).choices
    finally:
        loop_thread.run(server.stop())
