"""Conditions say what is wrong, from what the pods and Deployments report."""

from __future__ import annotations

from radixpool.operator.status import Observed, Verdict, pool_status

OK = Verdict(True, "Valid", "ok")


def deployment(name: str, *, replicas: int, ready: int, updated: int | None = None,
               conditions: list | None = None) -> dict:
    return {"metadata": {"name": name, "generation": 2},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": 2, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": ready if updated is None else updated,
                       "conditions": conditions or []}}


def pod(name: str, **status) -> dict:
    return {"metadata": {"name": name}, "status": status}


def status_for(observed: Observed, desired: int = 2, body: dict | None = None) -> dict:
    body = body or {"metadata": {"name": "llama", "namespace": "ml", "generation": 4}}
    return pool_status(body, OK, observed, desired_replicas=desired, desired_gateways=1,
                       served_name="llama", now="2026-01-01T00:00:00Z")


def cond(status: dict, kind: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_crash_looping_and_unpullable_pods_degrade_the_pool_with_their_names():
    observed = Observed(
        worker_deployment=deployment("llama-worker", replicas=2, ready=0),
        pods=[
            pod("llama-worker-a", containerStatuses=[{"name": "worker", "state": {"waiting": {
                "reason": "CrashLoopBackOff", "message": "back-off 5m0s"}}}]),
            pod("llama-worker-b", initContainerStatuses=[{"name": "download-model", "state": {
                "waiting": {"reason": "ImagePullBackOff"}}}]),
            pod("llama-worker-c", conditions=[{"type": "PodScheduled", "status": "False",
                                               "reason": "Unschedulable",
                                               "message": "0/3 nodes have nvidia.com/gpu"}]),
        ])
    degraded = cond(status_for(observed), "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "PodsFailing"
    assert "pod llama-worker-a container worker: CrashLoopBackOff" in degraded["message"]
    assert "download-model: ImagePullBackOff" in degraded["message"]
    assert "llama-worker-c: Unschedulable: 0/3 nodes have nvidia.com/gpu" in degraded["message"]


def test_a_crash_looping_container_between_two_crashes_still_degrades_the_pool():
    # Degraded went False each time the looping container ran again (loading its model before
    # the next crash) and True at its next CrashLoopBackOff: a flapping condition, and an
    # Event each way
    def worker(ready: bool, restarts: int, exit_code: int = 137) -> dict:
        return {"name": "worker", "ready": ready, "restartCount": restarts,
                "state": {"running": {"startedAt": "2026-01-01T00:10:00Z"}},
                "lastState": {"terminated": {"exitCode": exit_code, "reason": "OOMKilled"}}}

    def degraded_by(container: dict, unready_since: str = "2026-01-01T00:09:58Z") -> dict:
        conditions = [{"type": "Ready", "status": "True" if container["ready"] else "False",
                       "lastTransitionTime": unready_since}]
        observed = Observed(worker_deployment=deployment("llama-worker", replicas=1, ready=0),
                            pods=[pod("llama-worker-a", conditions=conditions,
                                      containerStatuses=[container])])
        return cond(status_for(observed), "Degraded")

    looping = degraded_by(worker(ready=False, restarts=4))
    assert looping["status"] == "True"
    assert "llama-worker-a container worker: restarted 4 times" in looping["message"]
    assert "code 137, OOMKilled" in looping["message"]
    assert degraded_by(worker(ready=True, restarts=4))["status"] == "False"   # it recovered
    assert degraded_by(worker(ready=False, restarts=1))["status"] == "False"  # one restart
    assert degraded_by(worker(ready=False, restarts=4, exit_code=0))["status"] == "False"
    # ready after its last restart, then failing a probe: not a crash loop
    assert degraded_by(worker(ready=False, restarts=4),
                       unready_since="2026-01-01T00:30:00Z")["status"] == "False"


def test_a_stuck_rollout_is_degraded_and_no_longer_progressing():
    stuck = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
              "message": "ReplicaSet llama-worker-7 has timed out progressing."}]
    observed = Observed(worker_deployment=deployment("llama-worker", replicas=2, ready=1,
                                                     conditions=stuck))
    status = status_for(observed)
    assert cond(status, "Progressing")["reason"] == "ProgressDeadlineExceeded"
    assert "timed out progressing" in cond(status, "Degraded")["message"]


def test_nothing_created_yet_reads_as_not_created():
    status = status_for(Observed())
    assert cond(status, "WorkersReady")["reason"] == "NotCreated"
    assert cond(status, "GatewayReady")["reason"] == "NotCreated"
    assert status["replicas"] == 0 and "endpoint" not in status


def test_load_balancer_address_is_reported_as_the_external_endpoint():
    service = {"spec": {"ports": [{"port": 80}]},
               "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}}
    status = status_for(Observed(gateway_service=service))
    assert status["endpoint"] == "http://llama-gateway.ml.svc:80"
    assert status["externalEndpoint"] == "http://203.0.113.7:80"


def test_ipv6_load_balancer_address_is_bracketed():
    """`http://2001:db8::7:80` is no URL a client can use: the address is in brackets."""
    service = {"spec": {"ports": [{"port": 80}]},
               "status": {"loadBalancer": {"ingress": [{"ip": "2001:db8::7"}]}}}
    status = status_for(Observed(gateway_service=service))
    assert status["externalEndpoint"] == "http://[2001:db8::7]:80"


def test_transition_time_moves_only_when_the_status_changes():
    observed = Observed(worker_deployment=deployment("llama-worker", replicas=2, ready=2))
    before = {"metadata": {"name": "llama", "namespace": "ml", "generation": 4},
              "status": {"conditions": [
                  {"type": "WorkersReady", "status": "True", "lastTransitionTime": "EARLIER"},
                  {"type": "Degraded", "status": "True", "lastTransitionTime": "EARLIER"}]}}
    status = status_for(observed, body=before)
    assert cond(status, "WorkersReady")["lastTransitionTime"] == "EARLIER"
    assert cond(status, "Degraded")["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])


def test_scaled_to_zero_is_ready_and_says_so():
    observed = Observed(worker_deployment=deployment("llama-worker", replicas=0, ready=0))
    ready = cond(status_for(observed, desired=0), "WorkersReady")
    assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")


def test_status_validates_against_the_crd_status_schema():
    from radixpool.operator.crd import ROOT
    from radixpool.operator.openapi import validate

    observed = Observed(worker_deployment=deployment("llama-worker", replicas=2, ready=1),
                        gateway_service={"spec": {"ports": [{"port": 8080}]}})
    assert validate(ROOT["properties"]["status"], status_for(observed), "status") == []


def test_a_rollout_keeps_full_capacity_ready_while_it_progresses():
    rolling = deployment("llama-worker", replicas=3, ready=2, updated=1)
    rolling["status"]["readyReplicas"] = 2
    status = status_for(Observed(worker_deployment=rolling), desired=2)
    assert cond(status, "WorkersReady")["status"] == "True"
    assert cond(status, "Progressing")["reason"] == "RollingOut"
