"""The lean HTTP/1.1 server under clients that do unusual but legal (or illegal) things."""

from __future__ import annotations

import socket

from radixpool.gateway.http_server import Request, Responder, bound_port, serve


async def echo(request: Request, respond: Responder) -> None:
    if request.path == "/stream":
        await respond.start(200, [(b"content-type", b"text/plain")])
        for part in (b"a", b"bb", b"ccc"):
            await respond.write(part)
        await respond.end()
    else:
        await respond.send(200, [], b"%s %s %d" % (request.method.encode(),
                                                 request.path.encode(), len(request.body)))


def exchange(port: int, data: bytes, until: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        got = b""
        while until not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_pipelined_requests_are_answered_in_order(loop_thread):
    server = loop_thread.run(serve(echo, "127.0.0.1", 0, 1000))
    port = bound_port(server)
    two = (b"GET /one HTTP/1.1\r\nhost: x\r\n\r\n"
           b"POST /two HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc")
    got = exchange(port, two, b"/two 3")
    assert got.index(b"GET /one 0") < got.index(b"POST /two 3")
    loop_thread.call(server.close)


def test_chunked_streams_and_chunked_uploads(loop_thread):
    server = loop_thread.run(serve(echo, "127.0.0.1", 0, 1000))
    port = bound_port(server)
    got = exchange(port, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n", b"0\r\n\r\n")
    assert b"transfer-encoding: chunked" in got and b"1\r\na\r\n2\r\nbb\r\n3\r\nccc\r\n" in got
    got = exchange(port, b"POST /up HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"4\r\nwxyz\r\n0\r\n\r\n", b"/up 4")
    assert got.endswith(b"POST /up 4")
    loop_thread.call(server.close)


def test_garbage_and_oversize_get_4xx_and_a_closed_connection(loop_thread):
    server = loop_thread.run(serve(echo, "127.0.0.1", 0, 1000))
    port = bound_port(server)
    assert exchange(port, b"\x16\x03\x01 not http at all\r\n\r\n", b"}").startswith(
        b"HTTP/1.1 400")
    big = b"x" * 5000
    got = exchange(port, b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                   % (len(big), big), b"}")
    assert got.startswith(b"HTTP/1.1 413") and b"exceeds the limit of 1000 bytes" in got
    loop_thread.call(server.close)
