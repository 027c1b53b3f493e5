"""The gateway's HTTP edge against a hostile in-cluster client: what it may make the gateway do
before it has shown a key, and inputs from the edges of HTTP/1. Raw sockets on loopback against
a real gateway with simulated workers."""

from __future__ import annotations

import json

from tests.gateway.test_http_edge import Responses, connect, read_until_closed

MIB = 1 << 20
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


def test_a_request_without_the_key_is_refused_before_its_body_is_read(make_stack):
    # The body was read (and a declared one over 1 MiB took its size from the large-body budget)
    # before the key was checked: a dozen keyless connections declaring 20 MiB and sending
    # nothing held the whole budget, and every client's large body got 503 for 30 s.
    stack = make_stack(1, api_key="client-key", max_body_bytes=32 * MIB,
                       large_body_budget_bytes=64 * MIB)
    edge = stack.server.server
    keyless = [connect(stack.url) for _ in range(4)]
    for c in keyless:
        c.sendall(HEAD + b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % (20 * MIB))
    for c in keyless:
        got = read_until_closed(c, 5.0)   # answered, and closed: the body is never read
        (status, body), = Responses(got).messages   # a 401, and no `100 Continue` before it
        assert status == 401, got[:200]
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        c.close()
    assert edge.large_bodies_held == 0
    # a keyed client's large body is still taken
    big = json.dumps({"prompt": "w1 " * (MIB // 2), "max_tokens": 1}).encode()
    r = stack.client.post("/v1/completions", content=big, headers={
        "authorization": "Bearer client-key", "content-type": "application/json"})
    assert r.status_code != 503, r.text[:200]
    assert stack.fleet.workers[0].requests == 1
