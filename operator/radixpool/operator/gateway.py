"""The gateway: Deployment, Service (the pool's endpoint) and the RBAC to watch EndpointSlices.

The gateway learns the worker set by watching the EndpointSlices of the headless worker Service,
so it needs list and watch on `discovery.k8s.io/endpointslices` in the pool's namespace, nothing
more (it never reads one slice by name: no get): a Role, not a ClusterRole.
"""

from __future__ import annotations

from typing import Any

from . import api
from .spec import Pool
from .workers import (
    ENDPOINT_PROPAGATION_SECONDS,
    HOME,
    POD_UID,
    UNHEALTHY_POD_EVICTION,
    api_key_env,
    container_security,
    control_key_env,
    cpu_quantity,
    pod_security,
)

# The least a stopping gateway gives its in-flight requests (`radixpool gateway --drain-timeout`).
GATEWAY_DRAIN_SECONDS = 30


def gateway_drain_seconds(pool: Pool) -> int:
    """A stopping gateway lets its streams run as long as a stopping worker lets them: with a
    shorter drain a gateway rollout would cut the streams a worker rollout lets finish."""
    return max(GATEWAY_DRAIN_SECONDS, pool.lifecycle["drainTimeoutSeconds"])


def gateway_grace_seconds(pool: Pool) -> int:
    """The preStop wait (the pod leaves the Service's endpoints first), the whole drain, and a
    margin: so the effective drain is the gateway's own, not grace minus preStop."""
    return ENDPOINT_PROPAGATION_SECONDS + gateway_drain_seconds(pool) + 5


def gateway_labels(pool: Pool) -> dict[str, str]:
    return api.pool_labels(pool.name, "gateway")


def gateway_selector(pool: Pool) -> dict[str, str]:
    return api.selector_labels(pool.name, "gateway")


def _meta(pool: Pool) -> dict[str, Any]:
    return {"name": api.gateway_name(pool.name), "namespace": pool.namespace,
            "labels": gateway_labels(pool)}


def desired_gateway_service_account(pool: Pool) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(pool)}


def desired_gateway_role(pool: Pool) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(pool),
        "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                   "verbs": ["list", "watch"]}],
    }


def desired_gateway_role_binding(pool: Pool) -> dict[str, Any]:
    name = api.gateway_name(pool.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": _meta(pool),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
    }


def desired_gateway_pdb(pool: Pool) -> dict[str, Any]:
    """Voluntary disruptions (node drains) take one ready gateway pod at a time; those not
    ready (no worker is) go whenever asked."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(pool),
        "spec": {"maxUnavailable": 1, "unhealthyPodEvictionPolicy": UNHEALTHY_POD_EVICTION,
                 "selector": {"matchLabels": gateway_selector(pool)}},
    }


def gateway_args(pool: Pool) -> list[str]:
    gw = pool.gateway
    args = ["gateway", "--k8s-service", api.worker_service_name(pool.name),
            "--namespace", pool.namespace, "--k8s-port-name", "http", "--policy", gw["policy"],
            "--cache-threshold", str(gw["cacheThreshold"]),
            "--balance-abs-threshold", str(gw["balanceAbsThreshold"]),
            "--balance-rel-threshold", str(gw["balanceRelThreshold"]),
            "--drain-timeout", str(gateway_drain_seconds(pool)),
            "--host", "::", "--port", str(api.GATEWAY_PORT)]
    args.append("--late-binding" if gw["lateBinding"] else "--no-late-binding")
    return args  # keys come from the environment only: RADIXPOOL_API_KEY, RADIXPOOL_WORKER_API_KEY


def desired_gateway_deployment(pool: Pool, image: str, uid: int | None = POD_UID) -> dict[str, Any]:
    gw = pool.gateway
    # Readiness follows the workers (/health is 503 with none ready); liveness must not, or a
    # healthy gateway is restarted in a loop while the model loads: /livez is 200 while it serves.
    health = {"path": "/health", "port": "http"}
    alive = {"path": "/livez", "port": "http"}
    container = {
        "name": "gateway", "image": image,
        "imagePullPolicy": gw.get("imagePullPolicy", "IfNotPresent"),
        "command": ["radixpool"], "args": gateway_args(pool),
        "ports": [{"name": "http", "containerPort": api.GATEWAY_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": HOME}, *api_key_env(pool),
                control_key_env(pool, "RADIXPOOL_WORKER_API_KEY")],
        "resources": {
            "requests": {"cpu": cpu_quantity(gw["resources"]["cpu"]),
                         "memory": str(gw["resources"]["memory"])},
            "limits": {"memory": str(gw["resources"]["memory"])}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "cache", "mountPath": f"{HOME}/.cache"}],
        "readinessProbe": {"httpGet": health, "periodSeconds": 5, "timeoutSeconds": 2},
        "livenessProbe": {"httpGet": alive, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 6},
        "lifecycle": {"preStop": {"exec": {
            "command": ["sleep", str(ENDPOINT_PROPAGATION_SECONDS)]}}},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": api.gateway_name(pool.name),
        "enableServiceLinks": False,
        "securityContext": pod_security(uid),
        "terminationGracePeriodSeconds": gateway_grace_seconds(pool),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}],
        # Replicas on different nodes where the scheduler can, so one node's loss or drain
        # leaves a gateway serving; never a reason to leave one pending.
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": gateway_selector(pool)}}],
    }
    for key in ("nodeSelector", "tolerations"):
        if gw.get(key):
            pod_spec[key] = gw[key]
    if pool.engine.get("imagePullSecrets"):
        pod_spec["imagePullSecrets"] = pool.engine["imagePullSecrets"]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(pool),
        "spec": {
            "replicas": gw["replicas"],
            "paused": False,   # a hand-paused rollout would hang without a word: taken back
            "selector": {"matchLabels": gateway_selector(pool)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            # its pods are ready once a worker is (/health), so its rollout has the workers'
            # whole startup budget before it counts as stuck
            "progressDeadlineSeconds": pool.lifecycle["startupTimeoutSeconds"] + 300,
            "revisionHistoryLimit": 5,
            "template": {"metadata": {"labels": gateway_labels(pool)}, "spec": pod_spec},
        },
    }


def desired_gateway_service(pool: Pool) -> dict[str, Any]:
    service = pool.gateway["service"]
    meta = _meta(pool)
    if service.get("annotations"):
        meta["annotations"] = service["annotations"]
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {
            "type": service["type"],
            "selector": gateway_selector(pool),
            "ports": [{"name": "http", "port": service["port"], "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }
