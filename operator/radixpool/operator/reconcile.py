"""One reconciliation of one pool: validate, check references, dry-run, apply, observe, report.

The order is the contract. Nothing is written to the cluster until the spec is valid, every
Secret and PVC it names exists, and the API server has accepted every object in a dry run, so a
rejected pool is never half-made (a pool that was valid and then gets a bad edit keeps running as
it was, with `Accepted=False` saying why). Applying is idempotent and forceful (server-side
apply), so running this on a timer puts back whatever was edited or deleted. Status is computed
from what is observed *after* applying.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from .desired import ObjectRef, OperatorConfig, desired_objects, obsolete_objects
from .openapi import FieldError
from .spec import InvalidPool, Pool, parse_pool
from .status import Event, Observed, Verdict, pool_status, transition_events


class ObjectRejected(Exception):
    """The API server refused an object the pool would own (400 / 422): a problem with the
    spec's pass-through fields (env, volumes, tolerations, ...), not with the cluster."""


class Cluster(Protocol):
    """The Kubernetes API as reconciliation needs it."""

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        """Whether a Secret or PersistentVolumeClaim exists."""

    def has_service_monitors(self) -> bool:
        """Whether the monitoring.coreos.com ServiceMonitor CRD is installed."""

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> None:
        """Create or update `obj`, taking ownership of every field it sets; with `dry_run` the
        server validates and admits it without storing. Raises `ObjectRejected` on 400 / 422."""

    def delete(self, ref: ObjectRef) -> None:
        """Delete the object if it exists."""

    def observe(self, namespace: str, pool: str) -> Observed:
        """The pool's Deployments, gateway Service and pods as they are now."""


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]
    events: list[Event]


def missing_references(pool: Pool, cluster: Cluster) -> list[FieldError]:
    return [FieldError(ref.path, f"{ref.kind} {ref.name!r} not found in namespace "
                                 f"{pool.namespace!r}")
            for ref in pool.references() if not cluster.exists(ref.kind, pool.namespace, ref.name)]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile_pool(body: dict[str, Any], cluster: Cluster, config: OperatorConfig,
                   now: str | None = None) -> Outcome:
    meta = body["metadata"]
    try:
        pool = parse_pool(body)
        missing = missing_references(pool, cluster)
        if missing:
            verdict = Verdict(False, "MissingReference", "; ".join(map(str, missing)))
        else:
            verdict = Verdict(True, "Valid", "the spec is valid and its references exist")
    except InvalidPool as invalid:
        pool, verdict = None, Verdict(False, "InvalidSpec", str(invalid))

    if pool is not None and verdict.accepted:
        rejection = _apply(pool, cluster, config)
        if rejection is not None:
            verdict = Verdict(False, "RejectedByAPIServer", rejection)

    observed = cluster.observe(meta.get("namespace", "default"), meta["name"])
    status = pool_status(
        body, verdict, observed,
        desired_replicas=pool.replicas if pool else _requested_replicas(body, observed),
        desired_gateways=(pool.gateway["replicas"] if pool
                          else _observed_replicas(observed.gateway_deployment)),
        served_name=pool.model.served_name if pool else _served_name(body),
        now=now or _now(),
    )
    return Outcome(status=status, events=transition_events(body, status))


def _apply(pool: Pool, cluster: Cluster, config: OperatorConfig) -> str | None:
    """Apply the pool's objects and remove obsolete ones; the API server's refusal or None.
    Every object passes a dry run (validation and admission) before any is written, so a spec
    the server refuses leaves nothing half-made."""
    monitors = cluster.has_service_monitors()
    objects = desired_objects(pool, config, service_monitors=monitors)
    rejection = _apply_all(objects, cluster, dry_run=True) or \
        _apply_all(objects, cluster, dry_run=False)   # admission may change in between
    if rejection is None:
        for ref in obsolete_objects(pool, service_monitors=monitors):
            cluster.delete(ref)
    return rejection


def _apply_all(objects: list[dict[str, Any]], cluster: Cluster, *, dry_run: bool) -> str | None:
    """Apply each object in order; the first refusal, or None."""
    for obj in objects:
        try:
            cluster.apply(obj, dry_run=dry_run)
        except ObjectRejected as rejected:
            return f"{obj['kind']} {obj['metadata']['name']}: {rejected}"
    return None


def _requested_replicas(body: dict[str, Any], observed: Observed) -> int:
    """For a rejected pool: what it asks for if that much is readable, else what runs."""
    asked = (body.get("spec") or {}).get("replicas", 1)
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0:
        return asked
    return _observed_replicas(observed.worker_deployment)


def _observed_replicas(deployment: dict[str, Any] | None) -> int:
    return int(((deployment or {}).get("spec") or {}).get("replicas") or 0)


def _served_name(body: dict[str, Any]) -> str:
    model = (body.get("spec") or {}).get("model") or {}
    name = model.get("servedName") if isinstance(model, dict) else None
    return name if isinstance(name, str) else body["metadata"]["name"]

