"""Kubernetes discovery, the I/O shell: LIST then WATCH the EndpointSlices of one Service
(`kubernetes.io/service-name=<service>`) with the official client, in a daemon thread (the client
is blocking), and hand every change to the event loop. A watch that expires (410 Gone, an ERROR
event) or breaks re-lists; nothing is polled. The rules live in `discovery.py`.

Every call has a client-side deadline: the server ends a watch after `WATCH_SECONDS`, but a
connection that was dropped silently (a NAT or load balancer forgetting it) never ends, and a
blocked read would freeze discovery for good. A watch read that stays silent `WATCH_SLACK_SECONDS`
past the server's own deadline is treated as broken and re-listed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from radixpool.gateway.discovery import EndpointSliceState

log = logging.getLogger("radixpool.gateway")

OnChange = Callable[[set[str], set[str], dict[str, str]], None]   # ready, terminating, pods


class DiscoveryUnavailable(RuntimeError):
    """The Kubernetes API cannot be reached with any configuration we know of."""


WATCH_SECONDS = 300
WATCH_SLACK_SECONDS = 30
CONNECT_SECONDS = 10
LIST_SECONDS = 30


def start_watch(service: str, namespace: str, port_name: str | None,
                on_change: OnChange) -> threading.Event:
    """Watch the Service's EndpointSlices; `on_change(ready, terminating, pods)` runs on this
    loop (`pods`: URL → pod name, where the endpoint names one).
    Set the returned event to stop (the thread ends at its next wake-up)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except config.ConfigException as exc:
            raise DiscoveryUnavailable(
                f"--k8s-service {service}: no in-cluster service account and no usable "
                f"kubeconfig ({exc})") from exc
    loop = asyncio.get_running_loop()
    stop = threading.Event()

    def deliver(ready: set[str], terminating: set[str], pods: dict[str, str]) -> None:
        loop.call_soon_threadsafe(on_change, ready, terminating, pods)

    threading.Thread(target=watch_endpoint_slices,
                     args=(client.DiscoveryV1Api(), service, namespace, port_name, deliver, stop),
                     name=f"endpointslices-{service}", daemon=True).start()
    return stop


def watch_endpoint_slices(api, service: str, namespace: str, port_name: str | None,
                          deliver: OnChange, stop: threading.Event, watcher=None) -> None:
    """The blocking LIST + WATCH loop; `api` is a `DiscoveryV1Api` and `watcher` a
    `kubernetes.watch.Watch` (or test doubles)."""
    from kubernetes.client import ApiClient

    plain = ApiClient().sanitize_for_serialization
    state = EndpointSliceState(port_name)
    selector = f"kubernetes.io/service-name={service}"
    while not stop.is_set():
        try:
            listed = api.list_namespaced_endpoint_slice(
                namespace, label_selector=selector,
                _request_timeout=(CONNECT_SECONDS, LIST_SECONDS))
            state.replace(plain(item) for item in listed.items)
            deliver(*state.workers(), state.pods())
            stream = (watcher or _new_watch()).stream(
                api.list_namespaced_endpoint_slice, namespace, label_selector=selector,
                resource_version=listed.metadata.resource_version, timeout_seconds=WATCH_SECONDS,
                _request_timeout=(CONNECT_SECONDS, WATCH_SECONDS + WATCH_SLACK_SECONDS))
            for event in stream:
                if stop.is_set() or event["type"] == "ERROR":
                    break  # ERROR is typically 410 Gone: re-list
                raw = event.get("raw_object") or plain(event["object"])
                if state.apply(event["type"], raw):
                    deliver(*state.workers(), state.pods())
        except Exception as exc:  # API or network trouble: keep the last known set, re-list
            log.warning("EndpointSlice watch for %s/%s: %r; re-listing", namespace, service, exc)
            stop.wait(2.0)


def _new_watch():
    from kubernetes import watch

    return watch.Watch()
