"""API-server refusals in the pool's own words: `spec.engine.env[0]`, not `containers[0].env[6]`.

The API server names paths in the object it refused (the generated Deployment). The pool's
pass-through fields land in known places there, so those paths are mapped back to the spec field
the user wrote; the generated path stays in the message, in parentheses, for whoever reads the
Deployment. Paths with no spec field behind them are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

POD = "spec.template.spec"
# (prefix in the Deployment, prefix in the pool) for fields copied whole from the spec.
_WORKER_FIELDS = [(f"{POD}.{key}", f"spec.engine.{key}") for key in (
    "tolerations", "nodeSelector", "affinity", "priorityClassName", "imagePullSecrets")]
_GATEWAY_FIELDS = [(f"{POD}.{key}", f"spec.gateway.{key}") for key in (
    "tolerations", "nodeSelector")]
_INDEXED = re.compile(r"^\[(\d+)\](.*)$")


def _offset_field(path: str, prefix: str, target: str, first: int) -> str | None:
    """`prefix[N]rest` → `target[N - first]rest` when N ≥ first."""
    if not path.startswith(prefix):
        return None
    match = _INDEXED.match(path[len(prefix):])
    if match is None or int(match.group(1)) < first:
        return None
    return f"{target}[{int(match.group(1)) - first}]{match.group(2)}"


def spec_path(path: str, obj: dict[str, Any], pool_spec: dict[str, Any]) -> str | None:
    """The pool's spec field behind `path` in the generated `obj`, or None."""
    name = obj["metadata"]["name"]
    if obj["kind"] != "Deployment":
        return None
    is_gateway = name.endswith("-gateway")
    for prefix, target in _GATEWAY_FIELDS if is_gateway else _WORKER_FIELDS:
        if path == prefix or path.startswith((prefix + ".", prefix + "[")):
            return target + path[len(prefix):]
    if is_gateway:
        return None
    pod = obj["spec"]["template"]["spec"]
    container = (pod.get("containers") or [{}])[0]
    engine = pool_spec.get("engine") or {}
    # the pool's own items come last, after the operator's
    for where, field, prefix in ((pod, "volumes", POD),
                                 (container, "volumeMounts", f"{POD}.containers[0]"),
                                 (container, "env", f"{POD}.containers[0]"),
                                 (container, "args", f"{POD}.containers[0]")):
        first = len(where.get(field) or []) - len(engine.get(field) or [])
        found = _offset_field(path, f"{prefix}.{field}", f"spec.engine.{field}", first)
        if found:
            return found
    return None


_PATH = re.compile(r"\bspec\.template\.spec[\w.\[\]\-]*")


def in_spec_terms(message: str, obj: dict[str, Any], pool_spec: dict[str, Any]) -> str:
    """`message` with each generated path that maps to a spec field named as that field."""
    def name(match: re.Match[str]) -> str:
        generated = match.group(0).rstrip(".")
        field = spec_path(generated, obj, pool_spec)
        return f"{field} ({generated})" if field else match.group(0)
    return _PATH.sub(name, message)
