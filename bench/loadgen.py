"""Load for the routing benchmarks on loopback: the workloads (token counts exact: the simulated
tokenizer is one token per word) and closed-loop clients sending streamed requests."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from radixpool.gateway.upstream import UpstreamPool

HEADERS = [(b"content-type", b"application/json")]


def words(start: int, n: int) -> str:
    return " ".join(f"w{(start + i) % 4096}" for i in range(n))


# --- workloads ------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    workers: int
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    sessions: dict[int, list[dict]] = field(default_factory=dict)

    def text(self, n: int, seed: int | None = None) -> str:
        """`n` words: fixed for a given `seed`, fresh (random) without one."""
        rng = random.Random(seed) if seed is not None else self.rng
        return " ".join(f"w{rng.randrange(4096)}" for _ in range(n))

    def next(self, client: int, max_tokens: int) -> dict:
        if self.name == "shared-prefix":
            group = self.rng.randrange(2 * self.workers)
            messages = [{"role": "system", "content": self.text(128, seed=-1) + " " +
                         self.text(768, seed=group)},
                        {"role": "user", "content": self.text(32)}]
        elif self.name == "common-prefix":
            messages = [{"role": "system", "content": self.text(1024, seed=-1)},
                        {"role": "user", "content": self.text(64)}]
        elif self.name == "random":
            messages = [{"role": "user", "content": self.text(512)}]
        else:
            sid = client + self.rng.randrange(4) * 1000
            history = self.sessions.setdefault(sid, [])
            if len(history) >= 16:
                history.clear()
            history.append({"role": "user", "content": self.text(64)})
            messages = list(history)
            history.append({"role": "assistant", "content": self.text(max_tokens, seed=-2)})
        return {"model": "sim-model", "messages": messages, "max_tokens": max_tokens,
                "stream": True}


# --- load generation ------------------------------------------------------------------------------
@dataclass
class Sample:
    latency: float
    ttft: float


async def one(pool: UpstreamPool, path: str, body: bytes) -> Sample:
    start = time.perf_counter()
    response = await pool.request("POST", path, HEADERS, body)
    first = None
    while await response.read() is not None:
        if first is None:
            first = time.perf_counter()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}")
    end = time.perf_counter()
    return Sample(end - start, (first or end) - start)


async def closed_loop(port: int, make, clients: int, total: int | None,
                      seconds: float | None) -> tuple[list[Sample], float]:
    pool = UpstreamPool("127.0.0.1", port, 5.0, max_idle=clients)
    samples: list[Sample] = []
    started = time.perf_counter()
    deadline = started + (seconds or 1e9)
    remaining = [total or 10**12]

    async def client(i: int) -> None:
        while remaining[0] > 0 and time.perf_counter() < deadline:
            remaining[0] -= 1
            path, body = make(i)
            samples.append(await one(pool, path, body))

    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    pool.close()
    return samples, elapsed


async def interleaved(ports: list[int], path: str, body: bytes, rounds: int
                      ) -> list[list[Sample]]:
    """One request to each port in turn, `rounds` times (the order flips every round): series
    taken side by side, so a drift in the machine's speed touches them alike."""
    pools = [UpstreamPool("127.0.0.1", port, 5.0, max_idle=1) for port in ports]
    series: list[list[Sample]] = [[] for _ in ports]
    for r in range(rounds):
        order = range(len(ports)) if r % 2 == 0 else reversed(range(len(ports)))
        for i in order:
            series[i].append(await one(pools[i], path, body))
    for pool in pools:
        pool.close()
    return series


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
