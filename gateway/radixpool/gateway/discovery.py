"""Kubernetes discovery, the pure part: EndpointSlices (as plain camelCase dicts, the way the API
serves them) → the set of ready worker URLs, the set of terminating ones, and each one's pod.

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

An endpoint backed by a pod names it in `targetRef` ({kind: Pod, name}): the gateway labels that
worker's series with it (`worker_pod`), the name every worker's own series carry as `pod`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from radixpool.listen import http_url


@dataclass(frozen=True)
class SliceView:
    """What one EndpointSlice says: its address family, its workers and their pods."""
    family: str
    ready: set[str]
    terminating: set[str]
    pods: dict[str, str]


def slice_endpoints(endpoint_slice: dict, port_name: str | None = None
                    ) -> tuple[set[str], set[str]]:
    """(ready URLs, terminating URLs) of one EndpointSlice."""
    ready: set[str] = set()
    terminating: set[str] = set()
    for url, endpoint in _endpoints(endpoint_slice, port_name):
        conditions = endpoint.get("conditions") or {}
        if conditions.get("terminating") is True:
            terminating.add(url)
        elif conditions.get("ready") is not False:
            ready.add(url)
    return ready, terminating


def slice_pods(endpoint_slice: dict, port_name: str | None = None) -> dict[str, str]:
    """URL → pod name, for the endpoints of one EndpointSlice whose `targetRef` is a pod."""
    pods: dict[str, str] = {}
    for url, endpoint in _endpoints(endpoint_slice, port_name):
        target = endpoint.get("targetRef") or {}
        if target.get("kind") == "Pod" and target.get("name"):
            pods[url] = target["name"]
    return pods


def _endpoints(endpoint_slice: dict, port_name: str | None) -> Iterator[tuple[str, dict]]:
    """(URL, endpoint) for each address of the slice, on the port named `port_name` (else its
    first); nothing when the slice has no such port."""
    ports = endpoint_slice.get("ports") or []
    if port_name is not None:
        ports = [p for p in ports if p.get("name") == port_name]
    port = next((p.get("port") for p in ports if p.get("port")), None)
    if port is None:
        return
    for endpoint in endpoint_slice.get("endpoints") or []:
        for address in endpoint.get("addresses") or []:
            yield http_url(address, port), endpoint


class EndpointSliceState:
    """The workers of one Service, maintained from a LIST and then WATCH events."""

    def __init__(self, port_name: str | None = None) -> None:
        self.port_name = port_name
        self._slices: dict[str, SliceView] = {}   # by slice name

    def replace(self, slices: Iterable[dict]) -> None:
        """A fresh LIST (start, or after the watch expired): forget everything else."""
        self._slices = {_name(s): self._view(s) for s in slices}

    def _view(self, endpoint_slice: dict) -> SliceView:
        return SliceView(endpoint_slice.get("addressType", ""),
                         *slice_endpoints(endpoint_slice, self.port_name),
                         slice_pods(endpoint_slice, self.port_name))

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

    def _followed(self) -> list[SliceView]:
        families = {view.family for view in self._slices.values()}
        skip = "IPv6" if {"IPv4", "IPv6"} <= families else None   # dual stack: one family
        return [view for view in self._slices.values() if view.family != skip]

    def workers(self) -> tuple[set[str], set[str]]:
        """(ready, terminating); an address ready in any slice counts as ready."""
        ready: set[str] = set()
        terminating: set[str] = set()
        for view in self._followed():
            ready |= view.ready
            terminating |= view.terminating
        return ready, terminating - ready

    def pods(self) -> dict[str, str]:
        """URL → pod name of the workers whose endpoint names its pod."""
        return {url: pod for view in self._followed() for url, pod in view.pods.items()}


def _name(endpoint_slice: dict) -> str:
    return (endpoint_slice.get("metadata") or {}).get("name", "")
