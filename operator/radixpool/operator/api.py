"""The InferencePool API's names: group, version, kinds, labels, and the owned objects' names."""

from __future__ import annotations

GROUP = "radixpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ("llmpool",)
CRD_NAME = f"{PLURAL}.{GROUP}"

FIELD_MANAGER = "radixpool-operator"
# a rollout the operator asks for (its pods must read a remade control key), as `kubectl rollout
# restart` does it: owned by a manager of its own, so the operator's applies leave it in place
RESTART_FIELD_MANAGER = "radixpool-operator-restart"
RESTARTED_AT_ANNOTATION = f"{GROUP}/restartedAt"
POOL_LABEL = f"{GROUP}/pool"
# On the worker and gateway Services of a pool that has its own ServiceMonitor: the chart's
# fleet-wide ServiceMonitor skips them, so no endpoint is scraped twice.
OWN_MONITOR_LABEL = f"{GROUP}/own-service-monitor"
COMPONENT_LABEL = "app.kubernetes.io/component"

WORKER_PORT = 8000
GATEWAY_PORT = 8080
# What the operator sets in every worker container itself: a pool's own env and mounts must not
# name these (server-side apply refuses a duplicate key with a 500 that says nothing of the spec)
WORKER_HOME = "/home/radixpool"
MODEL_MOUNT = "/models"
RESERVED_ENV = frozenset({"HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR",
                          "CUDA_CACHE_PATH", "HF_HUB_OFFLINE", "RADIXPOOL_API_KEY",
                          "RADIXPOOL_CONTROL_API_KEY"})
# The `radixpool worker` flags the operator sets from the pool (workers.worker_args). Repeated in
# engine.args (appended last) they would win behind the spec's back: `--port 9000` moved the
# worker off the port its probes and the gateway use, and it was restarted for want of a startup.
OPERATOR_WORKER_FLAGS = frozenset({
    "--model", "--served-model-name", "--host", "--port", "--device", "--dtype",
    "--kv-cache-tokens", "--mem-fraction", "--page-size", "--max-running-requests",
    "--chunked-prefill-size", "--schedule-policy", "--log-level", "--startup-timeout",
    "--drain-timeout"})
# The worker's key on its command line would be in the Deployment (readable by whoever may get
# Deployments, often more than may read Secrets) and in `ps`: the key goes in spec.apiKeySecret.
KEY_WORKER_FLAGS = frozenset({"--api-key"})
RESERVED_MOUNT_PATHS = frozenset({"/tmp", f"{WORKER_HOME}/.cache", "/dev/shm", MODEL_MOUNT})
# resources a GPU resource name must not stand for (it would overwrite the pod's own request)
CORE_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage", "pods"})
MAX_POOL_NAME = 45  # leaves room for "-workers" and ReplicaSet/pod hashes within 63 characters
POOL_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # a Service name: DNS-1035 label


def worker_deployment_name(pool: str) -> str:
    return f"{pool}-worker"


def worker_service_name(pool: str) -> str:
    """The headless Service whose EndpointSlices the gateway watches."""
    return f"{pool}-workers"


def gateway_name(pool: str) -> str:
    """Gateway Deployment, Service (the pool's endpoint), ServiceAccount, Role and RoleBinding."""
    return f"{pool}-gateway"


def pdb_name(pool: str) -> str:
    return f"{pool}-worker"


def gateway_pdb_name(pool: str) -> str:
    return f"{pool}-gateway"


def control_key_secret_name(pool: str, uid: str) -> str:
    """The pool's control key: what the gateway presents to its workers (generated once). Its
    name carries 12 hex digits of the pool's UID, which no one knows before the pool exists: a
    Secret made in advance under a name the pool would take (the operator may create Secrets
    but, by default, not read them) would otherwise be taken for the pool's own, its key known
    to whoever made it."""
    return f"{pool}-control-key-{uid.replace('-', '')[:12]}"


CONTROL_KEY_FIELD = "key"


def network_policy_name(pool: str) -> str:
    return f"{pool}-worker"


def service_monitor_name(pool: str) -> str:
    return pool


def pool_labels(pool: str, component: str) -> dict[str, str]:
    """Labels every owned object carries."""
    return {
        "app.kubernetes.io/name": "radixpool",
        "app.kubernetes.io/instance": pool,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/part-of": "radixpool",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        POOL_LABEL: pool,
    }


def selector_labels(pool: str, component: str) -> dict[str, str]:
    """The stable subset used in selectors (selectors of Deployments are immutable)."""
    return {POOL_LABEL: pool, COMPONENT_LABEL: component}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))

