"""Kubernetes discovery, the pure part: EndpointSlices (as plain camelCase dicts, the way the API
serves them) → the set of ready worker URLs and the set of terminating ones.

Rules, from the EndpointSlice API: an endpoint whose `conditions.terminating` is true is
*terminating* — the gateway stops sending it new requests but lets its streams finish; otherwise
it is *ready* unless `conditions.ready` is false (a missing `ready` means ready). Not-ready
endpoints are left out entirely. The port is the one named `port_name`, else the slice's first
port. A Service has several slices: the state keeps each slice's view by name, so a watch event
for one slice replaces that slice only, and a DELETED slice drops its endpoints.

A dual-stack Service has slices of both families (`addressType` IPv4 and IPv6) listing the same
pods: the gateway follows the IPv4 ones only while both exist, else each pod would be two workers
(its cache view, load and series split in two). A single-stack Service, IPv6 included, is
followed whole.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixpool.listen import http_url


def slice_endpoints(endpoint_slice: dict, port_name: str | None = None
                    ) -> tuple[set[str], set[str]]:
    """(ready URLs, terminating URLs) of one EndpointSlice."""
    ports = endpoint_slice.get("ports") or []
    if port_name is not None:
        ports = [p for p in ports if p.get("name") == port_name]
    port = next((p.get("port") for p in ports if p.get("port")), None)
    ready: set[str] = set()
    terminating: set[str] = set()
    if port is None:
        return ready, terminating
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("terminating") is True:
            target = terminating
        elif conditions.get("ready") is False:
            continue
        else:
            target = ready
        target.update(http_url(a, port) for a in endpoint.get("addresses") or [])
    return ready, terminating


class EndpointSliceState:
    """The workers of one Service, maintained from a LIST and then WATCH events."""

    def __init__(self, port_name: str | None = None) -> None:
        self.port_name = port_name
        self._slices: dict[str, tuple[str, set[str], set[str]]] = {}   # name → family, sets

    def replace(self, slices: Iterable[dict]) -> None:
        """A fresh LIST (start, or after the watch expired): forget everything else."""
        self._slices = {_name(s): self._view(s) for s in slices}

    def _view(self, endpoint_slice: dict) -> tuple[str, set[str], set[str]]:
        return (endpoint_slice.get("addressType", ""),
                *slice_endpoints(endpoint_slice, self.port_name))

    def apply(self, event_type: str, endpoint_slice: dict) -> bool:
        """One watch event; returns whether it was understood (ADDED / MODIFIED / DELETED)."""
        name = _name(endpoint_slice)
        if event_type in ("ADDED", "MODIFIED"):
            self._slices[name] = self._view(endpoint_slice)
        elif event_type == "DELETED":
            self._slices.pop(name, None)
        else:
            return False
        return True

    def workers(self) -> tuple[set[str], set[str]]:
        """(ready, terminating); an address ready in any slice counts as ready."""
        ready: set[str] = set()
        terminating: set[str] = set()
        families = {family for family, _, _ in self._slices.values()}
        skip = "IPv6" if {"IPv4", "IPv6"} <= families else None   # dual stack: one family
        for family, r, t in self._slices.values():
            if family == skip:
                continue
            ready |= r
            terminating |= t
        return ready, terminating - ready


def _name(endpoint_slice: dict) -> str:
    return (endpoint_slice.get("metadata") or {}).get("name", "")
