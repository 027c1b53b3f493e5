"""The command lines the operator writes into pods are accepted by the real parsers and mean what
the pool says (the worker and gateway commands are built in parallel: a missing one is skipped)."""

from __future__ import annotations

import argparse
import importlib
import socket

import pytest

from radixpool.listen import listen_socket
from radixpool.operator.gateway import gateway_args
from radixpool.operator.spec import parse_pool
from radixpool.operator.workers import worker_args
from tests.ipv6_loopback import ipv6_loopback_missing


def parse(module: str, command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixpool", exit_on_error=False)
    subparsers = parser.add_subparsers(dest="command")
    try:
        importlib.import_module(module).register(subparsers)
    except ImportError as error:
        pytest.skip(f"{module} not importable yet: {error}")
    if command not in subparsers.choices:
        pytest.skip(f"`radixpool {command}` is not registered by {module} yet")
    return parser.parse_args(argv)


FULL = {
    "replicas": 2, "apiKeySecret": {"name": "key"},
    "model": {"uri": "pvc://models/llama", "servedName": "llama-3"},
    "engine": {"device": "cuda", "dtype": "bfloat16", "kvCacheTokens": 100000, "pageSize": 16,
               "maxRunningRequests": 64, "chunkedPrefillSize": 4096, "schedulePolicy": "fcfs",
               "logLevel": "debug"},
    "gateway": {"policy": "power_of_two", "cacheThreshold": 0.4, "balanceAbsThreshold": 8,
                "balanceRelThreshold": 2.0, "lateBinding": False},
    "lifecycle": {"drainTimeoutSeconds": 45},
}


def test_the_flags_a_pool_may_not_repeat_are_those_the_operator_writes(pool_body):
    from radixpool.operator import api

    fraction = {**FULL, "engine": {**{k: v for k, v in FULL["engine"].items()
                                      if k != "kvCacheTokens"}, "memFraction": 0.8}}
    written = {arg for spec in (FULL, fraction)
               for arg in worker_args(parse_pool(pool_body(**spec))) if arg.startswith("--")}
    assert written == api.OPERATOR_WORKER_FLAGS


@pytest.mark.parametrize("spec", [{}, FULL], ids=["default", "full"])
def test_gateway_accepts_the_operator_command_line(pool_body, spec):
    pool = parse_pool(pool_body(**spec) if spec else pool_body())
    args = parse("radixpool.gateway.cli", "gateway", gateway_args(pool))
    assert args.k8s_service == "llama-workers" and args.namespace == "ml"
    assert args.policy == pool.gateway["policy"]
    assert args.cache_threshold == pool.gateway["cacheThreshold"]
    assert args.balance_abs_threshold == pool.gateway["balanceAbsThreshold"]
    assert args.balance_rel_threshold == pool.gateway["balanceRelThreshold"]
    assert args.late_binding == pool.gateway["lateBinding"] == (not spec)
    assert args.port == 8080 and args.host == "::"
    assert args.k8s_port_name == "http"


@pytest.mark.parametrize("spec", [{}, FULL], ids=["default", "full"])
def test_worker_accepts_the_operator_command_line(pool_body, spec):
    pool = parse_pool(pool_body(**spec) if spec else pool_body())
    args = parse("radixpool.worker.cli", "worker", worker_args(pool))
    assert args.port == 8000 and args.host == "::"
    assert args.page_size == pool.engine["pageSize"]
    assert args.schedule_policy == pool.engine["schedulePolicy"]
    assert args.drain_timeout == pool.lifecycle["drainTimeoutSeconds"]
    # The worker waits for its model as long as the startup probe does (it gave up at 900 s).
    assert args.startup_timeout == pool.lifecycle["startupTimeoutSeconds"] == 1800


def test_worker_reads_the_api_key_from_the_environment_the_pod_sets(pool_body, monkeypatch):
    from radixpool.operator.workers import api_key_env

    pool = parse_pool(pool_body(**FULL))
    assert [e["name"] for e in api_key_env(pool)] == ["RADIXPOOL_API_KEY"]
    monkeypatch.setenv("RADIXPOOL_API_KEY", "s3cret")
    args = parse("radixpool.worker.cli", "worker", worker_args(pool))
    assert args.api_key == "s3cret"


@pytest.mark.parametrize(("engine", "device"), [
    ({}, "cuda"),                                       # the default pool has one GPU
    ({"resources": {"gpus": 2}}, "cuda"),
    ({"resources": {"gpus": 0}}, "cpu"),
    ({"device": "cpu"}, "cpu"),
])
def test_worker_device_follows_the_gpus_the_pod_is_given(pool_body, engine, device):
    """`device: auto` (the default) on a GPU pod must not let the worker fall back to CPU when
    its container sees no GPU (it would serve an 8B model on CPU and pass readiness); on a pod
    given no GPU it must not pick up a GPU the node's runtime exposes anyway."""
    pool = parse_pool(pool_body(engine=engine))
    args = parse("radixpool.worker.cli", "worker", worker_args(pool))
    assert args.device == device


@pytest.mark.parametrize("module, command, render", [
    ("radixpool.worker.cli", "worker", worker_args),
    ("radixpool.gateway.cli", "gateway", gateway_args)])
def test_pods_listen_where_their_pod_ip_reaches_them(pool_body, module, command, render):
    """kubelet's probes, the gateway and Prometheus connect to the pod IP, which is IPv6 only on
    an IPv6-only cluster and either family on a dual-stack one: the rendered `--host`, bound as
    the servers bind it, accepts both (`0.0.0.0`, rendered before, took IPv4 only)."""
    args = parse(module, command, render(parse_pool(pool_body())))
    targets = [(socket.AF_INET, "127.0.0.1")]
    if ipv6_loopback_missing() is None:
        targets.append((socket.AF_INET6, "::1"))
    with listen_socket(args.host, 0) as sock:
        sock.listen()
        for family, address in targets:
            with socket.socket(family) as client:
                client.settimeout(10)
                assert client.connect_ex((address, sock.getsockname()[1])) == 0, address
