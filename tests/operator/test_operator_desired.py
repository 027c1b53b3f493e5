"""spec → desired objects: the right objects with the right fields, all valid Kubernetes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from radixpool.operator import api
from radixpool.operator.desired import OperatorConfig, desired_objects, obsolete_objects
from radixpool.operator.spec import parse_pool

CONFIG = OperatorConfig(worker_image="example.com/worker:1", gateway_image="example.com/ctl:1")
FULL = next(doc for doc in yaml.safe_load_all(
    (Path(__file__).resolve().parents[2] / "examples/inferencepool-full.yaml").read_text())
    if doc["kind"] == api.KIND)


def objects_of(body, service_monitors: bool = False) -> dict[str, dict]:
    objs = desired_objects(parse_pool(body), CONFIG, service_monitors=service_monitors)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def full_body(pool_body):
    body = pool_body(name=FULL["metadata"]["name"])
    body["spec"] = FULL["spec"]
    return body


def worker_container(objs: dict, name: str = "llama") -> dict:
    return objs[f"Deployment/{name}-worker"]["spec"]["template"]["spec"]["containers"][0]


def test_default_pool_owns_exactly_the_documented_objects(pool_body):
    assert sorted(objects_of(pool_body())) == [
        "Deployment/llama-gateway", "Deployment/llama-worker",
        "PodDisruptionBudget/llama-worker", "Role/llama-gateway", "RoleBinding/llama-gateway",
        "Service/llama-gateway", "Service/llama-workers", "ServiceAccount/llama-gateway",
    ]
    assert "ServiceMonitor/llama" in objects_of(pool_body(), service_monitors=True)


@pytest.mark.parametrize("variant", ["default", "full", "hf", "cpu-no-pdb"])
def test_every_object_is_valid_against_the_official_schemas(pool_body, assert_k8s_valid,
                                                             variant):
    body = {"default": pool_body(), "full": full_body(pool_body),
            "hf": pool_body(model={"uri": "hf://Qwen/Qwen3-8B@main", "hfTokenSecret": {
                "name": "hf"}}),
            "cpu-no-pdb": pool_body(engine={"resources": {"gpus": 0}, "device": "cpu"},
                                    lifecycle={"podDisruptionBudget": {"enabled": False}})}[variant]
    for obj in desired_objects(parse_pool(body), CONFIG, service_monitors=True):
        if obj["kind"] != "ServiceMonitor":
            assert_k8s_valid(obj)


def test_everything_is_labelled_and_owned_by_the_pool(pool_body):
    for key, obj in objects_of(pool_body(), service_monitors=True).items():
        labels = obj["metadata"]["labels"]
        assert labels[api.POOL_LABEL] == "llama", key
        assert labels["app.kubernetes.io/instance"] == "llama", key
        assert labels["app.kubernetes.io/managed-by"] == "radixpool-operator", key
        assert obj["metadata"]["namespace"] == "ml", key
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "radixpool.io/v1alpha1", "kind": "InferencePool", "name": "llama",
            "uid": "uid-llama", "controller": True, "blockOwnerDeletion": True}], key


def test_worker_pod_is_hardened_probed_and_drains(pool_body):
    objs = objects_of(pool_body(lifecycle={"drainTimeoutSeconds": 90,
                                           "startupTimeoutSeconds": 1200}))
    pod = objs["Deployment/llama-worker"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/home/radixpool/.cache", "/dev/shm"} <= mounted
    for env in container["env"]:  # every cache directory is on a writable volume
        if env["name"].endswith(("_HOME", "_DIR", "_PATH")) and env["name"] != "HOME":
            assert any(env["value"].startswith(path) for path in mounted), env
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    assert "tcpSocket" in container["livenessProbe"]  # a busy worker is never killed
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > 90
    assert container["args"][container["args"].index("--drain-timeout") + 1] == "90"
    assert pod["automountServiceAccountToken"] is False


def test_resource_quantities_are_strings(pool_body):
    container = worker_container(objects_of(pool_body(engine={"resources": {
        "gpus": 2, "cpu": 8, "memory": "64Gi", "gpuResourceName": "amd.com/gpu"}})))
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "amd.com/gpu": "2"},
        "limits": {"memory": "64Gi", "amd.com/gpu": "2"}}
    cpu_only = worker_container(objects_of(pool_body(engine={"resources": {"gpus": 0}})))
    assert "nvidia.com/gpu" not in cpu_only["resources"]["limits"]


def test_full_spec_reaches_the_worker_and_gateway_command_lines(pool_body):
    objs = objects_of(full_body(pool_body))
    args = worker_container(objs, "llama-8b")["args"]
    for flag, value in [("--model", "/models/llama-3.1-8b-instruct"),
                        ("--served-model-name", "meta-llama/Llama-3.1-8B-Instruct"),
                        ("--kv-cache-tokens", "400000"), ("--page-size", "16"),
                        ("--max-running-requests", "256"), ("--chunked-prefill-size", "8192"),
                        ("--schedule-policy", "lpm"), ("--device", "cuda"),
                        ("--dtype", "bfloat16"), ("--port", "8000")]:
        assert args[args.index(flag) + 1] == value, flag
    assert args[0] == "worker" and "--mem-fraction" not in args
    pod = objs["Deployment/llama-8b-worker"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == FULL["spec"]["engine"]["nodeSelector"]
    assert pod["tolerations"] == FULL["spec"]["engine"]["tolerations"]
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    gateway = objs["Deployment/llama-8b-gateway"]["spec"]["template"]["spec"]
    gw_args = gateway["containers"][0]["args"]
    for flag, value in [("--k8s-service", "llama-8b-workers"), ("--namespace", "ml"),
                        ("--policy", "cache_aware"), ("--cache-threshold", "0.5"),
                        ("--balance-abs-threshold", "32"), ("--balance-rel-threshold", "1.25")]:
        assert gw_args[gw_args.index(flag) + 1] == value, flag
    assert gateway["serviceAccountName"] == "llama-8b-gateway"
    service = objs["Service/llama-8b-gateway"]["spec"]
    assert service["type"] == "LoadBalancer" and service["ports"][0]["port"] == 80
    assert objs["Deployment/llama-8b-gateway"]["spec"]["replicas"] == 2


def test_api_key_comes_from_the_secret_never_inline(pool_body):
    objs = objects_of(pool_body(apiKeySecret={"name": "key", "key": "token"}))
    for deployment in ("llama-worker", "llama-gateway"):
        container = objs[f"Deployment/{deployment}"]["spec"]["template"]["spec"]["containers"][0]
        key = next(e for e in container["env"] if e["name"] == "RADIXPOOL_API_KEY")
        assert key["valueFrom"] == {"secretKeyRef": {"name": "key", "key": "token"}}
        assert "--api-key" not in container["args"] or (
            container["args"][container["args"].index("--api-key") + 1] == "$(RADIXPOOL_API_KEY)")
    worker = objs["Deployment/llama-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert "--api-key" not in worker["args"]  # the worker reads $RADIXPOOL_API_KEY itself


def test_hf_model_is_downloaded_by_an_init_container_into_the_cache_volume(pool_body):
    objs = objects_of(pool_body(model={"uri": "hf://Qwen/Qwen3-8B@v1", "cacheSize": "40Gi"}))
    pod = objs["Deployment/llama-worker"]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["command"][-3:] == ["Qwen/Qwen3-8B", "v1", "/models/Qwen/Qwen3-8B"]
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}} in pod["volumes"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/Qwen/Qwen3-8B"
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_gateway_may_watch_endpointslices_and_nothing_else(pool_body):
    objs = objects_of(pool_body())
    assert objs["Role/llama-gateway"]["rules"] == [{
        "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"]}]
    binding = objs["RoleBinding/llama-gateway"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-gateway",
                                    "namespace": "ml"}]
    assert binding["roleRef"]["name"] == "llama-gateway"
    workers = objs["Service/llama-workers"]["spec"]
    assert workers["clusterIP"] == "None"
    assert workers["selector"] == {api.POOL_LABEL: "llama", api.COMPONENT_LABEL: "worker"}


def test_scale_and_rollout_changes_touch_only_what_they_should(pool_body):
    before = objects_of(pool_body())
    scaled = objects_of(pool_body(replicas=5))
    assert scaled["Deployment/llama-worker"]["spec"]["replicas"] == 5
    before["Deployment/llama-worker"]["spec"]["replicas"] = 5
    assert scaled == before  # nothing else changes when scaling

    new_image = objects_of(pool_body(engine={"image": "example.com/worker:2"},
                                     lifecycle={"maxSurge": "50%", "maxUnavailable": 1}))
    deployment = new_image["Deployment/llama-worker"]["spec"]
    assert deployment["template"]["spec"]["containers"][0]["image"] == "example.com/worker:2"
    assert deployment["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": "50%", "maxUnavailable": 1}}
    assert deployment["selector"] == before["Deployment/llama-worker"]["spec"]["selector"]


def test_service_monitor_scrapes_the_named_http_port_of_both_services(pool_body):
    objs = objects_of(pool_body(), service_monitors=True)
    monitor = objs["ServiceMonitor/llama"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics",
                                             "interval": "15s"}]
    selected = monitor["spec"]["selector"]["matchLabels"]
    components = monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    for key in ("Service/llama-workers", "Service/llama-gateway"):
        service = objs[key]
        assert selected.items() <= service["metadata"]["labels"].items()
        assert service["metadata"]["labels"][api.COMPONENT_LABEL] in components
        assert service["spec"]["ports"][0]["name"] == "http"
    off = pool_body(monitoring={"serviceMonitor": {"enabled": False}})
    assert "ServiceMonitor/llama" not in objects_of(off, service_monitors=True)
    assert [r.kind for r in obsolete_objects(parse_pool(off), service_monitors=True)] == [
        "ServiceMonitor"]
