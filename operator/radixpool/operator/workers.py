"""The worker Deployment and the headless Service the gateway discovers workers through.

Worker pods are built to survive real operations:
- startup probe on `/health` with a budget of `startupTimeoutSeconds`, so a 100 GB model can load;
- readiness on `/health`, which turns 503 while loading or draining: the pod leaves the
  EndpointSlice and the gateway stops sending it work;
- liveness on `/livez`, 200 while the engine core is alive (a dead engine core behind a live HTTP
  server is restarted); it does not depend on load, and a generous timeout and threshold keep a
  worker busy with a long prefill from being killed for answering slowly;
- on deletion, preStop waits for the EndpointSlice change to reach the gateway, then SIGTERM makes
  the worker drain; the grace period covers both plus the drain timeout;
- non-root, no privilege escalation, read-only root filesystem: the writable paths (/tmp, caches,
  /dev/shm, the model cache) are volumes. They run as uid and gid `POD_UID`, or, where the
  platform assigns each namespace its uids (OpenShift's restricted-v2 SCC refuses a pod that asks
  for one outside the range), as whatever uid it gives them: the images work under any uid in
  group 0, and every path written is a volume or group 0's.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING
from typing import Any

from kubernetes.utils import parse_quantity

from . import api
from .spec import Pool

HOME = api.WORKER_HOME
POD_UID = 1000  # the images' own user (Dockerfile.worker, Dockerfile.control)
MODEL_MOUNT = api.MODEL_MOUNT
ENDPOINT_PROPAGATION_SECONDS = 5
STARTUP_PERIOD_SECONDS = 10
# The worker's own loading deadline (--startup-timeout) starts once its process has imported
# and begun to load; the startup probe's starts with the container. The probe allows this much
# more, so a load that overruns ends with the worker saying why ("engine core not ready after
# N s", exit 1), not with the kubelet stopping it mid-load and a log that does not say.
STARTUP_MARGIN_SECONDS = 60
# A pod that is not ready (a worker loading or broken, a gateway with no worker ready) serves
# nothing, so a drain may evict it. Under the default (IfHealthyBudget) a budget with too few
# ready pods refuses even those: a scaled-to-zero pool's gateways, never ready, held every drain
# of their nodes forever.
UNHEALTHY_POD_EVICTION = "AlwaysAllow"


def worker_labels(pool: Pool) -> dict[str, str]:
    return api.pool_labels(pool.name, "worker")


def worker_selector(pool: Pool) -> dict[str, str]:
    return api.selector_labels(pool.name, "worker")


def model_dir(pool: Pool) -> str:
    """Where the worker finds the checkpoint inside its container."""
    if pool.model.path:
        return pool.model.path
    if pool.model.pvc:
        return f"{MODEL_MOUNT}/{pool.model.pvc[1]}".rstrip("/")
    repo, _ = pool.model.hf
    return f"{MODEL_MOUNT}/{repo}"


def worker_device(pool: Pool) -> str:
    """`auto` is decided here, by whether the pod is given GPUs, not by the worker at start-up:
    a GPU pod whose GPU the container cannot see (no NVIDIA runtime on the node, a broken device
    plugin) must fail and say so, not serve an 8B model on CPU; and a pod given no GPU must not
    use one the node's runtime exposes to every container anyway (the CUDA base image sets
    NVIDIA_VISIBLE_DEVICES=all), which belongs to another pod."""
    device = pool.engine["device"]
    if device == "auto":
        return "cuda" if pool.engine["resources"]["gpus"] else "cpu"
    return device


def worker_args(pool: Pool) -> list[str]:
    """`radixpool worker` flags, in the order `radixpool worker --help` lists them."""
    engine = pool.engine
    args = ["worker", "--model", model_dir(pool),
            "--served-model-name", pool.model.served_name,
            "--host", "::", "--port", str(api.WORKER_PORT),
            "--device", worker_device(pool), "--dtype", engine["dtype"]]
    if "kvCacheTokens" in engine:
        args += ["--kv-cache-tokens", str(engine["kvCacheTokens"])]
    if "memFraction" in engine:
        args += ["--mem-fraction", str(engine["memFraction"])]
    args += ["--page-size", str(engine["pageSize"])]
    if "maxRunningRequests" in engine:
        args += ["--max-running-requests", str(engine["maxRunningRequests"])]
    if "chunkedPrefillSize" in engine:
        args += ["--chunked-prefill-size", str(engine["chunkedPrefillSize"])]
    args += ["--schedule-policy", engine["schedulePolicy"], "--log-level", engine["logLevel"],
             # The engine's own deadline for loading is the startup probe's budget: with its
             # default (900 s) a model that loads in 20 minutes was restarted forever.
             "--startup-timeout", str(pool.lifecycle["startupTimeoutSeconds"]),
             "--drain-timeout", str(pool.lifecycle["drainTimeoutSeconds"])]
    return args + list(engine.get("args", []))


def cpu_quantity(value: str | int | float) -> str:
    """A CPU quantity as the API server stores it: finer than a millicore is rounded up to one
    (`0.5m`, `100u` are stored as `1m`); the operator writes it so, or every pass would see the
    stored value differ from the spec's and apply again."""
    text = str(value)
    millis = parse_quantity(text) * 1000
    if millis == millis.to_integral_value():
        return text
    return f"{int(millis.to_integral_value(rounding=ROUND_CEILING))}m"


def api_key_env(pool: Pool) -> list[dict[str, Any]]:
    """The client API key from its Secret as $RADIXPOOL_API_KEY: workers and gateway read it
    from the environment themselves, so no key shows in the pod spec or the process list."""
    if not pool.api_key:
        return []
    ref = {"name": pool.api_key.name, "key": pool.api_key.key}
    return [{"name": "RADIXPOOL_API_KEY", "valueFrom": {"secretKeyRef": ref}}]


def control_key_env(pool: Pool, variable: str) -> dict[str, Any]:
    """The pool's control key (its own Secret, made once by the operator) as `variable`:
    RADIXPOOL_CONTROL_API_KEY in workers, RADIXPOOL_WORKER_API_KEY in the gateway."""
    return {"name": variable, "valueFrom": {"secretKeyRef": {
        "name": api.control_key_secret_name(pool.name, pool.uid), "key": api.CONTROL_KEY_FIELD}}}


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def pod_security(uid: int | None) -> dict[str, Any]:
    """`uid` None leaves runAsUser, runAsGroup and fsGroup to the platform."""
    ids = {} if uid is None else {"runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}
    return {"runAsNonRoot": True, **ids, "seccompProfile": {"type": "RuntimeDefault"}}


def _resources(pool: Pool) -> dict[str, Any]:
    res = pool.engine["resources"]
    requests = {"cpu": cpu_quantity(res["cpu"]), "memory": str(res["memory"])}
    limits = {"memory": str(res["memory"])}
    if res["gpus"]:
        # Quantities are strings: the Kubernetes client rejects integers before sending.
        requests[res["gpuResourceName"]] = limits[res["gpuResourceName"]] = str(res["gpus"])
    return {"requests": requests, "limits": limits}


def _volumes(pool: Pool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts of the worker container)."""
    res = pool.engine["resources"]
    volumes = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(res["shmSize"])}},
    ]
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": f"{HOME}/.cache"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if pool.model.pvc:
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": pool.model.pvc[0], "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if pool.model.hf:
        volumes.append({"name": "model-cache", "emptyDir": {"sizeLimit": pool.model.cache_size}})
        mounts.append({"name": "model-cache", "mountPath": MODEL_MOUNT})
    return volumes + list(pool.engine.get("volumes", [])), mounts + list(
        pool.engine.get("volumeMounts", []))


# What an `hf://` download skips: the worker reads config, tokenizer and safetensors only, and
# many repos carry the same weights again in other formats (Meta's Llama repos: `original/`,
# 16 GB of .pth beside the 16 GB of safetensors of an 8B model; Mistral's: the weights again
# under Mistral's own names as consolidated.safetensors).
DOWNLOAD_IGNORE = ("original/*", "consolidated*.safetensors", "*.pth", "*.pt", "*.bin",
                   "*.gguf", "*.onnx", "onnx/*",
                   "*.msgpack", "*.h5", "*.ot", "*.tflite", "*.mlmodel", "coreml/*")


def _download_container(pool: Pool, image: str) -> dict[str, Any]:
    """Init container fetching an `hf://` model into the model cache before the worker starts."""
    repo, revision = pool.model.hf
    script = ("from huggingface_hub import snapshot_download; import sys; "
              "snapshot_download(sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3], "
              "ignore_patterns=sys.argv[4:])")
    env = [{"name": "HF_HUB_OFFLINE", "value": "0"}, {"name": "HOME", "value": HOME},
           {"name": "HF_HOME", "value": f"{HOME}/.cache/huggingface"}]
    if pool.model.hf_token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": pool.model.hf_token.name, "key": pool.model.hf_token.key}}})
    return {
        "name": "download-model", "image": image,
        "imagePullPolicy": pool.engine.get("imagePullPolicy", "IfNotPresent"),
        "command": ["python", "-c", script, repo, revision or "", model_dir(pool),
                    *DOWNLOAD_IGNORE],
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_MOUNT},
                         {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "cache", "mountPath": f"{HOME}/.cache"}],
    }


def _probes() -> dict[str, Any]:
    health = {"path": "/health", "port": "http"}
    return {
        "startupProbe": {"httpGet": health, "periodSeconds": STARTUP_PERIOD_SECONDS,
                         "timeoutSeconds": 5},
        "readinessProbe": {"httpGet": health, "periodSeconds": 5, "timeoutSeconds": 3,
                           "failureThreshold": 2, "successThreshold": 1},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, "periodSeconds": 20,
                          "timeoutSeconds": 10, "failureThreshold": 6},
    }


def termination_grace_seconds(pool: Pool) -> int:
    return pool.lifecycle["drainTimeoutSeconds"] + ENDPOINT_PROPAGATION_SECONDS + 15


def desired_worker_deployment(pool: Pool, image: str, uid: int | None = POD_UID) -> dict[str, Any]:
    engine, lifecycle = pool.engine, pool.lifecycle
    volumes, mounts = _volumes(pool)
    probes = _probes()
    probes["startupProbe"]["failureThreshold"] = math.ceil(
        (lifecycle["startupTimeoutSeconds"] + STARTUP_MARGIN_SECONDS) / STARTUP_PERIOD_SECONDS)
    container = {
        "name": "worker", "image": image,
        "imagePullPolicy": engine.get("imagePullPolicy", "IfNotPresent"),
        "command": ["radixpool"], "args": worker_args(pool),
        "ports": [{"name": "http", "containerPort": api.WORKER_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": HOME},
                # Every cache the stack writes (HF, Triton, FlashInfer JIT, CUDA) lands on the
                # writable cache volume; the root filesystem is read-only.
                {"name": "XDG_CACHE_HOME", "value": f"{HOME}/.cache"},
                {"name": "HF_HOME", "value": f"{HOME}/.cache/huggingface"},
                {"name": "TRITON_CACHE_DIR", "value": f"{HOME}/.cache/triton"},
                {"name": "CUDA_CACHE_PATH", "value": f"{HOME}/.cache/nv"},
                {"name": "HF_HUB_OFFLINE", "value": "1"},
                *api_key_env(pool), control_key_env(pool, "RADIXPOOL_CONTROL_API_KEY"),
                *engine.get("env", [])],
        "resources": _resources(pool),
        "securityContext": container_security(),
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {
            "command": ["sleep", str(ENDPOINT_PROPAGATION_SECONDS)]}}},
        **probes,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(uid),
        "terminationGracePeriodSeconds": termination_grace_seconds(pool),
        "containers": [container],
        "volumes": volumes,
    }
    if pool.model.hf:
        pod_spec["initContainers"] = [_download_container(pool, image)]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName",
                "imagePullSecrets"):
        if engine.get(key):
            pod_spec[key] = engine[key]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": api.worker_deployment_name(pool.name), "namespace": pool.namespace,
                     "labels": worker_labels(pool)},
        "spec": {
            "replicas": pool.replicas,
            "paused": False,   # a hand-paused rollout would hang without a word: taken back
            "selector": {"matchLabels": worker_selector(pool)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": lifecycle["maxSurge"], "maxUnavailable": lifecycle["maxUnavailable"]}},
            # A rollout counts as stuck only after a model had its whole startup budget.
            "progressDeadlineSeconds": lifecycle["startupTimeoutSeconds"] + 300,
            "revisionHistoryLimit": 5,
            "template": {"metadata": {"labels": worker_labels(pool)}, "spec": pod_spec},
        },
    }


def desired_worker_service(pool: Pool) -> dict[str, Any]:
    """Headless: its EndpointSlices list each ready worker pod, which is what the gateway needs."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": api.worker_service_name(pool.name), "namespace": pool.namespace,
                     "labels": worker_labels(pool)},
        "spec": {
            "clusterIP": "None",
            "selector": worker_selector(pool),
            "publishNotReadyAddresses": False,
            "ports": [{"name": "http", "port": api.WORKER_PORT, "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }
