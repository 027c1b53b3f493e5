"""Two gateway builds side by side under the same load: A/B rounds, interleaved.

    python bench/gateway_ab.py --before main       # a git revision (extracted to a temp dir)
    python bench/gateway_ab.py --before /tmp/before  # or a source tree

One zero-service-time simulated worker, and one gateway per build in front of it (each from its
own source tree, by PYTHONPATH). Each round measures, for direct / before / after in turn: the
p50 of `--sequential` non-streamed requests, the p50 time to a stream's first byte, and the
throughput of `--concurrency` clients for `--seconds`, with the gateway's CPU per request. On a
shared machine the load moves between rounds; interleaving gives both builds the same share of
it, and the median over rounds is printed beside the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from fleet_procs import cpu_seconds, free_port, spawn_fleet, stop
from loadgen import closed_loop, words


def spawn_gateway(source: Path, urls: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    roots = ":".join(str(source / part) for part in ("common", "worker", "gateway", "operator"))
    env = {**os.environ, "PYTHONPATH": roots}
    proc = subprocess.Popen([sys.executable, "-m", "radixpool.cli", "gateway", "--worker-urls",
                             *urls, "--host", "127.0.0.1", "--port", str(port), "--log-level",
                             "warning"], env=env, cwd=source)
    for _ in range(400):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/workers", timeout=1).json()[
                    "routing_on"] == "tokens":
                return proc, port
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.025)
    proc.kill()
    raise RuntimeError(f"gateway from {source} did not come up")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True,
                   help="the other build: a source tree, or a git revision of this repository")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sequential", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="gateway-before-") as scratch:
        before = Path(args.before)
        if not before.is_dir():  # a revision: its tree, as `git archive` gives it
            archive = subprocess.run(["git", "archive", args.before], cwd=here, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
            before = Path(scratch)
        compare(before, here, args)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def compare(before: Path, here: Path, args: argparse.Namespace) -> None:
    load_at_start = load_average()
    fleet, urls = spawn_fleet(1, argparse.Namespace(kv_capacity_tokens=65536), zero=True)
    direct = int(urls[0].rsplit(":", 1)[1])
    gateways = {"before": spawn_gateway(before.resolve(), urls),
                "after": spawn_gateway(here, urls)}
    plain = json.dumps({"model": "sim-model", "prompt": words(0, 32), "max_tokens": 1}).encode()
    streamed = json.dumps({"model": "sim-model", "prompt": words(0, 32), "max_tokens": 1,
                           "stream": True}).encode()
    p50: dict[str, list[float]] = {}
    ttfb: dict[str, list[float]] = {}
    rps: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    targets = {"direct": (None, direct), **{k: v for k, v in gateways.items()}}
    try:
        for _ in range(args.rounds):
            for name, (proc, port) in targets.items():
                seq, _ = asyncio.run(closed_loop(port, lambda i: ("/v1/completions", plain), 1,
                                                 args.sequential, None))
                p50.setdefault(name, []).append(statistics.median(s.latency for s in seq))
                seq, _ = asyncio.run(closed_loop(port, lambda i: ("/v1/completions", streamed),
                                                 1, args.sequential, None))
                ttfb.setdefault(name, []).append(statistics.median(s.ttft for s in seq))
                if proc is None:
                    continue
                cpu0 = cpu_seconds(proc.pid)
                samples, elapsed = asyncio.run(closed_loop(
                    port, lambda i: ("/v1/completions", plain), args.concurrency, None,
                    args.seconds))
                rps.setdefault(name, []).append(len(samples) / elapsed)
                cpu.setdefault(name, []).append((cpu_seconds(proc.pid) - cpu0) / len(samples))
    finally:
        for proc, _ in gateways.values():
            stop(proc)
        stop(fleet)

    def show(values: list[float], scale: float, unit: str) -> str:
        return (f"{statistics.median(values) * scale:7.0f} {unit} "
                f"({min(values) * scale:.0f}-{max(values) * scale:.0f})")

    print(f"# {args.rounds} interleaved rounds; median (min-max) over rounds; "
          f"{os.cpu_count()} CPUs; zero-service-time simulated worker, 32-token prompts; "
          f"load average {load_at_start} at the start, {load_average()} at the end")
    for name in ("before", "after"):
        added = [g - d for g, d in zip(p50[name], p50["direct"])]
        added_ttfb = [g - d for g, d in zip(ttfb[name], ttfb["direct"])]
        print(f"{name:6s} non-streamed p50 added {show(added, 1e6, 'us')}; stream first byte "
              f"added {show(added_ttfb, 1e6, 'us')}; {show(rps[name], 1, 'req/s')} at "
              f"concurrency {args.concurrency}; gateway CPU {show(cpu[name], 1e6, 'us/req')}")


if __name__ == "__main__":
    main()
