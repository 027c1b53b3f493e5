"""The command lines the operator writes into pods are accepted by the real parsers and mean what
the pool says (the worker and gateway commands are built in parallel: a missing one is skipped)."""

from __future__ import annotations

import argparse
import importlib
import socket

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from radixpool.listen import listen_socket
from radixpool.operator.crd import ROOT
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


def test_worker_reads_the_api_key_from_the_environment_the_pod_sets(pool_body, monkeypatch,
                                                                   tmp_path):
    """As the gateway reads it: a Secret made from a file (`kubectl create secret generic
    --from-file`) holds the key with a newline, which the worker kept, so the key that worked
    at the gateway got 401 from a worker; a blank one the gateway refuses, the worker too."""
    from radixpool.gateway.cli import config_from_args as gateway_config
    from radixpool.operator.gateway import gateway_args
    from radixpool.operator.workers import api_key_env
    from radixpool.worker.server.config import config_from_args as worker_config

    pool = parse_pool(pool_body(**FULL))
    assert [e["name"] for e in api_key_env(pool)] == ["RADIXPOOL_API_KEY"]
    argv = worker_args(pool)
    argv[argv.index("--model") + 1] = str(tmp_path)
    gateway = parse("radixpool.gateway.cli", "gateway", gateway_args(pool))
    monkeypatch.setenv("RADIXPOOL_API_KEY", "s3cret\n")
    assert worker_config(parse("radixpool.worker.cli", "worker", argv)).api_key == "s3cret"
    assert gateway_config(gateway, {"RADIXPOOL_API_KEY": "s3cret\n"})[0].api_key == "s3cret"
    monkeypatch.setenv("RADIXPOOL_API_KEY", " \n")
    with pytest.raises(ValueError, match=r"\$RADIXPOOL_API_KEY is set but empty"):
        worker_config(parse("radixpool.worker.cli", "worker", argv))
    with pytest.raises(ValueError, match=r"\$RADIXPOOL_API_KEY is set but empty"):
        gateway_config(gateway, {"RADIXPOOL_API_KEY": " \n"})


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


def _field(schema: dict) -> st.SearchStrategy | None:
    """Values the CRD's schema allows for a scalar field, biased to its edges (bounds, powers of
    two); None for the fields the pods' command lines do not carry (strings, quantities, lists
    and opaque objects: they keep their defaults)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema["minimum"], schema["maximum"]
        edges = [v for v in (low, low + 1, high - 1, high, *(2**k for k in range(31)))
                 if low <= v <= high]
        return st.one_of(st.sampled_from(edges), st.integers(low, high))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"),
                         exclude_min=schema.get("exclusiveMinimum", False),
                         exclude_max=schema.get("exclusiveMaximum", False),
                         allow_nan=False, allow_infinity=False)
    if kind == "object" and schema.get("properties"):
        fields = {name: drawn for name, child in schema["properties"].items()
                  if (drawn := _field(child)) is not None}
        return st.fixed_dictionaries({}, optional=fields)
    return None


_SPEC = ROOT["properties"]["spec"]["properties"]
POOL_SPECS = st.fixed_dictionaries(
    {"model": st.sampled_from([{"path": "/models/m"}, {"uri": "hf://org/name@main"},
                               {"uri": "pvc://claim/dir"}, {"uri": "pvc://claim/"}])},
    optional={"replicas": _field(_SPEC["replicas"]),
              "engine": _field(_SPEC["engine"]), "gateway": _field(_SPEC["gateway"]),
              "lifecycle": _field(_SPEC["lifecycle"]),
              "apiKeySecret": st.just({"name": "client-key"})})
# what each Secret the pods read holds
SECRET_VALUES = {"RADIXPOOL_API_KEY": "client key", "RADIXPOOL_CONTROL_API_KEY": "control key",
                 "RADIXPOOL_WORKER_API_KEY": "control key"}


def _pod_environment(container: dict) -> dict[str, str]:
    return {env["name"]: env.get("value", SECRET_VALUES.get(env["name"], "x"))
            for env in container["env"]}


@settings(max_examples=300, deadline=None)
@example(spec={"model": {"path": "/models/m"}})   # only the required fields
@given(spec=POOL_SPECS)
def test_every_pool_the_api_server_and_operator_accept_has_pods_that_start(
        cel_refusals, tmp_path_factory, spec):
    """A pool the CRD (schema and CEL) and the operator accept renders worker and gateway
    command lines and environments that the worker's and the gateway's own flag parsing and
    config validation accept: the alternative is Accepted=True over pods that exit at start."""
    from radixpool.gateway.cli import config_from_args as gateway_config
    from radixpool.operator.gateway import desired_gateway_deployment
    from radixpool.operator.openapi import apply_defaults
    from radixpool.operator.spec import InvalidPool
    from radixpool.operator.workers import desired_worker_deployment
    from radixpool.worker.server.config import config_from_args as worker_config

    body = apply_defaults(ROOT, {"metadata": {"name": "llama", "namespace": "ml", "uid": "u-1"},
                                 "spec": spec})
    assume(not cel_refusals(body))
    try:
        pool = parse_pool(body)
    except InvalidPool:
        assume(False)
    model = tmp_path_factory.getbasetemp() / "model"   # the checkpoint's directory in the pod
    model.mkdir(exist_ok=True)
    worker = desired_worker_deployment(pool, "worker:1")["spec"]["template"]["spec"][
        "containers"][0]
    argv = list(worker["args"])
    argv[argv.index("--model") + 1] = str(model)
    with pytest.MonkeyPatch.context() as env:
        for name, value in _pod_environment(worker).items():
            env.setenv(name, value)
        config = worker_config(parse("radixpool.worker.cli", "worker", argv))
    assert config.engine.page_size == pool.engine["pageSize"]
    gateway = desired_gateway_deployment(pool, "control:1")["spec"]["template"]["spec"][
        "containers"][0]
    config, _ = gateway_config(parse("radixpool.gateway.cli", "gateway", gateway["args"]),
                               _pod_environment(gateway))
    assert config.policy == pool.gateway["policy"]
