"""Drift detection, refusals in spec terms, and the peering object made at start-up."""

from __future__ import annotations

import pytest

from radixpool.operator.desired import OperatorConfig, desired_objects
from radixpool.operator.drift import holds, stray_env_patch, stray_ports_patch
from radixpool.operator.peering import PeeringUnavailable, ensure_peering
from radixpool.operator.reconcile import ApiFailure
from radixpool.operator.spec import parse_pool
from radixpool.operator.spec_paths import in_spec_terms


def test_holds_ignores_what_the_server_adds_and_sees_what_was_changed():
    want = {"spec": {"replicas": 2, "template": {"spec": {"containers": [
        {"name": "w", "resources": {"requests": {"cpu": "0.5", "memory": "1Gi"}},
         "ports": [{"name": "http", "containerPort": 8000}]}]}}}}
    live = {"metadata": {"resourceVersion": "9"}, "status": {"replicas": 2},
            "spec": {"replicas": 2, "progressDeadlineSeconds": 600, "template": {"spec": {
                "containers": [{"name": "w", "terminationMessagePath": "/dev/termination-log",
                                "resources": {"requests": {"cpu": "500m", "memory": "1024Mi"}},
                                "ports": [{"name": "http", "containerPort": 8000,
                                           "protocol": "TCP"}]}]}}}}
    assert holds(want, live)
    live["spec"]["replicas"] = 1
    assert not holds(want, live)
    live["spec"]["replicas"] = 2
    live["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 9000
    assert not holds(want, live)
    assert not holds({"rules": [{"verbs": ["get"]}]}, {"rules": []})
    assert not holds({"a": "true"}, {"a": True}) and not holds({"a": 1}, {})
    # The API server drops false and empty fields: still as wanted.
    assert holds({"spec": {"publishNotReadyAddresses": False, "clusterIP": "None"}},
                 {"spec": {"clusterIP": "None"}})
    assert not holds({"spec": {"publishNotReadyAddresses": True}}, {"spec": {}})



def test_a_subject_added_by_hand_to_the_gateways_role_binding_is_drift(pool_body):
    """It was never taken out: every pass found the gateway's subject there and wrote nothing,
    so another account kept the gateway's permissions."""
    binding = next(o for o in desired_objects(parse_pool(pool_body()), OperatorConfig(),
                                              service_monitors=False)
                   if o["kind"] == "RoleBinding")
    live = {**binding, "subjects": [*binding["subjects"], {
        "kind": "ServiceAccount", "name": "default", "namespace": "ml"}]}
    assert holds(binding, binding)
    assert not holds(binding, live)


def test_stray_env_patch_removes_only_what_the_pool_does_not_set(pool_body):
    desired = next(o for o in desired_objects(parse_pool(pool_body(engine={"env": [
        {"name": "MINE", "value": "1"}]})), OperatorConfig(), service_monitors=False)
        if o["metadata"]["name"] == "llama-worker")
    live = {"spec": {"template": {"spec": {"containers": [
        {"name": "worker", "env": [{"name": "HOME", "value": "/h"}, {"name": "X", "value": "1"},
                                   {"name": "MINE", "value": "1"}, {"name": "Y", "value": "2"}]},
        {"name": "sidecar-injected", "env": [{"name": "Z", "value": "3"}]}]}}}}
    assert stray_env_patch(desired, live) == [
        {"op": "test", "path": "/spec/template/spec/containers/0/env/3/name", "value": "Y"},
        {"op": "remove", "path": "/spec/template/spec/containers/0/env/3"},
        {"op": "test", "path": "/spec/template/spec/containers/0/env/1/name", "value": "X"},
        {"op": "remove", "path": "/spec/template/spec/containers/0/env/1"},
    ]  # a container the pool does not define (an injected sidecar) is not touched
    assert stray_env_patch(desired, desired) == []



def test_a_service_port_edited_by_hand_is_put_back_before_the_apply(pool_body):
    """Server-side apply leaves a port another manager owns, and refuses the pool's port beside
    one of the same name: the pool showed Accepted=False (RejectedByAPIServer, "Duplicate value:
    http") and its gateway Service stayed on the hand-edited port."""
    def gateway_service(port: int) -> dict:
        return next(o for o in desired_objects(parse_pool(pool_body(gateway={
            "service": {"port": port}})), OperatorConfig(), service_monitors=False)
            if o["kind"] == "Service" and o["metadata"]["name"] == "llama-gateway")

    def live(port: int, applied: int | None) -> dict:
        fields = {"f:spec": {"f:ports": {f'k:{{"port":{applied},"protocol":"TCP"}}': {}}}}
        return {"metadata": {"managedFields": [
            {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {}},
            {"manager": "radixpool-operator", "operation": "Apply",
             "fieldsV1": fields if applied else {"f:spec": {"f:type": {}}}}]},
            "spec": {"ports": [{"name": "http", "port": port, "protocol": "TCP",
                                "targetPort": "http"}]}}

    desired = gateway_service(8080)
    edited = live(9090, applied=None)  # the edit took the port item from the operator
    assert stray_ports_patch(desired, edited) == [
        {"op": "test", "path": "/spec/ports", "value": edited["spec"]["ports"]},
        {"op": "replace", "path": "/spec/ports", "value": desired["spec"]["ports"]}]
    assert stray_ports_patch(desired, live(8080, applied=8080)) == []
    # a port the pool set before and no longer wants is the apply's to remove
    assert stray_ports_patch(gateway_service(9000), live(8080, applied=8080)) == []


def test_refusals_are_named_in_spec_terms(pool_body):
    body = pool_body(engine={"env": [{"name": "A", "value": "1"}, {"name": "1B", "value": "2"}],
                             "tolerations": [{"key": "k", "operator": "Sometimes"}],
                             "args": ["--skip-warmup"]})
    pool = parse_pool(body)
    objs = {o["metadata"]["name"]: o for o in desired_objects(
        pool, OperatorConfig(), service_monitors=False) if o["kind"] == "Deployment"}
    worker = objs["llama-worker"]
    env_index = len(worker["spec"]["template"]["spec"]["containers"][0]["env"]) - 1
    args_index = len(worker["spec"]["template"]["spec"]["containers"][0]["args"]) - 1
    message = (f"spec.template.spec.containers[0].env[{env_index}].name: Invalid value; "
               "spec.template.spec.tolerations[0].operator: Unsupported value; "
               f"spec.template.spec.containers[0].args[{args_index}]: bad; "
               "spec.template.spec.containers[0].env[0].name: the operator's own")
    said = in_spec_terms(message, worker, pool.spec)
    assert f"spec.engine.env[1].name (spec.template.spec.containers[0].env[{env_index}].name)" \
        in said
    assert "spec.engine.tolerations[0].operator (spec.template.spec.tolerations[0]" in said
    assert f"spec.engine.args[0] (spec.template.spec.containers[0].args[{args_index}])" in said
    assert said.endswith("spec.template.spec.containers[0].env[0].name: the operator's own")
    gateway = in_spec_terms("spec.template.spec.nodeSelector: bad", objs["llama-gateway"],
                            pool.spec)
    assert gateway.startswith("spec.gateway.nodeSelector (spec.template.spec.nodeSelector)")


@pytest.mark.parametrize("model", [{"path": "/models/m"}, {"uri": "hf://org/name"},
                                   {"uri": "pvc://claim/dir"}])
def test_refused_volumes_and_mounts_are_named_as_the_pools_own(pool_body, model):
    """The operator's volumes and mounts come first, so the API server's index was not the
    spec's: `volumes[3]` for the pool's first volume."""
    pool = parse_pool(pool_body(model=model, engine={
        "volumes": [{"name": "data", "emptyDir": {}}, {"name": "Bad_Vol", "emptyDir": {}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"},
                         {"name": "missing", "mountPath": "/other"}]}))
    worker = next(o for o in desired_objects(pool, OperatorConfig(), service_monitors=False)
                  if o["metadata"]["name"] == "llama-worker")
    pod = worker["spec"]["template"]["spec"]
    volume, mount = len(pod["volumes"]) - 1, len(pod["containers"][0]["volumeMounts"]) - 1
    said = in_spec_terms(
        f"[spec.template.spec.volumes[{volume}].name: Invalid value: \"Bad_Vol\", "
        f"spec.template.spec.containers[0].volumeMounts[{mount}].name: Not found: \"missing\", "
        "spec.template.spec.volumes[0].name: the operator's own]", worker, pool.spec)
    assert f"spec.engine.volumes[1].name (spec.template.spec.volumes[{volume}].name)" in said
    assert (f"spec.engine.volumeMounts[1].name (spec.template.spec.containers[0]"
            f".volumeMounts[{mount}].name)") in said
    assert "spec.template.spec.volumes[0].name: the operator's own" in said


class PeeringCluster:
    def __init__(self, present=(), failure: ApiFailure | None = None):
        self.present, self.failure, self.created = set(present), failure, []

    def create_if_missing(self, obj):
        if self.failure:
            raise self.failure
        key = (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if key in self.present:
            return False
        self.created.append(key)
        return True


def test_a_missing_peering_object_is_created_at_start_up():
    cluster = PeeringCluster(present={("KopfPeering", "a", "radixpool")})
    assert ensure_peering(cluster, "radixpool", ["a", "b"]) == ["KopfPeering b/radixpool"]
    assert ensure_peering(PeeringCluster(), "rp", []) == ["ClusterKopfPeering rp"]


@pytest.mark.parametrize("code,hint", [(404, "kubectl apply --server-side -f crds/kopf-peering"),
                                       (403, "grant the operator create")])
def test_a_peering_object_that_cannot_be_made_stops_the_operator_saying_why(code, hint):
    failure = ApiFailure("create", "ClusterKopfPeering", "", "radixpool", code, "x", "y")
    with pytest.raises(PeeringUnavailable, match="--standalone") as stopped:
        ensure_peering(PeeringCluster(failure=failure), "radixpool", [])
    assert hint in str(stopped.value)
    assert "ClusterKopfPeering radixpool is missing" in str(stopped.value)


def test_fields_the_operator_applied_and_the_pool_no_longer_sets_are_seen():
    from radixpool.operator.drift import sets_no_more_than

    # managedFields as the API server (v1.28) records the operator's apply of a Deployment
    applied = {"f:metadata": {"f:labels": {"f:radixpool.io/pool": {}}, "f:ownerReferences": {
        'k:{"uid":"u1"}': {}}}, "f:spec": {"f:template": {"f:spec": {
            "f:nodeSelector": {}, "f:containers": {'k:{"name":"worker"}': {
                ".": {}, "f:name": {}, "f:ports": {'k:{"containerPort":8000,"protocol":"TCP"}': {
                    ".": {}, "f:containerPort": {}, "f:protocol": {}}},
                "f:resources": {"f:limits": {"f:nvidia.com/gpu": {}}}}}}}}}
    live = {"metadata": {"managedFields": [
        {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
         "fieldsV1": {"f:status": {"f:replicas": {}}}},
        {"manager": "radixpool-operator", "operation": "Apply", "fieldsV1": applied}]}}

    def deployment(uid="u1", node_selector=True, gpu=True) -> dict:
        container = {"name": "worker", "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                     "resources": {"limits": {"nvidia.com/gpu": "1"} if gpu else {}}}
        pod = {"containers": [container], **({"nodeSelector": {"a": "b"}} if node_selector
                                             else {})}
        return {"metadata": {"labels": {"radixpool.io/pool": "p"},
                             "ownerReferences": [{"uid": uid}]},
                "spec": {"template": {"spec": pod}}}

    assert sets_no_more_than(deployment(), live)
    assert not sets_no_more_than(deployment(node_selector=False), live)
    assert not sets_no_more_than(deployment(gpu=False), live)
    assert not sets_no_more_than(deployment(uid="u2"), live)  # a stale owner reference
    assert sets_no_more_than(deployment(), {"metadata": {}})  # nothing recorded: nothing stale
