"""Assembling and running the gateway: the app, its HTTP edge (uvicorn), the monitors, discovery.

`GatewayServer` is used the same way by the CLI (`run`, blocking, uvloop, stops on SIGTERM/SIGINT
after in-flight requests finish, for up to `--drain-timeout`) and by tests and benchmarks
(`await start()` / `await stop()` inside their own loop, bound to port 0).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.http_edge import EdgeLimits, EdgeServer
from radixpool.gateway.monitor import Monitor
from radixpool.gateway.proxy import Gateway
from radixpool.listen import http_url
from radixpool.tokenization import PromptTokenizer

log = logging.getLogger("radixpool.gateway")

REFUSALS_WAIT_S = 1.0   # at most this long for the requests held at the drain's end to be refused


class GatewayServer:
    def __init__(self, config: GatewayConfig, tokenizer: PromptTokenizer | None = None) -> None:
        self.config = config
        self.gateway = Gateway(config, tokenizer)
        self.monitor: Monitor | None = None
        self.server: EdgeServer | None = None
        self._discovery_stop: threading.Event | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    async def start(self) -> None:
        self.monitor = Monitor(self.gateway.workers, self.gateway.fetch, self.gateway.metrics,
                               self.gateway.hung)
        self.monitor.start()
        if self.config.k8s_service:
            from radixpool.gateway.kubernetes_watch import start_watch

            self._discovery_stop = start_watch(self.config.k8s_service, self.config.namespace,
                                               self.config.k8s_port_name,
                                               self.gateway.workers.reconcile)
        cfg = self.config
        self.server = EdgeServer(self.gateway, cfg.host, cfg.port, EdgeLimits(
            header_read_timeout=cfg.header_read_timeout,
            keep_alive_timeout=cfg.keep_alive_timeout, max_header_bytes=cfg.max_header_bytes,
            max_body_bytes=cfg.max_body_bytes, body_read_timeout=cfg.body_read_timeout,
            max_connections=cfg.max_connections, write_stall_timeout=cfg.write_stall_timeout,
            large_body_budget_bytes=cfg.large_body_budget_bytes), screen=self.gateway.screen)
        await self.server.start()

    async def stop(self, drain_seconds: float = 0.0) -> None:
        """Refuse new requests (503 `draining`, `/health` 503), let those in flight finish for
        up to `drain_seconds` (a request held by late binding is still placed meanwhile, and
        answered 503 `draining` if still held at the end), then close."""
        gateway = self.gateway
        gateway.draining = True
        if self._discovery_stop is not None:
            self._discovery_stop.set()
        deadline = asyncio.get_running_loop().time() + drain_seconds
        while ((gateway.holding or any(w.inflight for w in gateway.workers))
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.05)
        if gateway.holding is not None and (answering := gateway.holding.close()):
            await asyncio.wait(answering, timeout=REFUSALS_WAIT_S)
        if self.server is not None:   # what is still answering has the rest of the drain
            await self.server.stop(grace=max(0.0, deadline - asyncio.get_running_loop().time()))
        if self.monitor is not None:
            await self.monitor.stop()
        for pool in self.gateway.pools.values():
            pool.close()
        self.gateway.bodies.close()


async def _main(config: GatewayConfig, tokenizer: PromptTokenizer | None) -> None:
    server = GatewayServer(config, tokenizer)
    await server.start()
    log.info("radixpool gateway on %s, policy %s, %d static workers",
             http_url(config.host, server.port), config.policy, len(config.worker_urls))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: finishing in-flight requests (up to %.0fs)", config.drain_timeout)
    await server.stop(config.drain_timeout)


def run(config: GatewayConfig) -> int:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from radixpool.gateway.kubernetes_watch import DiscoveryUnavailable

    try:
        tokenizer = PromptTokenizer.from_dir(config.tokenizer) if config.tokenizer else None
    except (OSError, ValueError) as exc:
        log.error("--tokenizer %s: %s", config.tokenizer, exc)
        return 2
    try:
        import uvloop
    except ImportError:  # Windows: the stock loop still works, only slower
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(_main(config, tokenizer))
    except (DiscoveryUnavailable, OSError) as exc:  # bad discovery config, port in use, ...
        log.error("%s", exc)
        return 2
    return 0
