"""How soon a worker names a prompt it has taken in: from the moment a request is sent to the
worker to the moment a `/kv_events?queued=1` reader (as a gateway is) gets its `queued` event,
while the worker is busy with other requests. Every other gateway in front of the worker is blind
to that request's placement until then (docs/gateway.md, Limits).

    python bench/queued_latency.py                        # the tiny model, CPU
    python bench/queued_latency.py --model PATH --device cuda --busy 64

Prints the delay's percentiles over `--probes` requests, each a prompt of its own sent through
`/generate` as token ids (so its block hashes are known), one every `--interval` seconds, while
`--busy` clients keep the worker generating.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from radixpool.fleet.process import ChildProcess, free_port, radixpool_argv
from radixpool.protocol.kv_blocks import prefix_block_hashes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: a tiny one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--busy", type=int, default=16, help="clients generating meanwhile")
    ap.add_argument("--busy-tokens", type=int, default=64, help="max_tokens of theirs")
    ap.add_argument("--probes", type=int, default=100)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="queued-latency-"))
    model = args.model
    if model is None:
        from radixpool.worker.tiny_model import make_tiny_model
        model = str(make_tiny_model(work / "tiny", "llama", 0, "bpe"))
    port = free_port()
    worker = ChildProcess("worker", radixpool_argv(
        "worker", "--model", model, "--served-model-name", "m", "--port", str(port),
        "--device", args.device, "--log-level", "warning"), port, work / "worker.log")
    try:
        worker.start()
        worker.wait_ready(300)
        info = httpx.get(worker.url + "/server_info").json()
        delays = asyncio.run(measure(worker.url, info, args))
    finally:
        worker.reap()
    delays.sort()
    pct = {q: delays[min(len(delays) - 1, int(q * len(delays)))] * 1e3 for q in (0.5, 0.9, 0.99)}
    print(f"# queued-event delay, {len(delays)} probes, {args.busy} busy clients x "
          f"{args.busy_tokens} tokens, device {args.device}, model {args.model or 'tiny'}")
    print(f"p50 {pct[0.5]:.2f} ms  p90 {pct[0.9]:.2f} ms  p99 {pct[0.99]:.2f} ms  "
          f"max {delays[-1] * 1e3:.2f} ms")


async def measure(url: str, info: dict, args: argparse.Namespace) -> list[float]:
    block = info["kv_block_size"]
    vocab = info.get("vocab_size") or 256
    rng = random.Random(0)
    seen: dict[str, float] = {}   # last block hash (hex) of each queued event -> when read
    stop = asyncio.Event()

    async def reader(client: httpx.AsyncClient) -> None:
        since = (await client.get("/kv_events/snapshot")).json()["seq"]
        while not stop.is_set():
            r = await client.get("/kv_events", params={"since": since, "queued": 1,
                                                       "timeout": 1})
            now = time.perf_counter()
            doc = r.json()
            for event in doc["events"]:
                if event["type"] == "queued" and event["blocks"]:
                    seen.setdefault(event["blocks"][-1], now)
            since = doc["next"]

    async def busy(client: httpx.AsyncClient) -> None:
        ids = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
        while not stop.is_set():
            await client.post("/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": args.busy_tokens, "ignore_eos": True, "temperature": 0}})

    limits = httpx.Limits(max_connections=args.busy + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(reader(client))]
        tasks += [asyncio.create_task(busy(client)) for _ in range(args.busy)]
        await asyncio.sleep(1.0)   # the worker is generating for them
        sent: dict[str, float] = {}
        probes = []
        for _ in range(args.probes):
            ids = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            last = f"{int(prefix_block_hashes(ids, block)[-1]):016x}"
            sent[last] = time.perf_counter()
            probes.append(asyncio.create_task(client.post("/generate", json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 1}})))
            await asyncio.sleep(args.interval)
        await asyncio.gather(*probes)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    missing = [h for h in sent if h not in seen]
    if missing:
        sys.exit(f"{len(missing)} probes never showed up as queued events")
    return [seen[h] - sent[h] for h in sent]


if __name__ == "__main__":
    main()
