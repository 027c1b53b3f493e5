"""The kopf handlers are glue: they write the reconciled status into kopf's patch (only when it
changed), post the events from `radixpool-operator`, keep one pass per pool at a time, back off
after API errors, and need no finalizer."""

from __future__ import annotations

import threading
import time

import kopf

from radixpool.operator import handlers
from radixpool.operator.desired import OperatorConfig
from radixpool.operator.gate import PoolGate
from radixpool.operator.reconcile import ApiFailure


def memo_for(cluster, gate: PoolGate | None = None) -> kopf.Memo:
    return kopf.Memo(cluster=cluster, config=OperatorConfig(), gate=gate or PoolGate(15, 300))


def test_handler_writes_status_and_posts_the_warning(cluster, pool_body):
    patch = kopf.Patch()
    handlers.apply_pool(body=kopf.Body(pool_body(replicas=3, gateway={"policy": "nope"})),
                        patch=patch, memo=memo_for(cluster))
    accepted = next(c for c in patch["status"]["conditions"] if c["type"] == "Accepted")
    assert accepted["status"] == "False" and "spec.gateway.policy" in accepted["message"]
    assert patch["status"]["ready"] == "0/3"
    assert [(e.type, e.reason) for e in cluster.events] == [("Warning", "InvalidSpec")]
    assert cluster.objects == {}


def test_timer_applies_a_valid_pool_then_leaves_an_unchanged_one_alone(cluster, pool_body):
    memo = memo_for(cluster)
    patch = kopf.Patch()
    cluster.add("InferencePool", "ml", "llama", pool_body())  # the timer checks it still exists
    handlers.check_pool(body=kopf.Body(pool_body()), patch=patch, memo=memo)
    assert cluster.stored("Deployment", "ml", "llama-worker") is not None
    assert patch["status"]["endpoint"] == "http://llama-gateway.ml.svc:8080"
    assert ("Normal", "Valid") in [(e.type, e.reason) for e in cluster.events]

    cluster.writes.clear()
    quiet = kopf.Patch()
    handlers.check_pool(body=kopf.Body({**pool_body(), "status": dict(patch["status"])}),
                        patch=quiet, memo=memo)
    assert cluster.writes == [] and dict(quiet) == {}  # no object write, no status patch


def test_api_failures_back_off_visibly(pool_body, cluster):
    now = [1000.0]
    gate = PoolGate(15, 300, clock=lambda: now[0])
    memo = memo_for(cluster, gate)
    cluster.fail["Deployment"] = ApiFailure("apply", "Deployment", "ml", "llama-worker", 503,
                                            "Service Unavailable", "etcd is down")
    body = pool_body()
    cluster.add("InferencePool", "ml", "llama", body)
    delays = []
    for _ in range(6):
        patch = kopf.Patch()
        handlers.check_pool(body=kopf.Body(body), patch=patch, memo=memo)
        degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
        assert "apply Deployment ml/llama-worker: 503 Service Unavailable: etcd is down" in (
            degraded["message"])
        delays.append(int(degraded["message"].rsplit("next attempt in ", 1)[1].rstrip("s")))
        body = {**body, "status": dict(patch["status"])}
        skipped = kopf.Patch()
        handlers.check_pool(body=kopf.Body(body), patch=skipped, memo=memo)  # too early
        assert dict(skipped) == {}
        now[0] += delays[-1]
    assert delays == [15, 30, 60, 120, 240, 300]
    assert [(e.type, e.reason) for e in cluster.events] == [("Warning", "APIError")]

    # A spec change is tried at once, whatever the backoff says.
    del cluster.fail["Deployment"]
    patch = kopf.Patch()
    handlers.apply_pool(body=kopf.Body(body), patch=patch, memo=memo)
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False" and gate.failures(body["metadata"]["uid"]) == 0


def test_timer_and_update_never_run_together_for_one_pool(pool_body, make_cluster):
    class Slow(make_cluster):
        def __init__(self):
            super().__init__()
            self.inside = self.most = 0
            self.guard = threading.Lock()

        def has_service_monitors(self):
            with self.guard:
                self.inside += 1
                self.most = max(self.most, self.inside)
            time.sleep(0.2)
            with self.guard:
                self.inside -= 1
            return False

    cluster = Slow()
    memo = memo_for(cluster)
    body = kopf.Body(pool_body())
    runs = [threading.Thread(target=fn, kwargs={"body": body, "patch": kopf.Patch(),
                                                 "memo": memo})
            for fn in (handlers.apply_pool, handlers.check_pool, handlers.apply_pool)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert cluster.most == 1


def test_no_handler_puts_a_finalizer_on_pools():
    registry = kopf.OperatorRegistry()
    handlers.register_periodic_check(5, registry=registry)
    default = kopf.get_default_registry()
    timers = [h for h in registry._spawning.get_all_handlers()]
    assert timers and all(h.requires_finalizer is False for h in timers)
    changing = list(default._changing.get_all_handlers())
    assert {h.fn for h in changing} == {handlers.apply_pool}  # create, update, resume
    assert not any(h.requires_finalizer for h in changing)


def test_a_deleted_pool_is_left_to_garbage_collection(cluster, pool_body):
    body = pool_body()
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    patch = kopf.Patch()
    handlers.check_pool(body=kopf.Body(body), patch=patch, memo=memo_for(cluster))
    assert cluster.objects == {} and dict(patch) == {}


def test_the_timer_of_a_deleted_pool_makes_nothing(cluster, pool_body):
    # kopf keeps running the timer of a pool deleted without a finalizer, with its last body
    memo = memo_for(cluster)
    patch = kopf.Patch()
    handlers.check_pool(body=kopf.Body(pool_body()), patch=patch, memo=memo)
    assert cluster.objects == {} and dict(patch) == {} and cluster.events == []

    successor = pool_body()
    successor["metadata"]["uid"] = "uid-llama-2"  # made again under the same name
    cluster.add("InferencePool", "ml", "llama", successor)
    handlers.check_pool(body=kopf.Body(pool_body()), patch=patch, memo=memo)
    assert [kind for kind in cluster.kinds()] == ["InferencePool"] and dict(patch) == {}
    handlers.check_pool(body=kopf.Body(successor), patch=patch, memo=memo)
    assert cluster.stored("Deployment", "ml", "llama-worker") is not None

    class Counting(type(cluster)):
        reads = 0

        def get(self, ref):
            Counting.reads += 1
            return super().get(ref)
    memo = memo_for(Counting())
    for _ in range(3):  # gone once, gone for good: no more requests for it
        handlers.check_pool(body=kopf.Body(pool_body()), patch=kopf.Patch(), memo=memo)
    assert Counting.reads == 1
