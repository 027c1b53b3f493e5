"""The gateway's Kubernetes discovery against a real API server, with the operator's RBAC.

Runs only when RADIXPOOL_E2E_KUBECONFIG names a cluster-admin kubeconfig; otherwise every test
here reports itself skipped (CI has no API server). In a fresh namespace the test makes what the
operator makes for a pool's gateway, from the operator's own code: the worker Service and the
gateway's ServiceAccount, Role and RoleBinding. The gateway then runs from this checkout with the
arguments of the operator's gateway Deployment, authenticated as that ServiceAccount (a
TokenRequest token), in front of simulated workers on this machine. No kubelet runs, so the test
writes the worker Service's EndpointSlices itself, as the endpoint controller would for ready,
terminating and deleted pods. A slice may not name a loopback address, so the workers listen on
this machine's own address. Where the gateway sends requests must follow the slices.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from test_chart_live import kube, service_account_kubeconfig
from test_operator_live import KUBECONFIG, REPO, pool_manifest, wait_for

from radixpool.operator.gateway import (
    desired_gateway_role,
    desired_gateway_role_binding,
    desired_gateway_service_account,
    gateway_args,
)
from radixpool.operator.spec import parse_pool
from radixpool.operator.workers import desired_worker_service

pytestmark = pytest.mark.skipif(
    not KUBECONFIG,
    reason="live-cluster e2e skipped: set RADIXPOOL_E2E_KUBECONFIG to a cluster-admin "
           "kubeconfig to run it (../shared/tools/k8s-local/ starts a local API server)")

__all__ = ["kube"]   # a fixture, used by name


def own_address() -> str:
    """This machine's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
        except OSError:
            pytest.skip("no non-loopback IPv4 address for the EndpointSlices to name")
        return probe.getsockname()[0]


@pytest.fixture(scope="module")
def pool(kube) -> Iterator[SimpleNamespace]:
    """A namespace with the worker Service and the gateway's account, Role and RoleBinding."""
    namespace = f"rp-discovery-{uuid.uuid4().hex[:6]}"
    kube.core.create_namespace({"metadata": {"name": namespace}})
    manifest = pool_manifest("llm")
    manifest["metadata"]["namespace"] = namespace
    spec = parse_pool(manifest)
    kube.core.create_namespaced_service(namespace, desired_worker_service(spec))
    kube.core.create_namespaced_service_account(namespace, desired_gateway_service_account(spec))
    kube.rbac.create_namespaced_role(namespace, desired_gateway_role(spec))
    kube.rbac.create_namespaced_role_binding(namespace, desired_gateway_role_binding(spec))
    try:
        yield SimpleNamespace(namespace=namespace, spec=spec,
                              service=desired_worker_service(spec)["metadata"]["name"],
                              account=desired_gateway_service_account(spec)["metadata"]["name"])
    finally:
        kube.core.delete_namespace(namespace)


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[list[str]]:
    """Three simulated workers listening on this machine's own address."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    fleet = start(["-m", "bench.simfleet", "--count", "3", "--host", own_address()],
                  {"PYTHONPATH": path}, tmp_path_factory.mktemp("fleet") / "fleet.log")
    try:
        yield json.loads(fleet.stdout.readline())["urls"]
    finally:
        stop(fleet)


@pytest.fixture(scope="module")
def gateway(kube, pool, workers, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """`radixpool gateway` with the operator's arguments, as the gateway's ServiceAccount."""
    logs = tmp_path_factory.mktemp("gateway")
    kubeconfig = service_account_kubeconfig(kube, pool.namespace, pool.account,
                                            logs / "kubeconfig")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = gateway_args(pool.spec)
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        args[args.index(flag) + 1] = value
    log = logs / "gateway.log"
    process = start(["-m", "radixpool.cli", *args, "--log-level", "info"],
                    {"KUBECONFIG": str(kubeconfig), "RADIXPOOL_WORKER_API_KEY": "control"}, log)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", log=log, process=process)
    finally:
        stop(process)


def endpoint_slice(name: str, service: str, worker: str, *, ready: bool = True,
                   terminating: bool = False, pod: str | None = None) -> dict[str, Any]:
    """One worker's slice, written as the endpoint controller writes a pod's (`pod`, by
    default `<name>-0`, is its targetRef)."""
    address, port = worker.removeprefix("http://").rsplit(":", 1)
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/service-name": service,
            "endpointslice.kubernetes.io/managed-by": "e2e.radixpool.io"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {
            "ready": ready, "serving": True, "terminating": terminating},
            "targetRef": {"kind": "Pod", "name": pod or f"{name}-0"}}],
    }


def pods_named(gateway: SimpleNamespace) -> dict[str, str]:
    """worker URL → pod, as `radixpool_gateway_worker_info` says on the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    return {s.labels["worker"]: s.labels["worker_pod"]
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "radixpool_gateway_worker_info"}


def fleet_view(gateway: SimpleNamespace) -> dict[str, dict[str, Any]]:
    assert gateway.process.poll() is None, gateway.log.read_text()[-3000:]
    doc = httpx.get(f"{gateway.url}/workers", timeout=5).json()
    return {w["url"]: w for w in doc["workers"]}


def served_by(gateway: SimpleNamespace, count: int) -> set[str]:
    """The workers that answered `count` completions of different prompts."""
    answered = set()
    for i in range(count):
        r = httpx.post(f"{gateway.url}/v1/completions", timeout=30, json={
            "model": "sim-model", "prompt": f"w{i} " * (40 + 17 * i), "max_tokens": 2})
        assert r.status_code == 200, r.text
        answered.add(r.headers["x-radixpool-worker"])
    return answered


def test_the_gateway_follows_the_worker_services_endpoint_slices_as_its_own_account(
        kube, pool, workers, gateway):
    from kubernetes import client

    a, b, c = workers
    slices = client.DiscoveryV1Api(kube.api_client)
    for name, worker in (("llm-a", a), ("llm-b", b)):
        slices.create_namespaced_endpoint_slice(pool.namespace,
                                                endpoint_slice(name, pool.service, worker))
    wait_for("both ready workers discovered", lambda: {
        u for u, w in fleet_view(gateway).items() if w["eligible"]} == {a, b})
    assert served_by(gateway, 12) <= {a, b}
    # each worker is named by its pod, the targetRef of its endpoint (dashboards join on it)
    assert {u: w["pod"] for u, w in fleet_view(gateway).items()} == {a: "llm-a-0", b: "llm-b-0"}
    assert pods_named(gateway) == {a: "llm-a-0", b: "llm-b-0"}

    # b's pod is terminating: it finishes what it has and gets nothing new
    slices.replace_namespaced_endpoint_slice(
        "llm-b", pool.namespace, endpoint_slice("llm-b", pool.service, b, ready=False,
                                                terminating=True))
    wait_for("b draining", lambda: fleet_view(gateway).get(b, {}).get("terminating"))
    assert served_by(gateway, 12) == {a}

    # a new pod c becomes ready and a's pod is gone
    slices.create_namespaced_endpoint_slice(pool.namespace,
                                            endpoint_slice("llm-c", pool.service, c))
    slices.delete_namespaced_endpoint_slice("llm-a", pool.namespace)
    wait_for("a removed, c discovered", lambda: (
        view := fleet_view(gateway)).keys() == {b, c} and view[c]["eligible"])
    assert served_by(gateway, 12) == {c}

    # b is back: a new pod took the old one's address
    slices.replace_namespaced_endpoint_slice(
        "llm-b", pool.namespace, endpoint_slice("llm-b", pool.service, b, pod="llm-b-1"))
    wait_for("b eligible again", lambda: fleet_view(gateway).get(b, {}).get("eligible"))
    assert fleet_view(gateway)[b]["pod"] == "llm-b-1"
    assert pods_named(gateway)[b] == "llm-b-1" and pods_named(gateway)[c] == "llm-c-0"
    assert "re-listing" not in gateway.log.read_text(), "the watch broke (RBAC?)"
