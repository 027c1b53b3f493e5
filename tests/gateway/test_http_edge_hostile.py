"""The gateway's HTTP edge against a hostile in-cluster client: what it may make the gateway do
before it has shown a key, and inputs from the edges of HTTP/1. Raw sockets on loopback against
a real gateway with simulated workers."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator

from radixpool.gateway.http_edge import EdgeLimits, EdgeServer, Request, Responder
from radixpool.http_edge import LINGER_IDLE_S
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


def test_idle_connections_past_the_limit_make_room_and_clients_are_still_served(make_stack):
    # Nothing capped the connections: a client holding a thousand idle sockets took the gateway
    # to its open-file limit (1024 in many containers), where it accepted and dropped every new
    # connection and could open none to its workers.
    stack = make_stack(1, max_connections=16)
    idle = [connect(stack.url) for _ in range(24)]
    try:
        got = stack.client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 1},
                                headers={"connection": "close"})
        assert got.status_code == 200
        for c in idle[:9]:   # the oldest idle ones were closed to make room
            assert read_until_closed(c, 5.0) == b""
        with connect(stack.url) as newest:   # the newest of them still serves
            newest.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert read_until_closed(newest).startswith(b"HTTP/1.1 200")
    finally:
        for c in idle:
            c.close()


def test_past_the_limit_room_is_made_for_a_share_of_it_at_once(loop_thread):
    # Making room looks at every connection. Done for each new connection past the limit, a
    # flood of them at 4096 connections cost 4.5 ms each on the event loop: a request sent
    # during such a flood waited 15 s. Room is now made for a 64th of the limit at once, so
    # the next connections pass no one over again.
    async def hello(request: Request, respond: Responder) -> None:
        await respond.send(200, [], b"hi")

    server = EdgeServer(hello, "127.0.0.1", 0, EdgeLimits(max_connections=128,
                                                          header_read_timeout=60.0))
    loop_thread.run(server.start())
    url, state = f"http://127.0.0.1:{server.port}", server._state
    idle: list[socket.socket] = []

    def open_ones(count: int, then_held: int) -> None:
        idle.extend(connect(url) for _ in range(count))
        deadline = time.monotonic() + 10
        while len(state.connections) != then_held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(state.connections) == then_held

    try:
        open_ones(128, then_held=128)
        open_ones(1, then_held=126)   # one past the limit: room for it and 128 // 64 more
        for c in idle[:3]:
            c.settimeout(5)
            assert c.recv(1) == b"", "one of the oldest idle connections left open"
        open_ones(2, then_held=128)   # in the room made: none is closed for them
        idle[3].sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert Responses(read_until_closed(idle[3])).messages == [(200, b"hi")]
    finally:
        for c in idle:
            c.close()
        loop_thread.run(server.stop())


@contextlib.contextmanager
def every_connection_answering(stack, count: int) -> Iterator[None]:
    """`count` connections, each with a request being answered (its head whole, its body still
    to come); on leaving, one of them is finished and must get its 200: none was cut."""
    busy = [connect(stack.url) for _ in range(count)]
    try:
        for c in busy:
            c.sendall(HEAD + b"content-length: 100\r\n\r\n{\"prompt\"")
        tasks = stack.server.server._state.tasks
        deadline = time.monotonic() + 5
        while len(tasks) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        yield
        busy[0].sendall(b': "w1", "max_tokens": 1}'.ljust(91))   # the rest of the 100 bytes
        (status, _), = Responses(read_until_closed(busy[0], 2.0)).messages
        assert status == 200
    finally:
        for c in busy:
            c.close()


def test_when_every_connection_is_being_answered_one_more_gets_503(make_stack):
    stack = make_stack(1, max_connections=4)
    with every_connection_answering(stack, 4), connect(stack.url) as late:
        late.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        (status, body), = Responses(read_until_closed(late)).messages
        assert status == 503
        assert json.loads(body)["error"]["code"] == "too_many_connections"


def test_a_flood_past_the_limit_with_every_connection_answering_is_refused_cheaply(
        make_stack, monkeypatch):
    # Each new connection past the limit looked at every open one before its 503 (4.5 ms at
    # 4096): clients retrying at overload spent the event loop on passes that found nothing.
    from radixpool import http_edge

    monkeypatch.setattr(http_edge, "FULL_RECHECK_S", 30.0)   # the whole flood in one window
    stack = make_stack(1, max_connections=4)
    with every_connection_answering(stack, 4):
        busy = set(stack.server.server._state.connections)
        looked_at = []
        answering = http_edge.EdgeProtocol._answering

        def counting(self) -> bool:
            if self in busy:
                looked_at.append(self)
            return answering(self)

        monkeypatch.setattr(http_edge.EdgeProtocol, "_answering", counting)
        for _ in range(20):
            with connect(stack.url) as late:
                late.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
                (status, body), = Responses(read_until_closed(late)).messages
                assert status == 503
                assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert len(looked_at) <= 2 * len(busy)   # one pass, not one per refused connection


def read_to_orderly_end(sock, seconds: float = 5.0) -> bytes:
    """All the server sends, which must end with its FIN: a reset fails the test."""
    sock.settimeout(seconds)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_a_client_still_sending_its_body_reads_the_413_not_a_reset(make_stack):
    # The gateway answered 413 before the body and closed with the body unread: the kernel
    # answered the rest with a reset, so a client writing its whole request before reading (as
    # most do) failed on its write and never saw the 413 (RFC 9112 §9.6)
    stack = make_stack(1, max_body_bytes=MIB)
    for framing in (b"content-length: %d\r\n\r\n" % (8 * MIB), None):
        with connect(stack.url) as c:
            if framing is None:   # no length declared: refused once 1 MiB has been read
                chunk = b"x" * MIB
                c.sendall(HEAD + b"transfer-encoding: chunked\r\n\r\n"
                          + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 8 + b"0\r\n\r\n")
            else:
                c.sendall(HEAD + framing + b"x" * (8 * MIB))
            (status, body), = Responses(read_to_orderly_end(c)).messages
        assert status == 413
        assert json.loads(body)["error"]["code"] == "request_too_large"
    assert stack.client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1}
                             ).status_code == 200


def test_a_connection_past_the_limit_reads_its_503_and_lingers_in_no_ones_way(make_stack):
    stack = make_stack(1, max_connections=4)
    state = stack.server.server._state
    with every_connection_answering(stack, 4):
        late = []
        for _ in range(2):   # a whole request with a 4 MiB body, sent at once
            late.append(connect(stack.url))
            late[-1].sendall(HEAD + b"content-length: %d\r\n\r\n" % (4 * MIB)
                             + b"x" * (4 * MIB))
            (status, body), = Responses(read_to_orderly_end(late[-1])).messages
            assert status == 503
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            if len(late) == 1:   # a client that never closes its side is closed in LINGER_IDLE_S
                deadline = time.monotonic() + LINGER_IDLE_S + 3
                while len(state.connections) > 4 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert len(state.connections) == 4
        # one waiting out its client holds no place: the next is refused too, not let in
        with connect(stack.url) as next_one:
            next_one.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
            (status, _), = Responses(read_until_closed(next_one)).messages
            assert status == 503
        for c in late:
            c.close()


def test_answers_their_clients_do_not_read_count_under_the_limit_until_sent(loop_thread):
    # A connection closed after its last answer, with that answer still to send to a client
    # that reads none of it, keeps its descriptor (and the answer's memory) until the client
    # reads or write_stall_timeout. Counted as gone, it let such clients open connections
    # without limit: each new one closed the last one's, which went on holding its descriptor
    async def app(request: Request, respond: Responder) -> None:
        await respond.send(200, [], b"x" * (16 * MIB))   # more than the kernel's buffers hold

    server = EdgeServer(app, "127.0.0.1", 0, EdgeLimits(max_connections=4))
    loop_thread.run(server.start())
    clients = []
    try:
        for _ in range(12):
            c = socket.socket()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # reads 12 bytes, no more
            c.connect(("127.0.0.1", server.port))
            c.settimeout(10)
            c.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            clients.append((c, c.recv(12)))
        assert [status for _, status in clients].count(b"HTTP/1.1 200") == 4, clients
        assert len(server._state.connections) <= 4 + 8   # the 503s, till their clients close
        got = b"".join([clients[0][1], read_until_closed(clients[0][0])])
        (status, body), = Responses(got).messages
        assert status == 200 and len(body) == 16 * MIB   # held, not cut, to make room
    finally:
        for c, _ in clients:
            c.close()
        loop_thread.run(server.stop(grace=1.0))


def test_an_http_1_0_client_gets_its_stream_unframed_and_ended_by_the_close(make_stack):
    stack = make_stack(1)
    body = json.dumps({"prompt": "w1 w2", "max_tokens": 3, "stream": True}).encode()
    with connect(stack.url) as c:
        c.sendall(b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        head, _, stream = read_until_closed(c).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()   # HTTP/1.0 has no chunked encoding
    events = [e for e in stream.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") for e in events[:-1]), events[:2]
    # a whole answer keeps its Content-Length
    with connect(stack.url) as c:
        c.sendall(b"GET /livez HTTP/1.0\r\n\r\n")
        got = read_until_closed(c)
    assert b"content-length: 15\r\n" in got and got.endswith(b'{"status":"ok"}')


def test_an_http_1_0_client_that_asks_for_100_continue_reads_its_answer_not_a_100(make_stack):
    # RFC 9110 10.1.1: a server ignores a 100-continue expectation in an HTTP/1.0 request (1xx
    # answers are HTTP/1.1's); the edge sent `100 Continue` first, which such a client takes
    # for its whole answer
    stack = make_stack(1)
    body = json.dumps({"prompt": "w1 w2", "max_tokens": 3}).encode()
    with connect(stack.url) as c:
        c.sendall(b"POST /v1/completions HTTP/1.0\r\nexpect: 100-continue\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                  % (len(body), body))
        got = read_until_closed(c)
    assert got.startswith(b"HTTP/1.1 200"), got[:100]
    assert json.loads(got.partition(b"\r\n\r\n")[2])["choices"]


def test_a_request_target_the_url_parser_refuses_gets_400_alone_or_pipelined(make_stack):
    # `CONNECT host:port` passed the request parser and broke uvicorn's URL parser in the
    # head's callback: the edge took the error for a broken body that did not exist and failed
    # itself (no answer, a traceback in the log per request)
    stack = make_stack(1)
    for first in (b"", b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n"):
        with connect(stack.url) as c:
            c.sendall(first + b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nhost: x\r\n\r\n")
            answers = Responses(read_until_closed(c, 5.0)).messages
        assert [status for status, _ in answers] == [200] * bool(first) + [400]
        assert json.loads(answers[-1][1])["error"]["code"] == "invalid_http_request"
    assert stack.client.get("/livez").status_code == 200


def test_a_handler_failure_logs_the_path_on_one_line(loop_thread, caplog):
    # The path is percent-decoded: `%0d%0a` in it wrote a forged line into the gateway's log
    async def failing(request: Request, respond: Responder) -> None:
        raise RuntimeError("a bug")

    server = EdgeServer(failing, "127.0.0.1", 0, EdgeLimits())
    loop_thread.run(server.start())
    try:
        with caplog.at_level(logging.ERROR, logger="radixpool.gateway"), \
                connect(f"http://127.0.0.1:{server.port}") as c:
            c.sendall(b"GET /x%0d%0a2026-01-01%20INFO%20forged HTTP/1.1\r\nhost: x\r\n"
                      b"connection: close\r\n\r\n")
            (status, _), = Responses(read_until_closed(c)).messages
        assert status == 500
        failure, = (r for r in caplog.records if "handler failed" in r.getMessage())
        assert "\n" not in failure.getMessage() and "\r" not in failure.getMessage()
        assert "forged" in failure.getMessage()
    finally:
        loop_thread.run(server.stop())
