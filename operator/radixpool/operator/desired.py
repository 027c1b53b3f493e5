"""spec → desired objects: the whole of what a pool should own, as plain dicts.

`desired_objects(pool, config, service_monitors=...)` is pure: same pool, same objects. Every
object carries the `app.kubernetes.io/*` and `radixpool.io/pool` labels and a controller owner
reference to the pool, so deleting the pool deletes them (Kubernetes garbage collection).
`obsolete_objects` names what the pool may have owned before and must not own now.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from . import api
from .gateway import (
    desired_gateway_deployment,
    desired_gateway_pdb,
    desired_gateway_role,
    desired_gateway_role_binding,
    desired_gateway_service,
    desired_gateway_service_account,
)
from .spec import Pool
from .workers import (
    POD_UID,
    UNHEALTHY_POD_EVICTION,
    desired_worker_deployment,
    desired_worker_service,
    worker_labels,
    worker_selector,
)

DEFAULT_WORKER_IMAGE = "ghcr.io/radixpool/radixpool-worker:0.1.0"
DEFAULT_CONTROL_IMAGE = "ghcr.io/radixpool/radixpool-control:0.1.0"
# Who may scrape the workers besides the gateway: pods named prometheus, in any namespace.
DEFAULT_PROMETHEUS_PEER: dict[str, Any] = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


PEER_FIELDS = ("podSelector", "namespaceSelector", "ipBlock")


@dataclass(frozen=True)
class OperatorConfig:
    """What the operator brings to every pool: images used when a pool names none, whether
    each pool's workers get a NetworkPolicy (only the gateway and Prometheus may reach them;
    `prometheus_peer` None: only the gateway), and whether pods are given their uid, gid and
    fsGroup (`set_pod_uid`, the images' 1000) or get them from the platform (OpenShift)."""

    worker_image: str = DEFAULT_WORKER_IMAGE
    gateway_image: str = DEFAULT_CONTROL_IMAGE
    network_policy: bool = False
    set_pod_uid: bool = True
    prometheus_peer: dict[str, Any] | None = field(
        default_factory=lambda: copy.deepcopy(DEFAULT_PROMETHEUS_PEER))

    @classmethod
    def from_env(cls) -> OperatorConfig:
        """Raises ValueError for a RADIXPOOL_PROMETHEUS_PEER that is no NetworkPolicy peer, or a
        RADIXPOOL_SET_POD_UID that is neither true nor false."""
        peer = os.environ.get("RADIXPOOL_PROMETHEUS_PEER")
        return cls(
            worker_image=os.environ.get("RADIXPOOL_WORKER_IMAGE", DEFAULT_WORKER_IMAGE),
            gateway_image=os.environ.get("RADIXPOOL_GATEWAY_IMAGE", DEFAULT_CONTROL_IMAGE),
            network_policy=os.environ.get("RADIXPOOL_NETWORK_POLICY", "").lower()
            in ("1", "true", "yes"),
            prometheus_peer=parse_peer(peer) if peer else copy.deepcopy(DEFAULT_PROMETHEUS_PEER),
            set_pod_uid=parse_switch("RADIXPOOL_SET_POD_UID", default=True),
        )

    @property
    def pod_uid(self) -> int | None:
        return POD_UID if self.set_pod_uid else None


def parse_switch(variable: str, *, default: bool) -> bool:
    value = os.environ.get(variable, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{variable} must be true or false, got {value!r}")


def parse_peer(text: str) -> dict[str, Any] | None:
    """A NetworkPolicy `from` peer as JSON. `null` or one that names nothing (the chart's
    `networkPolicy.prometheus: null`) is None: no one besides the gateway. Written as it is, an
    empty peer made the API server refuse every pool's NetworkPolicy ("must specify a peer")."""
    try:
        peer = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"RADIXPOOL_PROMETHEUS_PEER is not JSON: {error}") from None
    if peer is not None and not isinstance(peer, dict):
        raise ValueError(f"RADIXPOOL_PROMETHEUS_PEER must be a NetworkPolicy peer (a JSON "
                         f"object with {', '.join(PEER_FIELDS)}), got {text!r}")
    if not peer or not any(peer.get(key) is not None for key in PEER_FIELDS):
        return None
    return peer


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    namespace: str
    name: str


def ref_of(obj: dict[str, Any]) -> ObjectRef:
    meta = obj["metadata"]
    return ObjectRef(obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


def desired_pdb(pool: Pool) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": api.pdb_name(pool.name), "namespace": pool.namespace,
                     "labels": worker_labels(pool)},
        "spec": {
            "maxUnavailable": pool.lifecycle["podDisruptionBudget"]["maxUnavailable"],
            "unhealthyPodEvictionPolicy": UNHEALTHY_POD_EVICTION,
            "selector": {"matchLabels": api.selector_labels(pool.name, "worker")},
        },
    }


def control_key_secret(pool: Pool) -> dict[str, Any]:
    """The pool's control key, random, made once: never re-applied (a new key each pass would
    restart every pod), so it is not among `desired_objects`; owned by the pool like them."""
    return owned(pool, {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": api.control_key_secret_name(pool.name, pool.uid),
                     "namespace": pool.namespace,
                     "labels": api.pool_labels(pool.name, "control-key")},
        "stringData": {api.CONTROL_KEY_FIELD: secrets.token_urlsafe(32)},
    })


def desired_network_policy(pool: Pool, config: OperatorConfig) -> dict[str, Any]:
    """Only the pool's gateway pods and Prometheus reach the workers' port."""
    port = [{"port": api.WORKER_PORT, "protocol": "TCP"}]
    ingress = [{"from": [{"podSelector": {"matchLabels": api.selector_labels(
        pool.name, "gateway")}}], "ports": port}]
    if config.prometheus_peer is not None:
        ingress.append({"from": [copy.deepcopy(config.prometheus_peer)], "ports": port})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": api.network_policy_name(pool.name), "namespace": pool.namespace,
                     "labels": worker_labels(pool)},
        "spec": {
            "podSelector": {"matchLabels": worker_selector(pool)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def desired_service_monitor(pool: Pool) -> dict[str, Any]:
    """One ServiceMonitor scraping `/metrics` of the worker and gateway Services."""
    monitor = pool.spec["monitoring"]["serviceMonitor"]
    interval = monitor["interval"]
    # the pool's own labels win: they say whose monitor this is
    labels = {**monitor.get("labels", {}), **api.pool_labels(pool.name, "monitoring")}
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": api.service_monitor_name(pool.name), "namespace": pool.namespace,
                     "labels": labels},
        "spec": {
            "selector": {"matchLabels": {api.POOL_LABEL: pool.name},
                         "matchExpressions": [{"key": api.COMPONENT_LABEL, "operator": "In",
                                               "values": ["worker", "gateway"]}]},
            "namespaceSelector": {"matchNames": [pool.namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": interval}],
            "podTargetLabels": [api.COMPONENT_LABEL, api.POOL_LABEL],
        },
    }


def owner_reference(pool: Pool) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": pool.name,
            "uid": pool.uid, "controller": True, "blockOwnerDeletion": True}


def owned_by(obj: dict[str, Any], pool: Pool) -> bool:
    """Whether a live object is the pool's to change: its controller is an InferencePool of this
    name (this one, or an earlier one of the same name that garbage collection has yet to clear),
    or, its owner reference removed by hand, it still carries the pool's labels."""
    meta = obj.get("metadata") or {}
    controllers = [ref for ref in meta.get("ownerReferences") or [] if ref.get("controller")]
    if controllers:
        return any(ref.get("kind") == api.KIND and ref.get("name") == pool.name
                   and str(ref.get("apiVersion", "")).startswith(f"{api.GROUP}/")
                   for ref in controllers)
    labels = meta.get("labels") or {}
    return (labels.get(api.POOL_LABEL) == pool.name
            and labels.get("app.kubernetes.io/managed-by") == api.FIELD_MANAGER)


def left_by_earlier_pool(obj: dict[str, Any], pool: Pool) -> bool:
    """Whether a live object's controller is an earlier pool of this name: deleted (two pools
    cannot share a name), so garbage collection is about to remove the object."""
    return any(ref.get("controller") and ref.get("kind") == api.KIND
               and ref.get("name") == pool.name and ref.get("uid") != pool.uid
               for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def owned(pool: Pool, obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"]["ownerReferences"] = [owner_reference(pool)]
    return obj


def wants_pdb(pool: Pool) -> bool:
    return pool.lifecycle["podDisruptionBudget"]["enabled"]


def wants_service_monitor(pool: Pool, service_monitors: bool) -> bool:
    return service_monitors and pool.spec["monitoring"]["serviceMonitor"]["enabled"]


def desired_objects(pool: Pool, config: OperatorConfig, *,
                    service_monitors: bool) -> list[dict[str, Any]]:
    """Everything the pool owns, in creation order (RBAC before the pods that use it).
    `service_monitors` says whether the cluster has the ServiceMonitor CRD."""
    worker_image = pool.engine.get("image") or config.worker_image
    gateway_image = pool.gateway.get("image") or config.gateway_image
    objects = [
        desired_worker_service(pool),
        desired_worker_deployment(pool, worker_image, config.pod_uid),
        desired_gateway_service_account(pool),
        desired_gateway_role(pool),
        desired_gateway_role_binding(pool),
        desired_gateway_deployment(pool, gateway_image, config.pod_uid),
        desired_gateway_service(pool),
    ]
    if wants_pdb(pool):
        objects += [desired_pdb(pool), desired_gateway_pdb(pool)]
    if config.network_policy:
        objects.append(desired_network_policy(pool, config))
    if wants_service_monitor(pool, service_monitors):
        objects.append(desired_service_monitor(pool))
        for obj in objects:
            if obj["kind"] == "Service":
                obj["metadata"]["labels"][api.OWN_MONITOR_LABEL] = "true"
    return [owned(pool, obj) for obj in objects]


def obsolete_objects(pool: Pool, config: OperatorConfig, *,
                     service_monitors: bool) -> list[ObjectRef]:
    """Objects the pool owned under an earlier spec (or operator setting) and no longer wants."""
    refs = []
    if not wants_pdb(pool):
        refs += [ObjectRef("policy/v1", "PodDisruptionBudget", pool.namespace, name)
                 for name in (api.pdb_name(pool.name), api.gateway_pdb_name(pool.name))]
    if not config.network_policy:
        refs.append(ObjectRef("networking.k8s.io/v1", "NetworkPolicy", pool.namespace,
                              api.network_policy_name(pool.name)))
    if service_monitors and not wants_service_monitor(pool, service_monitors):
        refs.append(ObjectRef("monitoring.coreos.com/v1", "ServiceMonitor", pool.namespace,
                              api.service_monitor_name(pool.name)))
    return refs
