"""The routing benchmarks' processes on loopback: the simulated fleet (`python -m bench.simfleet`,
or `bench.sim_no_cached`), real gateways (`radixpool gateway`), a process's CPU time from /proc,
and the gateway's route-decision counters from its `/metrics`."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

CLK_TCK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_fleet(n: int, args: argparse.Namespace, zero: bool = False):
    module = "bench.sim_no_cached" if getattr(args, "omit_cached_tokens", False) \
        else "bench.simfleet"
    cmd = [sys.executable, "-m", module, "--count", str(n),
           "--kv-capacity-tokens", str(args.kv_capacity_tokens),
           "--eviction-policy", getattr(args, "eviction_policy", "lru"),
           "--prefill-us-per-token", "0" if zero else str(args.prefill_us_per_token),
           "--decode-ms-per-token", "0" if zero else str(args.decode_ms_per_token)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    urls = json.loads(proc.stdout.readline())["urls"]
    return proc, urls


def spawn_gateway(urls: list[str], policy: str, extra: list[str] = (), src: str | None = None):
    """`src`: run the gateway from another source checkout (a before/after comparison)."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixpool.cli", "gateway", "--worker-urls", *urls,
           "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--log-level", "warning", *extra]
    env = None if src is None else {**os.environ, "PYTHONPATH": os.pathsep.join(
        os.path.join(src, part) for part in ("common", "worker", "gateway", "operator"))}
    proc = subprocess.Popen(cmd, env=env)
    base = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            doc = httpx.get(base + "/workers", timeout=1).json()
            if doc["routing_on"] == "tokens":
                return proc, port
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.025)
    proc.kill()
    raise RuntimeError("gateway did not come up with the workers' tokenizer")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def decision_counts(metrics: str) -> str:
    """`cache_hit=120 cache_miss=40 ...` from the gateway's route-decision counters."""
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("radixpool_gateway_route_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            counts[reason] = counts.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    return " ".join(f"{k}={int(v)}" for k, v in sorted(counts.items()))
