"""The Kubernetes I/O shell (`KubeCluster`) against a small fake API server over real HTTP.

No cluster here, so a stand-in speaks just enough of the API (discovery, apply, get, list, delete)
for the real `kubernetes` client to run unmodified: this checks the requests the operator sends —
server-side apply with its field manager and force, the URLs, the deletes — and that status is
read back from what the server holds.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from radixpool.operator.desired import OperatorConfig
from radixpool.operator.reconcile import reconcile_pool

RESOURCES = {
    "api/v1": [("services", "Service"), ("serviceaccounts", "ServiceAccount"), ("pods", "Pod"),
               ("secrets", "Secret"), ("persistentvolumeclaims", "PersistentVolumeClaim")],
    "apis/apps/v1": [("deployments", "Deployment")],
    "apis/rbac.authorization.k8s.io/v1": [("roles", "Role"), ("rolebindings", "RoleBinding")],
    "apis/policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
    "apis/apiextensions.k8s.io/v1": [("customresourcedefinitions", "CustomResourceDefinition")],
    "apis/monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor")],
}


class FakeAPIServer(BaseHTTPRequestHandler):
    objects: dict[str, dict[str, Any]]
    requests: list[tuple[str, str, dict[str, list[str]], str]]

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self) -> None:
        self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                         "reason": "NotFound", "code": 404})

    def _route(self, method: str) -> tuple[str, dict[str, list[str]]]:
        url = urlparse(self.path)
        query = parse_qs(url.query)
        self.requests.append((method, url.path, query, self.headers.get("Content-Type", "")))
        return url.path.strip("/"), query

    def do_GET(self) -> None:
        path, query = self._route("GET")
        if path == "version":
            return self._send(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0"})
        if path == "apis":
            groups = [{"name": gv.split("/")[1], "versions": [{"groupVersion": gv[5:],
                       "version": gv.split("/")[2]}], "preferredVersion": {
                       "groupVersion": gv[5:], "version": gv.split("/")[2]}}
                      for gv in RESOURCES if gv.startswith("apis/")]
            return self._send(200, {"kind": "APIGroupList", "groups": groups})
        if path in RESOURCES:
            return self._send(200, {"kind": "APIResourceList", "groupVersion": path, "resources": [
                {"name": plural, "kind": kind, "namespaced": kind != "CustomResourceDefinition",
                 "verbs": ["get", "list", "patch", "delete", "create"]}
                for plural, kind in RESOURCES[path]]})
        if path in self.objects:
            return self._send(200, self.objects[path])
        prefix = path + "/"
        items = [obj for key, obj in self.objects.items()
                 if key.startswith(prefix) and "/" not in key[len(prefix):]]
        selector = query.get("labelSelector", [""])[0]
        if selector:
            key, _, value = selector.partition("=")
            items = [o for o in items if o["metadata"].get("labels", {}).get(key) == value]
        if items or path.split("/")[-1] in {p for group in RESOURCES.values() for p, _ in group}:
            return self._send(200, {"kind": "List", "apiVersion": "v1", "items": items,
                                    "metadata": {}})
        return self._not_found()

    def do_PATCH(self) -> None:
        path, _ = self._route("PATCH")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        stored = {**body, "status": self.objects.get(path, {}).get("status", {})}
        self.objects[path] = stored
        self._send(200, stored)

    def do_DELETE(self) -> None:
        path, _ = self._route("DELETE")
        if self.objects.pop(path, None) is None:
            return self._not_found()
        return self._send(200, {"kind": "Status", "status": "Success"})


@pytest.fixture
def server(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the discovery cache file
    handler = type("Handler", (FakeAPIServer,), {"objects": {}, "requests": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture
def kube_cluster(server):
    from kubernetes import client

    from radixpool.operator.kube import KubeCluster

    configuration = client.Configuration()
    configuration.host = server[1]
    return KubeCluster(client.ApiClient(configuration))


def test_reconcile_applies_every_object_server_side_with_force(server, kube_cluster, pool_body):
    handler, _ = server
    outcome = reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    applies = [(path, query, ctype) for method, path, query, ctype in handler.requests
               if method == "PATCH"]
    assert {path for path, _, _ in applies} == {
        "/api/v1/namespaces/ml/services/llama-workers",
        "/api/v1/namespaces/ml/services/llama-gateway",
        "/api/v1/namespaces/ml/serviceaccounts/llama-gateway",
        "/apis/apps/v1/namespaces/ml/deployments/llama-worker",
        "/apis/apps/v1/namespaces/ml/deployments/llama-gateway",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/roles/llama-gateway",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/rolebindings/llama-gateway",
        "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/llama-worker",
    }
    for _, query, ctype in applies:
        assert ctype.startswith("application/apply-patch+yaml")
        assert query["fieldManager"] == ["radixpool-operator"] and query["force"] == ["true"]
    deployment = handler.objects["apis/apps/v1/namespaces/ml/deployments/llama-worker"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == "1"
    assert outcome.status["endpoint"] == "http://llama-gateway.ml.svc:8080"


def test_status_is_read_back_from_the_server(server, kube_cluster, pool_body):
    handler, _ = server
    reconcile_pool(pool_body(replicas=2), kube_cluster, OperatorConfig())
    worker = handler.objects["apis/apps/v1/namespaces/ml/deployments/llama-worker"]
    worker["status"] = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    handler.objects["api/v1/namespaces/ml/pods/llama-worker-x"] = {
        "metadata": {"name": "llama-worker-x", "labels": {"radixpool.io/pool": "llama"}},
        "status": {"containerStatuses": [{"name": "worker", "state": {"waiting": {
            "reason": "CrashLoopBackOff"}}}]}}
    status = reconcile_pool(pool_body(replicas=2), kube_cluster, OperatorConfig()).status
    assert status["ready"] == "1/2"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "llama-worker-x container worker: CrashLoopBackOff" in degraded["message"]


def test_missing_secret_is_found_missing_and_nothing_is_written(server, kube_cluster, pool_body):
    handler, _ = server
    body = pool_body(apiKeySecret={"name": "nope"})
    outcome = reconcile_pool(body, kube_cluster, OperatorConfig())
    assert not [r for r in handler.requests if r[0] == "PATCH"]
    assert ("GET", "/api/v1/namespaces/ml/secrets/nope") in [r[:2] for r in handler.requests]
    accepted = outcome.status["conditions"][0]
    assert accepted["reason"] == "MissingReference"

    handler.objects["api/v1/namespaces/ml/secrets/nope"] = {"metadata": {"name": "nope"}}
    assert kube_cluster.exists("Secret", "ml", "nope")


def test_turning_the_pdb_off_deletes_it_and_monitors_follow_their_crd(server, kube_cluster,
                                                                      pool_body):
    handler, _ = server
    reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    assert not kube_cluster.has_service_monitors()
    off = pool_body(lifecycle={"podDisruptionBudget": {"enabled": False}})
    reconcile_pool(off, kube_cluster, OperatorConfig())
    assert ("DELETE", "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/llama-worker") in [
        r[:2] for r in handler.requests]
    assert "apis/policy/v1/namespaces/ml/poddisruptionbudgets/llama-worker" not in (
        handler.objects)
