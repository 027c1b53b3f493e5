"""The kopf peering object must exist before `radixpool operator` runs without `--standalone`.

Without it kopf waits silently and reconciles nothing. So at start-up the operator makes sure it
exists: it creates the missing object (a ClusterKopfPeering when it watches every namespace, a
KopfPeering in each watched namespace), and when it cannot (the kopf.dev CRDs are not installed,
or RBAC forbids creating it) it stops with a message that says what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .reconcile import ApiFailure

PEERING_API = "kopf.dev/v1"


class PeeringUnavailable(Exception):
    """The peering object is missing and could not be created."""


def peering_objects(name: str, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    if not namespaces:
        return [{"apiVersion": PEERING_API, "kind": "ClusterKopfPeering",
                 "metadata": {"name": name}}]
    return [{"apiVersion": PEERING_API, "kind": "KopfPeering",
             "metadata": {"name": name, "namespace": namespace}} for namespace in namespaces]


def ensure_peering(cluster: Any, name: str, namespaces: Sequence[str]) -> list[str]:
    """Create whichever peering objects are missing; the ones created, as `Kind ns/name`."""
    created = []
    for obj in peering_objects(name, namespaces):
        where = f"{obj['kind']} {obj['metadata'].get('namespace', '')}/{name}".replace(" /", " ")
        try:
            if cluster.create_if_missing(obj):
                created.append(where)
        except ApiFailure as failure:
            hint = ("install its CRD: kubectl apply --server-side -f crds/kopf-peering.yaml"
                    if failure.code == 404 else
                    f"create it (kubectl apply -f - with kind {obj['kind']}), or grant the "
                    f"operator create on kopf.dev {obj['kind'].lower()}s")
            raise PeeringUnavailable(
                f"the peering object {where} is missing and could not be created ({failure}); "
                f"{hint}; or run one replica with --standalone") from failure
    return created
