"""Drift: does a live object still hold what the operator wants it to hold?

`holds(desired, live)` is pure and deliberately one-sided: every field the operator sets must be
in the live object with the same value (or, if false or empty, may be absent: the API server
drops those); fields the API server adds (defaults, status, managed fields) or other controllers
own are ignored. So an unchanged pool needs no write at all, and only
a real change (an edit, a deleted object, a new spec) is applied again.

One-sided is not enough where the pool stops setting a field (a node selector, an annotation, a
GPU limit taken out of the spec): the live object still has it, and server-side apply removes it
only when the object is applied again. `sets_no_more_than` reads the fields the operator applied
last time from the object's `managedFields` and says whether the pool still sets every one.

`stray_env_patch` covers what server-side apply cannot: an env var someone added by hand is owned
by their field manager, so a forced apply leaves it in place; the operator removes it with a JSON
patch (each removal guarded by a `test` of its name, so a concurrent edit makes it fail, not
remove the wrong entry). `stray_ports_patch` does the same for a Service port edited or added by
hand: server-side apply leaves it too, and refuses the pool's own port beside it when the two
share a name, so the pool would stay refused (`RejectedByAPIServer`) with its Service on the
wrong port.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.utils import parse_quantity

from . import api


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have and type(want) is type(have):
        return True
    if isinstance(want, bool) or isinstance(have, bool):
        return False
    if isinstance(want, (str, int, float)) and isinstance(have, (str, int, float)):
        try:  # "0.5" and "500m", "1024Mi" and "1Gi": the server normalizes quantities
            return parse_quantity(want) == parse_quantity(have)
        except (ValueError, TypeError, ArithmeticError):
            return False
    return False


def _omitted(value: Any) -> bool:
    """The API server drops empty and false fields (`publishNotReadyAddresses: false`, `{}`)."""
    return value is False or value is None or value in ("", [], {})


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(item, dict) and "name" in item for item in items)


# Named items are compared by name (a volume mount by its path), one-sided, as others may add
# their own. A RoleBinding's subjects are one atomic list, replaced whole by an apply: a subject
# added by hand is drift.
WHOLE_LISTS = frozenset({"subjects"})


def _item_key(item: dict[str, Any]) -> Any:
    """A named item's key, as the API server merges them: a volume mount's is its path (one
    volume may be mounted at several), any other's its name."""
    return item.get("mountPath") or item["name"]


def holds(desired: Any, live: Any) -> bool:
    """Whether `live` carries every field of `desired` with the same value."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all((holds(value, live[key]) and (
                    key not in WHOLE_LISTS or len(value) == len(live[key])))
                   if key in live else _omitted(value) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list):
            return False
        if _named(desired) and _named(live):
            by_key = {_item_key(item): item for item in live}
            return all(_item_key(item) in by_key and holds(item, by_key[_item_key(item)])
                       for item in desired)
        return len(desired) == len(live) and all(map(holds, desired, live))
    return _same_scalar(desired, live)


def sets_no_more_than(desired: Any, live: dict[str, Any]) -> bool:
    """Whether `desired` still sets every field the operator's last apply set on `live` (from its
    `managedFields`); False means applying it again removes fields the pool no longer wants."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if (entry.get("manager") == api.FIELD_MANAGER and entry.get("operation") == "Apply"
                and not entry.get("subresource")):
            return _covers(desired, entry.get("fieldsV1") or {})
    return True


def _covers(desired: Any, fields: dict[str, Any]) -> bool:
    """Walk a fieldsV1 tree: `f:name` a field, `k:{...}` a list item by its keys, `v:...` a
    set member, `i:N` a list index, `.` the item itself."""
    for key, below in fields.items():
        kind, _, name = key.partition(":")
        if kind == "f":
            if not isinstance(desired, dict) or name not in desired:
                return False
            found = desired[name]
        elif kind == "k":
            keys = json.loads(name)
            found = next((item for item in desired if isinstance(item, dict) and all(
                item.get(k, v) == v for k, v in keys.items())), None) if isinstance(
                desired, list) else None  # a key the pool leaves to its default matches
            if found is None:
                return False
        elif kind == "v":
            if not isinstance(desired, list) or json.loads(name) not in desired:
                return False
            continue
        elif kind == "i":
            if not isinstance(desired, list) or int(name) >= len(desired):
                return False
            found = desired[int(name)]
        else:  # "."
            continue
        if below and not _covers(found, below):
            return False
    return True


def _containers(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    pod = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    return [(field, container) for field in ("initContainers", "containers")
            for container in pod.get(field) or []]


def stray_env_patch(desired: dict[str, Any], live: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON-patch operations removing env vars the live Deployment has and the pool does not."""
    wanted = {(field, c["name"]): {e["name"] for e in c.get("env") or []}
              for field, c in _containers(desired)}
    indexes = {field: {c.get("name"): i for i, c in enumerate(
        ((live.get("spec") or {}).get("template") or {}).get("spec", {}).get(field) or [])}
        for field in ("initContainers", "containers")}
    operations = []
    for field, container in _containers(live):
        keep = wanted.get((field, container.get("name")))
        if keep is None:
            continue
        position = indexes[field][container.get("name")]
        base = f"/spec/template/spec/{field}/{position}/env"
        env = container.get("env") or []
        for index in reversed(range(len(env))):  # from the end: earlier indexes stay valid
            if env[index].get("name") not in keep:
                operations += [{"op": "test", "path": f"{base}/{index}/name",
                                "value": env[index].get("name")},
                               {"op": "remove", "path": f"{base}/{index}"}]
    return operations


def _port_key(port: dict[str, Any]) -> tuple[Any, str]:
    return port.get("port"), port.get("protocol") or "TCP"


def _applied_port_keys(live: dict[str, Any]) -> set[tuple[Any, str]]:
    """The (port, protocol) of each Service port the operator's last apply set."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if (entry.get("manager") == api.FIELD_MANAGER and entry.get("operation") == "Apply"
                and not entry.get("subresource")):
            ports = ((entry.get("fieldsV1") or {}).get("f:spec") or {}).get("f:ports") or {}
            return {_port_key(json.loads(key[2:])) for key in ports if key.startswith("k:")}
    return set()


def stray_ports_patch(desired: dict[str, Any], live: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON-patch operations putting the pool's ports back on a Service that has one the pool
    neither sets nor set before (someone else's); ports the operator set before and the pool
    no longer wants are left to the apply. Guarded by a `test` of the ports as read."""
    ports = (live.get("spec") or {}).get("ports") or []
    known = {_port_key(port) for port in desired["spec"]["ports"]} | _applied_port_keys(live)
    if all(_port_key(port) in known for port in ports):
        return []
    return [{"op": "test", "path": "/spec/ports", "value": ports},
            {"op": "replace", "path": "/spec/ports", "value": desired["spec"]["ports"]}]
