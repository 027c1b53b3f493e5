"""Gateway test harness: a simulated worker fleet and a real gateway on loopback (ephemeral
ports), served by an event loop in a background thread so tests drive them with ordinary
blocking clients (httpx, the openai SDK)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace

import httpx
import pytest

from bench.simfleet import SimConfig, SimFleet
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.server import GatewayServer


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args):
        async def wrapper():
            return fn(*args)
        return self.run(wrapper())

    def close(self) -> None:
        async def cancel_rest() -> None:
            pending = asyncio.all_tasks() - {asyncio.current_task()}
            while pending:  # again until done: 3.11's wait_for can swallow a cancellation
                for task in pending:
                    task.cancel()
                _, pending = await asyncio.wait(pending, timeout=0.1)
        self.run(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Stack:
    """N simulated workers behind one gateway."""

    def __init__(self, loop: LoopThread, workers: int, sim: SimConfig,
                 config: GatewayConfig) -> None:
        self.loop = loop
        self.fleet = SimFleet(workers, sim)
        loop.run(self.fleet.start())
        self.config = replace(config, worker_urls=tuple(self.fleet.urls), host="127.0.0.1",
                              port=0)
        self.server = GatewayServer(self.config)
        loop.run(self.server.start())
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.client = httpx.Client(base_url=self.url, timeout=30.0)

    @property
    def gateway(self):
        return self.server.gateway

    def check_all(self) -> None:
        """One round of active checks on every worker, now (instead of waiting for the timer)."""
        monitor = self.server.monitor
        for worker in self.gateway.workers:
            self.loop.run(monitor.check(worker))

    def settle(self) -> None:
        """Let the gateway finish its bookkeeping: a client can read an answer before the
        gateway's loop has run the lines after sending it."""
        self.loop.run(asyncio.sleep(0))

    def worker_of(self, response: httpx.Response) -> int:
        return self.fleet.urls.index(response.headers["x-radixpool-worker"])

    def close(self) -> None:
        self.client.close()
        self.loop.run(self.server.stop())
        self.loop.run(self.fleet.stop())


@pytest.fixture(scope="module")
def loop_thread():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def make_stack(loop_thread):
    """`make_stack(workers=3, sim=SimConfig(...), **gateway_config) -> Stack`."""
    stacks: list[Stack] = []

    def make(workers: int = 3, sim: SimConfig | None = None, **config) -> Stack:
        config.setdefault("health_interval", 3600.0)  # tests run checks explicitly
        stack = Stack(loop_thread, workers, sim or SimConfig(), GatewayConfig(**config))
        stack.check_all()
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.close()


def words(start: int, count: int) -> str:
    """`count` distinct tokens of the simulated tokenizer (one word = one token)."""
    return " ".join(f"w{(start + i) % 4096}" for i in range(count))


def latencies_during(url: str, big: Callable[[], httpx.Response]
                     ) -> tuple[list[float], float, httpx.Response]:
    """Small requests (`GET /livez`) one after another while `big()` runs: their latencies, how
    long `big` took, and its response."""
    latencies: list[float] = []
    done = threading.Event()
    probe = httpx.Client(base_url=url, timeout=120)   # made before: clients cost GIL time
    probe.get("/livez")

    def small_requests() -> None:
        while not done.is_set():
            started = time.monotonic()
            probe.get("/livez")
            latencies.append(time.monotonic() - started)

    smalls = threading.Thread(target=small_requests)
    smalls.start()
    time.sleep(0.2)
    started = time.monotonic()
    try:
        response = big()
    finally:
        took = time.monotonic() - started
        done.set()
        smalls.join(120)
        probe.close()
    return latencies, took, response
