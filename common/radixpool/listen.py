"""Listening sockets and URLs for both address families (the worker's and the gateway's edge).

`--host ::` means every address of both families: one IPv6 socket with IPV6_V6ONLY off, which on
Linux also takes IPv4 connections (as ::ffff:a.b.c.d). A pod on an IPv6-only cluster (EKS/GKE
IPv6: the pod IP is IPv6 only) is then reached on its pod IP by kubelet's probes, the gateway and
Prometheus, and a dual-stack or IPv4 pod on its IPv4 address too. Where the kernel has IPv6 off
(no AF_INET6, or `::` not bindable) it binds 0.0.0.0 instead and logs that. asyncio's and
uvicorn's own binding of `::` sets IPV6_V6ONLY, so IPv4 clients were refused: both servers bind
here and hand the socket over.

Any other host binds as given: an IPv6 literal (brackets allowed) as IPv6 only, else IPv4.
"""

from __future__ import annotations

import errno
import logging
import socket

log = logging.getLogger(__name__)

ALL_ADDRESSES = "::"
# what a kernel without IPv6 answers: no such family, or no such address to bind
_NO_IPV6 = (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT)


def bare_host(host: str) -> str:
    """`[::1]` → `::1`; anything else unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """`host:port` as a URL authority or Host header writes it: IPv6 literals in brackets."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_url(host: str, port: int) -> str:
    return f"http://{host_port(host, port)}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket for `host:port`; see the module docstring."""
    host = bare_host(host)
    if host == ALL_ADDRESSES:
        try:
            return _bind(socket.AF_INET6, host, port, dual_stack=True)
        except OSError as exc:
            if exc.errno not in _NO_IPV6:
                raise
            log.warning("IPv6 is not available here (%s): listening on 0.0.0.0:%d, IPv4 only",
                        exc.strerror, port)
            return _bind(socket.AF_INET, "0.0.0.0", port)
    return _bind(socket.AF_INET6 if ":" in host else socket.AF_INET, host, port)


def _bind(family: int, host: str, port: int, dual_stack: bool = False) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
