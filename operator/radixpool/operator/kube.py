"""`Cluster` over the Kubernetes API: server-side apply, reads, deletes. The only I/O in the core.

Server-side apply with `force=True` under the field manager `radixpool-operator` makes every
apply both a create and a repair: fields someone edited are taken back, fields the pool no longer
sets are removed, and fields other controllers own (an HPA on the pool, not on the Deployment)
are left alone.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError

from . import api
from .desired import ObjectRef
from .reconcile import ObjectRejected
from .status import Observed

SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"
CRD_RECHECK_SECONDS = 60.0


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig."""
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class KubeCluster:
    def __init__(self, api_client: client.ApiClient):
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.extensions = client.ApiextensionsV1Api(api_client)
        self.dynamic = DynamicClient(api_client)
        self._monitors: tuple[float, bool] = (0.0, False)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        read = {"Secret": self.core.read_namespaced_secret,
                "PersistentVolumeClaim": self.core.read_namespaced_persistent_volume_claim}[kind]
        try:
            read(name, namespace, _preload_content=False).release_conn()  # never parse contents
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def has_service_monitors(self) -> bool:
        checked_at, present = self._monitors
        if time.monotonic() - checked_at < CRD_RECHECK_SECONDS:
            return present
        try:
            self.extensions.read_custom_resource_definition(
                SERVICE_MONITOR_CRD, _preload_content=False).release_conn()
            present = True
        except ApiException as error:
            if error.status != 404:
                raise
            present = False
        self._monitors = (time.monotonic(), present)
        return present

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> None:
        try:
            self.dynamic.server_side_apply(
                self._resource(obj["apiVersion"], obj["kind"]), body=obj,
                namespace=obj["metadata"]["namespace"], field_manager=api.FIELD_MANAGER,
                force_conflicts=True, dry_run="All" if dry_run else None)
        except DynamicApiError as error:
            if error.status in (400, 422):
                raise ObjectRejected(error.summary()) from error
            raise

    def delete(self, ref: ObjectRef) -> None:
        with contextlib.suppress(NotFoundError):
            self._resource(ref.api_version, ref.kind).delete(name=ref.name,
                                                             namespace=ref.namespace)

    def _get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._resource(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def observe(self, namespace: str, pool: str) -> Observed:
        pods = self._resource("v1", "Pod").get(
            namespace=namespace, label_selector=f"{api.POOL_LABEL}={pool}").to_dict()
        return Observed(
            worker_deployment=self._get("apps/v1", "Deployment", namespace,
                                        api.worker_deployment_name(pool)),
            gateway_deployment=self._get("apps/v1", "Deployment", namespace,
                                         api.gateway_name(pool)),
            gateway_service=self._get("v1", "Service", namespace, api.gateway_name(pool)),
            pods=pods.get("items") or [],
        )
