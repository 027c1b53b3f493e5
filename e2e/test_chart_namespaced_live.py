"""The chart told which namespaces to watch: Roles there, a ClusterRole for CRDs only, and the
operator, as the chart's ServiceAccount, still does all it must in those namespaces.

Runs only when RADIXPOOL_E2E_KUBECONFIG names a cluster-admin kubeconfig (see
test_chart_live.py); otherwise every test here reports itself skipped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import yaml
from test_chart_live import (
    CHART,
    Operator,
    create_pool,
    everything,
    kube,  # noqa: F401 - a fixture
    owned,
    service_account_kubeconfig,
)
from test_operator_live import KUBECONFIG, condition, get_pool, wait_for

pytestmark = pytest.mark.skipif(
    not KUBECONFIG,
    reason="live-cluster e2e skipped: set RADIXPOOL_E2E_KUBECONFIG to a cluster-admin "
           "kubeconfig to run it (../shared/tools/k8s-local/ starts a local API server)")

RELEASE = f"rpns{uuid.uuid4().hex[:4]}"


@pytest.fixture(scope="module")
def watched(kube) -> Iterator[SimpleNamespace]:  # noqa: F811 - the imported fixture
    import helm_python as helm

    inside, outside = f"{RELEASE}-in", f"{RELEASE}-out"
    for name in (inside, outside):
        kube.core.create_namespace({"metadata": {"name": name}})
    namespace = f"{RELEASE}-system"
    with helm.Config(kubeconfig_path=KUBECONFIG, namespace=namespace) as cfg:
        installed = cfg.install(str(CHART), RELEASE, {
            "watchNamespaces": [inside], "rbac": {"readSecrets": True}}, namespace=namespace,
            create_namespace=True, timeout=120)
        try:
            yield SimpleNamespace(inside=inside, outside=outside, namespace=namespace,
                                  manifest=[d for d in yaml.safe_load_all(installed["manifest"])
                                            if d])
        finally:
            cfg.uninstall(RELEASE, ignore_not_found=True)
            for name in (namespace, inside, outside):
                kube.core.delete_namespace(name)


@pytest.fixture(scope="module")
def operator(kube, watched, tmp_path_factory) -> Iterator[Operator]:  # noqa: F811
    deployment = next(d for d in watched.manifest if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    folder = tmp_path_factory.mktemp("ns")
    running = Operator(SimpleNamespace(
        container=pod["containers"][0], account=pod["serviceAccountName"],
        kubeconfig=service_account_kubeconfig(kube, watched.namespace,
                                              pod["serviceAccountName"],
                                              folder / "kubeconfig")), folder / "operator.log")
    yield running
    running.stop()


def test_the_rbac_is_namespaced(watched):
    kinds = {}
    for doc in watched.manifest:
        kinds.setdefault(doc["kind"], []).append(doc)
    assert [r["metadata"]["namespace"] for r in kinds["Role"]] == [watched.inside]
    cluster_resources = {res for rule in kinds["ClusterRole"][0]["rules"]
                         for res in rule["resources"]}
    assert cluster_resources == {"customresourcedefinitions", "namespaces"}


def test_a_pool_in_a_watched_namespace_is_made_and_checked(kube, watched,  # noqa: F811
                                                           operator):
    create_pool(kube, watched.inside, "llm")
    wait_for("every object", lambda: owned(kube, watched.inside, "llm") >= everything("llm"))
    pool = wait_for("Accepted", lambda: condition(
        p := get_pool(kube, watched.inside, "llm"), "Accepted").get("status") == "True" and p)
    assert condition(pool, "Degraded")["status"] == "False"
    # With rbac.readSecrets the Role lets the operator see that a named Secret is missing.
    create_pool(kube, watched.inside, "nokey", apiKeySecret={"name": "absent"})
    pool = wait_for("Accepted=False", lambda: condition(
        p := get_pool(kube, watched.inside, "nokey"), "Accepted").get("status") == "False" and p)
    assert condition(pool, "Accepted")["reason"] == "MissingReference"
    assert owned(kube, watched.inside, "nokey") == set()


def test_a_pool_elsewhere_is_left_alone(kube, watched, operator):  # noqa: F811
    create_pool(kube, watched.outside, "stray")
    wait_for("the watched pool handled", lambda: condition(
        get_pool(kube, watched.inside, "llm"), "Accepted"))
    time.sleep(10)
    assert "status" not in get_pool(kube, watched.outside, "stray")
    assert owned(kube, watched.outside, "stray") == set()
    assert operator.process.poll() is None, operator.log.read_text()[-3000:]
