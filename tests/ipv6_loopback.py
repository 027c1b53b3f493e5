"""Whether this machine can bind IPv6 loopback, for the tests that need it."""

from __future__ import annotations

import socket


def ipv6_loopback_missing() -> str | None:
    """Why ::1 cannot be used here (a skip reason), or None when it can."""
    if not socket.has_ipv6:
        return "Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        return f"no IPv6 loopback on this machine: {exc}"
    return None
