"""Stopping the gateway's HTTP edge with clients in every state: an answer being computed
finishes, an idle keep-alive connection closes at once, and whatever is left when the grace
period ends is cut with every handler ended (none cancelled mid-flight as a failure)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import threading
import time

import httpx

from bench.simfleet import SimConfig
from radixpool.http_edge import LINGER_MAX_S
from tests.gateway.conftest import words
from tests.gateway.test_http_edge import Responses, connect, read_until_closed


def test_stop_finishes_answers_closes_idle_connections_and_ends_every_handler(loop_thread):
    from radixpool.gateway import http_edge

    async def app(request, respond) -> None:
        if request.path == "/slow":
            await asyncio.sleep(0.5)
            await respond.send(200, [], b"done")
        else:   # a stream that would never end
            await respond.start(200, [])
            while True:
                await asyncio.sleep(0.05)
                await respond.write(b"x")

    errors = []
    uvicorn_log = logging.getLogger("uvicorn.error")
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    server = http_edge.EdgeServer(app, "127.0.0.1", 0, http_edge.EdgeLimits())
    loop_thread.run(server.start())
    uvicorn_log.addHandler(handler)   # after start: uvicorn's logging setup drops handlers
    url = f"http://127.0.0.1:{server.port}"
    try:
        idle, slow, endless, half_body = (connect(url) for _ in range(4))
        idle.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        idle.settimeout(5)
        answer = b""
        while not answer.endswith(b"done"):
            answer += idle.recv(65536)   # now idle, kept alive
        slow.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        endless.sendall(b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n")
        half_body.sendall(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n01234")
        time.sleep(0.2)
        stopped = {}

        async def stop_and_count() -> int:
            await server.stop(grace=1.0)
            return len(server._state.tasks)

        def stop() -> None:
            started = time.monotonic()
            stopped["handlers"] = loop_thread.run(stop_and_count())
            stopped["after"] = time.monotonic() - started

        stopping = threading.Thread(target=stop)
        stopping.start()
        started = time.monotonic()
        # closed at once, not at the end of the 1 s grace (the bound leaves room for a busy CPU)
        assert read_until_closed(idle, 5) == b"" and time.monotonic() - started < 0.9
        assert Responses(read_until_closed(slow, 5)).messages == [(200, b"done")]
        stopping.join(10)
        assert stopped["after"] < 3.0   # the grace period, then the rest is cut
        assert stopped["handlers"] == 0   # every handler ended before stop() returned
        assert not errors, [record.getMessage() for record in errors]   # none cut as a failure
        for sock in (idle, slow, endless, half_body):
            sock.close()
    finally:
        uvicorn_log.removeHandler(handler)


def test_a_stopping_gateway_cuts_what_outlives_its_drain_at_the_drain_deadline(make_stack):
    # the pod's grace period is sized for the drain plus a margin: the edge must not add its
    # own grace period after the drain (before: a further 5 s, the whole margin)
    stack = make_stack(1, sim=SimConfig(decode_ms_per_token=50.0))
    stream = stack.client.stream("POST", "/v1/completions", json={
        "prompt": words(0, 8), "max_tokens": 400, "stream": True})   # 20 s of tokens
    with stream as answer:
        assert answer.status_code == 200
        pieces = answer.iter_bytes()
        next(pieces)
        started = time.monotonic()
        stack.loop.run(stack.server.stop(drain_seconds=1.0))
        took = time.monotonic() - started
        with contextlib.suppress(httpx.HTTPError):
            for _ in pieces:
                pass
    assert 0.9 < took < 5.0, took   # the bug took 6 s: the drain and 5 s more


def test_an_answer_finished_while_stopping_closes_without_waiting_out_its_client(loop_thread):
    # An answer that ends once the server stops closes its connection (`connection: close`).
    # It read its client out first, as after any last answer: a client that kept sending held
    # stop() until LINGER_MAX_S, or its whole grace period, after every answer was whole
    from radixpool.gateway import http_edge

    async def app(request, respond) -> None:
        await asyncio.sleep(0.3)
        await respond.send(200, [], b"done")

    server = http_edge.EdgeServer(app, "127.0.0.1", 0, http_edge.EdgeLimits())
    loop_thread.run(server.start())
    client = connect(f"http://127.0.0.1:{server.port}")
    client.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    time.sleep(0.1)
    stopping = threading.Thread(target=loop_thread.run,
                                args=(server.stop(grace=3 * LINGER_MAX_S), 4 * LINGER_MAX_S))
    started = time.monotonic()
    stopping.start()
    answer = b""
    with contextlib.suppress(OSError):   # a client still sending: a byte every 0.1 s
        while stopping.is_alive() and time.monotonic() - started < 2 * LINGER_MAX_S:
            client.sendall(b"x")
            if select.select([client], [], [], 0.1)[0]:
                answer += client.recv(65536)
    stopping.join(4 * LINGER_MAX_S)
    took = time.monotonic() - started
    client.close()
    assert Responses(answer).messages == [(200, b"done")]
    assert took < LINGER_MAX_S / 2, took   # the bug: LINGER_MAX_S and more
