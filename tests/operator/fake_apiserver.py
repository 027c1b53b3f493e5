"""Just enough of a Kubernetes API server, over real HTTP, for the real clients to run against.

Serves discovery, get / list (with label selectors) / watch (streamed events after a
resourceVersion), server-side apply and merge patches (including `/status`), create, and delete
with finalizers. Objects live in memory under their URL path. Used where no cluster exists to run
the operator's I/O shell and the whole `radixpool operator` process unmodified.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

RESOURCES = {
    "api/v1": [("services", "Service"), ("serviceaccounts", "ServiceAccount"), ("pods", "Pod"),
               ("secrets", "Secret"), ("persistentvolumeclaims", "PersistentVolumeClaim"),
               ("events", "Event"), ("namespaces", "Namespace")],
    "apis/apps/v1": [("deployments", "Deployment")],
    "apis/rbac.authorization.k8s.io/v1": [("roles", "Role"), ("rolebindings", "RoleBinding")],
    "apis/policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
    "apis/apiextensions.k8s.io/v1": [("customresourcedefinitions", "CustomResourceDefinition")],
    "apis/radixpool.io/v1alpha1": [("inferencepools", "InferencePool")],
    "apis/kopf.dev/v1": [("kopfpeerings", "KopfPeering"),
                         ("clusterkopfpeerings", "ClusterKopfPeering")],
}
CLUSTER_SCOPED = {"CustomResourceDefinition", "Namespace", "ClusterKopfPeering"}
PLURALS = {plural for group in RESOURCES.values() for plural, _ in group}
WATCH_SECONDS = 5.0


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge(result.get(key), value)
    return result


def json_patch(target: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 JSON patch: add, replace, remove, test."""
    result = copy.deepcopy(target)
    for op in operations:
        *parents, last = [part.replace("~1", "/").replace("~0", "~")
                          for part in op["path"].lstrip("/").split("/")]
        node: Any = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if op["op"] == "test":
            current = node[int(last)] if isinstance(node, list) else node.get(last)
            if current != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        elif isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op["op"] == "add":
                node.insert(index, op["value"])
            else:
                node[index] = op["value"]
        else:
            node[last] = op["value"]
    return result


def collection_of(path: str) -> str:
    """The cluster-wide collection an object path belongs to (namespace removed)."""
    parts = path.split("/")
    if "namespaces" in parts[:-2]:
        index = parts.index("namespaces")
        parts = parts[:index] + parts[index + 2:]
    return "/".join(parts[:-1])


class Store:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []
        self.requests: list[tuple[str, str, dict[str, list[str]], str]] = []
        self.version = 0
        self.changed = threading.Condition()
        self.refuse: dict[str, str] = {}  # path → message answered with 422 to any write
        self.refuse_code: dict[str, int] = {}  # path → another status for `refuse` (apply's 500)
        self.forbid: dict[str, str] = {}  # path → message answered with 403 to any write
        # path → the name of an admission webhook with side effects, which refuses (400) every
        # dry run of the object, as the API server does before calling it
        self.no_dry_run: dict[str, str] = {}

    def put(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        with self.changed:
            self.version += 1
            before = self.objects.get(path)
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            parts = path.split("/")
            if "namespaces" in parts[:-2]:
                meta["namespace"] = parts[parts.index("namespaces") + 1]
            meta["resourceVersion"] = str(self.version)
            meta.setdefault("uid", f"uid-{self.version}")
            meta.setdefault("creationTimestamp",
                            datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
            generation = (before or {}).get("metadata", {}).get("generation", 0)
            if before is None or before.get("spec") != obj.get("spec"):
                generation += 1
            meta["generation"] = generation
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                self.objects.pop(path, None)
                self.events.append((self.version, "DELETED", path, obj))
            else:
                self.objects[path] = obj
                self.events.append((self.version, "MODIFIED" if before else "ADDED", path, obj))
            self.changed.notify_all()
            return obj

    def delete(self, path: str) -> dict[str, Any] | None:
        obj = self.objects.get(path)
        if obj is None:
            return None
        if obj["metadata"].get("finalizers"):
            return self.put(path, merge(obj, {"metadata": {
                "deletionTimestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}}))
        with self.changed:
            self.version += 1
            self.objects.pop(path)
            self.events.append((self.version, "DELETED", path, obj))
            self.changed.notify_all()
        return obj

    def listing(self, path: str, selector: str) -> list[dict[str, Any]]:
        cluster_wide = collection_of(path + "/x") == path
        items = [obj for key, obj in self.objects.items()
                 if (collection_of(key) == path if cluster_wide
                     else key.rsplit("/", 1)[0] == path)]
        if selector:
            key, _, value = selector.partition("=")
            items = [o for o in items if o["metadata"].get("labels", {}).get(key) == value]
        return items


class Handler(BaseHTTPRequestHandler):
    store: Store

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse_dry_run(self, path: str) -> bool:
        webhook = self.store.no_dry_run.get(path)
        if webhook is None:
            return False
        self._send(400, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                         "reason": "BadRequest", "code": 400,
                         "message": f'admission webhook "{webhook}" does not support dry run'})
        return True

    def _status(self, code: int, reason: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "reason": reason, "code": code, "message": reason})

    def _route(self, method: str) -> tuple[str, dict[str, list[str]]]:
        url = urlparse(self.path)
        query = parse_qs(url.query)
        self.store.requests.append((method, url.path, query,
                                    self.headers.get("Content-Type", "")))
        return url.path.strip("/"), query

    def _body(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or "{}")

    def do_GET(self) -> None:
        path, query = self._route("GET")
        if path == "version":
            return self._send(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0"})
        if path == "api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
        if path == "apis":
            groups = []
            for group_version in RESOURCES:
                if group_version.startswith("apis/"):
                    _, group, version = group_version.split("/")
                    entry = {"groupVersion": f"{group}/{version}", "version": version}
                    groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
            return self._send(200, {"kind": "APIGroupList", "groups": groups})
        if path in RESOURCES:
            resources = []
            for plural, kind in RESOURCES[path]:
                resources.append({"name": plural, "singularName": kind.lower(), "kind": kind,
                                  "namespaced": kind not in CLUSTER_SCOPED,
                                  "verbs": ["get", "list", "watch", "patch", "create", "delete"]})
                if kind == "InferencePool":
                    resources += [{"name": f"{plural}/{sub}", "kind": kind, "namespaced": True,
                                   "verbs": ["get", "patch", "update"]}
                                  for sub in ("status", "scale")]
            return self._send(200, {"kind": "APIResourceList", "groupVersion": path[5:]
                                    if path.startswith("apis/") else "v1",
                                    "resources": resources})
        if query.get("watch", ["false"])[0] in ("true", "1"):
            return self._watch(path, query)
        if path in self.store.objects:
            return self._send(200, self.store.objects[path])
        if path.split("/")[-1] in PLURALS:
            items = self.store.listing(path, query.get("labelSelector", [""])[0])
            return self._send(200, {"kind": "List", "apiVersion": "v1", "items": items,
                                    "metadata": {"resourceVersion": str(self.store.version)}})
        return self._status(404, "NotFound")

    def _watch(self, path: str, query: dict[str, list[str]]) -> None:
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        cluster_wide = collection_of(path + "/x") == path
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        deadline = time.monotonic() + WATCH_SECONDS
        while time.monotonic() < deadline:
            with self.store.changed:
                fresh = [(rv, kind, obj) for rv, kind, key, obj in self.store.events
                         if rv > since and (collection_of(key) == path if cluster_wide
                                            else key.rsplit("/", 1)[0] == path)]
                if not fresh:
                    self.store.changed.wait(timeout=0.2)
                    continue
            try:
                for rv, kind, obj in fresh:
                    self.wfile.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                    since = rv
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return  # the client stopped watching

    def do_POST(self) -> None:
        path, query = self._route("POST")
        body = self._body()
        name = body.get("metadata", {}).get("name") or f"gen-{self.store.version + 1}"
        body.setdefault("metadata", {})["name"] = name
        # admission comes before storage: refused whether or not the object exists
        if query.get("dryRun") and self._refuse_dry_run(f"{path}/{name}"):
            return None
        if f"{path}/{name}" in self.store.objects:
            return self._send(409, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                    "reason": "AlreadyExists", "code": 409,
                                    "message": f"{name!r} already exists"})
        if query.get("dryRun"):
            return self._send(201, body)
        self._send(201, self.store.put(f"{path}/{name}", body))

    def do_PATCH(self) -> None:
        path, query = self._route("PATCH")
        body = self._body()
        if query.get("dryRun") and self._refuse_dry_run(path):
            return None
        if path in self.store.forbid:
            return self._send(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                    "reason": "Forbidden", "code": 403,
                                    "message": self.store.forbid[path]})
        if path in self.store.refuse:
            code = self.store.refuse_code.get(path, 422)
            return self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                     "reason": "Invalid" if code == 422 else "InternalError",
                                     "code": code, "message": self.store.refuse[path]})
        content_type = self.headers.get("Content-Type", "")
        status_only = path.endswith("/status")
        path = path.removesuffix("/status")
        current = self.store.objects.get(path)
        if "apply-patch" in content_type:
            merged = {**body, "status": (current or {}).get("status", {})}
            if current:
                merged["metadata"] = merge(current["metadata"], body.get("metadata", {}))
        elif current is None:
            return self._status(404, "NotFound")
        elif "json-patch" in content_type:
            try:
                merged = json_patch(current, body)
            except (ValueError, KeyError, IndexError):
                return self._status(422, "Invalid")
        elif status_only:
            merged = merge(current, {"status": body.get("status")})
        else:  # with a status subresource, the main resource ignores status changes
            has_status_subresource = "/inferencepools/" in path
            merged = merge(current, {key: value for key, value in body.items()
                                     if key != "status" or not has_status_subresource})
        if query.get("dryRun"):
            return self._send(200, merged)
        self._send(200, self.store.put(path, merged))

    def do_DELETE(self) -> None:
        path, _ = self._route("DELETE")
        obj = self.store.delete(path)
        if obj is None:
            return self._status(404, "NotFound")
        return self._send(200, obj)


class FakeAPIServer:
    def __init__(self) -> None:
        self.store = Store()
        handler = type("BoundHandler", (Handler,), {"store": self.store})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeAPIServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def kubeconfig(self) -> str:
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        })
