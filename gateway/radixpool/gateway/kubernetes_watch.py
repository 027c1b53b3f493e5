"""Kubernetes discovery, the I/O shell: LIST then WATCH the EndpointSlices of one Service
(`kubernetes.io/service-name=<service>`) with the official client, in a daemon thread (the client
is blocking), and hand every change to the event loop. A watch that expires (410 Gone) or breaks
re-lists; nothing is polled. The rules live in `discovery.py`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from radixpool.gateway.discovery import EndpointSliceState

log = logging.getLogger("radixpool.gateway")

OnChange = Callable[[set[str], set[str]], None]


def start_watch(service: str, namespace: str, port_name: str | None,
                on_change: OnChange) -> threading.Thread:
    """Watch the Service's EndpointSlices; `on_change(ready, terminating)` runs on this loop."""
    loop = asyncio.get_running_loop()
    thread = threading.Thread(target=_run, args=(service, namespace, port_name, on_change, loop),
                              name=f"endpointslices-{service}", daemon=True)
    thread.start()
    return thread


def _run(service: str, namespace: str, port_name: str | None, on_change: OnChange,
         loop: asyncio.AbstractEventLoop) -> None:
    from kubernetes import client, config, watch
    from kubernetes.client.exceptions import ApiException

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.DiscoveryV1Api()
    plain = client.ApiClient().sanitize_for_serialization
    state = EndpointSliceState(port_name)
    selector = f"kubernetes.io/service-name={service}"

    def push() -> None:
        loop.call_soon_threadsafe(on_change, *state.workers())

    while not loop.is_closed():
        try:
            listed = api.list_namespaced_endpoint_slice(namespace, label_selector=selector)
            state.replace(plain(item) for item in listed.items)
            push()
            stream = watch.Watch().stream(
                api.list_namespaced_endpoint_slice, namespace, label_selector=selector,
                resource_version=listed.metadata.resource_version, timeout_seconds=300)
            for event in stream:
                if event["type"] == "ERROR":
                    break  # typically 410 Gone: re-list
                if state.apply(event["type"], plain(event["object"])):
                    push()
        except ApiException as exc:
            log.warning("EndpointSlice watch for %s/%s: %s; re-listing", namespace, service,
                        exc.reason)
            time.sleep(1.0)
        except Exception as exc:  # network trouble: keep the last known set, retry
            log.warning("EndpointSlice watch for %s/%s failed: %r", namespace, service, exc)
            time.sleep(2.0)
