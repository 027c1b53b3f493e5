"""The operator against a real cluster: install, apply, observe, scale, break, heal, delete.

Runs only when RADIXPOOL_E2E_KUBECONFIG names a kubeconfig (any cluster: kind, k3d, a cloud
one); otherwise every test here reports itself skipped. `e2e/kind.sh` makes a kind cluster,
builds and loads the images, and runs this suite. Each run works in a fresh namespace and runs
the operator from this checkout as a subprocess (`radixpool operator --namespace NS`).

RADIXPOOL_E2E_WORKER_IMAGE / RADIXPOOL_E2E_GATEWAY_IMAGE choose the images (kind.sh sets them to
the ones it built). With RADIXPOOL_E2E_MODEL_URI (e.g. `hf://Qwen/Qwen3-0.6B`, needs the cluster
to reach the hub) the pool must also become ready; without it the workers cannot load a model,
and the suite checks objects, status, scale, drift, rollout, rejection and deletion.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

KUBECONFIG = os.environ.get("RADIXPOOL_E2E_KUBECONFIG")
pytestmark = pytest.mark.skipif(
    not KUBECONFIG,
    reason="live-cluster e2e skipped: set RADIXPOOL_E2E_KUBECONFIG to a kubeconfig to run it "
           "(e2e/kind.sh makes a kind cluster and does so)")

REPO = Path(__file__).resolve().parents[1]
GROUP, VERSION, PLURAL = "radixpool.io", "v1alpha1", "inferencepools"
TIMEOUT = float(os.environ.get("RADIXPOOL_E2E_TIMEOUT", "120"))


def wait_for(what: str, check: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as error:  # the API may answer 404 until the object exists
            last = error
        if last and not isinstance(last, Exception):
            return last
        time.sleep(1)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def kube() -> Any:
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=KUBECONFIG)
    return SimpleNamespace(
        core=client.CoreV1Api(api_client), apps=client.AppsV1Api(api_client),
        rbac=client.RbacAuthorizationV1Api(api_client), policy=client.PolicyV1Api(api_client),
        custom=client.CustomObjectsApi(api_client), ext=client.ApiextensionsV1Api(api_client),
        errors=client.exceptions)


@pytest.fixture(scope="module")
def namespace(kube) -> Iterator[str]:
    for path in sorted((REPO / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            try:
                kube.ext.create_custom_resource_definition(doc)
            except kube.errors.ApiException as error:
                if error.status != 409:
                    raise
                # an older CRD would test an older schema: this checkout's replaces it
                current = kube.ext.read_custom_resource_definition(doc["metadata"]["name"])
                kube.ext.replace_custom_resource_definition(doc["metadata"]["name"], {
                    **doc, "metadata": {**doc["metadata"],
                                        "resourceVersion": current.metadata.resource_version}})
    wait_for("the InferencePool CRD to be established", lambda: any(
        c.type == "Established" and c.status == "True"
        for c in kube.ext.read_custom_resource_definition(f"{PLURAL}.{GROUP}").status.conditions))
    name = f"radixpool-e2e-{uuid.uuid4().hex[:6]}"
    kube.core.create_namespace({"metadata": {"name": name}})
    yield name
    kube.core.delete_namespace(name)


@pytest.fixture(scope="module")
def operator(namespace) -> Iterator[subprocess.Popen]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ}
    for key in ("RADIXPOOL_WORKER_IMAGE", "RADIXPOOL_GATEWAY_IMAGE"):
        if os.environ.get(f"RADIXPOOL_E2E_{key[len('RADIXPOOL_'):]}"):
            env[key] = os.environ[f"RADIXPOOL_E2E_{key[len('RADIXPOOL_'):]}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "radixpool.cli", "operator", "--namespace", namespace,
         "--standalone", "--kubeconfig", KUBECONFIG,
         "--liveness", f"http://127.0.0.1:{port}/healthz"], env=env)
    yield process
    process.terminate()
    process.wait(timeout=30)


def pool_manifest(name: str, **spec: Any) -> dict[str, Any]:
    model = {"uri": os.environ["RADIXPOOL_E2E_MODEL_URI"]} if os.environ.get(
        "RADIXPOOL_E2E_MODEL_URI") else {"path": "/models/absent"}
    base = {"replicas": 1, "model": model,
            "engine": {"device": "cpu", "resources": {"gpus": 0, "cpu": "100m",
                                                      "memory": "512Mi"}},
            "gateway": {"resources": {"cpu": "50m", "memory": "128Mi"}},
            "lifecycle": {"drainTimeoutSeconds": 5, "startupTimeoutSeconds": 600}}
    base.update(spec)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferencePool",
            "metadata": {"name": name}, "spec": base}


def get_pool(kube, namespace: str, name: str) -> dict[str, Any]:
    return kube.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def condition(pool: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in (pool.get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return {}


def refused_pool(kube, namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    """Create a pool the API server or the operator refuses; the pool once Accepted=False."""
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                pool_manifest(name, **spec))
    return wait_for("Accepted=False", lambda: condition(
        p := get_pool(kube, namespace, name), "Accepted").get("status") == "False" and p)


def owned_names(kube, namespace: str, pool: str) -> set[str]:
    selector = f"radixpool.io/pool={pool}"
    return {item.metadata.name
            for lister in (kube.apps.list_namespaced_deployment,
                           kube.core.list_namespaced_service,
                           kube.core.list_namespaced_service_account,
                           kube.rbac.list_namespaced_role, kube.rbac.list_namespaced_role_binding,
                           kube.policy.list_namespaced_pod_disruption_budget)
            for item in lister(namespace, label_selector=selector).items}


def test_pool_lifecycle(kube, namespace, operator):
    name = "e2e"
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                pool_manifest(name))
    expected = {"e2e-worker", "e2e-workers", "e2e-gateway"}

    # Every owned object appears, owned by the pool.
    wait_for("owned objects", lambda: owned_names(kube, namespace, name) >= expected)
    pool = get_pool(kube, namespace, name)
    worker = kube.apps.read_namespaced_deployment("e2e-worker", namespace)
    assert worker.metadata.owner_references[0].uid == pool["metadata"]["uid"]
    assert kube.core.read_namespaced_service("e2e-workers", namespace).spec.cluster_ip == "None"
    # (made in the same pass as the objects above, a moment after them)
    wait_for("the gateway's Role", lambda: kube.rbac.read_namespaced_role("e2e-gateway",
                                                                           namespace))
    wait_for("the workers' PodDisruptionBudget", lambda: kube.policy
             .read_namespaced_pod_disruption_budget("e2e-worker", namespace))

    # Status is written from observation.
    pool = wait_for("status", lambda: (p := get_pool(kube, namespace, name)).get("status", {})
                    .get("observedGeneration") == p["metadata"]["generation"] and p)
    status = pool["status"]
    assert condition(pool, "Accepted")["status"] == "True"
    assert status["selector"] == "app.kubernetes.io/component=worker,radixpool.io/pool=e2e"
    assert status["endpoint"] == f"http://e2e-gateway.{namespace}.svc:8080"
    if os.environ.get("RADIXPOOL_E2E_MODEL_URI"):
        wait_for("WorkersReady", lambda: condition(get_pool(kube, namespace, name),
                                                   "WorkersReady").get("status") == "True",
                 timeout=900)

    # Scale through the /scale subresource, as an HPA would.
    kube.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, name,
                                                     {"spec": {"replicas": 3}})
    wait_for("worker Deployment scaled to 3", lambda: kube.apps.read_namespaced_deployment(
        "e2e-worker", namespace).spec.replicas == 3)
    scale = kube.custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL,
                                                           name)
    assert scale["spec"]["replicas"] == 3

    # Break things; the operator puts them back.
    kube.core.delete_namespaced_service("e2e-workers", namespace)
    kube.apps.patch_namespaced_deployment("e2e-worker", namespace, {"spec": {"replicas": 1}})
    wait_for("drift healed", lambda: kube.apps.read_namespaced_deployment(
        "e2e-worker", namespace).spec.replicas == 3 and kube.core.read_namespaced_service(
        "e2e-workers", namespace))

    # A new image rolls out under the pool's rollout settings.
    kube.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {
        "spec": {"engine": {"image": "example.invalid/radixpool-worker:rollout"}}})
    wait_for("new image in the template", lambda: kube.apps.read_namespaced_deployment(
        "e2e-worker", namespace).spec.template.spec.containers[0].image.endswith(":rollout"))

    # Delete: everything goes.
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    wait_for("owned objects garbage-collected",
             lambda: not owned_names(kube, namespace, name) or None, timeout=TIMEOUT)


def test_invalid_pools_are_rejected_by_the_api_server_or_the_operator(kube, namespace, operator):
    both = pool_manifest("both", model={"path": "/m", "uri": "hf://a/b"})
    with pytest.raises(kube.errors.ApiException) as rejected:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, both)
    assert rejected.value.status == 422
    assert "exactly one of spec.model.path or spec.model.uri" in rejected.value.body

    negative = pool_manifest("negative", engine={"resources": {"cpu": "-1"}})
    with pytest.raises(kube.errors.ApiException) as rejected:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, negative)
    assert rejected.value.status == 422 and "spec.engine.resources.cpu" in rejected.value.body

    missing = pool_manifest("nokey", apiKeySecret={"name": "does-not-exist"})
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, missing)
    pool = wait_for("Accepted=False", lambda: condition(
        get_pool(kube, namespace, "nokey"), "Accepted").get("status") == "False" and get_pool(
        kube, namespace, "nokey"))
    assert "spec.apiKeySecret.name" in condition(pool, "Accepted")["message"]
    assert owned_names(kube, namespace, "nokey") == set()
    events = kube.core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=nokey").items
    assert any(e.reason == "MissingReference" and e.type == "Warning" for e in events)

    # The operator keeps serving other pools.
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                pool_manifest("fine"))
    wait_for("the other pool's Deployment", lambda: kube.apps.read_namespaced_deployment(
        "fine-worker", namespace))


@pytest.mark.parametrize(("spec", "field"), [
    ({"lifecycle": {"maxSurge": "1"}}, "spec.lifecycle.maxSurge"),
    ({"lifecycle": {"maxSurge": -1}}, "spec.lifecycle.maxSurge"),
    ({"lifecycle": {"maxUnavailable": "150%"}}, "spec.lifecycle.maxUnavailable"),
    ({"lifecycle": {"podDisruptionBudget": {"maxUnavailable": -1}}},
     "spec.lifecycle.podDisruptionBudget.maxUnavailable"),
    ({"gateway": {"image": "repo/gateway:1 "}}, "spec.gateway.image"),
])
def test_values_kubernetes_refuses_later_are_refused_at_apply_naming_the_pool_field(
        kube, namespace, spec, field):
    """Once accepted by the CRD, these came back later in the generated objects' terms: an
    Accepted=False naming spec.strategy.rollingUpdate..., or a Deployment that never got a pod
    (`spec.containers[0].image: must not have leading or trailing whitespace`)."""
    body = pool_manifest("refused", **spec)
    with pytest.raises(kube.errors.ApiException) as rejected:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    assert rejected.value.status == 422 and field in rejected.value.body


def test_a_malformed_env_item_is_reported_in_status(kube, namespace, operator):
    """Passed through by the schema, it crashed the operator's checks: no status at all, and a
    traceback every minute in the operator's log."""
    engine = {"device": "cpu", "resources": {"gpus": 0, "cpu": "100m", "memory": "512Mi"},
              "env": [{"name": "TOKEN", "valueFrom": "secretKeyRef"}]}
    pool = refused_pool(kube, namespace, "badenv", engine=engine)
    assert "spec.engine.env[0].valueFrom" in condition(pool, "Accepted")["message"]
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "badenv")


def test_a_refused_volume_is_named_as_the_pools_own_field(kube, namespace, operator):
    engine = {"device": "cpu", "resources": {"gpus": 0, "cpu": "100m", "memory": "512Mi"},
              "volumes": [{"name": "data", "emptyDir": {}}],
              "volumeMounts": [{"name": "data", "mountPath": "/data"},
                               {"name": "missing", "mountPath": "/other"}]}
    pool = refused_pool(kube, namespace, "mounts", engine=engine)
    accepted = condition(pool, "Accepted")
    assert accepted["reason"] == "RejectedByAPIServer"
    assert "spec.engine.volumeMounts[1].name (spec.template.spec.containers[0].volumeMounts[" \
        in accepted["message"]
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "mounts")


def test_an_object_already_holding_a_pools_name_is_left_alone(kube, namespace, operator):
    # Someone else's Service happens to have the name the pool's gateway Service needs.
    kube.core.create_namespaced_service(namespace, {
        "metadata": {"name": "taken-gateway", "labels": {"app": "billing"}},
        "spec": {"selector": {"app": "billing"}, "ports": [{"name": "http", "port": 8080}]}})
    pool = refused_pool(kube, namespace, "taken")
    accepted = condition(pool, "Accepted")
    assert accepted["reason"] == "NameConflict"
    assert f"Service {namespace}/taken-gateway" in accepted["message"]
    theirs = kube.core.read_namespaced_service("taken-gateway", namespace)
    assert theirs.spec.selector == {"app": "billing"} and not theirs.metadata.owner_references
    assert owned_names(kube, namespace, "taken") == set()

    kube.core.delete_namespaced_service("taken-gateway", namespace)  # the name is free now
    wait_for("Accepted=True", lambda: condition(get_pool(kube, namespace, "taken"),
                                                "Accepted").get("status") == "True")
    wait_for("the pool's own gateway Service", lambda: kube.core.read_namespaced_service(
        "taken-gateway", namespace).spec.selector.get("radixpool.io/pool") == "taken")
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "taken")


def test_no_prometheus_peer_still_makes_every_pool(kube):
    """The chart's `networkPolicy.prometheus: null` reaches the operator as `null`: only the
    gateway may reach the workers. It used to put an empty peer in every pool's NetworkPolicy,
    which the API server refused ("must specify a peer"): no pool was made."""
    name = f"radixpool-e2e-{uuid.uuid4().hex[:6]}"
    kube.core.create_namespace({"metadata": {"name": name}})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "RADIXPOOL_NETWORK_POLICY": "true", "RADIXPOOL_PROMETHEUS_PEER": "null"}
    process = subprocess.Popen(
        [sys.executable, "-m", "radixpool.cli", "operator", "--namespace", name, "--standalone",
         "--kubeconfig", KUBECONFIG, "--liveness", f"http://127.0.0.1:{port}/healthz"], env=env)
    try:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, name, PLURAL,
                                                    pool_manifest("nopeer"))
        pool = wait_for("Accepted", lambda: condition(
            p := get_pool(kube, name, "nopeer"), "Accepted").get("status") and p)
        assert condition(pool, "Accepted")["status"] == "True", condition(pool, "Accepted")
        from kubernetes import client

        policy = client.NetworkingV1Api(kube.core.api_client).read_namespaced_network_policy(
            "nopeer-worker", name)
        assert [peer.pod_selector.match_labels for rule in policy.spec.ingress
                for peer in rule._from] == [{"app.kubernetes.io/component": "gateway",
                                             "radixpool.io/pool": "nopeer"}]
    finally:
        process.terminate()
        process.wait(timeout=30)
        kube.core.delete_namespace(name)


SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"kind": "ServiceMonitor", "listKind": "ServiceMonitorList",
                       "plural": "servicemonitors", "singular": "servicemonitor"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                 "openAPIV3Schema": {"type": "object",
                                     "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_prometheus_operator_uninstalled_leaves_pools_healthy(kube, namespace):   # its CRDs
    """With prometheus-operator uninstalled (its ServiceMonitor CRD gone), every pool went
    Degraded (a 404 with an empty message, as a Warning Event) until the operator looked for
    the CRD again a minute later: now the pass that finds it gone goes on without it."""
    name = f"radixpool-e2e-{uuid.uuid4().hex[:6]}"
    crd = SERVICE_MONITOR_CRD["metadata"]["name"]
    kube.ext.create_custom_resource_definition(SERVICE_MONITOR_CRD)
    kube.core.create_namespace({"metadata": {"name": name}})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "radixpool.cli", "operator", "--namespace", name, "--standalone",
         "--kubeconfig", KUBECONFIG, "--liveness", f"http://127.0.0.1:{port}/healthz"])
    try:
        wait_for("the ServiceMonitor CRD served", lambda: any(
            c.type == "Established" and c.status == "True"
            for c in kube.ext.read_custom_resource_definition(crd).status.conditions or []))
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, name, PLURAL,
                                                    pool_manifest("watched"))
        wait_for("the pool's ServiceMonitor", lambda: kube.custom.list_namespaced_custom_object(
            "monitoring.coreos.com", "v1", name, "servicemonitors")["items"])
        kube.ext.delete_custom_resource_definition(crd)
        wait_for("the CRD gone", lambda: not any(
            c.metadata.name == crd for c in kube.ext.list_custom_resource_definition().items))
        kube.custom.patch_namespaced_custom_object(GROUP, VERSION, name, PLURAL, "watched",
                                                   {"spec": {"replicas": 2}})
        pool = wait_for("the change reconciled", lambda: (
            p := get_pool(kube, name, "watched"))["status"].get("observedGeneration") == 2
            and p, timeout=30)
        assert condition(pool, "Degraded").get("status") != "True", condition(pool, "Degraded")
        assert condition(pool, "Accepted")["status"] == "True"
        warnings = [(e.reason, e.message) for e in kube.core.list_namespaced_event(name).items
                    if e.type == "Warning"]
        assert not warnings, warnings
    finally:
        process.terminate()
        process.wait(timeout=30)
        kube.core.delete_namespace(name)
        with contextlib.suppress(kube.errors.ApiException):
            kube.ext.delete_custom_resource_definition(crd)


# The cluster's etcd client URL (k8s-local's is in its kube-apiserver's --etcd-servers).
ETCD = os.environ.get("RADIXPOOL_E2E_ETCD")


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _as_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def replace_field(message: bytes, path: tuple[int, ...], value: bytes) -> bytes:
    """`message` (protobuf wire format) with every length-delimited field at `path` (field
    numbers through nested messages) set to `value`."""
    out, i = bytearray(), 0
    while i < len(message):
        start = i
        key, i = _varint(message, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(message, i)
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        elif wire == 2:
            length, body = _varint(message, i)
            i = body + length
            if number == path[0]:
                inner = (value if len(path) == 1
                         else replace_field(message[body:i], path[1:], value))
                out += _as_varint(key) + _as_varint(len(inner)) + inner
                continue
        else:
            raise ValueError(f"unexpected wire type {wire}")
        out += message[start:i]
    return bytes(out)


def etcd(call: str, **body: str) -> dict[str, Any]:
    import base64
    import json
    import urllib.request

    encoded = {k: base64.b64encode(v.encode("latin-1")).decode() for k, v in body.items()}
    request = urllib.request.Request(f"{ETCD}/v3/kv/{call}", data=json.dumps(encoded).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)


def make_side_effects_unknown(name: str) -> None:
    """Rewrites a ValidatingWebhookConfiguration in etcd as a cluster upgraded from before
    Kubernetes 1.22 holds one registered under v1beta1: `sideEffects: Unknown` (the v1 API takes
    only None / NoneOnDryRun for a new webhook, but keeps what is stored)."""
    import base64

    key = f"/registry/validatingwebhookconfigurations/{name}"
    stored = base64.b64decode(etcd("range", key=key)["kvs"][0]["value"])
    assert stored.startswith(b"k8s\x00"), stored[:8]   # protobuf: runtime.Unknown
    # runtime.Unknown.raw (2) → ValidatingWebhookConfiguration.webhooks (2) → .sideEffects (6)
    changed = b"k8s\x00" + replace_field(stored[4:], (2, 2, 6), b"Unknown")
    etcd("put", key=key, value=changed.decode("latin-1"))


class AdmissionWebhook:
    """A validating admission webhook over HTTPS on loopback (a self-signed certificate made by
    `openssl`): allows everything except a pod template carrying the env var `DENY`, and records
    the (kind, name, dryRun) of every request the API server sends it. `deny_code` is the status
    its refusal asks for (none: the API server answers 400; Gatekeeper asks for 403)."""

    def __init__(self, directory: Path, deny_code: int | None = None):
        import ssl
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        cert, key = directory / "webhook.crt", directory / "webhook.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)], check=True,
                       capture_output=True, timeout=60)
        self.ca_bundle = cert.read_bytes()
        self.seen: list[tuple[str, str, bool]] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                import json

                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                request = review["request"]
                obj = request.get("object") or {}
                seen.append((request["kind"]["kind"], request.get("name") or "",
                             bool(request.get("dryRun"))))
                containers = (((obj.get("spec") or {}).get("template") or {}).get("spec")
                              or {}).get("containers") or []
                denied = any(env.get("name") == "DENY" for c in containers
                             for env in c.get("env") or [])
                response: dict[str, Any] = {"uid": request["uid"], "allowed": not denied}
                if denied:
                    response["status"] = {"message": "env DENY is not allowed here"}
                    if deny_code is not None:
                        response["status"]["code"] = deny_code
                body = json.dumps({"apiVersion": "admission.k8s.io/v1",
                                   "kind": "AdmissionReview", "response": response}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}/validate"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def register(self, admission, config_name: str, webhook_name: str, namespace: str,
                 rules: list[dict[str, Any]]) -> None:
        """A ValidatingWebhookConfiguration sending this webhook what `rules` match in
        `namespace` (sideEffects None: the v1 API takes no other for a new one)."""
        import base64

        admission.create_validating_webhook_configuration({
            "metadata": {"name": config_name},
            "webhooks": [{
                "name": webhook_name,
                "clientConfig": {"url": self.url,
                                 "caBundle": base64.b64encode(self.ca_bundle).decode()},
                "rules": rules,
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 5,
                "admissionReviewVersions": ["v1"]}]})

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_webhook_that_cannot_dry_run_still_lets_pools_be_made(kube, namespace, operator,
                                                                  tmp_path):
    """A webhook with `sideEffects: Unknown` makes the API server refuse every dry run of what it
    matches (400 "does not support dry run"). The operator took that for the spec's fault:
    Accepted=False and nothing made, for every pool in the namespace; and with pods running,
    its once-a-minute dry-run create of the control key failed too (Degraded). Such webhooks
    live on in clusters upgraded from before 1.22 (registered under v1beta1); the v1 API makes
    no new one, so the test registers it with None and rewrites it in etcd as they are stored."""

    from kubernetes import client

    if not ETCD:
        pytest.skip("set RADIXPOOL_E2E_ETCD to the cluster's etcd URL: since Kubernetes 1.22 the "
                    "API registers no new webhook with sideEffects Unknown (only one from an "
                    "older cluster has it), so this test writes it so into etcd")
    webhook = AdmissionWebhook(tmp_path)
    admission = client.AdmissionregistrationV1Api(kube.core.api_client)
    config_name = f"{namespace}-side-effects"
    webhook.register(admission, config_name, "side-effects.radixpool-e2e.io", namespace, [
        {"apiGroups": ["", "apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
         "resources": ["deployments", "secrets"]}])
    try:
        make_side_effects_unknown(config_name)
        assert admission.read_validating_webhook_configuration(config_name).webhooks[
            0].side_effects == "Unknown"
        probe = {"metadata": {"name": "probe"}, "data": {}}

        def refuses_dry_run() -> bool:
            try:
                kube.core.create_namespaced_secret(namespace, probe, dry_run="All")
            except kube.errors.ApiException as error:
                return error.status == 400 and "does not support dry run" in error.body
            return False
        wait_for("the webhook to take effect", refuses_dry_run)

        kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                    pool_manifest("hooked"))
        pool = wait_for("Accepted", lambda: condition(
            p := get_pool(kube, namespace, "hooked"), "Accepted").get("status") and p)
        assert condition(pool, "Accepted")["status"] == "True", condition(pool, "Accepted")
        for deployment in ("hooked-worker", "hooked-gateway"):
            assert kube.apps.read_namespaced_deployment(deployment, namespace)
            assert ("Deployment", deployment, False) in webhook.seen  # it saw the real request
        events = wait_for("the AppliedWithoutDryRun Event", lambda: [
            e for e in kube.core.list_namespaced_event(
                namespace, field_selector="involvedObject.name=hooked").items
            if e.reason == "AppliedWithoutDryRun"])
        assert 'admission webhook "side-effects.radixpool-e2e.io" does not support dry run' in (
            events[0].message) and "Deployment hooked-worker" in events[0].message

        # a webhook that denies is still the pool's refusal...
        engine = {"device": "cpu", "resources": {"gpus": 0, "cpu": "100m", "memory": "512Mi"},
                  "env": [{"name": "DENY", "value": "1"}]}
        pool = refused_pool(kube, namespace, "denied", engine=engine)
        accepted = condition(pool, "Accepted")
        assert accepted["reason"] == "RejectedByAPIServer"
        assert "denied the request: env DENY is not allowed here" in accepted["message"]

        # ...and the running pool's control key is still checked every minute: a create, which
        # the webhook sees, answered 409 (present), not a dry run failing the pass.
        key = next(name for kind, name, _ in webhook.seen
                   if kind == "Secret" and name.startswith("hooked-control-key-"))
        wait_for("the control key checked again", lambda: [
            1 for kind, name, dry in webhook.seen if (kind, name, dry) == ("Secret", key, False)
        ][1:], timeout=max(TIMEOUT, 150))
        degraded = condition(get_pool(kube, namespace, "hooked"), "Degraded")
        assert degraded.get("status") != "True", degraded
    finally:
        admission.delete_validating_webhook_configuration(config_name)
        webhook.close()
        for name in ("hooked", "denied"):
            with contextlib.suppress(kube.errors.ApiException):
                kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                            name)


def test_a_policy_webhook_denying_with_403_is_the_pools_refusal(kube, namespace, operator,
                                                                 tmp_path):
    """Gatekeeper's webhooks deny with 403. The operator took a 403 for a permission it lacked:
    Degraded (APIError), retried for good, while Accepted stayed True over a pool never made."""

    from kubernetes import client

    webhook = AdmissionWebhook(tmp_path, deny_code=403)
    admission = client.AdmissionregistrationV1Api(kube.core.api_client)
    config_name = f"{namespace}-policy"
    webhook.register(admission, config_name, "policy.radixpool-e2e.io", namespace, [
        {"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
         "resources": ["deployments"]}])
    engine = {"device": "cpu", "resources": {"gpus": 0, "cpu": "100m", "memory": "512Mi"},
              "env": [{"name": "DENY", "value": "1"}]}
    try:
        pool = refused_pool(kube, namespace, "policed", engine=engine)
        accepted = condition(pool, "Accepted")
        assert accepted["reason"] == "RejectedByAPIServer", accepted
        assert ('admission webhook "policy.radixpool-e2e.io" denied the request: env DENY is '
                "not allowed here") in accepted["message"]
        assert condition(pool, "Degraded").get("status") != "True", condition(pool, "Degraded")
        assert ("Deployment", "policed-worker", True) in webhook.seen   # refused at its dry run
        with pytest.raises(kube.errors.ApiException):
            kube.apps.read_namespaced_deployment("policed-worker", namespace)
    finally:
        admission.delete_validating_webhook_configuration(config_name)
        webhook.close()
        with contextlib.suppress(kube.errors.ApiException):
            kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                        "policed")


def test_an_operator_told_to_leave_uids_to_the_platform_takes_them_out_of_running_pools(kube):
    """OpenShift's restricted-v2 SCC refuses pods asking for a uid outside the namespace's range,
    and every pool's pods asked for 1000. Moved to `--no-set-pod-uid` (the chart's
    openshift.enabled), the operator takes runAsUser, runAsGroup and fsGroup out of the pools it
    made before, and keeps the rest of their securityContext."""
    name = f"radixpool-e2e-{uuid.uuid4().hex[:6]}"
    kube.core.create_namespace({"metadata": {"name": name}})

    def run_operator(set_uid: str) -> subprocess.Popen:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return subprocess.Popen(
            [sys.executable, "-m", "radixpool.cli", "operator", "--namespace", name,
             "--standalone", "--kubeconfig", KUBECONFIG, "--resync-seconds", "3",
             "--liveness", f"http://127.0.0.1:{port}/healthz"],
            env={**os.environ, "RADIXPOOL_SET_POD_UID": set_uid})

    def pod_security(deployment: str) -> dict[str, Any]:
        pod = kube.apps.read_namespaced_deployment(deployment, name).spec.template.spec
        return kube.core.api_client.sanitize_for_serialization(pod.security_context)

    process = run_operator("true")
    try:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, name, PLURAL,
                                                    pool_manifest("uids"))
        for deployment in ("uids-worker", "uids-gateway"):
            wait_for(f"{deployment} as uid 1000", lambda d=deployment: pod_security(d).get(
                "runAsUser") == 1000)
        process.terminate()
        process.wait(timeout=30)
        process = run_operator("false")
        for deployment in ("uids-worker", "uids-gateway"):
            security = wait_for(f"{deployment} without a uid", lambda d=deployment: (
                s := pod_security(d)) and "runAsUser" not in s and s)
            assert security == {"runAsNonRoot": True,
                                "seccompProfile": {"type": "RuntimeDefault"}}, security
    finally:
        process.terminate()
        process.wait(timeout=30)
        kube.core.delete_namespace(name)
