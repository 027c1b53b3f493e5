"""HTTP servers alone, side by side: the numbers behind the gateway's choice of server.

    python bench/http_servers.py                       # all candidates
    python bench/http_servers.py edge granian          # some

Each candidate serves the same answers in its own process (a 68-byte JSON body, and a 10-event
SSE stream at /s); one client process measures the p50 of 2,000 sequential requests, the p50 time
to a stream's first byte, and throughput at concurrency 32 with the server's CPU per request.
`edge` is what the gateway and the workers run (uvicorn's httptools protocol with the limits of
`radixpool.http_edge`), `uvicorn` the same protocol bare; `handwritten` is the asyncio+httptools
server the gateway ran on first (now the simulated workers'); `granian` is Granian's RSGI
interface (the gateway's server before `edge`), `granian-asgi` its ASGI one. Granian and aiohttp
are not dependencies of the project: those not installed are skipped (`pip install granian`).
A server alone is only part of the story: `bench/gateway_floor.py` and `bench/routing.py
overhead` measure the gateway itself."""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import subprocess
import sys
import time

from fleet_procs import cpu_seconds, free_port, stop
from loadgen import closed_loop

KINDS = ("handwritten", "edge", "granian", "granian-asgi", "aiohttp", "uvicorn")
NEEDS = {"granian": "granian", "aiohttp": "aiohttp"}   # not dependencies of the project

BODY = b'{"id":"x","choices":[{"text":"hello"}],"usage":{"prompt_tokens":32}}'
EVENTS = [b'data: {"choices":[{"text":"w"}]}\n\n'] * 10
JSON = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]
SSE = [(b"content-type", b"text/event-stream")]


async def asgi_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/s":
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        for event in EVENTS:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": BODY})


async def rsgi_app(scope, proto) -> None:
    await proto()
    if scope.path == "/s":
        stream = proto.response_stream(200, [("content-type", "text/event-stream")])
        for event in EVENTS:
            await stream.send_bytes(event)
    else:
        proto.response_bytes(200, [("content-type", "application/json")], BODY)


async def handwritten_app(request, respond) -> None:
    if request.path == "/s":
        await respond.start(200, SSE)
        for event in EVENTS:
            await respond.write(event)
        await respond.end()
    else:
        await respond.send(200, JSON[:1], BODY)


async def aiohttp_handler(request):
    from aiohttp import web

    await request.read()
    if request.path == "/s":
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in EVENTS:
            await response.write(event)
        await response.write_eof()
        return response
    return web.Response(body=BODY, content_type="application/json")


async def serve_in_loop(kind: str, port: int) -> None:
    if kind == "handwritten":
        from simfleet.http_server import serve as serve_handwritten

        await serve_handwritten(handwritten_app, "127.0.0.1", port, 1 << 20)
    elif kind.startswith("granian"):   # granian-asgi: its ASGI interface (backpressure on streams)
        from granian.constants import Interfaces
        from granian.server.embed import Server

        rsgi = kind == "granian"
        asyncio.get_running_loop().create_task(Server(
            rsgi_app if rsgi else asgi_app, "127.0.0.1", port,
            interface=Interfaces.RSGI if rsgi else Interfaces.ASGINL, log_enabled=False).serve())
        await asyncio.sleep(0.5)
    else:
        from aiohttp import web

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", aiohttp_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


def serve(kind: str, port: int) -> None:
    if kind in ("uvicorn", "edge"):
        import uvicorn

        from radixpool.http_edge import EdgeLimits, edge_protocol

        print("ready", flush=True)
        uvicorn.run(asgi_app, host="127.0.0.1", port=port, loop="uvloop",
                    http="httptools" if kind == "uvicorn" else edge_protocol(EdgeLimits()),
                    log_level="warning", access_log=False, lifespan="off")
    else:
        import uvloop

        uvloop.run(serve_in_loop(kind, port))


def compare(kinds: list[str]) -> None:
    body = b'{"model":"m","prompt":"' + b"w " * 32 + b'","max_tokens":1}'
    for kind in kinds:
        package = NEEDS.get(kind.split("-")[0])
        if package and importlib.util.find_spec(package) is None:
            print(f"{kind:12s} skipped: {package} is not installed (pip install {package})")
            continue
        port = free_port()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)],
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        time.sleep(0.5)
        try:
            asyncio.run(closed_loop(port, lambda i: ("/x", body), 1, 300, None))
            seq, _ = asyncio.run(closed_loop(port, lambda i: ("/x", body), 1, 2000, None))
            seqs, _ = asyncio.run(closed_loop(port, lambda i: ("/s", body), 1, 2000, None))
            cpu0 = cpu_seconds(proc.pid)
            load, elapsed = asyncio.run(closed_loop(port, lambda i: ("/x", body), 32, None, 3.0))
            cpu = cpu_seconds(proc.pid) - cpu0
            print(f"{kind:12s} p50 {statistics.median(s.latency for s in seq) * 1e6:5.0f} us  "
                  f"stream first byte p50 {statistics.median(s.ttft for s in seqs) * 1e6:5.0f} us"
                  f"  {len(load) / elapsed:6.0f} req/s @32  server CPU "
                  f"{cpu / len(load) * 1e6:4.0f} us/req", flush=True)
        finally:
            stop(proc)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        compare(sys.argv[1:] or list(KINDS))
