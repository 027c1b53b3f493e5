"""The Helm chart, rendered and linted by Helm's own library (helm-python-sdk wraps Helm v4)."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from radixpool.operator import api
from radixpool.operator.crd import crd_files
from radixpool.operator.dashboards import dashboard_files
from radixpool.operator.desired import OperatorConfig, desired_objects
from radixpool.operator.spec import parse_pool

CHART = Path(__file__).resolve().parents[2] / "charts" / "radixpool"
CUSTOM = {
    "replicaCount": 2,
    "image": {"repository": "registry.example.com/rp/control", "tag": "1.2.3",
              "pullPolicy": "Always"},
    "workerImage": {"repository": "registry.example.com/rp/worker", "tag": "1.2.3"},
    "imagePullSecrets": [{"name": "regcred"}],
    "watchNamespaces": ["team-a", "team-b"],
    "serviceMonitor": {"enabled": True, "interval": "30s", "labels": {"release": "prom"}},
    "dashboards": {"enabled": True, "namespace": "monitoring"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "logVerbose": True,
    "resyncSeconds": 30,
}


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name="rp", namespace="radixpool-system",
                                 is_install=True)
    docs = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for doc in docs:
        found.setdefault(doc["kind"], []).append(doc)
    return found


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["default", "custom"])
def test_helm_lint_is_clean(values):
    report = helm.lint(str(CHART), values, strict=True, kube_version="v1.33.0")
    problems = [msg for msg in report["messages"] if msg["severity"] >= 2]
    assert problems == [] and report["errors"] == []


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["default", "custom"])
def test_every_rendered_object_is_valid_kubernetes(values, assert_k8s_valid):
    docs = render(values)
    for doc in docs:
        if doc["apiVersion"].startswith(("kopf.dev/", "monitoring.coreos.com/")):
            continue  # custom resources: checked by the tests below
        assert_k8s_valid(doc)
    kinds = by_kind(docs)
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"} <= set(kinds)


def test_default_install_runs_one_cluster_wide_operator_with_peering():
    kinds = by_kind(render({}))
    deployment = kinds["Deployment"][0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/radixpool/radixpool-control:0.1.0"
    assert container["command"] == ["radixpool"]
    assert container["args"][:3] == ["operator", "--all-namespaces", "--peering=radixpool"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # kubelet probes the pod IP (IPv6 on an IPv6-only cluster): every address of both families
    assert "--liveness=http://[::]:8081/healthz" in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert [p["kind"] for p in kinds["ClusterKopfPeering"]] == ["ClusterKopfPeering"]
    assert "ConfigMap" not in kinds and "ServiceMonitor" not in kinds


def test_custom_values_reach_the_objects():
    kinds = by_kind(render(CUSTOM))
    deployment = kinds["Deployment"][0]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 2
    assert container["image"] == "registry.example.com/rp/control:1.2.3"
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]
    assert "--verbose" in container["args"] and "--resync-seconds=30" in container["args"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["RADIXPOOL_WORKER_IMAGE"] == "registry.example.com/rp/worker:1.2.3"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert sorted(p["metadata"]["namespace"] for p in kinds["KopfPeering"]) == [
        "team-a", "team-b"]
    monitor = kinds["ServiceMonitor"][0]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert monitor["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics",
                                               "interval": "30s"}


def test_dashboards_ship_as_labelled_configmaps_with_the_repo_json():
    maps = by_kind(render(CUSTOM))["ConfigMap"]
    shipped = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == "monitoring"
        shipped.update(config_map["data"])
    assert {name: json.loads(text) for name, text in shipped.items()} == {
        name: json.loads(text) for name, text in dashboard_files().items()}


def test_chart_installs_the_same_crds_as_crds_folder():
    with helm.Chart.load(CHART) as chart:
        carried = {Path(crd["filename"]).name: crd["data"] for crd in chart.crds}
    assert carried == crd_files()


def test_notes_name_the_pools_namespace_in_every_command_about_the_pool():
    """`kubectl scale llmpool qwen3-8b` without `-n` looked for the pool in the current
    namespace, not in the one the notes had just created it in."""
    with helm.Chart.load(CHART) as chart:
        notes = next(text for path, text in chart.render(
            values={}, name="rp", namespace="radixpool-system", is_install=True).items()
            if path.endswith("NOTES.txt"))
    commands = [line[line.index("kubectl"):] for line in notes.splitlines()
                if "kubectl" in line and "qwen3-8b" in line]
    assert len(commands) >= 3
    assert all("-n <namespace>" in command for command in commands), commands


def test_notes_pool_command_runs_as_printed(tmp_path):
    """The notes' `kubectl apply ... <<'POOL'`, copied as printed (the namespace filled in), ends
    at its POOL line. Its terminator was indented like the rest, and bash ends a here-document
    only at a line that is exactly POOL: the shell kept reading, and the pool was never applied."""
    import subprocess

    with helm.Chart.load(CHART) as chart:
        notes = next(text for path, text in chart.render(
            values={}, name="rp", namespace="radixpool-system", is_install=True).items()
            if path.endswith("NOTES.txt"))
    lines = notes.splitlines()
    start = next(i for i, line in enumerate(lines) if "<<'POOL'" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "POOL")
    applied = tmp_path / "applied.yaml"
    copied = [line.replace("<namespace>", "team-a") for line in lines[start:end + 1]]
    script = "\n".join([f'kubectl() {{ cat > "{applied}"; }}', *copied, "echo after-the-pool"])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert "here-document" not in done.stderr, done.stderr
    assert done.stdout.strip() == "after-the-pool"
    pool = yaml.safe_load(applied.read_text())
    assert (pool["kind"], pool["metadata"]["name"]) == ("InferencePool", "qwen3-8b")


def test_values_schema_rejects_nonsense_naming_the_value():
    with helm.Chart.load(CHART) as chart:
        for bad, where in [({"replicaCount": 0}, "/replicaCount"),
                           ({"watchNamespaces": ["Not_A_Namespace"]}, "/watchNamespaces/0"),
                           ({"image": {"repository": "x", "pullPolicy": "Sometimes"}},
                            "/image/pullPolicy"),
                           ({"replicas": 2}, "replicas"),
                           # every pool's pods would name it: none could be created
                           ({"workerImage": {"repository": "x", "tag": "0.2.0 "}},
                            "/workerImage/tag"),
                           ({"gatewayImage": {"repository": "my registry/x"}},
                            "/gatewayImage/repository")]:
            with pytest.raises(helm.HelmValuesError, match=where):
                chart.validate_schema(bad)


def grants(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def assert_grants_what_the_operator_does(granted, pool_body) -> None:
    plural = {"Deployment": "deployments", "Service": "services",
              "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
              "PodDisruptionBudget": "poddisruptionbudgets", "ServiceMonitor": "servicemonitors",
              "NetworkPolicy": "networkpolicies"}
    objs = desired_objects(parse_pool(pool_body()), OperatorConfig(network_policy=True),
                           service_monitors=True)
    for obj in objs:
        group = obj["apiVersion"].rpartition("/")[0]
        assert {"create", "patch", "get"} <= granted[(group, plural[obj["kind"]])], obj["kind"]
    assert {"get", "list", "watch", "patch"} <= granted[(api.GROUP, api.PLURAL)]
    assert "patch" in granted[(api.GROUP, f"{api.PLURAL}/status")]
    # The operator may grant the gateway only what it holds itself, and holds no more: the
    # gateway lists and watches EndpointSlices, and the operator never reads them.
    assert granted[("discovery.k8s.io", "endpointslices")] == {"list", "watch"}
    for kind in ("poddisruptionbudgets", "servicemonitors", "networkpolicies"):
        assert "delete" in granted[(plural_group(kind), kind)]
    assert {"create"} <= granted[("", "events")] and {"list"} <= granted[("", "pods")]
    # nothing reads the status subresource or patches an Event (kopf's included): no more
    assert granted[(api.GROUP, f"{api.PLURAL}/status")] == {"patch"}
    assert granted[("", "events")] == {"create"}


def plural_group(plural: str) -> str:
    return {"poddisruptionbudgets": "policy", "servicemonitors": "monitoring.coreos.com",
            "networkpolicies": "networking.k8s.io"}[plural]


def test_cluster_role_grants_what_the_operator_applies_and_no_wildcards(pool_body):
    role = by_kind(render({}))["ClusterRole"][0]
    granted = grants(role["rules"])
    assert_grants_what_the_operator_does(granted, pool_body)
    # Reading every Secret in the cluster is opt-in; creating the pools' control keys is not.
    assert granted[("", "secrets")] == {"create"}
    # kopf lists namespaces only to find watched ones; watching them all, it never does
    assert ("", "namespaces") not in granted
    with_secrets = grants(by_kind(render({"rbac": {"readSecrets": True}}))["ClusterRole"][0][
        "rules"])
    assert with_secrets[("", "secrets")] == {"create", "get"}


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_only_cluster_things(pool_body):
    kinds = by_kind(render({"watchNamespaces": ["team-a", "team-b"], "rbac": {
        "readSecrets": True}}))
    cluster = grants(kinds["ClusterRole"][0]["rules"])
    assert set(cluster) == {("apiextensions.k8s.io", "customresourcedefinitions"),
                            ("", "namespaces")}
    roles = kinds["Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        granted = grants(role["rules"])
        assert_grants_what_the_operator_does(granted, pool_body)
        assert granted[("", "secrets")] == {"create", "get"}
        assert {"get", "list", "watch", "patch"} <= granted[("kopf.dev", "kopfpeerings")]
    bindings = kinds["RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": "rp-radixpool"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rp-radixpool",
                                        "namespace": "radixpool-system"}]


def test_standalone_with_more_than_one_replica_is_refused():
    with pytest.raises(helm.HelmError, match="replicaCount must be 1"):
        render({"peering": {"enabled": False}, "replicaCount": 2})
    deployment = by_kind(render({"peering": {"enabled": False}}))["Deployment"][0]
    assert "--standalone" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    # nor two for a moment: a rolling update's surge pod would reconcile beside the old one
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    peered = by_kind(render({}))["Deployment"][0]
    # peering decides which replica works; the defaults written out, for Helm to own
    assert peered["spec"]["strategy"]["type"] == "RollingUpdate"


def test_chart_supports_kubernetes_1_28():
    with helm.Chart.load(CHART) as chart:
        assert chart.metadata["kubeVersion"] == ">=1.28.0-0"
    report = helm.lint(str(CHART), {}, strict=True, kube_version="v1.28.4")
    assert report["errors"] == []


def test_network_policy_is_on_by_default_and_its_peer_reaches_the_operator():
    env = {e["name"]: e["value"] for e in by_kind(render({}))["Deployment"][0]["spec"][
        "template"]["spec"]["containers"][0]["env"]}
    assert env["RADIXPOOL_NETWORK_POLICY"] == "true"
    assert json.loads(env["RADIXPOOL_PROMETHEUS_PEER"]) == {
        "namespaceSelector": {}, "podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "prometheus"}}}
    off = by_kind(render({"networkPolicy": {"enabled": False}}))["Deployment"][0]
    env = {e["name"]: e["value"] for e in off["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RADIXPOOL_NETWORK_POLICY"] == "false"


@pytest.mark.parametrize("prometheus", [None, {"podSelector": None, "namespaceSelector": None}])
def test_no_prometheus_peer_lets_only_the_gateway_reach_the_workers(prometheus, pool_body,
                                                                    monkeypatch):
    """`--set networkPolicy.prometheus=null` (Helm's way to drop a default) reached the operator
    as `null` and put an empty peer in every pool's NetworkPolicy: the API server refused them
    all ("must specify a peer"), so no pool in the cluster was made."""
    deployment = by_kind(render({"networkPolicy": {"prometheus": prometheus}}))["Deployment"][0]
    for env in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        monkeypatch.setenv(env["name"], env["value"])
    config = OperatorConfig.from_env()
    policy = next(o for o in desired_objects(parse_pool(pool_body()), config,
                                             service_monitors=False)
                  if o["kind"] == "NetworkPolicy")
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert peers == [{"podSelector": {"matchLabels": api.selector_labels("llama", "gateway")}}]


def test_fleet_service_monitor_skips_pools_that_have_their_own(pool_body):
    monitor = by_kind(render(CUSTOM))["ServiceMonitor"][0]
    expressions = monitor["spec"]["selector"]["matchExpressions"]
    assert {"key": api.OWN_MONITOR_LABEL, "operator": "DoesNotExist"} in expressions
    objs = desired_objects(parse_pool(pool_body()), OperatorConfig(), service_monitors=True)
    for service in (o for o in objs if o["kind"] == "Service"):
        assert api.OWN_MONITOR_LABEL in service["metadata"]["labels"]  # so not selected twice


OPENSHIFT = {"openshift": {"enabled": True}}


@pytest.mark.parametrize("values", [OPENSHIFT, {**CUSTOM, **OPENSHIFT}],
                         ids=["openshift", "custom-openshift"])
def test_on_openshift_the_operator_and_every_pool_take_their_uid_from_the_platform(
        values, pool_body, monkeypatch, assert_k8s_valid, restricted_v2):
    """OpenShift's restricted-v2 SCC refuses pods asking for a uid or fsGroup outside the
    namespace's range: the operator's pod asked for 1000 (and so did every pool's), so nothing
    started. `openshift.enabled` leaves them to the platform, in the operator's pod and, through
    the operator, in every pool's pods; the rest of the hardening stays."""
    report = helm.lint(str(CHART), values, strict=True, kube_version="v1.33.0")
    assert [m for m in report["messages"] if m["severity"] >= 2] == [] == report["errors"]
    deployment = by_kind(render(values))["Deployment"][0]
    assert_k8s_valid(deployment)
    pod = deployment["spec"]["template"]["spec"]
    assert restricted_v2(pod) == []
    assert pod["securityContext"] == {"runAsNonRoot": True,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for env in container["env"]:
        monkeypatch.setenv(env["name"], env["value"])
    for obj in desired_objects(parse_pool(pool_body()), OperatorConfig.from_env(),
                               service_monitors=False):
        if obj["kind"] == "Deployment":
            assert restricted_v2(obj["spec"]["template"]["spec"]) == [], obj["metadata"]["name"]


def test_vanilla_kubernetes_keeps_uid_1000_and_the_pod_security_context_is_a_value(
        pool_body, monkeypatch, restricted_v2):
    deployment = by_kind(render({}))["Deployment"][0]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000,
                                      "runAsGroup": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    for env in pod["containers"][0]["env"]:
        monkeypatch.setenv(env["name"], env["value"])
    worker = next(o for o in desired_objects(parse_pool(pool_body()), OperatorConfig.from_env(),
                                             service_monitors=False) if o["kind"] == "Deployment")
    assert worker["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 1000
    # a key set to null is left out; others may be added
    custom = by_kind(render({"podSecurityContext": {"runAsUser": None, "runAsGroup": None,
                                                    "fsGroup": 2000}}))["Deployment"][0]
    assert custom["spec"]["template"]["spec"]["securityContext"] == {
        "runAsNonRoot": True, "fsGroup": 2000, "seccompProfile": {"type": "RuntimeDefault"}}
