"""Status from observation: what the Deployments, pods and Service report, never what was hoped.

`pool_status` is pure. Conditions:
- `Accepted`: the spec passed validation and every Secret / PVC it names exists.
- `WorkersReady`: as many ready workers as `spec.replicas` asks (during a rollout, old and new
  pods both count: the pool serves at full capacity).
- `GatewayReady`: as many ready gateway pods as `spec.gateway.replicas` asks.
- `Progressing`: a rollout or scale is under way (False once it completes or gets stuck).
- `Degraded`: something needs a human: pods crash-looping (also between two crashes, running
  again and not ready), images not pulling, pods
  unschedulable, a rollout past its deadline, or the Kubernetes API refusing the operator
  (`APIError`: the API's message, the object it concerns, and when the next attempt is).
- `Ready`: the one to watch: accepted, workers and gateway ready, nothing degraded; its reason
  names the first thing missing.
A condition keeps its `lastTransitionTime` while its status stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from radixpool.listen import http_url

from . import api

# A container that has failed this often and is running again, not yet ready, is taken to be
# crash-looping still: it is between two crashes.
CRASH_RESTARTS = 2
BROKEN_WAITING_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})


@dataclass(frozen=True)
class Observed:
    """What exists in the cluster for one pool (None: not found)."""

    worker_deployment: dict[str, Any] | None = None
    gateway_deployment: dict[str, Any] | None = None
    gateway_service: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    """The outcome of validation: the `Accepted` condition."""

    accepted: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


def _replicas(deployment: dict[str, Any] | None) -> dict[str, int]:
    status = (deployment or {}).get("status") or {}
    return {key: int(status.get(key) or 0)
            for key in ("replicas", "readyReplicas", "updatedReplicas", "availableReplicas")}


def _deployment_condition(deployment: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for condition in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return {}


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason,
            "message": message}


def workers_ready(deployment: dict[str, Any] | None, desired: int) -> dict[str, Any]:
    if deployment is None:
        return _condition("WorkersReady", False, "NotCreated",
                          "the worker Deployment does not exist")
    seen = _replicas(deployment)
    ready = seen["readyReplicas"]  # serving capacity; the template rollout is `Progressing`
    if desired == 0:
        return _condition("WorkersReady", True, "ScaledToZero", "spec.replicas is 0")
    text = f"{seen['readyReplicas']}/{desired} workers ready, {seen['updatedReplicas']} updated"
    return _condition("WorkersReady", ready >= desired, "AllReady" if ready >= desired
                      else "NotReady", text)


def gateway_ready(deployment: dict[str, Any] | None, desired: int) -> dict[str, Any]:
    if deployment is None:
        return _condition("GatewayReady", False, "NotCreated",
                          "the gateway Deployment does not exist")
    ready = _replicas(deployment)["readyReplicas"]
    return _condition("GatewayReady", ready >= desired, "AllReady" if ready >= desired
                      else "NotReady", f"{ready}/{desired} gateway pods ready")


def progressing(deployment: dict[str, Any] | None, desired: int) -> dict[str, Any]:
    if deployment is None:
        return _condition("Progressing", False, "NotCreated", "no worker Deployment")
    if _deployment_condition(deployment, "Progressing").get("reason") == "ProgressDeadlineExceeded":
        return _condition("Progressing", False, "ProgressDeadlineExceeded",
                          "the worker rollout made no progress within its deadline")
    seen = _replicas(deployment)
    meta_generation = (deployment.get("metadata") or {}).get("generation", 0)
    observed_generation = (deployment.get("status") or {}).get("observedGeneration", 0)
    if observed_generation < meta_generation or seen["updatedReplicas"] < desired:
        return _condition("Progressing", True, "RollingOut",
                          f"{seen['updatedReplicas']}/{desired} workers on the current template")
    if seen["replicas"] != desired or seen["readyReplicas"] < desired:
        return _condition("Progressing", True, "Scaling",
                          f"{seen['replicas']} workers exist, {desired} wanted, "
                          f"{seen['readyReplicas']} ready")
    return _condition("Progressing", False, "Complete", f"{desired} workers up to date")


def degraded(observed: Observed) -> dict[str, Any]:
    problems = []
    for deployment in (observed.worker_deployment, observed.gateway_deployment):
        stuck = _deployment_condition(deployment, "Progressing")
        if stuck.get("reason") == "ProgressDeadlineExceeded":
            problems.append(f"deployment {deployment['metadata']['name']}: {stuck.get('message')}")
        failure = _deployment_condition(deployment, "ReplicaFailure")
        if failure.get("status") == "True":
            problems.append(f"deployment {deployment['metadata']['name']}: "
                            f"{failure.get('message')}")
    for pod in observed.pods:
        problems += _pod_problems(pod)
    if problems:
        return _condition("Degraded", True, "PodsFailing", "; ".join(sorted(problems)[:5]))
    return _condition("Degraded", False, "AsExpected", "no failing pods or stuck rollouts")


def _pod_problems(pod: dict[str, Any]) -> list[str]:
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    problems = []
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            problems.append(f"pod {name}: Unschedulable: {condition.get('message', '')}")
    containers = (status.get("initContainerStatuses") or []) + (
        status.get("containerStatuses") or [])
    for container in containers:
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in BROKEN_WAITING_REASONS:
            problems.append(f"pod {name} container {container.get('name')}: "
                            f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": "))
        last = (container.get("lastState") or {}).get("terminated") or {}
        restarts = int(container.get("restartCount") or 0)
        if (last and last.get("exitCode") != 0 and restarts >= CRASH_RESTARTS
                and not container.get("ready")
                and _unready_since_start(status, (state.get("running") or {}).get("startedAt"))):
            # between two crashes of a loop (CrashLoopBackOff only while it waits): still
            # failing until it is ready, or Degraded would flap with every restart
            problems.append(f"pod {name} container {container.get('name')}: restarted "
                            f"{restarts} times, not ready since its last exit "
                            f"(code {last.get('exitCode')}, {last.get('reason') or 'no reason'})")
    return problems


def _unready_since_start(pod_status: dict[str, Any], started_at: str | None) -> bool:
    """Whether a container running since `started_at` has not been ready since: the pod's
    Ready condition last turned False no later than that (at the crash before), not after (a
    pod that was ready, then failed a probe, is not between two crashes)."""
    if not started_at:
        return False
    for condition in pod_status.get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") == "False":
            changed = condition.get("lastTransitionTime")
            return bool(changed) and _instant(changed) <= _instant(started_at)
    return False


def _instant(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _endpoints(pool_name: str, namespace: str,
               service: dict[str, Any] | None) -> dict[str, str]:
    if service is None:
        return {}
    port = service["spec"]["ports"][0]["port"]
    found = {"endpoint": f"http://{api.gateway_name(pool_name)}.{namespace}.svc:{port}"}
    ingress = (((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or [])
    if ingress:
        host = ingress[0].get("hostname") or ingress[0].get("ip")
        found["externalEndpoint"] = http_url(host, port)   # an IPv6 LB address in brackets
    return found


def ready(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    """The aggregate: every other condition as a serving pool has it."""
    by_type = {c["type"]: c for c in conditions}
    for kind, wanted, reason in (("Degraded", "False", "Degraded"),
                                 ("Accepted", "True", "NotAccepted"),
                                 ("WorkersReady", "True", "WorkersNotReady"),
                                 ("GatewayReady", "True", "GatewayNotReady")):
        condition = by_type.get(kind)
        if condition is None or condition["status"] != wanted:
            message = condition["message"] if condition else f"{kind} is not known yet"
            return _condition("Ready", False, reason, message)
    return _condition("Ready", True, "Serving", "accepted; workers and gateway ready")


def _stamp(conditions: list[dict[str, Any]], body: dict[str, Any], now: str,
           generation: int) -> None:
    previous = {c["type"]: c for c in (body.get("status") or {}).get("conditions") or []}
    for condition in conditions:
        before = previous.get(condition["type"])
        unchanged = before and before.get("status") == condition["status"]
        condition["lastTransitionTime"] = before["lastTransitionTime"] if unchanged else now
        condition["observedGeneration"] = generation


def failed_status(body: dict[str, Any], message: str, now: str) -> dict[str, Any]:
    """The status after a pass the API stopped: what was known stays, `Degraded` says why."""
    status = dict(body.get("status") or {})
    kept = [dict(c) for c in status.get("conditions") or []
            if c.get("type") not in ("Degraded", "Ready")]
    conditions = [*kept, _condition("Degraded", True, "APIError", message)]
    conditions.append(ready(conditions))
    generation = int(body["metadata"].get("generation", 0))
    fresh = conditions[len(kept):]
    _stamp(fresh, body, now, generation)
    status["conditions"] = conditions
    return status


def pool_status(body: dict[str, Any], verdict: Verdict, observed: Observed, *,
                desired_replicas: int, desired_gateways: int, served_name: str,
                now: str) -> dict[str, Any]:
    """The status subresource for `body`, from `verdict` and `observed`."""
    meta = body["metadata"]
    generation = int(meta.get("generation", 0))
    seen = _replicas(observed.worker_deployment)
    conditions = [
        _condition("Accepted", verdict.accepted, verdict.reason, verdict.message),
        workers_ready(observed.worker_deployment, desired_replicas),
        gateway_ready(observed.gateway_deployment, desired_gateways),
        progressing(observed.worker_deployment, desired_replicas),
        degraded(observed),
    ]
    conditions.append(ready(conditions))
    _stamp(conditions, body, now, generation)
    selector = api.selector_string(api.selector_labels(meta["name"], "worker"))
    return {
        "observedGeneration": generation,
        "model": served_name,
        "replicas": seen["replicas"],
        "readyReplicas": seen["readyReplicas"],
        "updatedReplicas": seen["updatedReplicas"],
        "ready": f"{seen['readyReplicas']}/{desired_replicas}",
        "selector": selector,
        "gatewayReadyReplicas": _replicas(observed.gateway_deployment)["readyReplicas"],
        **_endpoints(meta["name"], meta.get("namespace", "default"), observed.gateway_service),
        "conditions": conditions,
    }


def transition_events(body: dict[str, Any], status: dict[str, Any]) -> list[Event]:
    """Kubernetes Events for conditions that changed: once per change, not once per check."""
    before = {c["type"]: (c.get("status"), c.get("reason"))
              for c in (body.get("status") or {}).get("conditions") or []}
    events = []
    for condition in status["conditions"]:
        kind, now_status = condition["type"], condition["status"]
        if before.get(kind) == (now_status, condition["reason"]):
            continue
        if kind == "Accepted":
            bad = now_status == "False"
            events.append(Event("Warning" if bad else "Normal", condition["reason"],
                                condition["message"]))
        elif kind == "Degraded" and now_status == "True":
            events.append(Event("Warning", condition["reason"], condition["message"]))
        elif kind == "WorkersReady" and now_status == "True" and (
                before.get(kind, ("", ""))[0] != "True"):
            events.append(Event("Normal", "WorkersReady", condition["message"]))
    return events
