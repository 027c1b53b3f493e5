"""What a huge or hostile request body costs everyone else at the gateway.

    python bench/hostile_bodies.py                   # this checkout
    python bench/hostile_bodies.py --before REV      # and another build (revision or tree) beside

One zero-service-time simulated worker behind the gateway. For each body below, a probe thread
sends small routed requests (a 32-token completion) one after another while the body is posted;
printed: the big request's status and time, the probes' p50 and worst latency while it was in
the gateway, and the peak memory (VmHWM) of the gateway and of its parse processes after it.
Bodies, each about `--mib` MiB (the gateway's body limit is 32 MiB by default):
  prompt      one plain prompt string (a long document): legitimate
  messages    many one-word chat messages
  id-batch    a /generate batch of one-id prompts: [[1], [1], ...]
  nested      chat messages that are tiny arrays: refused (400), after the parse
  keys        a chat request with millions of unknown keys: refused (400 too_many_members)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from fleet_procs import spawn_fleet, stop
from gateway_ab import spawn_gateway
from loadgen import words


def bodies(mib: int) -> dict[str, tuple[str, bytes]]:
    size = mib << 20
    return {
        "prompt": ("/v1/completions", json.dumps(
            {"model": "sim-model", "prompt": words(0, size // 6), "max_tokens": 1}).encode()),
        "messages": ("/v1/chat/completions", json.dumps(
            {"model": "sim-model", "max_tokens": 1,
             "messages": [{"role": "user", "content": "w1"}] * (size // 34)}).encode()),
        "id-batch": ("/generate", json.dumps(
            {"model": "sim-model", "input_ids": [[1]] * (size // 5),
             "sampling_params": {"max_new_tokens": 1}}).encode()),
        "nested": ("/v1/chat/completions", json.dumps(
            {"model": "sim-model", "messages": [[1]] * (size // 5)}).encode()),
        "keys": ("/v1/chat/completions", json.dumps(
            {"model": "sim-model", "messages": [{"role": "user", "content": "w1"}],
             **{f"k{i}": 0 for i in range(size // 12)}}).encode()),
    }


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid="], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def run(name: str, source: Path, urls: list[str], mib: int) -> None:
    proc, port = spawn_gateway(source, urls)
    url = f"http://127.0.0.1:{port}"
    small = json.dumps({"model": "sim-model", "prompt": words(0, 32), "max_tokens": 1}).encode()
    try:
        for kind, (path, body) in bodies(mib).items():
            probes: list[float] = []
            done = threading.Event()

            def probe(probes: list[float] = probes, done: threading.Event = done) -> None:
                with httpx.Client(base_url=url, timeout=120) as c:
                    while not done.is_set():
                        started = time.perf_counter()
                        c.post("/v1/completions", content=small)
                        probes.append(time.perf_counter() - started)

            thread = threading.Thread(target=probe)
            thread.start()
            time.sleep(0.3)
            before = len(probes)
            with httpx.Client(timeout=300) as c:
                started = time.perf_counter()
                status = c.post(url + path, content=body).status_code
                took = time.perf_counter() - started
            during = probes[before:] or [float("nan")]
            done.set()
            thread.join(300)
            parse = [peak_mib(p) for p in children(proc.pid)]
            print(f"{name:6s} {kind:9s} {len(body) / 2**20:5.1f} MiB  status {status}  "
                  f"{took * 1e3:7.0f} ms   probes during it: {len(during):5d}, p50 "
                  f"{statistics.median(during) * 1e3:6.1f} ms, worst {max(during) * 1e3:7.1f} ms"
                  f"   peak MiB: gateway {peak_mib(proc.pid):5.0f}, parse processes "
                  f"{' '.join(f'{m:.0f}' for m in parse) or '-'}", flush=True)
    finally:
        stop(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default=None,
                   help="another build too: a source tree, or a git revision of this repository")
    p.add_argument("--mib", type=int, default=24, help="size of each body")
    args = p.parse_args()
    here = Path(__file__).resolve().parents[1]
    fleet, urls = spawn_fleet(1, argparse.Namespace(kv_capacity_tokens=65536), zero=True)
    try:
        with tempfile.TemporaryDirectory(prefix="gateway-before-") as scratch:
            if args.before:
                before = Path(args.before)
                if not before.is_dir():
                    archive = subprocess.run(["git", "archive", args.before], cwd=here,
                                             check=True, capture_output=True).stdout
                    subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
                    before = Path(scratch)
                run("before", before.resolve(), urls, args.mib)
            run("after" if args.before else "this", here, urls, args.mib)
    finally:
        stop(fleet)


if __name__ == "__main__":
    sys.exit(main())
