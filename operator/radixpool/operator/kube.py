"""`Cluster` over the Kubernetes API: server-side apply, reads, deletes. The only I/O in the core.

Server-side apply with `force=True` under the field manager `radixpool-operator` makes every
apply both a create and a repair: fields someone edited are taken back, fields the pool no longer
sets are removed, and fields other controllers own (an HPA on the pool, not on the Deployment)
are left alone. Every API error leaves here as `ObjectRejected` (400 / 422, an admission
policy's refusal whatever its status, or apply's 500 for an object it cannot type: the spec's
fault), `DryRunUnsupported` (a dry run an admission webhook will not take part in) or
`ApiFailure` naming the request and the object, never as the client's bare exception.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError, ResourceNotFoundError
from urllib3.exceptions import HTTPError

from . import api
from .desired import ObjectRef, ref_of
from .reconcile import ApiFailure, DryRunUnsupported, KindGone, ObjectRejected
from .status import Event

SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"
SERVICE_MONITOR_KIND = "ServiceMonitor"
CRD_RECHECK_SECONDS = 60.0
# How long `create_once` trusts that an object it made (or found) is still there. It may not read
# Secrets, so it asks again (a create; 409 when present): a pool deleted and made again under the
# same name, or a control key deleted by hand, gets its Secret back within this long.
CREATE_RECHECK_SECONDS = 60.0
# Events name this component (`kubectl describe` shows it under From).
REPORTING_COMPONENT = api.FIELD_MANAGER
# What the API server answers (400) to a dry run that reaches an admission webhook declaring
# side effects (`sideEffects: Unknown` or `Some`), whatever the object holds: the webhook is not
# even called (k8s.io/apiserver, admission/plugin/webhook/errors: NewDryRunUnsupportedErr).
DRY_RUN_UNSUPPORTED = re.compile(r'admission webhook ".*" does not support dry run')
# How the API server words an admission policy's refusal, whatever status the policy chose (a
# webhook's own code, 403 by Gatekeeper's habit; a ValidatingAdmissionPolicy's by its reason):
# the object's fault, as a 422 is, never a permission the operator lacks.
ADMISSION_DENIED = re.compile(
    r'admission webhook ".*" denied the request'
    r"|ValidatingAdmissionPolicy '.*' (with binding '.*' )?denied request")

log = logging.getLogger("radixpool.operator")


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig."""
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _refuses_dry_run(error: DynamicApiError) -> bool:
    return error.status == 400 and DRY_RUN_UNSUPPORTED.fullmatch(_api_message(error)[2]) is not None


def _api_message(error: ApiException | DynamicApiError) -> tuple[int | None, str, str]:
    body = getattr(error, "body", None)
    try:
        parsed = json.loads(body) if body else {}
    except (TypeError, ValueError):
        parsed = {}
    message = parsed.get("message") if isinstance(parsed, dict) else None
    return error.status, str(error.reason or ""), message or ""


@contextlib.contextmanager
def _naming(action: str, kind: str, namespace: str, name: str) -> Iterator[None]:
    """API errors inside become `ApiFailure`s that say what was asked of which object."""
    try:
        yield
    except (ApiException, DynamicApiError) as error:
        raise ApiFailure(action, kind, namespace, name, *_api_message(error)) from error
    except ResourceNotFoundError as error:  # discovery: the API server does not serve the kind
        raise ApiFailure(action, kind, namespace, name, 404, "NotFound",
                         f"the API server does not serve {kind}") from error
    except (HTTPError, OSError) as error:  # connection refused, timeouts
        raise ApiFailure(action, kind, namespace, name, None, type(error).__name__,
                         str(error)) from error


TYPED_PATCH_FAILED = "failed to create typed patch object"


class KubeCluster:
    def __init__(self, api_client: client.ApiClient):
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.extensions = client.ApiextensionsV1Api(api_client)
        self.dynamic = DynamicClient(api_client)
        self._monitors: tuple[float, bool] = (0.0, False)
        # create_once: (object, owner uid) → when it was last made or found present
        self._created: dict[tuple[ObjectRef, str], float] = {}
        # create_once: objects made without a dry run whose `before` has yet to succeed
        self._owed: set[tuple[ObjectRef, str]] = set()
        self._told_no_dry_run: set[ObjectRef] = set()
        self.instance = socket.gethostname()

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def exists(self, kind: str, namespace: str, name: str) -> bool | None:
        read = {"Secret": self.core.read_namespaced_secret,
                "PersistentVolumeClaim": self.core.read_namespaced_persistent_volume_claim}[kind]
        try:
            with _naming("get", kind, namespace, name):
                read(name, namespace, _preload_content=False).release_conn()  # never parsed
        except ApiFailure as failure:
            if failure.code == 404:
                return False
            if failure.code == 403 and kind == "Secret":
                return None  # not allowed to read Secrets here: cannot tell
            raise
        return True

    def has_service_monitors(self) -> bool:
        checked_at, present = self._monitors
        if time.monotonic() - checked_at < CRD_RECHECK_SECONDS:
            return present
        try:
            with _naming("get", "CustomResourceDefinition", "", SERVICE_MONITOR_CRD):
                self.extensions.read_custom_resource_definition(
                    SERVICE_MONITOR_CRD, _preload_content=False).release_conn()
            present = True
        except ApiFailure as failure:
            if failure.code != 404:
                raise
            present = False
        self._monitors = (time.monotonic(), present)
        return present

    def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        with _naming("get", ref.kind, ref.namespace, ref.name):
            try:
                return self._resource(ref.api_version, ref.kind).get(
                    name=ref.name, namespace=ref.namespace).to_dict()
            except (NotFoundError, ResourceNotFoundError):  # no such object, or no such kind
                return None

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        meta = obj["metadata"]
        action = "dry-run apply" if dry_run else "apply"
        with _naming(action, obj["kind"], meta["namespace"], meta["name"]):
            try:
                return self.dynamic.server_side_apply(
                    self._resource(obj["apiVersion"], obj["kind"]), body=obj,
                    namespace=meta["namespace"], field_manager=api.FIELD_MANAGER,
                    force_conflicts=True, dry_run="All" if dry_run else None).to_dict()
            except (NotFoundError, ResourceNotFoundError) as error:
                if obj["kind"] != SERVICE_MONITOR_KIND:
                    raise
                # its CRD went away since `has_service_monitors` looked: look again next time
                self._monitors = (0.0, False)
                self.dynamic.resources.invalidate_cache()
                raise KindGone(f"{obj['kind']} is no longer served (its CRD was removed)"
                               ) from error
            except DynamicApiError as error:
                message = _api_message(error)[2]
                if dry_run and _refuses_dry_run(error):
                    raise DryRunUnsupported(message) from error
                # 500 "failed to create typed patch object": server-side apply could not read
                # the object against its schema (an unknown key in an opaque core/v1 item, a
                # duplicate list key): the spec's fault as much as a 422, and as lasting
                if (error.status in (400, 422) or ADMISSION_DENIED.search(message)
                        or (error.status == 500 and TYPED_PATCH_FAILED in message)):
                    raise ObjectRejected(message or error.summary()) from error
                raise

    def patch_json(self, ref: ObjectRef, operations: list[dict[str, Any]]) -> None:
        with _naming("patch", ref.kind, ref.namespace, ref.name):
            self._resource(ref.api_version, ref.kind).patch(
                name=ref.name, namespace=ref.namespace, body=operations,
                content_type="application/json-patch+json", field_manager=api.FIELD_MANAGER)

    def create_once(self, obj: dict[str, Any],
                    before: Callable[[], None] | None = None) -> bool:
        ref = ref_of(obj)
        owner = ",".join(o["uid"] for o in obj["metadata"].get("ownerReferences", []))
        key = (ref, owner)
        if key in self._owed:
            if before is not None:
                before()
            self._owed.discard(key)
        made = self._created.get(key)
        if made is not None and time.monotonic() - made < CREATE_RECHECK_SECONDS:
            return False
        created = unchecked = False
        with _naming("create", ref.kind, ref.namespace, ref.name):
            resource = self._resource(ref.api_version, ref.kind)
            try:
                if before is not None:  # a dry run says whether it is missing
                    try:
                        resource.create(body=obj, namespace=ref.namespace, dry_run="All")
                    except DynamicApiError as error:
                        if not _refuses_dry_run(error):
                            raise
                        unchecked = True
                        self._tell_no_dry_run(ref, _api_message(error)[2])
                    else:
                        before()
                resource.create(body=obj, namespace=ref.namespace)
                created = True
            except DynamicApiError as error:
                if error.status != 409:  # 409: it exists already
                    raise
        if created and unchecked:
            # No dry run could say it was missing: made first, `before` after, and owed (run
            # again on the next call) until it succeeds, as a 409 will not say it was missing.
            self._owed.add(key)
            before()
            self._owed.discard(key)
        now = time.monotonic()
        self._created = {seen: at for seen, at in self._created.items()
                         if now - at < CREATE_RECHECK_SECONDS}  # pools gone, made again
        self._created[key] = now
        return created

    def _tell_no_dry_run(self, ref: ObjectRef, message: str) -> None:
        """Logs, once per object, that an admission webhook refuses its dry runs."""
        if ref not in self._told_no_dry_run:
            self._told_no_dry_run.add(ref)
            log.warning("cannot dry-run creating %s %s/%s (%s): created without one",
                        ref.kind, ref.namespace, ref.name, message)

    def restart(self, ref: ObjectRef, stamp: str) -> None:
        patch = {"spec": {"template": {"metadata": {"annotations": {
            api.RESTARTED_AT_ANNOTATION: stamp}}}}}
        with _naming("patch", ref.kind, ref.namespace, ref.name):
            self._resource(ref.api_version, ref.kind).patch(
                name=ref.name, namespace=ref.namespace, body=patch,
                content_type="application/merge-patch+json",
                field_manager=api.RESTART_FIELD_MANAGER)

    def delete(self, ref: ObjectRef) -> None:
        with _naming("delete", ref.kind, ref.namespace, ref.name), \
                contextlib.suppress(NotFoundError):
            self._resource(ref.api_version, ref.kind).delete(name=ref.name,
                                                             namespace=ref.namespace)

    def pods(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        with _naming("list", "Pod", namespace, f"-l {api.POOL_LABEL}={pool}"):
            found = self._resource("v1", "Pod").get(
                namespace=namespace, label_selector=f"{api.POOL_LABEL}={pool}").to_dict()
        return found.get("items") or []

    def post_event(self, body: dict[str, Any], event: Event) -> None:
        """A core/v1 Event about the pool, from `radixpool-operator` (not from kopf)."""
        meta = body["metadata"]
        now = datetime.now(timezone.utc)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        namespace = meta.get("namespace", "default")
        with _naming("create", "Event", namespace, f"about {api.KIND} {meta['name']}"):
            self.core.create_namespaced_event(namespace, {
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}",
                             "namespace": namespace},
                "involvedObject": {"apiVersion": body.get("apiVersion", api.API_VERSION),
                                   "kind": api.KIND, "name": meta["name"],
                                   "namespace": namespace, "uid": meta.get("uid")},
                "type": event.type, "reason": event.reason, "message": event.message[:1024],
                "source": {"component": REPORTING_COMPONENT},
                "reportingComponent": REPORTING_COMPONENT, "reportingInstance": self.instance,
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
                "eventTime": None, "action": event.reason,
            })

    def create_if_missing(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless it exists; whether it was created."""
        meta = obj["metadata"]
        namespace = meta.get("namespace")
        with _naming("create", obj["kind"], namespace or "", meta["name"]):
            resource = self._resource(obj["apiVersion"], obj["kind"])
            try:
                resource.get(name=meta["name"], namespace=namespace)
                return False
            except NotFoundError:
                resource.create(body=obj, namespace=namespace)
                return True
