"""What a huge request body costs the worker's event loop, which streams every request's tokens.

    python bench/worker_hostile_bodies.py                # this checkout
    python bench/worker_hostile_bodies.py --only ids     # bodies whose name holds "ids"

Starts one tiny-model worker on loopback (CPU). For each body below (all valid JSON, under the
worker's 64 MiB body limit), a probe thread sends `GET /livez` every 20 ms while the body is
posted; printed: the request's status, error code and time, and the longest any probe sent
while the body was in the worker waited for its answer (the loop was held that long).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from radixpool.fleet.process import ChildProcess, free_port, radixpool_argv

MIB = 1 << 20


def bodies() -> dict[str, tuple[str, bytes]]:
    def doc(**fields) -> bytes:
        return json.dumps(fields, separators=(",", ":")).encode()

    msg = {"role": "user", "content": "hi"}
    part = {"type": "text", "text": "w"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}}}}
    return {
        # refused later by the handler (too_many_choices)
        "generate ids 2M x [1]": ("/generate", doc(input_ids=[[1]] * 2_000_000)),
        "generate text 3M distinct": ("/generate", doc(text=[str(i) for i in range(3_000_000)])),
        "completions 3M distinct": ("/v1/completions",
                                    doc(prompt=[str(i) for i in range(3_000_000)])),
        "completions 2M x [1]": ("/v1/completions", doc(prompt=[[1]] * 2_000_000)),
        "completions 1024 x n128": ("/v1/completions", doc(prompt=["a"] * 1024, n=128)),
        # refused later by the handler (context_length_exceeded)
        "generate ids 1 x 16M": ("/generate", doc(input_ids=[1] * 16_000_000)),
        "completions 1 x 16M": ("/v1/completions", doc(prompt=[1] * 16_000_000)),
        "generate 1024 x 7.5k ids": ("/generate", doc(input_ids=[[1] * 7_500] * 1024)),
        "chat 65k messages": ("/v1/chat/completions", doc(messages=[msg] * 65_000)),
        "chat 65k empty messages": ("/v1/chat/completions",
                                    doc(messages=[{"role": "user", "content": ""}] * 65_000)),
        "chat 65k parts": ("/v1/chat/completions",
                           doc(messages=[{"role": "user", "content": [part] * 65_000}])),
        # legal, or refused only for other reasons
        "chat 128 tools x 400 props": ("/v1/chat/completions",
                                       doc(messages=[msg], tools=[tool] * 128, max_tokens=1)),
        "chat 128 distinct tools": ("/v1/chat/completions", doc(
            messages=[msg], max_tokens=1,
            tools=[{**tool, "function": {**tool["function"], "name": f"f{j}"}}
                   for j in range(128)])),
        "chat logit_bias 131k": ("/v1/chat/completions", doc(
            messages=[msg], max_tokens=1, logit_bias={str(i): 1.0 for i in range(131_000)})),
        "generate 1024 x 1 id": ("/generate", doc(
            input_ids=[[1]] * 1024, sampling_params={"max_new_tokens": 1})),
        "completions 100k-id prompt": ("/v1/completions", doc(prompt=[1] * 100_000,
                                                              max_tokens=1)),
    }


def measure(url: str, path: str, body: bytes) -> tuple[int, str, float, float, int]:
    probes: list[tuple[float, float]] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while not done.is_set():
                sent = time.monotonic()
                c.get("/livez")
                probes.append((sent, time.monotonic()))
                time.sleep(0.02)

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.2)
    with httpx.Client(timeout=300) as c:
        started = time.monotonic()
        r = c.post(url + path, content=body, headers={"content-type": "application/json"})
        took = time.monotonic() - started
    done.set()
    thread.join(120)
    during = [answered - sent for sent, answered in probes if started <= sent <= started + took]
    code = str(r.json()["error"]["code"]) if r.status_code >= 400 else "-"
    return r.status_code, code, took, max(during, default=float("nan")), len(during)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="bodies whose name holds this")
    args = p.parse_args()
    from radixpool.worker.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="hostile-worker-") as scratch:
        model = make_tiny_model(Path(scratch) / "model", "llama", 0, "bpe")
        port = free_port()
        worker = ChildProcess("worker", radixpool_argv(
            "worker", "--model", str(model), "--served-model-name", "tiny", "--port", str(port),
            "--device", "cpu", "--kv-cache-tokens", "8192"), port, Path(scratch) / "worker.log")
        worker.start()
        try:
            worker.wait_ready(180)
            print(f"{'body':28s} {'MiB':>5s} {'status':>6s} {'code':24s} {'took s':>7s} "
                  f"{'longest /livez ms':>18s} {'probes':>6s}", flush=True)
            for name, (path, body) in bodies().items():
                if args.only not in name:
                    continue
                status, code, took, gap, count = measure(worker.url, path, body)
                print(f"{name:28s} {len(body) / MIB:5.1f} {status:6d} {code:24s} {took:7.2f} "
                      f"{gap * 1e3:18.0f} {count:6d}", flush=True)
        finally:
            worker.stop(30)


if __name__ == "__main__":
    sys.exit(main())
