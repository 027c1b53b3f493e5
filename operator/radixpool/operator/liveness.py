"""The operator's liveness endpoint (`--liveness URL`), on both address families.

kopf's own endpoint (`liveness_endpoint`) binds through aiohttp and asyncio, which bind `::`
IPv6-only, and the old default `0.0.0.0` is IPv4-only: one or the other left kubelet's probe to
the pod IP refused on an IPv6-only or a dual-stack cluster, and the operator restarted forever.
This one binds with `radixpool.listen` (`::`, the default: every IPv6 and IPv4 address, IPv4 only
where IPv6 is off) and answers on the kopf event loop, so a wedged loop fails the probe as it did
with kopf's. The operator registers no probe handlers, so kopf's answered `{}`: so does this one.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import kopf
from aiohttp import web

from radixpool.listen import listen_socket


def parse_endpoint(url: str) -> tuple[str, int, str]:
    """`http://HOST:PORT/PATH` → (host, port, path); raises ValueError naming the URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"--liveness {url!r}: {exc}") from None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(f"--liveness {url!r}: expected http://HOST:PORT/PATH, "
                         "an IPv6 address in brackets")
    return parts.hostname, port, parts.path or "/"


async def serve(url: str) -> web.AppRunner:
    """Start answering `GET PATH` with 200 `{}`; stop it with `runner.cleanup()`."""
    host, port, path = parse_endpoint(url)

    async def alive(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.get(path, alive)])
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.SockSite(runner, listen_socket(host, port)).start()
    return runner


def register(url: str, registry: kopf.OperatorRegistry | None = None) -> None:
    """Serve `url` from the operator's start to its end (kopf startup and cleanup handlers); a
    port that cannot be bound stops the operator instead of being retried."""
    registry = registry or kopf.get_default_registry()
    runners: list[web.AppRunner] = []

    async def serve_liveness(**_: Any) -> None:
        try:
            runners.append(await serve(url))
        except OSError as exc:
            raise kopf.PermanentError(f"cannot serve the liveness endpoint {url}: {exc}") from exc

    async def stop_liveness(**_: Any) -> None:
        while runners:
            await runners.pop().cleanup()

    kopf.on.startup(registry=registry, id="liveness")(serve_liveness)
    kopf.on.cleanup(registry=registry, id="liveness")(stop_liveness)
