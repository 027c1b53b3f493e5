"""The gateway's budget for large request bodies: clients that send (or trickle) bodies of
several MiB at once cannot make the gateway hold more than `large_body_budget_bytes` of them;
past it a large body is refused 503 at once, and small requests are never refused for it."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from radixpool.gateway.config import GatewayConfig
from tests.gateway.conftest import words
from tests.gateway.test_http_edge import Responses, connect, read_until_closed

MIB = 1 << 20
HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n")


def refusal(got: bytes) -> tuple[int, dict]:
    (status, body), = Responses(got).messages
    return status, json.loads(body)["error"]


def test_large_bodies_past_the_budget_get_503_and_small_requests_are_served(make_stack):
    stack = make_stack(1, max_body_bytes=4 * MIB, large_body_budget_bytes=8 * MIB)
    edge = stack.server.server
    trickling = []
    for _ in range(2):   # two 4 MiB bodies begun, never finished: the whole budget
        c = connect(stack.url)
        c.sendall(HEAD + b"content-length: %d\r\n\r\n{\"prompt\": \"" % (4 * MIB))
        trickling.append(c)
    deadline = time.monotonic() + 5
    while edge.large_bodies_held < 8 * MIB and time.monotonic() < deadline:
        time.sleep(0.01)
    assert edge.large_bodies_held == 8 * MIB
    try:
        with connect(stack.url) as c:   # declared: refused before its body is read
            c.sendall(HEAD + b"content-length: %d\r\n\r\n" % (2 * MIB))
            got = read_until_closed(c, 5.0)
        status, error = refusal(got)
        assert status == 503 and error["code"] == "bodies_over_budget"
        assert b"\r\nretry-after: 1\r\n" in got.lower()
        with connect(stack.url) as c:   # chunked: refused once it grows past 1 MiB
            c.sendall(HEAD + b"transfer-encoding: chunked\r\n\r\n%x\r\n" % MIB + b" " * MIB
                      + b"\r\n")
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                c.sendall(b"2\r\n{}\r\n")
            status, error = refusal(read_until_closed(c, 5.0))
        assert status == 503 and error["code"] == "bodies_over_budget"
        small = stack.client.post("/v1/completions", json={"prompt": words(0, 8),
                                                           "max_tokens": 1})
        assert small.status_code == 200   # never refused for the budget
        assert stack.fleet.workers[0].requests == 1
    finally:
        trickling.pop().close()
    # what a request took comes back when it ends: a large body fits again
    deadline = time.monotonic() + 5
    while edge.large_bodies_held > 4 * MIB and time.monotonic() < deadline:
        time.sleep(0.01)
    big = json.dumps({"prompt": words(0, 8) + " " * (2 * MIB), "max_tokens": 1}).encode()
    assert stack.client.post("/v1/completions", content=big).status_code == 200
    trickling.pop().close()
    deadline = time.monotonic() + 5
    while edge.large_bodies_held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert edge.large_bodies_held == 0


def test_a_budget_smaller_than_the_largest_body_is_refused_at_start():
    with pytest.raises(ValueError, match="large_body_budget_bytes"):
        GatewayConfig(max_body_bytes=64 * MIB, large_body_budget_bytes=32 * MIB)


