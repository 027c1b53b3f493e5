"""The Kubernetes I/O shell (`KubeCluster`) against a small fake API server over real HTTP.

No cluster here, so a stand-in speaks just enough of the API (discovery, apply, get, list, delete)
for the real `kubernetes` client to run unmodified: this checks the requests the operator sends —
server-side apply with its field manager and force, the URLs, the deletes — and that status is
read back from what the server holds.
"""

from __future__ import annotations

import pytest
from fake_apiserver import FakeAPIServer

from radixpool.operator import api
from radixpool.operator.desired import OperatorConfig
from radixpool.operator.reconcile import reconcile_pool


@pytest.fixture
def server(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the discovery cache file
    with FakeAPIServer() as fake:
        yield fake.store, fake.url


@pytest.fixture
def kube_cluster(server):
    from kubernetes import client

    from radixpool.operator.kube import KubeCluster

    configuration = client.Configuration()
    configuration.host = server[1]
    return KubeCluster(client.ApiClient(configuration))


def test_reconcile_applies_every_object_server_side_with_force(server, kube_cluster, pool_body):
    store, _ = server
    outcome = reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    patches = [(path, query, ctype) for method, path, query, ctype in store.requests
               if method == "PATCH"]
    dry_runs = [p for p in patches if p[1].get("dryRun") == ["All"]]
    applies = [p for p in patches if "dryRun" not in p[1]]
    assert len(applies) == 9
    # No dry run for the ServiceAccount, Role and RoleBinding (nothing of the spec in them; a
    # RoleBinding's dry run fails while its Role does not exist yet).
    assert {p[0].split("/")[-2] for p in dry_runs} == {
        "services", "deployments", "poddisruptionbudgets"} and len(dry_runs) == 6
    assert patches.index(dry_runs[-1]) < patches.index(applies[0])  # every dry run comes first
    assert {path for path, _, _ in applies} == {
        "/api/v1/namespaces/ml/services/llama-workers",
        "/api/v1/namespaces/ml/services/llama-gateway",
        "/api/v1/namespaces/ml/serviceaccounts/llama-gateway",
        "/apis/apps/v1/namespaces/ml/deployments/llama-worker",
        "/apis/apps/v1/namespaces/ml/deployments/llama-gateway",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/roles/llama-gateway",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/rolebindings/llama-gateway",
        "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/llama-worker",
        "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/llama-gateway",
    }
    for _, query, ctype in applies:
        assert ctype.startswith("application/apply-patch+yaml")
        assert query["fieldManager"] == ["radixpool-operator"] and query["force"] == ["true"]
    deployment = store.objects["apis/apps/v1/namespaces/ml/deployments/llama-worker"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == "1"
    assert outcome.status["endpoint"] == "http://llama-gateway.ml.svc:8080"


def test_status_is_read_back_from_the_server(server, kube_cluster, pool_body):
    store, _ = server
    reconcile_pool(pool_body(replicas=2), kube_cluster, OperatorConfig())
    worker = store.objects["apis/apps/v1/namespaces/ml/deployments/llama-worker"]
    worker["status"] = {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}
    store.objects["api/v1/namespaces/ml/pods/llama-worker-x"] = {
        "metadata": {"name": "llama-worker-x", "labels": {"radixpool.io/pool": "llama"}},
        "status": {"containerStatuses": [{"name": "worker", "state": {"waiting": {
            "reason": "CrashLoopBackOff"}}}]}}
    status = reconcile_pool(pool_body(replicas=2), kube_cluster, OperatorConfig()).status
    assert status["ready"] == "1/2"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "llama-worker-x container worker: CrashLoopBackOff" in degraded["message"]


def test_missing_secret_is_found_missing_and_nothing_is_written(server, kube_cluster, pool_body):
    store, _ = server
    body = pool_body(apiKeySecret={"name": "nope"})
    outcome = reconcile_pool(body, kube_cluster, OperatorConfig())
    assert not [r for r in store.requests if r[0] == "PATCH"]
    assert ("GET", "/api/v1/namespaces/ml/secrets/nope") in [r[:2] for r in store.requests]
    accepted = outcome.status["conditions"][0]
    assert accepted["reason"] == "MissingReference"

    store.objects["api/v1/namespaces/ml/secrets/nope"] = {"metadata": {"name": "nope"}}
    assert kube_cluster.exists("Secret", "ml", "nope")


def test_turning_the_pdb_off_deletes_it_and_monitors_follow_their_crd(server, kube_cluster,
                                                                      pool_body):
    store, _ = server
    reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    assert not kube_cluster.has_service_monitors()
    off = pool_body(lifecycle={"podDisruptionBudget": {"enabled": False}})
    reconcile_pool(off, kube_cluster, OperatorConfig())
    assert ("DELETE", "/apis/policy/v1/namespaces/ml/poddisruptionbudgets/llama-worker") in [
        r[:2] for r in store.requests]
    assert "apis/policy/v1/namespaces/ml/poddisruptionbudgets/llama-worker" not in (
        store.objects)


def test_a_refusal_is_reported_with_the_servers_message(server, kube_cluster, pool_body):
    store, _ = server
    store.refuse["apis/apps/v1/namespaces/ml/deployments/llama-worker"] = (
        "spec.template.spec.containers[0].env[0].name: Invalid value: \"1X\"")
    outcome = reconcile_pool(pool_body(engine={"env": [{"name": "1X", "value": "v"}]}),
                             kube_cluster, OperatorConfig())
    accepted = outcome.status["conditions"][0]
    assert accepted["reason"] == "RejectedByAPIServer"
    assert "Deployment llama-worker: spec.template.spec.containers[0].env[0].name" in (
        accepted["message"])
    assert not any(key.startswith("api") and "/services/" in key for key in store.objects)


def test_an_object_server_side_apply_cannot_type_is_a_refusal_not_an_api_error(
        server, kube_cluster, pool_body):
    """An unknown key in an opaque core/v1 item (affinity) gets apply's 500 "failed to create
    typed patch object": the spec's fault, lasting, so Accepted=False naming it, not a
    Degraded APIError retried for ever (a new pool then had no Accepted condition at all)."""
    store, _ = server
    path = "apis/apps/v1/namespaces/ml/deployments/llama-worker"
    store.refuse[path] = ('failed to create typed patch object (ml/llama-worker; apps/v1, '
                          'Kind=Deployment): .spec.template.spec.affinity.nodeAfinity: field '
                          'not declared in schema')
    store.refuse_code[path] = 500
    outcome = reconcile_pool(pool_body(engine={"affinity": {"nodeAfinity": {}}}), kube_cluster,
                             OperatorConfig())
    accepted = outcome.status["conditions"][0]
    assert (accepted["type"], accepted["status"], accepted["reason"]) == (
        "Accepted", "False", "RejectedByAPIServer")
    assert ".spec.engine.affinity.nodeAfinity (spec.template.spec.affinity.nodeAfinity): field " \
        "not declared in schema" in accepted["message"]   # in the spec's terms


def test_an_api_error_names_the_object_and_carries_the_apis_message(server, kube_cluster,
                                                                    pool_body):
    store, _ = server
    store.forbid["apis/apps/v1/namespaces/ml/deployments/llama-gateway"] = (
        'deployments.apps "llama-gateway" is forbidden: User "system:serviceaccount:rp:rp" '
        'cannot patch resource "deployments" in API group "apps" in the namespace "ml"')
    outcome = reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "APIError"
    assert degraded["message"].startswith(
        "dry-run apply Deployment ml/llama-gateway: 403 Forbidden: deployments.apps "
        '"llama-gateway" is forbidden: User "system:serviceaccount:rp:rp" cannot patch')


def test_stray_env_is_removed_with_a_guarded_json_patch(server, kube_cluster, pool_body):
    store, _ = server
    reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    path = "apis/apps/v1/namespaces/ml/deployments/llama-worker"
    store.objects[path]["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "ADDED_BY_HAND", "value": "1"})
    store.requests.clear()
    reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    writes = [(m, p, c) for m, p, _, c in store.requests if m != "GET"]
    assert writes == [("PATCH", "/" + path, "application/json-patch+json")]
    env = store.objects[path]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "ADDED_BY_HAND" not in [e["name"] for e in env]


def test_events_come_from_the_operator_not_kopf(server, kube_cluster, pool_body):
    from radixpool.operator.status import Event

    store, _ = server
    body = pool_body()
    kube_cluster.post_event(body, Event("Warning", "APIError", "apply Deployment ml/x: 403"))
    event = next(obj for key, obj in store.objects.items() if "/events/" in key)
    assert event["source"] == {"component": "radixpool-operator"}
    assert event["reportingComponent"] == "radixpool-operator"
    assert event["involvedObject"]["kind"] == "InferencePool"
    assert event["involvedObject"]["uid"] == "uid-llama"
    assert (event["type"], event["reason"]) == ("Warning", "APIError")


def test_the_control_key_comes_back_for_a_pool_made_again_and_after_a_hand_delete(
        server, kube_cluster, pool_body, monkeypatch):
    from radixpool.operator import kube

    store, _ = server
    secret = "api/v1/namespaces/ml/secrets/llama-control-key-uidllama"
    reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    assert store.objects[secret]["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    store.requests.clear()
    reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    assert not [r for r in store.requests if r[0] == "POST"]  # steady state: not asked again

    # `kubectl delete` and `apply` of the same pool at once: garbage collection removes the old
    # pool's key, and the new pool (same name, new uid) gets its own, under a name of its own.
    for key in [key for key, obj in store.objects.items() if obj["metadata"].get(
            "ownerReferences", [{}])[0].get("uid") == "uid-llama"]:
        del store.objects[key]  # garbage collection, the control key among them
    again = pool_body()
    again["metadata"]["uid"] = "uid-llama-2"
    reconcile_pool(again, kube_cluster, OperatorConfig())
    secret = "api/v1/namespaces/ml/secrets/llama-control-key-uidllama2"
    assert store.objects[secret]["metadata"]["ownerReferences"][0]["uid"] == "uid-llama-2"

    deployments = [f"apis/apps/v1/namespaces/ml/deployments/llama-{part}"
                   for part in ("worker", "gateway")]

    def restarted() -> list[str | None]:
        return [(store.objects[d]["spec"]["template"]["metadata"].get("annotations") or {}).get(
            api.RESTARTED_AT_ANNOTATION) for d in deployments]

    assert restarted() == [None, None]   # a key made with its pool restarts nothing

    # Deleted by hand: made again once the operator asks again (no read permission needed).
    # The running pods read the old key when they started, pods started now would read the new
    # one, and gateway and workers would refuse each other: both Deployments roll onto it.
    del store.objects[secret]
    monkeypatch.setattr(kube, "CREATE_RECHECK_SECONDS", 0.0)
    reconcile_pool(again, kube_cluster, OperatorConfig())
    assert secret in store.objects
    stamps = restarted()
    assert all(stamps), stamps
    patches = [r for r in store.requests if r[0] == "PATCH" and r[1] in
               ["/" + d for d in deployments] and r[2].get("fieldManager") == [
                   api.RESTART_FIELD_MANAGER]]
    assert len(patches) == 2, store.requests[-6:]
    reconcile_pool(again, kube_cluster, OperatorConfig())  # present: the 409 is no failure
    assert restarted() == stamps   # and no second restart; the operator's apply leaves it


def test_pods_roll_onto_a_remade_control_key_even_after_a_restart_failed(
        server, kube_cluster, pool_body, monkeypatch):
    """The key was made first and the pods restarted after: when the gateway's restart failed
    (an API error), later passes found the key present and never restarted it, so the
    restarted workers (new key) and the gateway (old key) refused each other for good."""
    from radixpool.operator import kube

    store, _ = server
    monkeypatch.setattr(kube, "CREATE_RECHECK_SECONDS", 0.0)
    secret = "api/v1/namespaces/ml/secrets/llama-control-key-uidllama"
    gateway = "apis/apps/v1/namespaces/ml/deployments/llama-gateway"
    reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    del store.objects[secret]  # by hand
    store.forbid[gateway] = "the API server had trouble"
    assert reconcile_pool(pool_body(), kube_cluster, OperatorConfig()).failure
    del store.forbid[gateway]
    assert not reconcile_pool(pool_body(), kube_cluster, OperatorConfig()).failure
    assert secret in store.objects
    annotations = store.objects[gateway]["spec"]["template"]["metadata"].get("annotations") or {}
    assert api.RESTARTED_AT_ANNOTATION in annotations


WEBHOOK = "sidecar-injector.example.com"


def test_a_webhook_that_cannot_dry_run_lets_the_pool_be_made_and_says_so(
        server, kube_cluster, pool_body):
    """An admission webhook with `sideEffects: Unknown` makes the API server refuse every dry
    run of what it matches (400 "does not support dry run"). The operator read that as the
    spec's fault: Accepted=False, RejectedByAPIServer, and nothing was ever made. It cannot
    pre-check those objects, so it applies them without, and an Event says so."""
    store, _ = server
    for part in ("worker", "gateway"):
        store.no_dry_run[f"apis/apps/v1/namespaces/ml/deployments/llama-{part}"] = WEBHOOK
    outcome = reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    accepted = outcome.status["conditions"][0]
    assert (accepted["status"], accepted["reason"]) == ("True", "Valid"), accepted
    assert not outcome.failure
    for part in ("worker", "gateway"):
        assert f"apis/apps/v1/namespaces/ml/deployments/llama-{part}" in store.objects
    said = [e for e in outcome.events if e.reason == "AppliedWithoutDryRun"]
    assert len(said) == 1 and said[0].type == "Normal"
    assert f'Deployment llama-worker (admission webhook "{WEBHOOK}" does not support dry run)' \
        in said[0].message and "Deployment llama-gateway" in said[0].message
    # objects the webhook does not match are still dry-run before anything is written
    patches = [(path, query) for method, path, query, _ in store.requests if method == "PATCH"]
    first_write = next(i for i, (_, query) in enumerate(patches) if "dryRun" not in query)
    assert "/api/v1/namespaces/ml/services/llama-workers" in [
        path for path, query in patches[:first_write] if query.get("dryRun") == ["All"]]

    again = reconcile_pool({**pool_body(), "status": outcome.status}, kube_cluster,
                           OperatorConfig())
    assert again.events == []   # nothing changed, nothing dry-run: said once, not every pass


@pytest.mark.parametrize("code, message", [
    (422, 'Deployment.apps "llama-worker" is invalid: spec.template.spec.containers[0].env[0]'
          '.name: Invalid value: "1X"'),
    (400, f'admission webhook "{WEBHOOK}" denied the request: env 1X is not allowed'),
])
def test_a_webhook_that_cannot_dry_run_still_has_real_refusals_reported(
        server, kube_cluster, pool_body, code, message):
    store, _ = server
    path = "apis/apps/v1/namespaces/ml/deployments/llama-worker"
    store.no_dry_run[path] = WEBHOOK
    store.refuse[path], store.refuse_code[path] = message, code
    outcome = reconcile_pool(pool_body(engine={"env": [{"name": "1X", "value": "v"}]}),
                             kube_cluster, OperatorConfig())
    accepted = outcome.status["conditions"][0]
    assert (accepted["status"], accepted["reason"]) == ("False", "RejectedByAPIServer")
    assert message.rsplit(": ", 1)[1] in accepted["message"]
    assert path not in store.objects


def test_the_control_key_comes_back_where_a_webhook_refuses_dry_runs_of_secrets(
        server, kube_cluster, pool_body, monkeypatch):
    """With pods running, the operator asks every minute whether the pool's control key is
    missing by a dry-run create. A webhook matching Secrets that cannot dry-run refused it: the
    pool turned Degraded (APIError) a minute after it was made, for good. The key is now made
    without the dry run, and a key found missing that way still rolls the pods onto it, even
    when the first roll fails."""
    from radixpool.operator import kube

    store, _ = server
    monkeypatch.setattr(kube, "CREATE_RECHECK_SECONDS", 0.0)
    secret = "api/v1/namespaces/ml/secrets/llama-control-key-uidllama"
    gateway = "apis/apps/v1/namespaces/ml/deployments/llama-gateway"
    store.no_dry_run[secret] = WEBHOOK
    assert not reconcile_pool(pool_body(), kube_cluster, OperatorConfig()).failure
    steady = reconcile_pool(pool_body(), kube_cluster, OperatorConfig())
    assert not steady.failure, steady.failure
    assert not any(e.type == "Warning" for e in steady.events)

    del store.objects[secret]   # by hand; and the gateway's roll fails once
    store.forbid[gateway] = "the API server had trouble"
    assert reconcile_pool(pool_body(), kube_cluster, OperatorConfig()).failure
    assert secret in store.objects
    del store.forbid[gateway]
    assert not reconcile_pool(pool_body(), kube_cluster, OperatorConfig()).failure
    for part in ("worker", "gateway"):
        template = store.objects[f"apis/apps/v1/namespaces/ml/deployments/llama-{part}"][
            "spec"]["template"]
        assert api.RESTARTED_AT_ANNOTATION in (template["metadata"].get("annotations") or {})


@pytest.mark.parametrize("code, message", [
    (403, 'admission webhook "validation.gatekeeper.sh" denied the request: [no-env] env 1X is '
          'not allowed'),
    (403, 'deployments.apps "llama-worker" is forbidden: ValidatingAdmissionPolicy '
          "'no-env' with binding 'no-env-ml' denied request: env 1X is not allowed"),
])
def test_an_admission_policy_refusing_with_403_is_the_specs_fault_not_a_permission(
        server, kube_cluster, pool_body, code, message):
    """Gatekeeper's webhooks deny with 403, and a ValidatingAdmissionPolicy with reason
    Forbidden does too. The operator took that for a permission it lacked: Degraded (APIError),
    retried for good, with Accepted=True over a pool that was never made. It is the spec's
    refusal, as a 422 is: Accepted=False, RejectedByAPIServer, the policy's words, nothing
    written."""
    store, _ = server
    path = "apis/apps/v1/namespaces/ml/deployments/llama-worker"
    store.refuse[path], store.refuse_code[path] = message, code
    outcome = reconcile_pool(pool_body(engine={"env": [{"name": "1X", "value": "v"}]}),
                             kube_cluster, OperatorConfig())
    accepted = outcome.status["conditions"][0]
    assert (accepted["status"], accepted["reason"]) == ("False", "RejectedByAPIServer")
    assert "env 1X is not allowed" in accepted["message"]
    assert not outcome.failure
    assert path not in store.objects

