"""Operator test fixtures: pool bodies, an in-memory cluster, official-schema validation."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from radixpool.operator import api
from radixpool.operator.desired import ObjectRef
from radixpool.operator.reconcile import ObjectRejected
from radixpool.operator.status import Observed

K8S_VERSION = "1.33"


def make_pool(name: str = "llama", namespace: str = "ml", generation: int = 1,
              **spec: Any) -> dict[str, Any]:
    spec.setdefault("model", {"path": "/models/llama"})
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "generation": generation},
            "spec": spec}


class FakeCluster:
    """The API server as reconciliation sees it: objects by (kind, namespace, name).

    `apply` stores the object as the operator sent it (server-side apply owns every field it
    sets); tests play the kubelet and controllers by editing `status` through `set_ready`.
    """

    def __init__(self, *, service_monitors: bool = False):
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.service_monitors = service_monitors
        self.applies = 0
        self.refuse: dict[str, str] = {}  # kind → the API server's message, on any apply

    def add(self, kind: str, namespace: str, name: str, obj: dict | None = None) -> None:
        self.objects[(kind, namespace, name)] = obj or {"metadata": {"name": name}}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def kinds(self) -> list[str]:
        return sorted(kind for kind, _, _ in self.objects)

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        return (kind, namespace, name) in self.objects

    def has_service_monitors(self) -> bool:
        return self.service_monitors

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> None:
        if obj["kind"] in self.refuse:
            raise ObjectRejected(self.refuse[obj["kind"]])
        if dry_run:
            return
        self.applies += 1
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        before = self.objects.get(key)
        stored = copy.deepcopy(obj)
        generation = 1
        if before is not None:
            stored["status"] = before.get("status", {})
            generation = before["metadata"].get("generation", 1)
            if before.get("spec") != obj.get("spec"):
                generation += 1
        stored["metadata"]["generation"] = generation
        self.objects[key] = stored

    def delete(self, ref: ObjectRef) -> None:
        self.objects.pop((ref.kind, ref.namespace, ref.name), None)

    def observe(self, namespace: str, pool: str) -> Observed:
        pods = [obj for (kind, ns, _), obj in self.objects.items()
                if kind == "Pod" and ns == namespace
                and obj["metadata"].get("labels", {}).get(api.POOL_LABEL) == pool]
        return Observed(
            worker_deployment=self.get("Deployment", namespace, api.worker_deployment_name(pool)),
            gateway_deployment=self.get("Deployment", namespace, api.gateway_name(pool)),
            gateway_service=self.get("Service", namespace, api.gateway_name(pool)),
            pods=pods,
        )

    def set_ready(self, namespace: str, name: str, ready: int, updated: int | None = None,
                  replicas: int | None = None) -> None:
        """Play the Deployment controller: the rollout reached `ready` ready pods."""
        deployment = self.objects[("Deployment", namespace, name)]
        deployment["status"] = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": ready if replicas is None else replicas,
            "readyReplicas": ready, "availableReplicas": ready,
            "updatedReplicas": ready if updated is None else updated,
        }


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def make_cluster():
    return FakeCluster


@pytest.fixture
def pool_body():
    return make_pool


@pytest.fixture(scope="session")
def assert_k8s_valid():
    """Validate an object against the official Kubernetes schema for its kind (strict: unknown
    fields fail). ServiceMonitor is not a core kind; it is checked by its own test."""
    import kubernetes_validate

    def check(obj: dict[str, Any]) -> None:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = ".".join(str(part) for part in error.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid at {where}: "
                        f"{error.message}")

    return check
