"""`radixpool worker`: load the engine, serve HTTP, drain on SIGTERM.

The HTTP server starts first, so `/health` answers 503 while the model loads. SIGTERM (or SIGINT)
while it loads stops the engine core at once and exits 0: a pod deleted while loading goes in
seconds, not at the end of its grace period. Once serving, SIGTERM starts a drain: `/health`
and new requests get 503, running requests get up to `--drain-timeout` to finish, then the server
stops, the engine shuts down and the process exits 0. A second SIGTERM or a
SIGINT stops at once. If the engine core process dies, the worker logs why, lets the requests in
flight end with 503, and exits 1 within seconds, so the container is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import asdict
from types import FrameType

import uvicorn

from radixpool.http_edge import edge_protocol
from radixpool.listen import http_url, listen_socket
from radixpool.worker.server.app import create_app
from radixpool.worker.server.config import ServerConfig, in_flag_terms
from radixpool.worker.server.state import WorkerState

log = logging.getLogger("radixpool.worker.server")
ABORT_GRACE_S = 5.0   # after a drain timeout, how long aborted requests get to send their end
CORE_POLL_S = 0.5     # how often the engine core process is checked
CORE_DEATH_GRACE_S = 3.0   # after the core died, how long failing requests get to answer


class WorkerServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: WorkerState) -> None:
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stop_loading = threading.Event()   # set on exit: an engine still loading stops

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not calling super(): uvicorn re-raises captured signals after shutdown, which would
        # turn a clean drain into death by SIGTERM (exit status 143 instead of 0).
        # A model still loading is abandoned: the drain has nothing to wait for, and shutdown
        # would otherwise wait for the load to finish (the loading thread cannot be cancelled).
        self._stop_loading.set()
        if sig == signal.SIGTERM and not self.should_exit and self.loop is not None \
                and self.state.lifecycle.begin_drain():
            self.loop.call_soon_threadsafe(self._spawn, self._drain())
            return
        if self.should_exit:
            self.force_exit = True
        elif self.loop is not None:
            self.loop.call_soon_threadsafe(self.state.lifecycle.stop_waiting)   # end long polls
        self.should_exit = True

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        self.state.lifecycle.stop_waiting()   # long polls answer now; new ones get 503
        timeout = self.state.config.drain_timeout
        log.info("SIGTERM: draining %d running request(s), up to %.0f s",
                 self.state.lifecycle.inflight, timeout)
        lifecycle = self.state.lifecycle
        if await lifecycle.wait_idle(timeout):
            log.info("drained; shutting down")
        else:
            lifecycle.drain_expired = True
            aborted = self.state.abort_all()
            log.warning("drain timeout: aborted %d running request(s)", aborted)
            # their streams end with finish_reason "abort", whole answers with a 503 (a gateway
            # sends them again elsewhere); the rest is cut at shutdown
            await lifecycle.wait_idle(ABORT_GRACE_S)
        self.config.timeout_graceful_shutdown = 1
        self.should_exit = True

    async def _load_engine(self) -> None:
        from radixpool.worker import Engine
        from radixpool.worker.engine_errors import EngineStartCancelled

        cfg = self.state.config
        try:
            engine = await asyncio.to_thread(Engine, cancel=self._stop_loading,
                                             **asdict(cfg.engine))
        except EngineStartCancelled:
            log.info("stopped while the model was loading")
            return
        except Exception as exc:
            reason = in_flag_terms(str(exc))   # `--kv-cache-tokens`, not `kv_cache_tokens`
            log.error("engine failed to start: %s", reason)
            self.state.lifecycle.mark_failed(f"the engine failed to start: {reason}")
            self.should_exit = True
            return
        engine.bind_loop()   # the core's output is read on this loop: no receiver thread hop
        self.state.attach(engine)
        self._spawn(self._watch_core(engine))
        info = engine.info
        log.info("serving %s as '%s' on %s — %s %s, %s attention, context %d tokens, "
                 "KV capacity %d tokens (page size %d), tool calls %s, warm-up %s, instance %s",
                 cfg.engine.model_path, cfg.served_model_name, http_url(cfg.host, cfg.port),
                 info.device, info.dtype, info.attention_backend, info.context_length,
                 info.kv_capacity_tokens, info.page_size, self.state.tool_format,
                 f"{info.warmup_seconds:.2f} s" if cfg.engine.warmup else "skipped",
                 engine.instance_id)

    async def _watch_core(self, engine) -> None:
        """Exit non-zero once the engine core process is gone: nothing here can revive it."""
        while engine.alive:
            await asyncio.sleep(CORE_POLL_S)
        if self.should_exit:
            return   # a shutdown already under way
        reason = engine.stall or (f"the engine core process died (exit code "
                                  f"{engine.core_exit_code})")
        log.error("%s; exiting with status 1 so the worker is restarted", reason)
        lifecycle = self.state.lifecycle
        lifecycle.mark_failed(reason)
        await lifecycle.wait_idle(CORE_DEATH_GRACE_S)   # requests in flight end with 503 first
        self.config.timeout_graceful_shutdown = 1
        self.should_exit = True

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        self._spawn(self._load_engine())
        await super().serve(sockets)


def run_worker(config: ServerConfig) -> int:
    from prometheus_client import disable_created_metrics

    disable_created_metrics()   # no `_created` series: they double the scrape for nothing
    level = config.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = listen_socket(config.host, config.port)   # `::`: both families; uvicorn's: v6 only
    except OSError as exc:   # the port in use, an address not on this host
        log.error("cannot listen on %s: %s", http_url(config.host, config.port), exc.strerror)
        return 1
    state = WorkerState(config)
    uv_config = uvicorn.Config(
        create_app(state), host=config.host, port=config.port, log_level=config.log_level,
        access_log=config.log_level == "debug", timeout_graceful_shutdown=5,
        timeout_keep_alive=30, http=edge_protocol(config.edge),
    )
    server = WorkerServer(uv_config, state)
    try:
        server.run(sockets=[sock])   # uvicorn's loop factory: uvloop when installed
    finally:
        sock.close()
        state.bodies.close()
        if state.engine is not None:
            state.engine.shutdown()
    if state.lifecycle.failure is not None:
        return 1
    return 0
