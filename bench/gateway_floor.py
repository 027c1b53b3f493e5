"""The floor under the gateway's added latency: its HTTP edge and worker client with no routing.

    python bench/gateway_floor.py [--rounds 2000]

A proxy made of the gateway's own parts only: `http_edge.EdgeServer` (Granian) in front, an
`upstream.UpstreamPool` to one zero-service-time simulated worker behind, and nothing between
(no parsing, no tokenization, no policy, no metrics). A client process sends the same 32-token
completion as `bench/routing.py overhead`, direct and via this proxy in turn. What it adds is
what any routing code on top of these parts adds to at least; `overhead` less this is what the
routing itself costs in place.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from fleet_procs import free_port, spawn_fleet, stop
from loadgen import words

from radixpool.gateway.http_edge import EdgeLimits, EdgeServer, Request, Responder
from radixpool.gateway.upstream import UpstreamPool

HERE = Path(__file__).resolve().parent
JSON = [(b"content-type", b"application/json")]

CLIENT = """
import asyncio, statistics, sys
sys.path.insert(0, {bench!r})
from loadgen import interleaved
body, ports = {body!r}, [{direct}, {proxy}]
asyncio.run(interleaved(ports, "/v1/completions", body, 300))  # warm up both paths
direct, via = asyncio.run(interleaved(ports, "/v1/completions", body, {rounds}))
d = statistics.median(s.latency for s in direct) * 1e6
v = statistics.median(s.latency for s in via) * 1e6
print(f"edge + worker client, no routing: direct {{d:.0f}} us, via {{v:.0f}} us, "
      f"added {{v - d:.0f}} us (p50 of {rounds}, interleaved)")
"""


async def main(rounds: int) -> None:
    fleet, urls = spawn_fleet(1, argparse.Namespace(kv_capacity_tokens=65536), zero=True)
    worker_port = int(urls[0].rsplit(":", 1)[1])
    pool = UpstreamPool("127.0.0.1", worker_port, 5.0)

    async def relay(request: Request, respond: Responder) -> None:
        upstream = await pool.request("POST", request.path, JSON, request.body)
        data = await upstream.body()
        upstream.release()
        await respond.send(upstream.status, JSON, data)

    edge = EdgeServer(relay, "127.0.0.1", free_port(), EdgeLimits())
    await edge.start()
    body = json.dumps({"model": "sim-model", "prompt": words(0, 32), "max_tokens": 1}).encode()
    try:  # the client is another process: this one's event loop serves the edge
        client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT.format(
            bench=str(HERE), body=body, direct=worker_port, proxy=edge.port, rounds=rounds))
        await client.wait()
    finally:
        await edge.stop()
        pool.close()
        stop(fleet)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2000)
    import uvloop

    uvloop.run(main(p.parse_args().rounds))
