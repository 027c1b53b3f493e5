"""Several real gateways at once (active-active replicas), in real time on loopback.

    python bench/multi_gateway.py                      # 4 workers, 1/2/3 gateways, 2 workloads
    python bench/multi_gateway.py --workers 4 8 --gateways 1 3 --repeats 2

Per cell, fresh processes: one simulated fleet (`python -m bench.simfleet`: each worker the
engine's own radix cache, serving `/kv_events` to every gateway that follows it) and G real
gateways (`radixpool gateway`, the same flags, each given every worker's URL). Once every gateway
follows every worker's KV events, closed-loop clients send the shared-prefix or multi-turn
workload of `bench/routing.py` (`bench/loadgen.py`), each request to a gateway drawn at random
(clients spread over replicas behind one Service): each gateway routes only its share and counts
only its own in-flight requests, while the workers' KV events reach all of them. The first
`--warmup-per-worker` requests per worker (the cold start: gateways that do not yet know what
another one just sent, until its prefill ends and the KV events arrive) are counted apart from
the `--requests-per-worker` that follow.

Printed per cell: the fleet's hit rate (cached / prompt tokens, counted by the workers
themselves) cold, warm and over all, then for the warm part: latency p50/p99, requests per
worker, requests per gateway, and the gateways' route decisions summed (both parts). Real time
on a shared machine: latencies move with its load; the hit rate moves by a few requests' worth
from run to run (which client asks next, and which gateway it draws, depend on timing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass

import httpx
from fleet_procs import decision_counts, spawn_fleet, spawn_gateway, stop
from loadgen import Sample, Workload, one, pct
from simfleet.sglang_eviction import BENCH_EVICTION_POLICIES

from radixpool.gateway.upstream import UpstreamPool


def wait_for_kv_events(ports: list[int], seconds: float = 30.0) -> None:
    """Until every gateway follows every worker's KV-event stream."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rows = [w for p in ports
                for w in httpx.get(f"http://127.0.0.1:{p}/workers", timeout=5).json()["workers"]]
        if all(w["tree_source"] == "kv_events" for w in rows):
            return
        time.sleep(0.05)
    raise RuntimeError("the gateways did not start following the workers' KV events")


async def spread_load(ports: list[int], make, clients: int, total: int, rng: random.Random
                      ) -> tuple[list[Sample], list[int], float]:
    """`clients` closed-loop clients, `total` requests, each to a gateway drawn with `rng`."""
    pools = [UpstreamPool("127.0.0.1", p, 5.0, max_idle=clients) for p in ports]
    samples: list[Sample] = []
    per_gateway = [0] * len(ports)
    remaining = [total]
    started = time.perf_counter()

    async def client(i: int) -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            g = rng.randrange(len(pools))
            per_gateway[g] += 1
            path, body = make(i)
            samples.append(await one(pools[g], path, body))

    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    for pool in pools:
        pool.close()
    return samples, per_gateway, elapsed


@dataclass(frozen=True)
class Cell:
    hits: tuple[float, float, float]  # cold, warm, all
    row: str


def run_cell(n: int, workload: str, gateways: int, repeat: int,
             args: argparse.Namespace) -> Cell:
    fleet, urls = spawn_fleet(n, args)
    procs: list = []
    try:
        ports = []
        for _ in range(gateways):
            proc, port = spawn_gateway(urls, "cache_aware", args.gateway_arg)
            procs.append(proc)
            ports.append(port)
        wait_for_kv_events(ports)
        wl = Workload(workload, n, rng=random.Random(args.seed + repeat))
        draw = random.Random(-1 - args.seed - repeat)  # which gateway each request goes to

        def make(i: int) -> tuple[str, bytes]:
            return "/v1/chat/completions", json.dumps(wl.next(i, args.max_tokens)).encode()

        httpx.delete(urls[0] + "/sim/stats")
        clients = args.concurrency_per_worker * n
        asyncio.run(spread_load(ports, make, clients, args.warmup_per_worker * n, draw))
        first = httpx.delete(urls[0] + "/sim/stats").json()  # read and reset
        samples, per_gateway, elapsed = asyncio.run(spread_load(
            ports, make, clients, args.requests_per_worker * n, draw))
        stats = httpx.get(urls[0] + "/sim/stats").json()
        reasons = " ".join(decision_counts(httpx.get(f"http://127.0.0.1:{p}/metrics").text)
                           for p in ports)
    finally:
        for proc in procs:
            stop(proc)
        stop(fleet)
    lat = [s.latency * 1e3 for s in samples]
    both = (first["cached_tokens"] + stats["cached_tokens"]) / max(
        1, first["prompt_tokens"] + stats["prompt_tokens"])
    hits = (first["hit_rate"], stats["hit_rate"], both)
    return Cell(hits, f"{n:>3} {workload:<13} {gateways:>3} {repeat:>3} "
                      f"{hits[0]:6.3f} {hits[1]:6.3f} {hits[2]:6.3f} "
                      f"{len(samples) / elapsed:7.1f} {pct(lat, 0.5):7.1f} {pct(lat, 0.99):7.1f}  "
                      f"{'/'.join(map(str, stats['requests'])):<19} "
                      f"{'/'.join(map(str, per_gateway)):<12} {summed(reasons)}")


def summed(reasons: str) -> str:
    """`cache_hit=3 cache_miss=1 cache_hit=2` → `cache_hit=5 cache_miss=1`."""
    counts: dict[str, int] = {}
    for part in reasons.split():
        key, value = part.split("=")
        counts[key] = counts.get(key, 0) + int(value)
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[4])
    p.add_argument("--workloads", nargs="+", default=["shared-prefix", "multi-turn"],
                   choices=["shared-prefix", "multi-turn"])
    p.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (seeds seed..)")
    p.add_argument("--warmup-per-worker", type=int, default=20,
                   help="requests per worker sent first (the cold start), counted apart")
    p.add_argument("--requests-per-worker", type=int, default=60)
    p.add_argument("--concurrency-per-worker", type=int, default=2)
    p.add_argument("--prefill-us-per-token", type=float, default=100.0)
    p.add_argument("--decode-ms-per-token", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-capacity-tokens", type=int, default=8192)
    p.add_argument("--eviction-policy", default="lru", choices=BENCH_EVICTION_POLICIES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for every gateway, repeatable")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally blocks: stop children
    print(f"# several real gateways, real time on loopback: requests spread at random over G "
          f"gateway processes; simulated workers: prefill {args.prefill_us_per_token} "
          f"us/uncached token (one at a time), decode {args.decode_ms_per_token} ms/token x "
          f"{args.max_tokens}, KV {args.kv_capacity_tokens} tokens/worker, eviction "
          f"{args.eviction_policy}; {args.concurrency_per_worker} clients/worker, "
          f"{args.warmup_per_worker} + {args.requests_per_worker} req/worker; gateway flags: "
          f"{' '.join(args.gateway_arg) or '(defaults)'}")
    print("# hit: the fleet's hit rate from the workers' own counts, over the first (cold) "
          "requests, the rest (warm), and all; the other columns are over the warm part")
    print("  N workload        G rep   cold   warm    all   req/s lat50ms   lat99  per worker"
          "          per gateway  decisions (all gateways)")
    means: list[str] = []
    for n in args.workers:
        for workload in args.workloads:
            hits: dict[int, list[tuple[float, float, float]]] = {g: [] for g in args.gateways}
            for repeat in range(args.repeats):
                for g in args.gateways:
                    cell = run_cell(n, workload, g, repeat, args)
                    hits[g].append(cell.hits)
                    print(cell.row, flush=True)
            mean = {g: [statistics.fmean(h[i] for h in hits[g]) for i in range(3)]
                    for g in args.gateways}
            one = mean[min(args.gateways)]
            means += [f"{n:>3} {workload:<13} {g:>3} {args.repeats:>3} "
                      + " ".join(f"{m[i]:6.3f} ({m[i] - one[i]:+.3f})" for i in range(3))
                      for g, m in mean.items()]
    print(f"# means over the repeats; in brackets, the difference from {min(args.gateways)} "
          f"gateway(s)")
    print("  N workload        G  runs cold            warm            all")
    print("\n".join(means))


if __name__ == "__main__":
    main()
