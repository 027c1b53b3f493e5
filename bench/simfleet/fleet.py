"""A fleet of simulated workers in one event loop (tests, the routing benchmark, and
`python -m bench.simfleet --count N`), with a sampler that catches routing failures the fleet can
see: a worker sitting idle while another has prefills queued."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable

from radixpool.tokenization import PromptTokenizer

from .http_server import serve
from .kv import sim_tokenizer_files
from .sglang_eviction import BENCH_EVICTION_POLICIES
from .worker import SimConfig, SimWorker

SAMPLE_SECONDS = 0.005


class SimFleet:
    def __init__(self, count: int, config: SimConfig) -> None:
        files = sim_tokenizer_files()
        tokenizer = PromptTokenizer(files)
        self.workers = [SimWorker(config, tokenizer, files) for _ in range(count)]
        for worker in self.workers:
            worker.fleet_stats = self._stats_endpoint
        self.samples = 0
        self.idle_while_queued = 0
        self._sampler: asyncio.Task | None = None

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    async def start(self, host: str = "127.0.0.1", base_port: int = 0) -> None:
        for i, worker in enumerate(self.workers):
            worker.server = await serve(worker, host, base_port + i if base_port else 0, 1 << 26,
                                        connections=worker.connections)
        self._sampler = asyncio.get_running_loop().create_task(self._sample())

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        for worker in self.workers:
            await kill(worker)

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_SECONDS)
            busy = [w.running + w.waiting for w in self.workers if w.server is not None]
            queued = any(w.waiting for w in self.workers)
            if any(busy):
                self.samples += 1
                if queued and min(busy) == 0:
                    self.idle_while_queued += 1

    def stats(self) -> dict:
        prompt = sum(w.prompt_tokens for w in self.workers)
        cached = sum(w.cached_tokens for w in self.workers)
        return {
            "requests": [w.requests for w in self.workers],
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "busy_samples": self.samples,
            "idle_while_queued_samples": self.idle_while_queued,
        }

    def _stats_endpoint(self, reset: bool) -> dict:
        stats = self.stats()
        if reset:
            self.reset_stats()
        return stats

    def reset_stats(self) -> None:
        for w in self.workers:
            w.prompt_tokens = w.cached_tokens = w.requests = 0
        self.samples = self.idle_while_queued = 0


async def kill(worker: SimWorker) -> None:
    """Stop listening and cut every open connection: a crashed worker, as clients see it."""
    server, worker.server = worker.server, None
    if server is not None:
        server.close()
    for connection in list(worker.connections):
        connection.abort()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SimConfig()
    p.add_argument("--count", type=int, default=1, help="workers to run")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="first port (0: ephemeral ports)")
    p.add_argument("--kv-capacity-tokens", type=int, default=d.kv_capacity_tokens)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--eviction-policy", choices=BENCH_EVICTION_POLICIES, default=d.eviction_policy)
    p.add_argument("--prefill-us-per-token", type=float, default=d.prefill_us_per_token)
    p.add_argument("--decode-ms-per-token", type=float, default=d.decode_ms_per_token)
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false")


def main(argv: list[str] | None = None,
         prepare: Callable[[SimFleet], None] | None = None) -> int:
    """Serve `--count` simulated workers until killed; `prepare` may alter them first."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.simfleet",
        description="Simulated RadixPool workers for tests and benchmarks: the worker protocol "
                    "(/server_info, /tokenizer, /kv_events, cached_tokens, ...) over the engine's "
                    "own radix cache, no model. Prints the workers' URLs as JSON.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    config = SimConfig(kv_capacity_tokens=args.kv_capacity_tokens, block_size=args.block_size,
                       eviction_policy=args.eviction_policy,
                       prefill_us_per_token=args.prefill_us_per_token,
                       decode_ms_per_token=args.decode_ms_per_token, kv_events=args.kv_events)

    async def run() -> None:
        fleet = SimFleet(args.count, config)
        if prepare is not None:
            prepare(fleet)
        await fleet.start(args.host, args.port)
        print(json.dumps({"urls": fleet.urls}), flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(run())
    except KeyboardInterrupt:
        pass
    sys.stdout.flush()
    return 0
