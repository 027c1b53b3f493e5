"""The HTTP edge raises the soft open-file limit to the hard one: many containers start
processes at 1024, a thousand idle client sockets away from refusing everyone."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

PROBE = """
import resource
from radixpool.http_edge import FD_RESERVE, edge_protocol, EdgeLimits
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
protocol = edge_protocol(EdgeLimits(max_connections=1 << 30))
soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
print(soft, protocol.max_connections, FD_RESERVE)
"""


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096,
                    reason="the hard open-file limit here leaves nothing to raise")
def test_the_edge_raises_the_open_file_limit_and_keeps_a_reserve():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    soft, room, reserve = map(int, out.split())
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert room == soft - reserve   # connections capped below the descriptors left


GATEWAY_UNDER_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
from radixpool.cli import main
sys.exit(main(["gateway", "--worker-urls", "{worker}", "--host", "127.0.0.1", "--port", "{port}",
               "--no-late-binding", "--health-interval", "0.5"]))
"""


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048,
                    reason="the hard open-file limit here is too low to run the clients")
def test_a_gateway_whose_clients_fill_its_open_files_refuses_them_and_keeps_its_workers():
    """Each client connection being answered holds a worker connection too. The gateway let in
    as many clients as its open-file limit less 256: a spike of streams past half of it left no
    descriptor for the worker connections, and the gateway blamed its workers (connect errors:
    502s, the breaker and the health checks took them out) instead of refusing the extra clients
    with 503 `too_many_connections`."""
    import json
    import socket
    import time

    import httpx

    from bench.simfleet import SimConfig, SimFleet
    from tests.gateway.conftest import LoopThread, words

    limit, clients = 700, 400
    loop = LoopThread()
    fleet = SimFleet(1, SimConfig(decode_ms_per_token=400.0))
    loop.run(fleet.start())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gateway = subprocess.Popen(
        [sys.executable, "-c", GATEWAY_UNDER_LIMIT.format(limit=limit, worker=fleet.urls[0],
                                                         port=port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    sockets: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        body = json.dumps({"prompt": words(0, 4), "max_tokens": 4, "stream": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                   b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        for _ in range(clients):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(request)
            sockets.append(c)
        statuses = []
        for c in sockets:
            c.settimeout(20)
            got = b""
            try:
                while (chunk := c.recv(65536)) and b"\r\n" not in got:
                    got += chunk
            except OSError:
                pass
            statuses.append(int(got[9:12]) if got.startswith(b"HTTP/1.1 ") else None)
            c.close()
        assert 200 in statuses and 503 in statuses, statuses
        assert set(statuses) <= {200, 503}, statuses   # no 502, no connection dropped
        r = httpx.post(url + "/v1/completions", json={"prompt": words(0, 4), "max_tokens": 1},
                       timeout=10)
        assert r.status_code == 200, r.text   # its worker was never taken out
    finally:
        for c in sockets:
            c.close()
        gateway.terminate()
        gateway.wait(30)
        loop.run(fleet.stop())
        loop.close()
