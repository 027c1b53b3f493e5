"""Reconciliation against an in-memory cluster: create, reject, heal, scale, report."""

from __future__ import annotations

from radixpool.operator import api
from radixpool.operator.desired import OperatorConfig
from radixpool.operator.reconcile import ApiFailure, reconcile_pool

CONFIG = OperatorConfig()
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def conditions(status) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def with_status(body, status):
    return {**body, "status": status}


def test_valid_pool_creates_everything_and_reports_it_is_not_ready_yet(cluster, pool_body):
    outcome = reconcile_pool(pool_body(), cluster, CONFIG, now=T0)
    # The RoleBinding is created although its Role did not exist before this pass: without the
    # `bind` verb the API server checks the Role, so it is never dry-run ahead of the Role.
    assert cluster.kinds() == ["Deployment", "Deployment", "PodDisruptionBudget",
                               "PodDisruptionBudget", "Role", "RoleBinding", "Secret", "Service",
                               "Service", "ServiceAccount"]
    status = outcome.status
    cond = conditions(status)
    assert cond["Accepted"]["status"] == "True"
    assert cond["WorkersReady"]["status"] == "False"
    assert cond["WorkersReady"]["message"].startswith("0/1 workers ready")
    assert status["ready"] == "0/1" and status["readyReplicas"] == 0
    assert status["selector"] == "app.kubernetes.io/component=worker,radixpool.io/pool=llama"
    assert status["endpoint"] == "http://llama-gateway.ml.svc:8080"
    assert status["observedGeneration"] == 1 and status["model"] == "llama"


def test_status_follows_what_the_deployments_report(cluster, pool_body):
    body = pool_body(replicas=2)
    reconcile_pool(body, cluster, CONFIG, now=T0)
    cluster.set_ready("ml", "llama-worker", 2)
    cluster.set_ready("ml", "llama-gateway", 1)  # of the 2 gateway replicas a pool has by default
    status = reconcile_pool(body, cluster, CONFIG, now=T1).status
    assert conditions(status)["GatewayReady"]["status"] == "False"
    cluster.set_ready("ml", "llama-gateway", 2)
    status = reconcile_pool(body, cluster, CONFIG, now=T1).status
    cond = conditions(status)
    assert [cond[k]["status"] for k in ("Accepted", "WorkersReady", "GatewayReady",
                                        "Progressing", "Degraded", "Ready")] == [
        "True", "True", "True", "False", "False", "True"]
    assert status["ready"] == "2/2" and status["gatewayReadyReplicas"] == 2


def test_invalid_pool_creates_nothing_and_warns_once(cluster, pool_body):
    body = pool_body(replicas=-3, gateway={"policy": "fastest"})
    outcome = reconcile_pool(body, cluster, CONFIG, now=T0)
    assert cluster.objects == {}
    accepted = conditions(outcome.status)["Accepted"]
    assert accepted["status"] == "False" and accepted["reason"] == "InvalidSpec"
    assert "spec.replicas" in accepted["message"] and "spec.gateway.policy" in accepted["message"]
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "InvalidSpec")]
    again = reconcile_pool(with_status(body, outcome.status), cluster, CONFIG, now=T1)
    assert again.events == []  # the periodic check does not repeat the Event
    assert conditions(again.status)["Accepted"]["lastTransitionTime"] == T0


def test_missing_secret_or_claim_blocks_creation_until_it_exists(cluster, pool_body):
    body = pool_body(apiKeySecret={"name": "api-key"}, model={"uri": "pvc://models/llama"})
    outcome = reconcile_pool(body, cluster, CONFIG, now=T0)
    assert cluster.objects == {}
    accepted = conditions(outcome.status)["Accepted"]
    assert accepted["reason"] == "MissingReference"
    assert "spec.apiKeySecret.name: Secret 'api-key' not found in namespace 'ml'" in (
        accepted["message"])
    assert "spec.model.uri: PersistentVolumeClaim 'models' not found" in accepted["message"]
    cluster.add("Secret", "ml", "api-key")
    cluster.add("PersistentVolumeClaim", "ml", "models")
    healed = reconcile_pool(with_status(body, outcome.status), cluster, CONFIG, now=T1)
    assert conditions(healed.status)["Accepted"]["status"] == "True"
    assert ("Normal", "Valid") in [(e.type, e.reason) for e in healed.events]
    assert cluster.stored("Deployment", "ml", "llama-worker") is not None


def test_bad_edit_of_a_running_pool_keeps_it_running_as_it_was(cluster, pool_body):
    reconcile_pool(pool_body(replicas=2), cluster, CONFIG, now=T0)
    cluster.set_ready("ml", "llama-worker", 2)
    outcome = reconcile_pool(pool_body(replicas=2, engine={"pageSize": 0}), cluster, CONFIG)
    assert cluster.stored("Deployment", "ml", "llama-worker")["spec"]["replicas"] == 2
    cond = conditions(outcome.status)
    assert cond["Accepted"]["status"] == "False"
    assert "spec.engine.pageSize" in cond["Accepted"]["message"]
    assert cond["WorkersReady"]["status"] == "True"  # still observed, still serving


def test_a_malformed_core_v1_item_is_a_status_not_an_exception(cluster, pool_body):
    """The schema passes env items through as written; one the operator's checks could not read
    raised TypeError: the pool got no status and the handler failed every minute."""
    body = pool_body(engine={"env": [{"name": "TOKEN", "valueFrom": "secretKeyRef"}]})
    outcome = reconcile_pool(body, cluster, CONFIG, now=T0)
    accepted = conditions(outcome.status)["Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("False", "InvalidSpec")
    assert "spec.engine.env[0].valueFrom" in accepted["message"]
    assert cluster.objects == {}


def test_objects_the_api_server_refuses_leave_nothing_half_made(cluster, pool_body):
    cluster.refuse["Deployment"] = (
        'Deployment.apps "llama-worker" is invalid: spec.template.spec.tolerations[0].operator: '
        'Unsupported value: "Sometimes"')
    body = pool_body(engine={"tolerations": [{"key": "gpu", "operator": "Sometimes"}]})
    outcome = reconcile_pool(body, cluster, CONFIG, now=T0)
    assert cluster.objects == {}  # the Services before it in the list were not written either
    accepted = conditions(outcome.status)["Accepted"]
    assert accepted["reason"] == "RejectedByAPIServer"
    assert "tolerations[0].operator" in accepted["message"]
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "RejectedByAPIServer")]


def test_drift_is_put_back(cluster, pool_body):
    body = pool_body(replicas=3)
    reconcile_pool(body, cluster, CONFIG)
    cluster.objects.pop(("Service", "ml", "llama-workers"))
    cluster.stored("Deployment", "ml", "llama-worker")["spec"]["replicas"] = 1
    cluster.stored("Role", "ml", "llama-gateway")["rules"] = []
    reconcile_pool(body, cluster, CONFIG)
    assert cluster.stored("Service", "ml", "llama-workers")["spec"]["clusterIP"] == "None"
    assert cluster.stored("Deployment", "ml", "llama-worker")["spec"]["replicas"] == 3
    assert cluster.stored("Role", "ml", "llama-gateway")["rules"][0]["resources"] == [
        "endpointslices"]


def test_scaling_and_rollout_show_as_progressing(cluster, pool_body):
    reconcile_pool(pool_body(replicas=2), cluster, CONFIG)
    cluster.set_ready("ml", "llama-worker", 2)
    scaled = reconcile_pool(pool_body(replicas=4, generation=2), cluster, CONFIG)
    assert cluster.stored("Deployment", "ml", "llama-worker")["spec"]["replicas"] == 4
    progressing = conditions(scaled.status)["Progressing"]
    assert progressing["status"] == "True" and progressing["observedGeneration"] == 2
    assert scaled.status["ready"] == "2/4"

    cluster.set_ready("ml", "llama-worker", 4)
    rolled = reconcile_pool(pool_body(replicas=4, generation=3,
                                      engine={"image": "example.com/worker:2"}), cluster, CONFIG)
    assert conditions(rolled.status)["Progressing"]["reason"] == "RollingOut"
    cluster.set_ready("ml", "llama-worker", 4)
    done = reconcile_pool(pool_body(replicas=4, generation=3,
                                    engine={"image": "example.com/worker:2"}), cluster, CONFIG)
    assert conditions(done.status)["Progressing"]["reason"] == "Complete"


def test_disabling_the_pdb_removes_it(cluster, pool_body):
    reconcile_pool(pool_body(), cluster, CONFIG)
    assert cluster.stored("PodDisruptionBudget", "ml", "llama-worker")
    reconcile_pool(pool_body(lifecycle={"podDisruptionBudget": {"enabled": False}}), cluster,
                   CONFIG)
    assert cluster.stored("PodDisruptionBudget", "ml", "llama-worker") is None


def test_service_monitor_only_where_its_crd_exists(pool_body, make_cluster):
    without, with_crd = make_cluster(), make_cluster(service_monitors=True)
    reconcile_pool(pool_body(), without, CONFIG)
    reconcile_pool(pool_body(), with_crd, CONFIG)
    assert "ServiceMonitor" not in without.kinds() and "ServiceMonitor" in with_crd.kinds()


def test_a_service_monitor_crd_removed_since_the_operator_looked_is_no_failure(
        pool_body, make_cluster):
    # prometheus-operator uninstalled: the operator's cached "the CRD is there" made every
    # pool Degraded (APIError, a 404) until it looked again, a minute later
    cluster = make_cluster(service_monitors=True)
    body = pool_body()
    first = reconcile_pool(body, cluster, CONFIG, now=T0)
    assert "ServiceMonitor" in cluster.kinds()
    cluster.remove_service_monitor_crd()
    again = reconcile_pool(with_status({**body, "spec": {**body["spec"], "replicas": 2}},
                                       first.status), cluster, CONFIG, now=T1)
    assert again.failure is None
    assert conditions(again.status)["Degraded"]["status"] == "False"
    assert cluster.stored("Deployment", "ml", "llama-worker")["spec"]["replicas"] == 2
    assert "ServiceMonitor" not in cluster.kinds()
    assert not [e for e in again.events if e.type == "Warning"]


def test_one_bad_pool_does_not_affect_another(cluster, pool_body):
    reconcile_pool(pool_body(name="bad", replicas=-1), cluster, CONFIG)
    good = reconcile_pool(pool_body(name="good"), cluster, CONFIG)
    assert conditions(good.status)["Accepted"]["status"] == "True"
    assert {name for _, _, name in cluster.objects} >= {"good-worker", "good-gateway"}
    assert not any(name.startswith("bad") for _, _, name in cluster.objects)


def test_steady_state_writes_nothing(cluster, pool_body):
    body = pool_body(replicas=2, engine={"env": [{"name": "A", "value": "1"}],
                                         "resources": {"cpu": "0.5"}})
    first = reconcile_pool(body, cluster, CONFIG, now=T0)
    assert len(cluster.writes) == 10  # 9 objects and the control-key Secret
    # The API server normalizes quantities ("0.5" → "500m"): still the same value.
    worker = cluster.stored("Deployment", "ml", "llama-worker")
    worker["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "500m"
    worker["metadata"]["resourceVersion"] = "42"  # and adds fields of its own
    cluster.writes.clear()
    again = reconcile_pool(with_status(body, first.status), cluster, CONFIG, now=T1)
    assert cluster.writes == [] and again.status == first.status and again.events == []


def test_a_volume_mounted_twice_is_not_applied_again_and_again(cluster, pool_body):
    """One volume at two paths (a ConfigMap's keys by subPath) was drift on every pass: its
    mounts were compared by their shared name, so each pass dry-ran and applied the worker
    Deployment again, for good."""
    body = pool_body(engine={"volumes": [{"name": "extra", "configMap": {"name": "extra"}}],
                             "volumeMounts": [
                                 {"name": "extra", "mountPath": "/etc/a", "subPath": "a"},
                                 {"name": "extra", "mountPath": "/etc/b", "subPath": "b"}]})
    first = reconcile_pool(body, cluster, CONFIG, now=T0)
    cluster.writes.clear()
    reconcile_pool(with_status(body, first.status), cluster, CONFIG, now=T1)
    assert cluster.writes == []


def test_a_changed_spec_rewrites_only_what_changed(cluster, pool_body):
    reconcile_pool(pool_body(replicas=2), cluster, CONFIG, now=T0)
    cluster.writes.clear()
    reconcile_pool(pool_body(replicas=5, generation=2), cluster, CONFIG, now=T1)
    assert cluster.writes == [("apply", "Deployment", "llama-worker")]


def test_an_env_var_added_by_hand_is_removed(cluster, pool_body):
    body = pool_body(engine={"env": [{"name": "MINE", "value": "1"}]})
    reconcile_pool(body, cluster, CONFIG)
    env = cluster.stored("Deployment", "ml", "llama-worker")["spec"]["template"]["spec"][
        "containers"][0]["env"]
    env.insert(2, {"name": "DEBUG", "value": "1"})
    env.append({"name": "HACK", "value": "x"})
    reconcile_pool(body, cluster, CONFIG)
    names = [e["name"] for e in cluster.stored("Deployment", "ml", "llama-worker")["spec"][
        "template"]["spec"]["containers"][0]["env"]]
    assert "DEBUG" not in names and "HACK" not in names and "MINE" in names


def test_api_errors_name_the_object_and_degrade_the_pool(cluster, pool_body):
    body = pool_body()
    cluster.fail["Deployment"] = ApiFailure(
        "apply", "Deployment", "ml", "llama-worker", 403, "Forbidden",
        'deployments.apps "llama-worker" is forbidden: User "system:serviceaccount:x:y" '
        'cannot patch resource "deployments"')
    outcome = reconcile_pool(body, cluster, CONFIG, now=T0, retry_in=30)
    assert "apply Deployment ml/llama-worker: 403 Forbidden" in outcome.failure
    cond = conditions(outcome.status)
    assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "APIError"
    assert "Deployment ml/llama-worker" in cond["Degraded"]["message"]
    assert "cannot patch resource" in cond["Degraded"]["message"]
    assert "next attempt in 30s" in cond["Degraded"]["message"]
    assert cond["Ready"]["status"] == "False" and cond["Ready"]["reason"] == "Degraded"
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "APIError")]

    # A retry that fails the same way says so in the status, without another Event.
    again = reconcile_pool(with_status(body, outcome.status), cluster, CONFIG, now=T1,
                           retry_in=60)
    assert again.events == [] and "next attempt in 60s" in conditions(again.status)[
        "Degraded"]["message"]
    del cluster.fail["Deployment"]
    healed = reconcile_pool(with_status(body, again.status), cluster, CONFIG, now=T1)
    assert healed.failure is None
    assert conditions(healed.status)["Degraded"]["status"] == "False"


def test_a_pool_is_accepted_where_the_operator_may_not_read_secrets(cluster, pool_body):
    cluster.secrets_readable = False
    outcome = reconcile_pool(pool_body(apiKeySecret={"name": "api-key"}), cluster, CONFIG)
    assert conditions(outcome.status)["Accepted"]["status"] == "True"
    assert cluster.stored("Deployment", "ml", "llama-worker") is not None


def test_refusals_name_the_spec_field_not_the_generated_path(cluster, pool_body):
    cluster.refuse["Deployment"] = (
        'Deployment.apps "llama-worker" is invalid: spec.template.spec.containers[0].env[7].name:'
        ' Invalid value: "1BAD": a valid environment variable name must consist of letters')
    body = pool_body(engine={"env": [{"name": "1BAD", "value": "v"}]})
    outcome = reconcile_pool(body, cluster, CONFIG, now=T0)
    message = conditions(outcome.status)["Accepted"]["message"]
    assert "spec.engine.env[0].name (spec.template.spec.containers[0].env[7].name)" in message


def test_ready_names_the_first_thing_missing(cluster, pool_body):
    body = pool_body(replicas=2)
    status = reconcile_pool(body, cluster, CONFIG, now=T0).status
    ready = conditions(status)["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "WorkersNotReady"
    invalid = reconcile_pool(pool_body(replicas=-1), cluster, CONFIG, now=T0).status
    assert conditions(invalid)["Ready"]["reason"] == "NotAccepted"


def test_the_control_key_is_made_once_and_reaches_workers_and_gateway_by_reference(
        cluster, pool_body):
    body = pool_body(apiKeySecret={"name": "client-key"})
    cluster.add("Secret", "ml", "client-key")
    # A Secret someone made before the pool, under the name a pool's key had (the operator
    # cannot read Secrets by default): it was taken for the pool's key, known to its maker
    cluster.add("Secret", "ml", "llama-control-key")
    reconcile_pool(body, cluster, CONFIG)
    name = "llama-control-key-uidllama"   # from the pool's UID, unknown before the pool exists
    secret = cluster.stored("Secret", "ml", name)
    key = secret["stringData"]["key"]
    assert len(key) >= 32 and secret["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    reconcile_pool(body, cluster, CONFIG)
    assert cluster.stored("Secret", "ml", name)["stringData"]["key"] == key

    def env(deployment: str) -> dict:
        container = cluster.stored("Deployment", "ml", deployment)["spec"]["template"]["spec"][
            "containers"][0]
        assert not any("key" in arg.lower() for arg in container["args"])  # never in argv
        return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
                if "valueFrom" in e}

    control = {"name": name, "key": "key"}
    client = {"name": "client-key", "key": "api-key"}
    assert env("llama-worker") == {"RADIXPOOL_API_KEY": client,
                                   "RADIXPOOL_CONTROL_API_KEY": control}
    assert env("llama-gateway") == {"RADIXPOOL_API_KEY": client,
                                    "RADIXPOOL_WORKER_API_KEY": control}


def test_pods_of_an_older_operator_roll_onto_the_renamed_control_key_once(cluster, pool_body):
    # An operator that named the key `<pool>-control-key` made this pool: upgraded, the new one
    # makes the key under its new name, and the Deployments' env change rolls the pods onto it.
    # A restart on top of that made a second template change, and a ReplicaSet whose pods were
    # started only to be replaced.
    reconcile_pool(pool_body(), cluster, CONFIG)
    name = "llama-control-key-uidllama"
    del cluster.objects[("Secret", "ml", name)]
    cluster.add("Secret", "ml", "llama-control-key")
    for deployment in ("llama-worker", "llama-gateway"):
        for env in cluster.stored("Deployment", "ml", deployment)["spec"]["template"]["spec"][
                "containers"][0]["env"]:
            if "valueFrom" in env and env["valueFrom"]["secretKeyRef"]["name"] == name:
                env["valueFrom"]["secretKeyRef"]["name"] = "llama-control-key"
    cluster.writes.clear()
    reconcile_pool(pool_body(), cluster, CONFIG)
    assert ("create", "Secret", name) in cluster.writes
    assert not [w for w in cluster.writes if w[0] == "restart"], cluster.writes
    for deployment in ("llama-worker", "llama-gateway"):
        stored = cluster.stored("Deployment", "ml", deployment)["spec"]["template"]
        assert {env["valueFrom"]["secretKeyRef"]["name"] for env in stored["spec"][
            "containers"][0]["env"] if "secretKeyRef" in env.get("valueFrom", {})} == {name}
        assert api.RESTARTED_AT_ANNOTATION not in (stored["metadata"].get("annotations") or {})


def test_a_refused_pool_gets_no_control_key(cluster, pool_body):
    cluster.refuse["Deployment"] = "spec.template.spec.tolerations[0].operator: Unsupported"
    reconcile_pool(pool_body(engine={"tolerations": [{"key": "k", "operator": "X"}]}), cluster,
                   CONFIG)
    assert cluster.objects == {}


def test_an_object_of_the_same_name_it_does_not_own_is_left_alone(cluster, pool_body):
    theirs = {"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "llama-gateway", "namespace": "ml",
                           "labels": {"app": "billing"}},
              "spec": {"selector": {"app": "billing"}, "ports": [{"port": 80}]}}
    cluster.add("Service", "ml", "llama-gateway", theirs)
    outcome = reconcile_pool(pool_body(), cluster, CONFIG, now=T0)
    assert cluster.stored("Service", "ml", "llama-gateway") == theirs  # not taken over
    assert cluster.writes == []  # and nothing else half-made
    accepted = conditions(outcome.status)["Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("False", "NameConflict")
    assert "Service ml/llama-gateway" in accepted["message"]
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "NameConflict")]

    cluster.objects.pop(("Service", "ml", "llama-gateway"))  # its owner renames it
    outcome = reconcile_pool(with_status(pool_body(), outcome.status), cluster, CONFIG, now=T1)
    assert conditions(outcome.status)["Accepted"]["status"] == "True"
    assert cluster.stored("Service", "ml", "llama-gateway")["spec"]["selector"] == {
        "radixpool.io/pool": "llama", "app.kubernetes.io/component": "gateway"}


def test_a_pdb_it_does_not_own_survives_turning_the_pools_off(cluster, pool_body):
    mine = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "llama-worker", "namespace": "ml"},
            "spec": {"minAvailable": 1}}
    cluster.add("PodDisruptionBudget", "ml", "llama-worker", mine)
    outcome = reconcile_pool(pool_body(lifecycle={"podDisruptionBudget": {"enabled": False}}),
                             cluster, CONFIG)
    assert conditions(outcome.status)["Accepted"]["status"] == "True"
    assert cluster.stored("PodDisruptionBudget", "ml", "llama-worker") == mine
    assert ("delete", "PodDisruptionBudget", "llama-worker") not in cluster.writes


def test_a_pool_made_again_waits_for_garbage_collection_of_its_predecessors_objects(
        cluster, pool_body):
    reconcile_pool(pool_body(), cluster, CONFIG)
    again = pool_body()
    again["metadata"]["uid"] = "uid-llama-2"  # deleted and made again before GC cleared up
    cluster.writes.clear()
    outcome = reconcile_pool(again, cluster, CONFIG, now=T0)
    assert cluster.writes == []  # nothing taken over: that needs delete permission on them
    cond = conditions(outcome.status)
    assert cond["Accepted"]["status"] == "True" and cond["Degraded"]["status"] == "False"
    assert cond["WorkersReady"]["reason"] == "NotCreated"
    assert [e.type for e in outcome.events] == ["Normal"]

    cluster.objects.clear()  # garbage collection
    reconcile_pool(again, cluster, CONFIG, now=T1)
    for kind, name in (("Deployment", "llama-worker"), ("Service", "llama-workers"),
                       ("Secret", "llama-control-key-uidllama2")):
        owner = cluster.stored(kind, "ml", name)["metadata"]["ownerReferences"][0]
        assert owner["uid"] == "uid-llama-2"


def test_an_object_whose_owner_reference_was_removed_by_hand_is_healed(cluster, pool_body):
    reconcile_pool(pool_body(), cluster, CONFIG)
    cluster.stored("Service", "ml", "llama-workers")["metadata"].pop("ownerReferences")
    outcome = reconcile_pool(pool_body(), cluster, CONFIG)
    assert conditions(outcome.status)["Accepted"]["status"] == "True"
    owner = cluster.stored("Service", "ml", "llama-workers")["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-llama"


def test_what_the_pool_stops_setting_is_removed_from_its_objects(pool_body, make_cluster):
    cluster = make_cluster(service_monitors=True)
    before = pool_body(engine={"nodeSelector": {"gpu": "a100"}, "resources": {"gpus": 1}},
                       gateway={"service": {"annotations": {"lb": "internal"}}})
    reconcile_pool(before, cluster, CONFIG, now=T0)
    after = pool_body(generation=2, engine={"resources": {"gpus": 0}},
                      monitoring={"serviceMonitor": {"enabled": False}})
    reconcile_pool(after, cluster, CONFIG, now=T1)
    pod = cluster.stored("Deployment", "ml", "llama-worker")["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
    service = cluster.stored("Service", "ml", "llama-gateway")["metadata"]
    assert "lb" not in service.get("annotations", {})
    # its own ServiceMonitor gone, the fleet-wide one must scrape the pool again
    assert "radixpool.io/own-service-monitor" not in service["labels"]
    cluster.writes.clear()
    reconcile_pool(after, cluster, CONFIG, now=T1)
    assert cluster.writes == []  # and then nothing more to do


def test_running_pools_give_up_their_uid_once_the_operator_is_told_to(cluster, pool_body):
    """An operator moved to `--no-set-pod-uid` (the chart's openshift.enabled) takes runAsUser,
    runAsGroup and fsGroup out of the pools it already made, which otherwise kept asking for
    uid 1000 on a platform that refuses it."""
    import dataclasses

    reconcile_pool(pool_body(), cluster, CONFIG, now=T0)
    platform = dataclasses.replace(CONFIG, set_pod_uid=False)
    assert reconcile_pool(pool_body(), cluster, platform, now=T1).failure is None
    for name in ("llama-worker", "llama-gateway"):
        pod = cluster.stored("Deployment", "ml", name)["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"runAsNonRoot": True,
                                          "seccompProfile": {"type": "RuntimeDefault"}}, name
    cluster.writes.clear()
    reconcile_pool(pool_body(), cluster, platform, now=T1)
    assert cluster.writes == []
