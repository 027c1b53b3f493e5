"""One reconciliation of one pool: validate, check references, compare, dry-run, apply, report.

The order is the contract. Nothing is written to the cluster until the spec is valid, every
Secret and PVC it names exists, and the API server has accepted every changed object in a dry run,
so a rejected pool is never half-made (a pool that was valid and then gets a bad edit keeps running
as it was, with `Accepted=False` saying why). An object no dry run can check (an admission webhook
with side effects refuses every dry run of what it matches) is applied unchecked, and a Normal
Event says so: the API server may then refuse it only once others are written. Only objects that
no longer hold what the pool wants are applied (server-side apply, forceful), so a pool whose
objects are as wanted costs reads only, never a write; running this on a timer puts back whatever
was edited or deleted. Status is computed from what is observed *after* applying. Any other API
error (403, 404, 5xx) becomes `Degraded=True` with the API's message and the object it concerns,
never an exception.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from . import api
from .desired import (
    ObjectRef,
    OperatorConfig,
    control_key_secret,
    desired_objects,
    left_by_earlier_pool,
    obsolete_objects,
    owned_by,
    ref_of,
)
from .drift import holds, sets_no_more_than, stray_env_patch, stray_ports_patch
from .openapi import FieldError
from .spec import InvalidPool, Pool, parse_pool
from .spec_paths import in_spec_terms
from .status import Event, Observed, Verdict, failed_status, pool_status, transition_events

log = logging.getLogger("radixpool.operator")


class ObjectRejected(Exception):
    """The API server refused an object the pool would own (400 / 422): a problem with the
    spec's pass-through fields (env, volumes, tolerations, ...), not with the cluster."""


class DryRunUnsupported(Exception):
    """The API server could not dry-run an object: an admission webhook that matches it declares
    side effects (`sideEffects: Unknown` or `Some`) and so refuses every dry run (400). Says
    nothing about the object itself, so the object is applied unchecked."""


class KindGone(Exception):
    """An object's kind is no longer served: its CRD was removed after the operator last looked
    (a ServiceMonitor, with prometheus-operator uninstalled). The cluster forgets that it had
    the kind, so a pass that looks again goes on without it."""


class ApiFailure(Exception):
    """Any other API error, naming what was asked and of which object (403, 404, 409, 5xx)."""

    def __init__(self, action: str, kind: str, namespace: str, name: str, code: int | None,
                 reason: str, message: str):
        self.code = code
        where = f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"
        super().__init__(f"{action} {where}: {code or ''} {reason}: {message}".replace(
            ":  ", ": ").strip())


# RBAC objects and the ServiceAccount carry no spec field, so the API server cannot refuse them
# for the spec's sake; and a RoleBinding's dry run fails (404) while its Role does not exist yet,
# because the escalation check looks the Role up. They are applied without a dry run.
NOT_DRY_RUN = frozenset({"ServiceAccount", "Role", "RoleBinding"})


class Cluster(Protocol):
    """The Kubernetes API as reconciliation needs it. Methods raise `ApiFailure` on API errors."""

    def exists(self, kind: str, namespace: str, name: str) -> bool | None:
        """Whether a Secret or PersistentVolumeClaim exists; None when not allowed to look."""

    def has_service_monitors(self) -> bool:
        """Whether the monitoring.coreos.com ServiceMonitor CRD is installed."""

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        """The object as stored, or None."""

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Create or update `obj`, taking ownership of every field it sets; with `dry_run` the
        server validates and admits it without storing. Returns the object as stored. Raises
        `ObjectRejected` on 400 / 422, and `DryRunUnsupported` for a dry run an admission webhook
        refuses to take part in."""

    def patch_json(self, ref: ObjectRef, operations: list[dict[str, Any]]) -> None:
        """Apply a JSON patch to the object."""

    def create_once(self, obj: dict[str, Any],
                    before: Callable[[], None] | None = None) -> bool:
        """Create `obj` unless it exists; never update it (the pool's generated control key).
        Needs no read permission: an existing object is a 409 from the API server. Asked again
        now and then, and at once for a new owner, so a deleted object comes back. `before`
        runs when it is found missing, before it is made: if it raises, nothing is made (the
        next call finds it missing again). Where no dry run can find it missing (an admission
        webhook refuses them), `before` runs once it is made, and on each later call until it
        succeeds. True when this call made it."""

    def restart(self, ref: ObjectRef, stamp: str) -> None:
        """Roll a Deployment's pods, as `kubectl rollout restart` does: `stamp` in a pod template
        annotation, under a field manager of its own, so the operator's applies leave it."""

    def delete(self, ref: ObjectRef) -> None:
        """Delete the object if it exists."""

    def pods(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        """The pool's pods."""


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]
    events: list[Event]
    failure: str | None = None  # the API error that stopped this pass, if any


def missing_references(pool: Pool, cluster: Cluster) -> list[FieldError]:
    # exists() is None where the operator may not read Secrets: then a missing one shows as
    # pods failing with CreateContainerConfigError (Degraded), not as Accepted=False.
    return [FieldError(ref.path, f"{ref.kind} {ref.name!r} not found in namespace "
                                 f"{pool.namespace!r}")
            for ref in pool.references()
            if cluster.exists(ref.kind, pool.namespace, ref.name) is False]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile_pool(body: dict[str, Any], cluster: Cluster, config: OperatorConfig,
                   now: str | None = None, retry_in: float = 0.0) -> Outcome:
    """One pass. `retry_in` is what the status says about the next attempt if this one fails."""
    now = now or _now()
    try:
        return _reconcile(body, cluster, config, now)
    except ApiFailure as failure:
        message = f"{failure}; next attempt in {retry_in:.0f}s"
        status = failed_status(body, message, now)
        return Outcome(status=status, events=transition_events(body, status),
                       failure=str(failure))


def _reconcile(body: dict[str, Any], cluster: Cluster, config: OperatorConfig,
               now: str) -> Outcome:
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

    live: dict[ObjectRef, dict[str, Any] | None] = {}
    unchecked: list[str] = []
    if pool is not None and verdict.accepted:
        try:
            refusal = _apply(pool, cluster, config, live, unchecked)
        except KindGone as gone:   # made without it this time: not Degraded for a minute
            log.info("%s/%s: %s; going on without it", pool.namespace, pool.name, gone)
            live.clear()
            unchecked.clear()
            refusal = _apply(pool, cluster, config, live, unchecked)
        if refusal is not None:
            verdict = refusal

    observed = _observe(cluster, meta.get("namespace", "default"), meta["name"], live)
    status = pool_status(
        body, verdict, observed,
        desired_replicas=pool.replicas if pool else _requested_replicas(body, observed),
        desired_gateways=(pool.gateway["replicas"] if pool
                          else _observed_replicas(observed.gateway_deployment)),
        served_name=pool.model.served_name if pool else _served_name(body),
        now=now,
    )
    events = transition_events(body, status)
    if unchecked:
        message = "no dry run before applying: " + "; ".join(unchecked)
        log.warning("%s/%s: %s", meta.get("namespace", "default"), meta["name"], message)
        events.append(Event("Normal", "AppliedWithoutDryRun", message))
    return Outcome(status=status, events=events)


def _reads_secret(deployment: dict[str, Any], name: str) -> bool:
    """Whether the Deployment's pods take an env var from the Secret `name`."""
    spec = deployment.get("spec", {}).get("template", {}).get("spec", {})
    return any(((env.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name") == name
               for container in spec.get("containers", []) for env in container.get("env", []))


def _apply(pool: Pool, cluster: Cluster, config: OperatorConfig,
           live: dict[ObjectRef, dict[str, Any] | None], unchecked: list[str]) -> Verdict | None:
    """Apply the objects that do not hold what the pool wants, remove stray env vars and
    obsolete objects; why the pool cannot be made, or None. Objects of the same name the pool
    does not own (someone else's Service, say) are never taken over. Every changed object passes
    a dry run (validation and admission) before any is written, so a spec the server refuses
    leaves nothing half-made. `live` is filled with the objects as they stand afterwards,
    `unchecked` with the objects applied without a dry run the API server would not do."""
    monitors = cluster.has_service_monitors()
    objects = desired_objects(pool, config, service_monitors=monitors)
    for obj in objects:
        live[ref_of(obj)] = cluster.get(ref_of(obj))
    taken = [ref for ref, current in live.items()
             if current is not None and not owned_by(current, pool)]
    if taken:
        for ref in taken:
            live[ref] = None  # not the pool's: its status must not describe them
        names = ", ".join(f"{ref.kind} {ref.namespace}/{ref.name}" for ref in taken)
        return Verdict(False, "NameConflict",
                       f"not owned by this pool, so left alone: {names} (rename the pool, or "
                       "remove what holds the name)")
    leftovers = [ref for ref, current in live.items()
                 if current is not None and left_by_earlier_pool(current, pool)]
    if leftovers:
        # Taking them over would need delete permission on them (a new owner reference, under
        # OwnerReferencesPermissionEnforcement): wait; a later pass makes them anew.
        for ref in leftovers:
            live[ref] = None
        return None
    changed = [obj for obj in objects if not _holds(obj, live[ref_of(obj)])]
    for obj in changed:
        current = live[ref_of(obj)]
        if obj["kind"] == "Service" and current is not None:
            operations = stray_ports_patch(obj, current)
            if operations:  # before the dry run, which the stray port would fail
                cluster.patch_json(ref_of(obj), operations)
    checked = [obj for obj in changed if obj["kind"] not in NOT_DRY_RUN]
    running = [ref for ref, current in live.items()
               if ref.kind == "Deployment" and current is not None]
    rejection = _dry_run_all(checked, cluster, pool, unchecked)
    if rejection is None:
        key = control_key_secret(pool)
        stale = [ref for ref in running
                 if _reads_secret(live[ref], key["metadata"]["name"])]

        def roll_onto_new_key() -> None:
            # The key is missing (deleted by hand) while pods run: they read the old one when
            # they started (env from the Secret), and a pod started now would read the new one,
            # so gateway and workers would refuse each other. Roll them all onto it, before it
            # is made: a restart that fails leaves it missing, so the next pass rolls them
            # again rather than never. (Pods that read a key of another name, from an operator
            # that named it otherwise, roll onto this one with the change to their env: once,
            # not twice.)
            log.warning("%s/%s: its control key is missing; restarting its pods onto a new one",
                        pool.namespace, pool.name)
            for ref in stale:
                cluster.restart(ref, _now())
        cluster.create_once(key, before=roll_onto_new_key if stale else None)
        # admission may still refuse what its dry run let through
        rejection = _apply_all(changed, cluster, pool, live)
    if rejection is not None:
        return Verdict(False, "RejectedByAPIServer", rejection)
    for obj in objects:
        current = live[ref_of(obj)]
        if obj["kind"] == "Deployment" and current is not None:
            operations = stray_env_patch(obj, current)
            if operations:
                cluster.patch_json(ref_of(obj), operations)
    for ref in obsolete_objects(pool, config, service_monitors=monitors):
        current = cluster.get(ref)
        if current is not None and owned_by(current, pool):  # never someone else's
            cluster.delete(ref)
    return None


def _holds(obj: dict[str, Any], current: dict[str, Any] | None) -> bool:
    return current is not None and holds(obj, current) and sets_no_more_than(obj, current)


def _refusal(rejected: ObjectRejected, obj: dict[str, Any], pool: Pool) -> str:
    """The API server's refusal of `obj`, in the spec's terms."""
    message = in_spec_terms(str(rejected), obj, pool.spec)
    return f"{obj['kind']} {obj['metadata']['name']}: {message}"


def _dry_run_all(objects: list[dict[str, Any]], cluster: Cluster, pool: Pool,
                 unchecked: list[str]) -> str | None:
    """Dry-run each object in order; the first refusal, or None. An object whose dry run an
    admission webhook will not take part in goes to `unchecked` (it cannot be checked, which is
    no reason to refuse it: it is applied, and the webhook sees the real request)."""
    for obj in objects:
        try:
            cluster.apply(obj, dry_run=True)
        except DryRunUnsupported as refused:
            unchecked.append(f"{obj['kind']} {obj['metadata']['name']} ({refused})")
        except ObjectRejected as rejected:
            return _refusal(rejected, obj, pool)
    return None


def _apply_all(objects: list[dict[str, Any]], cluster: Cluster, pool: Pool,
               live: dict[ObjectRef, dict[str, Any] | None]) -> str | None:
    """Apply each object in order; the first refusal, or None."""
    for obj in objects:
        try:
            live[ref_of(obj)] = cluster.apply(obj)
        except ObjectRejected as rejected:
            return _refusal(rejected, obj, pool)
    return None


def _observe(cluster: Cluster, namespace: str, pool: str,
             live: dict[ObjectRef, dict[str, Any] | None]) -> Observed:
    def current(api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        ref = ObjectRef(api_version, kind, namespace, name)
        return live[ref] if ref in live else cluster.get(ref)
    return Observed(
        worker_deployment=current("apps/v1", "Deployment", api.worker_deployment_name(pool)),
        gateway_deployment=current("apps/v1", "Deployment", api.gateway_name(pool)),
        gateway_service=current("v1", "Service", api.gateway_name(pool)),
        pods=cluster.pods(namespace, pool),
    )


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
