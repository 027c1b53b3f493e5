"""The chart as a cluster admin installs it, and the operator with the chart's own permissions.

Runs only when RADIXPOOL_E2E_KUBECONFIG names a cluster-admin kubeconfig; otherwise every test
here reports itself skipped (CI has no API server). Helm's own library (helm-python-sdk, Helm v4)
installs `charts/radixpool` into a fresh namespace; the operator then runs from this checkout with
exactly the arguments and environment of the chart's Deployment, but authenticated as the chart's
ServiceAccount (a TokenRequest token in a kubeconfig), so every request meets the chart's RBAC
as it would in the pod. Pools are made in other namespaces, deleted with and without a running
operator, and the release is uninstalled. No kubelet is needed: where readiness matters the tests
set the pods' status by hand, as a kubelet would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from test_operator_live import (
    GROUP,
    KUBECONFIG,
    PLURAL,
    REPO,
    VERSION,
    condition,
    get_pool,
    pool_manifest,
    wait_for,
)

pytestmark = pytest.mark.skipif(
    not KUBECONFIG,
    reason="live-cluster e2e skipped: set RADIXPOOL_E2E_KUBECONFIG to a cluster-admin "
           "kubeconfig to run it (../shared/tools/k8s-local/ starts a local API server)")

CHART = REPO / "charts" / "radixpool"
RELEASE = f"rp{uuid.uuid4().hex[:5]}"
RESYNC = 3


@pytest.fixture(scope="module")
def kube() -> Any:
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=KUBECONFIG)
    return SimpleNamespace(
        api_client=api_client,
        core=client.CoreV1Api(api_client), apps=client.AppsV1Api(api_client),
        rbac=client.RbacAuthorizationV1Api(api_client), policy=client.PolicyV1Api(api_client),
        net=client.NetworkingV1Api(api_client), auth=client.AuthorizationV1Api(api_client),
        custom=client.CustomObjectsApi(api_client), errors=client.exceptions)


@pytest.fixture(scope="module")
def release(kube) -> Iterator[SimpleNamespace]:
    """`helm install` of the chart with its defaults (cluster-wide, peering, NetworkPolicy)."""
    import helm_python as helm

    namespace = f"{RELEASE}-system"
    with helm.Config(kubeconfig_path=KUBECONFIG, namespace=namespace) as cfg:
        installed = cfg.install(str(CHART), RELEASE, {}, namespace=namespace,
                                create_namespace=True, timeout=120)
        assert installed["status"] == "deployed"
        try:
            yield SimpleNamespace(name=RELEASE, namespace=namespace, helm=cfg,
                                  manifest=[d for d in yaml.safe_load_all(installed["manifest"])
                                            if d])
        finally:
            cfg.uninstall(RELEASE, ignore_not_found=True)
            kube.core.delete_namespace(namespace)


def service_account_kubeconfig(kube, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount, with a TokenRequest token."""
    token = kube.core.create_namespaced_service_account_token(
        account, namespace, {"spec": {"expirationSeconds": 3600}}).status.token
    admin = yaml.safe_load(Path(KUBECONFIG).read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])
    cluster = next(c for c in admin["clusters"] if c["name"] == context["context"]["cluster"])
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": cluster["cluster"]}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa"}}]}))
    return path


@pytest.fixture(scope="module")
def as_chart(kube, release, tmp_path_factory) -> SimpleNamespace:
    """The chart's operator Deployment, its ServiceAccount, and a kubeconfig as that account."""
    deployment = next(d for d in release.manifest if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    kubeconfig = service_account_kubeconfig(kube, release.namespace, pod["serviceAccountName"],
                                            tmp_path_factory.mktemp("sa") / "kubeconfig")
    return SimpleNamespace(container=pod["containers"][0], account=pod["serviceAccountName"],
                           kubeconfig=kubeconfig)


class Operator:
    """`radixpool operator` from this checkout, with the chart's args and env, as the chart's
    ServiceAccount (only the liveness address, the kubeconfig and the resync period differ)."""

    def __init__(self, as_chart: SimpleNamespace, log: Path, extra: tuple[str, ...] = ()):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        args = [a for a in as_chart.container["args"]
                if not a.startswith(("--liveness", "--resync-seconds"))]
        env = {**os.environ, **{e["name"]: e["value"] for e in as_chart.container["env"]}}
        env.pop("KUBECONFIG", None)
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "radixpool.cli", *args, *extra,
             "--kubeconfig", str(as_chart.kubeconfig), f"--resync-seconds={RESYNC}",
             f"--liveness=http://127.0.0.1:{port}/healthz"],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def operator(as_chart, tmp_path_factory) -> Iterator[Operator]:
    running = Operator(as_chart, tmp_path_factory.mktemp("op") / "operator.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def namespaces(kube) -> Iterator[list[str]]:
    names = [f"{RELEASE}-team-{team}" for team in ("a", "b")]
    for name in names:
        kube.core.create_namespace({"metadata": {"name": name}})
    yield names
    for name in names:
        try:
            kube.core.delete_namespace(name)
        except kube.errors.ApiException as error:
            if error.status != 404:
                raise


def create_pool(kube, namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    return kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                       pool_manifest(name, **spec))


def owned(kube, namespace: str, pool: str) -> set[str]:
    selector = f"radixpool.io/pool={pool}"
    found = set()
    for kind, lister in (("Deployment", kube.apps.list_namespaced_deployment),
                         ("Service", kube.core.list_namespaced_service),
                         ("ServiceAccount", kube.core.list_namespaced_service_account),
                         ("Role", kube.rbac.list_namespaced_role),
                         ("RoleBinding", kube.rbac.list_namespaced_role_binding),
                         ("PodDisruptionBudget", kube.policy.list_namespaced_pod_disruption_budget),
                         ("NetworkPolicy", kube.net.list_namespaced_network_policy)):
        found |= {f"{kind}/{item.metadata.name}"
                  for item in lister(namespace, label_selector=selector).items}
    return found


def everything(pool: str) -> set[str]:
    return {f"Deployment/{pool}-worker", f"Deployment/{pool}-gateway",
            f"Service/{pool}-workers", f"Service/{pool}-gateway",
            f"ServiceAccount/{pool}-gateway", f"Role/{pool}-gateway",
            f"RoleBinding/{pool}-gateway", f"PodDisruptionBudget/{pool}-worker",
            f"PodDisruptionBudget/{pool}-gateway", f"NetworkPolicy/{pool}-worker"}


def make_pods_ready(kube, namespace: str, pool: str) -> int:
    """Play the kubelet: every pod of the pool Running and Ready."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    pods = kube.core.list_namespaced_pod(namespace, label_selector=f"radixpool.io/pool={pool}")
    for pod in pods.items:
        kube.core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": {
            "phase": "Running", "podIP": "10.0.0.9",
            "conditions": [{"type": kind, "status": "True", "lastTransitionTime": now}
                           for kind in ("PodScheduled", "Initialized", "ContainersReady",
                                        "Ready")]}})
    return len(pods.items)


def apply_requests() -> float:
    """Server-side apply requests the API server has answered, from its /metrics."""
    text = subprocess.run(["kubectl", "--kubeconfig", KUBECONFIG, "get", "--raw", "/metrics"],
                          check=True, capture_output=True, text=True).stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("apiserver_request_total{") and 'verb="APPLY"' in line)


def events_about(kube, namespace: str, pool: str) -> list[Any]:
    return kube.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pool}").items


def test_the_chart_installs_on_this_cluster_with_least_privilege(kube, release, as_chart):
    kinds = {d["kind"] for d in release.manifest}
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
            "ClusterKopfPeering"} <= kinds
    from kubernetes import client

    version = client.VersionApi(kube.api_client).get_code()
    assert (int(version.major), int(version.minor.rstrip("+"))) >= (1, 28)  # kubeVersion

    def can(verb: str, resource: str, group: str = "", namespace: str = "default") -> bool:
        review = kube.auth.create_subject_access_review({"spec": {
            "user": f"system:serviceaccount:{release.namespace}:{as_chart.account}",
            "resourceAttributes": {"verb": verb, "resource": resource, "group": group,
                                   "namespace": namespace}}})
        return review.status.allowed

    assert can("create", "deployments", "apps") and can("patch", "inferencepools/status",
                                                          "radixpool.io")
    # No `bind` or `escalate`: the gateway's RoleBinding is created by holding what it grants.
    assert not can("bind", "roles", "rbac.authorization.k8s.io")
    assert not can("escalate", "roles", "rbac.authorization.k8s.io")
    assert not can("get", "secrets")  # opt-in (rbac.readSecrets)
    assert not can("create", "clusterkopfpeerings", "kopf.dev", namespace="")
    # the gateway lists and watches EndpointSlices (the operator grants what it holds); watching
    # every namespace, kopf never lists namespaces
    assert can("watch", "endpointslices", "discovery.k8s.io")
    assert not can("get", "endpointslices", "discovery.k8s.io")
    assert not can("list", "namespaces", namespace="")


def control_key_name(pool: str, uid: str) -> str:
    return f"{pool}-control-key-{uid.replace('-', '')[:12]}"


def test_the_operator_as_the_charts_account_creates_pools_in_other_namespaces(
        kube, namespaces, operator):
    # Made before the pool, under the name a pool's control key had: the operator may not read
    # Secrets, and it took this one for the pool's key (known to whoever made it)
    kube.core.create_namespaced_secret(namespaces[0], {
        "metadata": {"name": "llm-control-key"}, "stringData": {"key": "known-to-its-maker"}})
    for namespace in namespaces:
        create_pool(kube, namespace, "llm")
    for namespace in namespaces:
        wait_for(f"every object of {namespace}/llm", lambda ns=namespace: owned(
            kube, ns, "llm") >= everything("llm"))
        pool = wait_for("status", lambda ns=namespace: (p := get_pool(kube, ns, "llm")).get(
            "status", {}).get("observedGeneration") == p["metadata"]["generation"] and p)
        assert condition(pool, "Accepted")["status"] == "True"
        assert condition(pool, "Degraded")["status"] == "False", condition(pool, "Degraded")
        assert condition(pool, "Ready")["reason"] == "WorkersNotReady"
        assert not pool["metadata"].get("finalizers")
        binding = kube.rbac.read_namespaced_role_binding("llm-gateway", namespace)
        assert binding.role_ref.name == "llm-gateway"
        name = control_key_name("llm", pool["metadata"]["uid"])
        control = kube.core.read_namespaced_secret(name, namespace)
        assert control.metadata.owner_references[0].uid == pool["metadata"]["uid"]
        gateway = kube.apps.read_namespaced_deployment("llm-gateway", namespace)
        refs = {e.name: e.value_from.secret_key_ref.name
                for e in gateway.spec.template.spec.containers[0].env if e.value_from}
        assert refs["RADIXPOOL_WORKER_API_KEY"] == name
        assert operator.process.poll() is None, operator.log.read_text()[-3000:]


def test_the_pool_turns_ready_when_its_pods_do(kube, namespaces, operator):
    namespace = namespaces[0]
    wait_for("pods of the pool", lambda: make_pods_ready(kube, namespace, "llm") >= 2)
    pool = wait_for("Ready=True", lambda: condition(
        p := get_pool(kube, namespace, "llm"), "Ready").get("status") == "True" and p)
    assert condition(pool, "WorkersReady")["status"] == "True"
    assert condition(pool, "GatewayReady")["status"] == "True"
    reasons = {(e.reason, e.source.component) for e in events_about(kube, namespace, "llm")}
    assert ("WorkersReady", "radixpool-operator") in reasons
    assert not any(component == "kopf" for _, component in reasons)


def test_steady_state_writes_nothing(kube, namespaces, operator):
    namespace = namespaces[1]
    wait_for("status", lambda: condition(get_pool(kube, namespace, "llm"), "Accepted"))
    time.sleep(RESYNC * 2)  # the first passes settle

    def versions() -> dict[str, str]:
        found = {"pool": get_pool(kube, namespace, "llm")["metadata"]["resourceVersion"]}
        for lister in (kube.apps.list_namespaced_deployment, kube.core.list_namespaced_service,
                       kube.rbac.list_namespaced_role, kube.rbac.list_namespaced_role_binding,
                       kube.policy.list_namespaced_pod_disruption_budget,
                       kube.net.list_namespaced_network_policy):
            for item in lister(namespace, label_selector="radixpool.io/pool=llm").items:
                found[item.metadata.name + type(item).__name__] = item.metadata.resource_version
        return found

    before, applies = versions(), apply_requests()
    time.sleep(RESYNC * 4)  # four timer passes
    # No object or status written (resourceVersions), and not even a no-op server-side apply
    # (the API server's own request counter: only the operator applies here).
    assert versions() == before
    assert apply_requests() == applies


def test_drift_including_a_hand_added_env_var_is_put_back(kube, namespaces, operator):
    namespace = namespaces[1]
    kube.apps.patch_namespaced_deployment("llm-worker", namespace, {"spec": {"template": {
        "spec": {"containers": [{"name": "worker", "env": [{"name": "BY_HAND", "value": "1"}]}]}}}})
    kube.core.delete_namespaced_service("llm-workers", namespace)

    def healed() -> bool:
        env = kube.apps.read_namespaced_deployment("llm-worker", namespace).spec.template.spec
        names = [e.name for e in env.containers[0].env or []]
        return "BY_HAND" not in names and bool(
            kube.core.read_namespaced_service("llm-workers", namespace))
    wait_for("the env var removed and the Service back", healed)



def test_a_service_port_edited_by_hand_is_put_back(kube, namespaces, operator):
    """Server-side apply left the hand-edited port in place, and the API server refused the
    pool's own beside it (a duplicate name): the pool turned Accepted=False, blaming its spec,
    and its endpoint stayed on the wrong port for good."""
    namespace = namespaces[1]
    kube.core.patch_namespaced_service("llm-gateway", namespace, [
        {"op": "replace", "path": "/spec/ports/0/port", "value": 9090}])

    def ports() -> list[int]:
        return [p.port for p in kube.core.read_namespaced_service("llm-gateway",
                                                                  namespace).spec.ports]
    wait_for("the gateway Service back on its port", lambda: ports() == [8080])
    time.sleep(RESYNC * 2)
    assert ports() == [8080]
    accepted = condition(get_pool(kube, namespace, "llm"), "Accepted")
    assert accepted["status"] == "True", accepted



def test_a_subject_added_by_hand_to_the_gateways_role_binding_is_taken_out(kube, namespaces,
                                                                          operator):
    """It stayed for good: the operator found the gateway's own subject there and wrote nothing,
    so another account kept the gateway's permissions."""
    namespace = namespaces[1]
    kube.rbac.patch_namespaced_role_binding("llm-gateway", namespace, [
        {"op": "add", "path": "/subjects/-",
         "value": {"kind": "ServiceAccount", "name": "default", "namespace": namespace}}])
    wait_for("only the gateway's account bound", lambda: [
        s.name for s in kube.rbac.read_namespaced_role_binding("llm-gateway", namespace)
        .subjects] == ["llm-gateway"])


def test_api_errors_show_as_degraded_with_the_object_and_a_warning_event(kube, namespaces,
                                                                         operator):
    namespace = namespaces[1]
    kube.core.create_namespaced_resource_quota(namespace, {
        "metadata": {"name": "no-more-services"}, "spec": {"hard": {"services": "2"}}})
    try:
        create_pool(kube, namespace, "quota")  # its two Services exceed the quota
        pool = wait_for("Degraded=True", lambda: condition(
            p := get_pool(kube, namespace, "quota"), "Degraded").get("status") == "True" and p)
        degraded = condition(pool, "Degraded")
        assert degraded["reason"] == "APIError"
        assert f"Service {namespace}/quota-workers: 403 Forbidden" in degraded["message"]
        assert "exceeded quota: no-more-services" in degraded["message"]
        assert "next attempt in" in degraded["message"]
        assert condition(pool, "Ready")["status"] == "False"
        warnings = [e for e in events_about(kube, namespace, "quota") if e.type == "Warning"]
        assert [(e.reason, e.source.component) for e in warnings] == [
            ("APIError", "radixpool-operator")]
    finally:
        kube.core.delete_namespaced_resource_quota("no-more-services", namespace)
    wait_for("recovered", lambda: condition(get_pool(kube, namespace, "quota"), "Degraded").get(
        "status") == "False", timeout=120)


def test_deleting_a_pool_with_the_operator_running_removes_everything(kube, namespaces,
                                                                      operator):
    namespace = namespaces[1]
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "quota")
    wait_for("owned objects garbage-collected", lambda: not owned(kube, namespace, "quota"))
    # and they stay gone: the operator's periodic check of a deleted pool does not make them again
    # (garbage collection would remove them at once, so watch for them being made at all)
    from kubernetes import watch

    since = kube.apps.list_namespaced_deployment(namespace).metadata.resource_version
    made = [event["object"].metadata.name for event in watch.Watch().stream(
        kube.apps.list_namespaced_deployment, namespace, resource_version=since,
        label_selector="radixpool.io/pool=quota", timeout_seconds=RESYNC * 5)
        if event["type"] == "ADDED"]
    assert made == []


def test_a_pool_deleted_and_made_again_at_once_gets_all_its_objects_back(kube, namespaces,
                                                                       operator):
    namespace = namespaces[1]

    def control_key_owner(uid: str) -> str:
        secret = kube.core.read_namespaced_secret(control_key_name("again", uid), namespace)
        return secret.metadata.owner_references[0].uid

    first_uid = create_pool(kube, namespace, "again")["metadata"]["uid"]
    wait_for("objects", lambda: owned(kube, namespace, "again") >= everything("again"))
    first = wait_for("the control key", lambda: control_key_owner(first_uid))
    # Garbage collection of the old pool's worker Deployment held up, as a slow one would be.
    hold = {"metadata": {"finalizers": ["radixpool.io/e2e-hold"]}}
    kube.apps.patch_namespaced_deployment("again-worker", namespace, hold)
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "again")
    wait_for("the pool gone", lambda: not any(
        p["metadata"]["name"] == "again" for p in kube.custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL)["items"]))
    try:
        uid = create_pool(kube, namespace, "again")["metadata"]["uid"]
        wait_for("the new pool's status", lambda: condition(get_pool(kube, namespace, "again"),
                                                            "Degraded"))
        time.sleep(RESYNC * 3)
        pool = get_pool(kube, namespace, "again")
        assert condition(pool, "Degraded")["status"] == "False", condition(pool, "Degraded")
        assert condition(pool, "Accepted")["status"] == "True"
        assert kube.apps.read_namespaced_deployment(
            "again-worker", namespace).metadata.owner_references[0].uid == first  # left alone
    finally:
        kube.apps.patch_namespaced_deployment("again-worker", namespace,
                                              {"metadata": {"finalizers": None}})

    def owners() -> set[str]:
        found = {kube.apps.read_namespaced_deployment(name, namespace).metadata.owner_references[
            0].uid for name in ("again-worker", "again-gateway")}
        return found | {control_key_owner(uid)}
    wait_for("every object, the control key too, owned by the new pool", lambda: owners() == {
        uid}, timeout=150)
    assert uid != first
    assert owned(kube, namespace, "again") == everything("again")
    # Taking the old pool's objects over needs delete permission on them (a 403 and a warning
    # under OwnerReferencesPermissionEnforcement): they were left to garbage collection.
    assert [e.message for e in events_about(kube, namespace, "again")
            if e.type == "Warning" and e.involved_object.uid == uid] == []
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "again")


def test_what_a_pool_stops_setting_leaves_its_objects(kube, namespaces, operator):
    namespace = namespaces[1]
    create_pool(kube, namespace, "trim", engine={
        "device": "cpu", "nodeSelector": {"pool": "gpu"},
        "resources": {"gpus": 1, "cpu": "100m", "memory": "512Mi"}},
        gateway={"service": {"annotations": {"lb": "internal"}}})

    def worker() -> Any:
        return kube.apps.read_namespaced_deployment("trim-worker", namespace).spec.template.spec

    def annotations() -> dict[str, str]:
        return kube.core.read_namespaced_service("trim-gateway", namespace).metadata.annotations
    wait_for("the node selector, GPU limit and annotation", lambda: worker().node_selector and (
        "nvidia.com/gpu" in worker().containers[0].resources.limits) and annotations())
    kube.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "trim", {
        "spec": {"engine": {"nodeSelector": None, "resources": {"gpus": 0}},
                 "gateway": {"service": {"annotations": None}}}})
    wait_for("all three gone from the pool's objects", lambda: not worker().node_selector and (
        "nvidia.com/gpu" not in worker().containers[0].resources.limits) and not annotations())
    time.sleep(RESYNC * 2)
    applies = apply_requests()
    time.sleep(RESYNC * 3)
    assert apply_requests() == applies  # converged: not applied again and again
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "trim")


def test_a_pool_too_big_for_two_copies_in_its_annotations_is_handled_quietly(kube, namespaces,
                                                                           operator):
    import json

    namespace = namespaces[1]
    manifest = pool_manifest("big", engine={
        "device": "cpu", "args": ["--control-api-key-file", "/keys/" + "x" * 150_000],
        "resources": {"gpus": 0, "cpu": "100m", "memory": "512Mi"}})
    # as `kubectl apply` makes it: its own copy of the manifest in an annotation (limit 256 KiB)
    manifest["metadata"]["annotations"] = {
        "kubectl.kubernetes.io/last-applied-configuration": json.dumps(manifest)}
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    wait_for("objects", lambda: owned(kube, namespace, "big") >= everything("big"))
    kube.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "big",
                                               {"spec": {"replicas": 2}})
    wait_for("scaled", lambda: kube.apps.read_namespaced_deployment(
        "big-worker", namespace).spec.replicas == 2)
    record = get_pool(kube, namespace, "big")["metadata"]["annotations"][
        "radixpool.io/last-handled-configuration"]
    assert len(record) < 200
    assert "Too long" not in operator.log.read_text()
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "big")


def test_without_a_running_operator_pools_and_their_namespace_still_go(kube, namespaces,
                                                                      operator):
    operator.stop()
    namespace = namespaces[0]
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llm")
    wait_for("the pool gone", lambda: not kube.custom.list_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL)["items"] or None)
    wait_for("owned objects garbage-collected", lambda: not owned(kube, namespace, "llm"))
    kube.core.delete_namespace(namespaces[1])  # its pool "llm" still in it
    wait_for("the namespace deleted, pool and all", lambda: namespaces[1] not in {
        ns.metadata.name for ns in kube.core.list_namespace().items}, timeout=180)


def test_without_its_peering_object_the_operator_says_so_and_exits(as_chart, tmp_path):
    log = tmp_path / "operator.log"
    absent = Operator(as_chart, log, extra=("--peering=absent-peering",))
    code = absent.process.wait(timeout=120)
    output = log.read_text()
    assert code == 1, output[-2000:]
    assert "ClusterKopfPeering absent-peering is missing and could not be created" in output
    assert "--standalone" in output


def test_helm_upgrade_changes_the_release_in_place_and_back(kube, release, as_chart):
    # what a cluster admin does after installing: change values, then return to the defaults
    def can_get_secrets() -> bool:
        return kube.auth.create_subject_access_review({"spec": {
            "user": f"system:serviceaccount:{release.namespace}:{as_chart.account}",
            "resourceAttributes": {"verb": "get", "resource": "secrets",
                                   "namespace": "default"}}}).status.allowed

    deployment = next(d for d in release.manifest if d["kind"] == "Deployment")["metadata"]
    upgraded = release.helm.upgrade(str(CHART), release.name, {
        "rbac": {"readSecrets": True}, "replicaCount": 2, "dashboards": {"enabled": True}},
        namespace=release.namespace, timeout=120)
    assert upgraded["status"] == "deployed"
    assert can_get_secrets()
    assert kube.apps.read_namespaced_deployment(
        deployment["name"], release.namespace).spec.replicas == 2
    assert any(m.metadata.name.startswith(RELEASE)
               for m in kube.core.list_namespaced_config_map(release.namespace).items)
    restored = release.helm.upgrade(str(CHART), release.name, {}, namespace=release.namespace,
                                    timeout=120, reset_values=True)
    assert restored["status"] == "deployed"
    assert not can_get_secrets()
    assert kube.apps.read_namespaced_deployment(
        deployment["name"], release.namespace).spec.replicas == 1
    assert not any(m.metadata.name.startswith(RELEASE)
                   for m in kube.core.list_namespaced_config_map(release.namespace).items)


def test_helm_upgrade_to_standalone_and_back(kube, release):
    """`helm upgrade --set peering.enabled=false` failed (422): the Deployment kept the
    rollingUpdate settings the API server had filled in, and it refuses them beside
    `type: Recreate`, so a release could not be switched to one standalone replica."""
    name = next(d for d in release.manifest if d["kind"] == "Deployment")["metadata"]["name"]

    def operator_pod() -> Any:
        return kube.apps.read_namespaced_deployment(name, release.namespace).spec

    standalone = release.helm.upgrade(str(CHART), release.name, {"peering": {"enabled": False}},
                                      namespace=release.namespace, timeout=120,
                                      reset_values=True)
    assert standalone["status"] == "deployed"
    assert operator_pod().strategy.type == "Recreate"
    assert "--standalone" in operator_pod().template.spec.containers[0].args
    restored = release.helm.upgrade(str(CHART), release.name, {}, namespace=release.namespace,
                                    timeout=120, reset_values=True)
    assert restored["status"] == "deployed"
    assert operator_pod().strategy.type == "RollingUpdate"
    assert "--standalone" not in operator_pod().template.spec.containers[0].args


def test_uninstall_leaves_no_pool_stuck(kube, release, namespaces, as_chart, tmp_path):
    namespace = namespaces[0]
    leftover = Operator(as_chart, tmp_path / "operator.log")
    try:
        create_pool(kube, namespace, "after")
        wait_for("objects", lambda: owned(kube, namespace, "after") >= everything("after"))
    finally:
        leftover.stop()
    release.helm.uninstall(release.name)
    wait_for("the release's ClusterRole gone", lambda: not [
        r for r in kube.rbac.list_cluster_role().items if r.metadata.name.startswith(RELEASE)])
    kube.core.delete_namespace(namespace)
    wait_for("the namespace deleted with its pool, no operator anywhere", lambda: namespace not in {
        ns.metadata.name for ns in kube.core.list_namespace().items}, timeout=180)
