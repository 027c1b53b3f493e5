"""What the e2e tests read from a running fleet: Prometheus counters, the gateway's view of each
worker, and the memory of a process with its descendants."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"  # the name the e2e fleet serves the tiny model as
WORDS = ("cache", "token", "prefix", "model", "serve", "request", "worker", "gateway", "radix",
         "tree", "memory", "batch", "stream", "route", "cluster", "pool", "node", "page", "block")


def long_text(seed: int, words: int = 200) -> str:
    """A prompt of about `words` tokens, the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def scrape(url: str) -> dict[str, float]:
    """Every sample of `url/metrics`, summed over labels, by sample name."""
    r = httpx.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def gateway_view(gateway_url: str) -> dict[str, dict]:
    """`GET /workers` of the gateway, by worker URL."""
    doc = httpx.get(gateway_url + "/workers", timeout=10).json()
    return {w["url"]: w for w in doc["workers"]}


def server_info(worker_url: str) -> dict:
    return httpx.get(worker_url + "/server_info", timeout=10).json()


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for a condition the fleet reaches asynchronously (health checks, KV events)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.1)


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (Linux /proc)."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            # each thread lists the children it started (the engine core comes from a thread)
            children = [c for task in Path(f"/proc/{p}/task").iterdir()
                        for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        todo.extend(int(c) for c in children)
    return total
