"""Operator test fixtures: pool bodies, an in-memory cluster, official-schema validation."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from radixpool.operator import api
from radixpool.operator.desired import ObjectRef
from radixpool.operator.reconcile import ApiFailure, KindGone, ObjectRejected
from radixpool.operator.status import Event

K8S_VERSION = "1.33"


def make_pool(name: str = "llama", namespace: str = "ml", generation: int = 1,
              **spec: Any) -> dict[str, Any]:
    spec.setdefault("model", {"path": "/models/llama"})
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "generation": generation},
            "spec": spec}


def fields_v1(value: Any) -> dict[str, Any]:
    """The fields an apply of `value` sets, as the API server records them in `managedFields`
    (lists of named items keyed by name, other lists atomic: close enough for these tests)."""
    if isinstance(value, dict):
        return {f"f:{key}": fields_v1(item) for key, item in value.items()}
    if isinstance(value, list) and value and all(
            isinstance(item, dict) and "name" in item for item in value):
        return {"k:" + json.dumps({"name": item["name"]}): {".": {}, **fields_v1(item)}
                for item in value}
    return {}


class FakeCluster:
    """The API server as reconciliation sees it: objects by (kind, namespace, name).

    `apply` stores the object as the operator sent it (server-side apply owns every field it
    sets); tests play the kubelet and controllers by editing `status` through `set_ready`.
    Like the real API server without the `bind` verb, a RoleBinding (even in a dry run) is
    refused with 404 while the Role it names does not exist (the escalation check reads it).
    """

    def __init__(self, *, service_monitors: bool = False):
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        # whether the ServiceMonitor CRD is installed, and what the operator last saw of it
        # (KubeCluster keeps that for a minute, and forgets it when an apply finds it gone)
        self.service_monitors = self._monitors_seen = service_monitors
        self.applies = 0
        self.writes: list[tuple[str, str, str]] = []  # (verb, kind, name) of every write
        self.refuse: dict[str, str] = {}  # kind → the API server's message, on any apply
        self.fail: dict[str, ApiFailure] = {}  # kind → raised on any apply
        self.events: list[Event] = []
        self.secrets_readable = True

    def add(self, kind: str, namespace: str, name: str, obj: dict | None = None) -> None:
        self.objects[(kind, namespace, name)] = obj or {"metadata": {"name": name}}

    def stored(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def kinds(self) -> list[str]:
        return sorted(kind for kind, _, _ in self.objects)

    def exists(self, kind: str, namespace: str, name: str) -> bool | None:
        if kind == "Secret" and not self.secrets_readable:
            return None
        return (kind, namespace, name) in self.objects

    def has_service_monitors(self) -> bool:
        return self._monitors_seen

    def remove_service_monitor_crd(self) -> None:
        """prometheus-operator uninstalled: its CRD goes, and every ServiceMonitor with it."""
        self.service_monitors = False
        self.objects = {key: obj for key, obj in self.objects.items()
                        if key[0] != "ServiceMonitor"}

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((ref.kind, ref.namespace, ref.name)))

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        meta = obj["metadata"]
        if obj["kind"] in self.fail:
            raise self.fail[obj["kind"]]
        if obj["kind"] in self.refuse:
            raise ObjectRejected(self.refuse[obj["kind"]])
        if obj["kind"] == "ServiceMonitor" and not self.service_monitors:
            self._monitors_seen = False
            raise KindGone("ServiceMonitor is no longer served (its CRD was removed)")
        role = obj.get("roleRef", {}).get("name")
        if obj["kind"] == "RoleBinding" and not self.exists("Role", meta["namespace"], role):
            raise ApiFailure("dry-run apply" if dry_run else "apply", "RoleBinding",
                             meta["namespace"], meta["name"], 404, "Not Found",
                             f'roles.rbac.authorization.k8s.io "{role}" not found')
        if dry_run:
            return copy.deepcopy(obj)
        self.applies += 1
        self.writes.append(("apply", obj["kind"], meta["name"]))
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
        stored["metadata"]["managedFields"] = [{
            "manager": api.FIELD_MANAGER, "operation": "Apply", "fieldsV1": fields_v1(obj)}]
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def patch_json(self, ref: ObjectRef, operations: list[dict[str, Any]]) -> None:
        self.writes.append(("patch", ref.kind, ref.name))
        obj = self.objects[(ref.kind, ref.namespace, ref.name)]
        for op in operations:
            *parents, last = op["path"].strip("/").split("/")
            node = obj
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            target = node[int(last)] if isinstance(node, list) else node[last]
            if op["op"] == "test":
                assert target == op["value"], op
            else:
                del node[int(last) if isinstance(node, list) else last]

    def create_once(self, obj: dict[str, Any], before=None) -> bool:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        if before is not None:
            before()
        self.writes.append(("create", obj["kind"], obj["metadata"]["name"]))
        self.objects[key] = copy.deepcopy(obj)
        return True

    def restart(self, ref: ObjectRef, stamp: str) -> None:
        self.writes.append(("restart", ref.kind, ref.name))
        template = self.objects[(ref.kind, ref.namespace, ref.name)]["spec"]["template"]
        template["metadata"].setdefault("annotations", {})[api.RESTARTED_AT_ANNOTATION] = stamp

    def delete(self, ref: ObjectRef) -> None:
        self.writes.append(("delete", ref.kind, ref.name))
        self.objects.pop((ref.kind, ref.namespace, ref.name), None)

    def pods(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        return [obj for (kind, ns, _), obj in self.objects.items()
                if kind == "Pod" and ns == namespace
                and obj["metadata"].get("labels", {}).get(api.POOL_LABEL) == pool]

    def post_event(self, body: dict[str, Any], event: Event) -> None:
        self.events.append(event)

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


def _cel_rules(node: dict[str, Any], path: tuple[str, ...] = ()
               ) -> list[tuple[tuple[str, ...], str, str]]:
    """(path of the schema node, CEL rule, message) for every x-kubernetes-validations entry."""
    found = [(path, rule["rule"], rule["message"])
             for rule in node.get("x-kubernetes-validations", [])]
    for name, child in (node.get("properties") or {}).items():
        found += _cel_rules(child, (*path, name))
    return found


@pytest.fixture(scope="session")
def cel_refusals():
    """`refusals(body)`: the messages of the CRD's CEL rules a pool (its defaults applied) breaks,
    evaluated by cel-python as the API server evaluates them; `refusals.rules` lists them."""
    import celpy

    from radixpool.operator.crd import ROOT

    env = celpy.Environment()
    rules = _cel_rules(ROOT)
    programs = [(path, env.program(env.compile(rule)), message) for path, rule, message in rules]

    def refusals(body: dict[str, Any]) -> list[str]:
        broken = []
        for path, program, message in programs:
            value = body
            for key in path:
                value = value[key]
            if not program.evaluate({"self": celpy.json_to_cel(value)}):
                broken.append(message)
        return broken

    refusals.rules = rules
    return refusals


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


# OpenShift's default SCC for every authenticated user, restricted-v2 (OpenShift 4.11+), as it
# judges a pod: runAsUser MustRunAsRange and fsGroup MustRunAs within the namespace's range (its
# openshift.io/sa.scc.uid-range annotation; the range is picked per namespace, so no fixed uid is
# in it: this is one such range), seccomp runtime/default, no privilege escalation, every
# capability dropped (NET_BIND_SERVICE alone may be added), no host namespaces or ports, and only
# these volume types. It has no runAsGroup strategy: runAsGroup is not judged.
RESTRICTED_V2_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                   "persistentVolumeClaim", "projected", "secret"})
NAMESPACE_UIDS = range(1000680000, 1000690000)


def restricted_v2_refusals(pod: dict[str, Any]) -> list[str]:
    """Why restricted-v2 would refuse this pod spec (empty: admitted)."""
    refusals = []
    security = pod.get("securityContext") or {}
    for key in ("runAsUser", "fsGroup"):
        if key in security and security[key] not in NAMESPACE_UIDS:
            refusals.append(f"pod {key} {security[key]} is not in the namespace's range")
    if (security.get("seccompProfile") or {}).get("type", "RuntimeDefault") != "RuntimeDefault":
        refusals.append("pod seccompProfile is not RuntimeDefault")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            refusals.append(f"pod {key}")
    for container in pod.get("initContainers", []) + pod["containers"]:
        name, ctx = container["name"], container.get("securityContext") or {}
        if "runAsUser" in ctx and ctx["runAsUser"] not in NAMESPACE_UIDS:
            refusals.append(f"{name}: runAsUser {ctx['runAsUser']} is not in the range")
        if ctx.get("allowPrivilegeEscalation", False) or ctx.get("privileged"):
            refusals.append(f"{name}: privilege escalation")
        capabilities = ctx.get("capabilities") or {}
        if "ALL" not in capabilities.get("drop", []):
            refusals.append(f"{name}: capabilities not all dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            refusals.append(f"{name}: capabilities added")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            refusals.append(f"{name}: host port")
    for volume in pod.get("volumes", []):
        if not set(volume) - {"name"} <= RESTRICTED_V2_VOLUMES:
            refusals.append(f"volume {volume['name']}: type not allowed")
    return refusals


@pytest.fixture(scope="session")
def restricted_v2():
    """`restricted_v2(pod_spec)`: why OpenShift's restricted-v2 SCC would refuse it."""
    return restricted_v2_refusals
