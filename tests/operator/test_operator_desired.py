"""spec → desired objects: the right objects with the right fields, all valid Kubernetes."""

from __future__ import annotations

import dataclasses
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
        "PodDisruptionBudget/llama-gateway", "PodDisruptionBudget/llama-worker",
        "Role/llama-gateway", "RoleBinding/llama-gateway",
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
    # past the worker's own deadline (1200 s from when it begins to load), so an overrun ends
    # with the worker's words, not the kubelet's kill mid-load
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200 + 60
    # Liveness asks whether the engine core is alive (/livez), not whether the socket accepts.
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > 90
    assert container["args"][container["args"].index("--drain-timeout") + 1] == "90"
    # the worker's own deadline for loading is the startup probe's budget, not its 900 s default
    assert container["args"][container["args"].index("--startup-timeout") + 1] == "1200"
    assert pod["automountServiceAccountToken"] is False


def test_resource_quantities_are_strings(pool_body):
    container = worker_container(objects_of(pool_body(engine={"resources": {
        "gpus": 2, "cpu": 8, "memory": "64Gi", "gpuResourceName": "amd.com/gpu"}})))
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "amd.com/gpu": "2"},
        "limits": {"memory": "64Gi", "amd.com/gpu": "2"}}
    cpu_only = worker_container(objects_of(pool_body(engine={"resources": {"gpus": 0}})))
    assert "nvidia.com/gpu" not in cpu_only["resources"]["limits"]


@pytest.mark.parametrize(("cpu", "stored"), [("0.5m", "1m"), ("100u", "1m"), ("0.0001", "1m"),
                                             ("1.0005", "1001m"), ("7500m", "7500m"),
                                             ("0.5", "0.5"), (4, "4")])
def test_cpu_finer_than_a_millicore_is_written_as_the_server_stores_it(pool_body, cpu, stored):
    """The API server rounds a CPU request up to a millicore: written as the spec says it, the
    stored Deployment never held it, and every pass applied both Deployments again."""
    objs = objects_of(pool_body(engine={"resources": {"cpu": cpu}}, gateway={
        "resources": {"cpu": cpu, "memory": "1Gi"}}))
    assert worker_container(objs)["resources"]["requests"]["cpu"] == stored
    gateway = objs["Deployment/llama-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["resources"]["requests"]["cpu"] == stored


def test_the_names_a_pool_may_not_set_are_those_the_operator_sets(pool_body):
    """`api.RESERVED_ENV` / `RESERVED_MOUNT_PATHS` (what `spec` refuses in engine.env and
    engine.volumeMounts) must follow what the worker container really gets."""
    container = worker_container(objects_of(pool_body(model={"uri": "pvc://claim/m"},
                                                      apiKeySecret={"name": "k"})))
    assert {e["name"] for e in container["env"]} == api.RESERVED_ENV
    assert {m["mountPath"] for m in container["volumeMounts"]} <= api.RESERVED_MOUNT_PATHS


def test_a_rollout_counts_as_stuck_only_after_the_models_startup_budget_and_is_never_paused(
        pool_body):
    """The gateway's pods are ready once a worker is: with the default 600 s deadline a model
    that takes longer to load marked the pool Degraded. A hand-paused Deployment hung a rollout
    without a word: the operator sets `paused: false`, so drift takes it back."""
    objs = objects_of(pool_body(lifecycle={"startupTimeoutSeconds": 3600}))
    for name in ("llama-worker", "llama-gateway"):
        spec = objs[f"Deployment/{name}"]["spec"]
        assert spec["progressDeadlineSeconds"] == 3900 and spec["paused"] is False, name


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
        assert "--api-key" not in container["args"]  # read from the environment, never argv


def test_hf_model_is_downloaded_by_an_init_container_into_the_cache_volume(pool_body):
    objs = objects_of(pool_body(model={"uri": "hf://Qwen/Qwen3-8B@v1", "cacheSize": "40Gi"}))
    pod = objs["Deployment/llama-worker"]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["command"][3:6] == ["Qwen/Qwen3-8B", "v1", "/models/Qwen/Qwen3-8B"]
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}} in pod["volumes"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/Qwen/Qwen3-8B"
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_hf_download_fetches_what_the_worker_reads_and_not_the_other_weight_formats(
        pool_body, monkeypatch):
    """The init container downloaded the whole repo: for meta-llama/Llama-3.1-8B-Instruct that
    is the 16 GB of safetensors plus the same weights again as `original/*.pth`."""
    import sys
    import types

    from huggingface_hub.utils import filter_repo_objects

    objs = objects_of(pool_body(model={"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}))
    init = objs["Deployment/llama-worker"]["spec"]["template"]["spec"]["initContainers"][0]
    python, flag, script, *argv = init["command"]
    assert (python, flag) == ("python", "-c")
    calls = []
    hub = types.ModuleType("huggingface_hub")
    hub.snapshot_download = lambda repo, **kw: calls.append((repo, kw))
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setattr(sys, "argv", ["-c", *argv])
    exec(script, {})
    [(repo, kwargs)] = calls
    assert repo == "meta-llama/Llama-3.1-8B-Instruct" and kwargs["revision"] is None
    assert kwargs["local_dir"] == "/models/meta-llama/Llama-3.1-8B-Instruct"
    files = ["config.json", "generation_config.json", "model-00001-of-00004.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "LICENSE", "README.md", "USE_POLICY.md",
             "original/consolidated.00.pth", "original/params.json",
             "original/tokenizer.model", "pytorch_model-00001-of-00004.bin",
             "consolidated.safetensors"]   # Mistral's repos: the weights under its own names
    kept = set(filter_repo_objects(files, allow_patterns=kwargs.get("allow_patterns"),
                                   ignore_patterns=kwargs.get("ignore_patterns")))
    assert {"config.json", "generation_config.json", "model-00001-of-00004.safetensors",
            "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= kept
    assert not {f for f in kept if f.startswith(("original/", "consolidated"))
                or f.endswith((".pth", ".bin"))}
    # tokenizers that ship as sentencepiece or BPE files at the top level still come
    assert set(filter_repo_objects(["tokenizer.model", "vocab.json", "merges.txt",
                                    "chat_template.jinja"],
                                   ignore_patterns=kwargs.get("ignore_patterns"))) == {
        "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja"}


def test_gateway_may_watch_endpointslices_and_nothing_else(pool_body):
    objs = objects_of(pool_body())
    assert objs["Role/llama-gateway"]["rules"] == [{
        "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
        "verbs": ["list", "watch"]}]
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
    assert [r.kind for r in obsolete_objects(parse_pool(off), CONFIG, service_monitors=True)] == [
        "NetworkPolicy", "ServiceMonitor"]



def test_a_pools_service_monitor_carries_the_labels_its_prometheus_selects_by(pool_body):
    """A Prometheus picks ServiceMonitors by label (kube-prometheus-stack: `release=<name>`
    only); one the pool cannot label is never scraped, and the chart's fleet-wide monitor skips
    that pool's Services: its dashboards stay empty."""
    body = pool_body(monitoring={"serviceMonitor": {"labels": {"release": "kube-prom"}}})
    monitor = objects_of(body, service_monitors=True)["ServiceMonitor/llama"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prom"
    assert api.pool_labels("llama", "monitoring").items() <= monitor["metadata"]["labels"].items()
    plain = objects_of(pool_body(), service_monitors=True)["ServiceMonitor/llama"]
    assert plain["metadata"]["labels"] == api.pool_labels("llama", "monitoring")

@pytest.mark.parametrize("drain", [0, 30, 120, 900])
def test_gateway_liveness_does_not_depend_on_workers_and_its_drain_is_whole(pool_body, drain):
    """A stream a stopping worker would finish is not cut by a stopping gateway either: a
    gateway rollout lets streams run as long as a worker rollout does."""
    objs = objects_of(pool_body(lifecycle={"drainTimeoutSeconds": drain}))
    pod = objs["Deployment/llama-gateway"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 with no worker
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    args = container["args"]
    gateway_drain = float(args[args.index("--drain-timeout") + 1])
    assert gateway_drain >= drain
    # The grace period covers the preStop wait and then the gateway's whole drain after SIGTERM.
    assert pod["terminationGracePeriodSeconds"] - pre_stop > gateway_drain


def test_a_pool_runs_two_gateways_by_default_and_a_drain_leaves_one_serving(pool_body):
    objs = objects_of(pool_body())
    deployment = objs["Deployment/llama-gateway"]["spec"]
    assert deployment["replicas"] == 2
    assert objs["PodDisruptionBudget/llama-gateway"]["spec"]["maxUnavailable"] == 1
    # on different nodes where possible, so a node's loss or drain leaves one serving
    [spread] = deployment["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"] == deployment["selector"]["matchLabels"]
    assert objects_of(pool_body(gateway={"replicas": 1}))["Deployment/llama-gateway"]["spec"][
        "replicas"] == 1


def test_gateway_pdb_lets_one_gateway_pod_go_at_a_time(pool_body):
    objs = objects_of(pool_body(gateway={"replicas": 3}))
    pdb = objs["PodDisruptionBudget/llama-gateway"]
    assert pdb["spec"] == {"maxUnavailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                           "selector": {"matchLabels": {
                               api.POOL_LABEL: "llama", api.COMPONENT_LABEL: "gateway"}}}
    off = pool_body(lifecycle={"podDisruptionBudget": {"enabled": False}})
    assert not [key for key in objects_of(off) if key.startswith("PodDisruptionBudget")]
    assert {r.name for r in obsolete_objects(parse_pool(off), CONFIG, service_monitors=False)
            if r.kind == "PodDisruptionBudget"} == {"llama-worker", "llama-gateway"}


@pytest.mark.parametrize("replicas", [0, 1, 3])
def test_a_node_drain_is_never_held_up_by_pods_that_serve_nothing(pool_body, replicas):
    """A gateway is not ready while no worker is (a pool scaled to 0, a model loading, workers
    crash-looping), nor is a worker that is loading or broken. Under the default policy
    (IfHealthyBudget) a budget with no ready pod refuses to evict even those, so `kubectl
    drain` waited forever on the node of a scaled-to-zero pool's gateway. Ready pods stay
    guarded by maxUnavailable."""
    objs = objects_of(pool_body(replicas=replicas))
    for name in ("llama-worker", "llama-gateway"):
        spec = objs[f"PodDisruptionBudget/{name}"]["spec"]
        assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow", name
        assert spec["maxUnavailable"] == 1


def test_network_policy_lets_only_the_gateway_and_prometheus_reach_workers(pool_body,
                                                                          assert_k8s_valid):
    assert not any(k.startswith("NetworkPolicy") for k in objects_of(pool_body()))
    config = dataclasses.replace(CONFIG, network_policy=True)
    objs = {f"{o['kind']}/{o['metadata']['name']}": o
            for o in desired_objects(parse_pool(pool_body()), config, service_monitors=False)}
    policy = objs["NetworkPolicy/llama-worker"]
    assert_k8s_valid(policy)
    worker_pod_labels = objs["Deployment/llama-worker"]["spec"]["template"]["metadata"]["labels"]
    gateway_pod_labels = objs["Deployment/llama-gateway"]["spec"]["template"]["metadata"][
        "labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= worker_pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    gateway_rule, prometheus_rule = policy["spec"]["ingress"]
    assert gateway_rule["from"][0]["podSelector"]["matchLabels"].items() <= (
        gateway_pod_labels.items())
    assert "namespaceSelector" not in gateway_rule["from"][0]  # this namespace's gateway only
    assert prometheus_rule["from"] == [{"namespaceSelector": {}, "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert gateway_rule["ports"] == prometheus_rule["ports"] == [
        {"port": api.WORKER_PORT, "protocol": "TCP"}]
    assert obsolete_objects(parse_pool(pool_body()), config, service_monitors=False) == []


def test_network_policy_and_prometheus_peer_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RADIXPOOL_NETWORK_POLICY", "true")
    monkeypatch.setenv("RADIXPOOL_PROMETHEUS_PEER",
                       '{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}')
    config = OperatorConfig.from_env()
    assert config.network_policy is True
    assert config.prometheus_peer == {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}


@pytest.mark.parametrize("peer", ["not json", "[]", '"prometheus"'])
def test_a_prometheus_peer_that_is_no_peer_is_refused_at_start(monkeypatch, peer):
    monkeypatch.setenv("RADIXPOOL_PROMETHEUS_PEER", peer)
    with pytest.raises(ValueError, match="RADIXPOOL_PROMETHEUS_PEER"):
        OperatorConfig.from_env()


def test_services_of_a_pool_with_its_own_service_monitor_say_so(pool_body):
    own = objects_of(pool_body(), service_monitors=True)
    assert own["Service/llama-workers"]["metadata"]["labels"][api.OWN_MONITOR_LABEL] == "true"
    assert own["Service/llama-gateway"]["metadata"]["labels"][api.OWN_MONITOR_LABEL] == "true"
    without_crd = objects_of(pool_body(), service_monitors=False)
    assert api.OWN_MONITOR_LABEL not in without_crd["Service/llama-workers"]["metadata"]["labels"]


def pod_specs(config: OperatorConfig, body) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"]
            for o in desired_objects(parse_pool(body), config, service_monitors=False)
            if o["kind"] == "Deployment"}


@pytest.mark.parametrize("model", ["/models/llama", "hf://Qwen/Qwen3-8B", "pvc://models/llama"])
def test_pods_take_their_uid_from_the_platform_where_it_assigns_them(pool_body, assert_k8s_valid,
                                                                     restricted_v2, model):
    """OpenShift's restricted-v2 SCC gives each namespace a uid range and refuses a pod asking
    for a uid or fsGroup outside it: every pool's pods asked for 1000, so none started there.
    With `--no-set-pod-uid` they ask for none, and keep everything else that hardens them."""
    body = pool_body(model={"uri": model} if "://" in model else {"path": model})
    fixed = pod_specs(CONFIG, body)
    for pod in fixed.values():
        assert {pod["securityContext"][key] for key in ("runAsUser", "runAsGroup",
                                                        "fsGroup")} == {1000}
        assert restricted_v2(pod)   # vanilla Kubernetes: as before, and refused there
    config = dataclasses.replace(CONFIG, set_pod_uid=False)
    for obj in desired_objects(parse_pool(body), config, service_monitors=False):
        assert_k8s_valid(obj)
    for name, pod in pod_specs(config, body).items():
        assert restricted_v2(pod) == [], name
        assert pod["securityContext"] == {"runAsNonRoot": True,
                                          "seccompProfile": {"type": "RuntimeDefault"}}
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}, name
        assert pod == {**fixed[name], "securityContext": pod["securityContext"]}


@pytest.mark.parametrize("value, fixed", [("", True), ("true", True), ("false", False),
                                          ("0", False)])
def test_whether_pods_get_a_uid_comes_from_the_environment(monkeypatch, value, fixed):
    monkeypatch.setenv("RADIXPOOL_SET_POD_UID", value)
    assert OperatorConfig.from_env().set_pod_uid is fixed


def test_a_pod_uid_switch_that_is_no_switch_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("RADIXPOOL_SET_POD_UID", "openshift")
    with pytest.raises(ValueError, match="RADIXPOOL_SET_POD_UID must be true or false"):
        OperatorConfig.from_env()
