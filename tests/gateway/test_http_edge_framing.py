"""The HTTP edge against bodies whose framing is broken or never ends: a Transfer-Encoding that
is not chunked at the end, a bad chunk, endless trailer fields or chunk extensions. Each is
refused at once with a 4xx, reaches no worker, and the gateway serves on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import pytest

from tests.gateway.conftest import words
from tests.gateway.test_http_edge import Responses, connect, read_until_closed


@pytest.mark.parametrize("framing", [
    b"transfer-encoding: gzip\r\n\r\n",           # a request's last coding must be chunked
    b"transfer-encoding: xchunked\r\n\r\n",
    b"transfer-encoding: chunked\r\n\r\n%x\n",    # a bare LF after the chunk size
], ids=["gzip", "xchunked", "bare-lf-chunk"])
def test_a_body_that_cannot_be_framed_gets_400_at_once_and_reaches_no_worker(make_stack, framing):
    # the parser fails after the head: the request has begun, and its handler waits for a body
    # that will never come unless the edge refuses it
    stack = make_stack(1, body_read_timeout=30.0)
    whole = json.dumps({"prompt": words(0, 8), "max_tokens": 3}).encode()
    if b"%x" in framing:
        framing %= len(whole)
    with connect(stack.url) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\n" + framing + whole)
        started = time.monotonic()
        got = read_until_closed(c, 10.0)
    assert time.monotonic() - started < 5
    (status, body), = Responses(got).messages
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_http_request"
    assert stack.fleet.workers[0].requests == 0
    assert stack.client.post("/v1/completions", content=whole).status_code == 200


@pytest.mark.parametrize("framing", [
    (b"2\r\n{}\r\n0\r\n", b"x-trailer: " + b"a" * 1000 + b"\r\n"),   # endless trailer fields
    (b"2\r\n{}\r\n0\r\nx-trailer: ", b"a" * 1000),                   # one endless trailer
    (b"2;ext=", b"a" * 1000),                                           # an endless extension
], ids=["trailer-fields", "trailer-value", "chunk-extension"])
def test_a_chunked_body_with_endless_framing_gets_431_before_the_body_timeout(
        make_stack, framing):
    # uvicorn kept every trailer field until the body read timeout: ~1 GB in a few seconds
    stack = make_stack(1, body_read_timeout=30.0)
    start, unit = framing
    with connect(stack.url) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ntransfer-encoding: chunked\r\n\r\n" + start)
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(4096):   # 4 MiB at most
                c.sendall(unit * 1024)
        got = read_until_closed(c, 5.0)
    assert time.monotonic() - started < 5
    (status, body), = Responses(got).messages
    assert status == 431 and b"trailer" in body
    assert stack.fleet.workers[0].requests == 0
    assert stack.client.get("/livez").status_code == 200


def test_trailer_fields_are_not_merged_into_the_request_headers(loop_thread):
    # the workers' handlers (FastAPI) read headers from the scope when they need them, which
    # may be after the body: a trailer must not turn up there as a header the client never sent
    import uvicorn
    from uvicorn.server import ServerState

    from radixpool.http_edge import EdgeLimits as ProtocolLimits
    from radixpool.http_edge import edge_protocol

    async def app(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        names = b",".join(name for name, _ in scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": names})

    config = uvicorn.Config(app, lifespan="off", http=edge_protocol(ProtocolLimits()),
                            log_level="warning")
    config.load()
    state = ServerState()

    async def serve():
        return await asyncio.get_running_loop().create_server(
            lambda: config.http_protocol_class(config=config, server_state=state,
                                               app_state={}), "127.0.0.1", 0)

    server = loop_thread.run(serve())
    try:
        with connect(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}") as c:
            c.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                      b"connection: close\r\n\r\n2\r\n{}\r\n0\r\nauthorization: Bearer x\r\n\r\n")
            (status, names), = Responses(read_until_closed(c)).messages
        assert status == 200 and names == b"host,transfer-encoding,connection"
    finally:
        loop_thread.call(server.close)


@pytest.mark.parametrize("upgrade", [b"h2c", b"websocket"])
def test_a_request_asking_to_upgrade_is_served_over_http_1_1_or_refused_never_half_read(
        make_stack, caplog, upgrade):
    # Such a request's body was taken for the new protocol: the application got it empty (a
    # gateway answered "not valid JSON" to a valid body), and uvicorn logged two warnings per
    # request (one telling to install a WebSocket library): any client could fill the log
    stack = make_stack(1)
    whole = json.dumps({"prompt": words(0, 8), "max_tokens": 3}).encode()
    asks = b"connection: upgrade, close\r\nupgrade: %s\r\n" % upgrade
    uvicorn_log = logging.getLogger("uvicorn")   # the protocol's; it does not propagate
    uvicorn_log.addHandler(caplog.handler)
    try:
        for _ in range(3):   # bodiless: served as is
            with connect(stack.url) as c:
                c.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + asks + b"\r\n")
                (status, body), = Responses(read_until_closed(c, 10.0)).messages
            assert status == 200 and json.loads(body)["data"], body
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    with connect(stack.url) as c:   # with a body: refused, whole, before any worker sees it
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + asks
                  + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                  % (len(whole), whole))
        (status, body), = Responses(read_until_closed(c, 10.0)).messages
    assert status == 400 and json.loads(body)["error"]["code"] == "upgrade_not_supported"
    assert stack.fleet.workers[0].requests == 0
    assert stack.client.post("/v1/completions", content=whole).status_code == 200


@pytest.mark.parametrize("first", [
    b"GET /livez HTTP/1.1\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
    b"CONNECT /livez HTTP/1.1\r\n\r\n",
], ids=["upgrade", "connect"])
@pytest.mark.parametrize("count", [1, 3000])
def test_requests_pipelined_behind_one_not_switched_in_the_same_read_are_answered(
        make_stack, first, count):
    # The parser stops at the end of a head asking to switch protocols (CONNECT always does),
    # and what followed it in the same read was dropped: served over HTTP/1.1 instead, that
    # request was answered and the one behind it never was, its client left waiting until the
    # connection's idle timeout. Thousands of them in one read must not recurse either.
    stack = make_stack(1, header_read_timeout=3.0)
    with connect(stack.url) as c:
        c.sendall(first * count
                  + b"GET /livez HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        messages = Responses(read_until_closed(c, 10.0)).messages
    assert len(messages) == count + 1 and messages[-1] == (200, b'{"status":"ok"}')


@pytest.mark.parametrize("broken", [
    b"transfer-encoding: chunked\r\n\r\nzz\r\n",   # a bad chunk size
    b"connection: upgrade\r\nupgrade: h2c\r\ncontent-length: 2\r\n\r\n{}",   # a body to switch
], ids=["bad-chunk", "upgrade"])
def test_a_refused_body_that_waited_for_100_continue_is_answered_once_without_a_traceback(
        make_stack, caplog, broken):
    # The body is refused in the read that ended the head, before the handler ran: the handler
    # then asked for the body, and uvicorn wrote the `100 Continue` it still owed after the
    # 400 and its FIN: "Exception in ASGI application" with a traceback, for every such request
    stack = make_stack(1)
    uvicorn_log = logging.getLogger("uvicorn")   # the protocol's; it does not propagate
    uvicorn_log.addHandler(caplog.handler)
    try:
        with connect(stack.url) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                      + broken)
            (status, _), = Responses(read_until_closed(c, 10.0)).messages
        assert stack.client.get("/livez").status_code == 200
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert status == 400
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert stack.fleet.workers[0].requests == 0
