"""The simulated workers' HTTP/1.1 server (test and benchmark support), on asyncio + httptools.

The gateway no longer runs on it: it is served by the hardened edge (`radixpool.http_edge`),
which enforces the timeouts and limits this one lacks (no header timeout, no header cap,
pipelined requests read ahead without bound). The simulated workers keep it because a test can
cut every connection at once (`HttpProtocol.abort`: a crashed worker, as clients see it). It
parses with httptools, keeps connections alive, sets TCP_NODELAY, answers requests on one
connection in order, and hands the application a `Request` and a `Responder`:

    async def app(request: Request, respond: Responder) -> None

`Responder.send` answers in one write with Content-Length; `start`/`write`/`end` stream with
chunked encoding, one chunk per `write`, honouring the transport's flow control.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import httptools

from radixpool.gateway.http_edge import Headers, error_body, json_body
from radixpool.gateway.upstream import set_nodelay

__all__ = ["Headers", "HttpProtocol", "Request", "Responder", "bound_port", "error_body",
           "json_body", "serve"]

App = Callable[["Request", "Responder"], Awaitable[None]]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "path", "query")

    def __init__(self, method: str, path: str, query: str, headers: dict[bytes, bytes],
                 body: bytes, keep_alive: bool) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive


class Responder:
    __slots__ = ("_chunked", "_proto", "keep_alive", "started")

    def __init__(self, proto: HttpProtocol, keep_alive: bool) -> None:
        self._proto = proto
        self._chunked = False
        self.keep_alive = keep_alive
        self.started = False

    @property
    def disconnected(self) -> bool:
        return self._proto.closed

    def _head(self, status: int, headers: Headers, extra: bytes) -> bytes:
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
        parts.extend(b"%s: %s\r\n" % (k, v) for k, v in headers)
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(extra)
        return b"".join(parts)

    async def send(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = True
        head = self._head(status, headers, b"content-length: %d\r\n\r\n" % len(body))
        await self._proto.write(head + body)

    async def send_error(self, status: int, message: str, code: str | None = None) -> None:
        await self.send(*error_body(status, message, code))

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self._chunked = True
        await self._proto.write(self._head(status, headers, b"transfer-encoding: chunked\r\n\r\n"))

    async def write(self, data: bytes) -> None:
        if data:
            await self._proto.write(b"%x\r\n%b\r\n" % (len(data), data))

    async def end(self) -> None:
        if self._chunked:
            await self._proto.write(b"0\r\n\r\n")


class HttpProtocol(asyncio.Protocol):
    def __init__(self, app: App, max_body: int,
                 connections: set[HttpProtocol] | None = None) -> None:
        self.app = app
        self.connections = connections
        self.max_body = max_body
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_len = 0
        self._rejected = False
        self._pending: deque[Request] = deque()
        self._busy = False
        self._can_write: asyncio.Event | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)
        if self.connections is not None:
            self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.connections is not None:
            self.connections.discard(self)
        if self._can_write is not None:
            self._can_write.set()

    def pause_writing(self) -> None:
        self._can_write = asyncio.Event()

    def resume_writing(self) -> None:
        if self._can_write is not None:
            self._can_write.set()
            self._can_write = None

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reject(400, f"malformed HTTP request: {exc}")

    # --- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_len = b"", {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            self._reject(413, f"request body of {int(length)} bytes exceeds the limit of "
                              f"{self.max_body} bytes", drain=True)
        elif self._headers.get(b"expect", b"").lower() == b"100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits 1 s without it

    def on_body(self, body: bytes) -> None:
        if self._rejected:
            return
        self._body_len += len(body)
        if self._body_len > self.max_body:
            self._reject(413, f"request body exceeds the limit of {self.max_body} bytes",
                         drain=True)
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._rejected:
            self._close()  # the rejected body has been read to its end: the client sees the 413
            return
        url = httptools.parse_url(self._url)
        request = Request(self.parser.get_method().decode(), url.path.decode("utf-8", "replace"),
                          (url.query or b"").decode("utf-8", "replace"), self._headers,
                          b"".join(self._body), self.parser.should_keep_alive())
        self._pending.append(request)
        if not self._busy:
            self._busy = True
            asyncio.get_running_loop().create_task(self._serve())

    # --- serving ------------------------------------------------------------------------------
    async def _serve(self) -> None:
        while self._pending and not self.closed:
            request = self._pending.popleft()
            respond = Responder(self, request.keep_alive)
            try:
                await self.app(request, respond)
            except Exception as exc:  # a bug must cost one request, never the connection loop
                if not respond.started:
                    await respond.send_error(500, f"internal gateway error: {exc!r}")
                else:
                    self._close()
            if not respond.keep_alive:  # the client asked, or the app cut a stream short
                self._close()
        self._busy = False

    async def write(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            return
        self.transport.write(data)
        if self._can_write is not None:
            await self._can_write.wait()

    def _reject(self, status: int, message: str, drain: bool = False) -> None:
        """Answer `status` at once and close; with `drain`, read the rest of the body first so
        the client is not reset before it reads the answer."""
        if self._rejected:
            return
        self._rejected = True
        if self.transport is not None and not self.closed:
            _, headers, body = error_body(status, message)
            head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
            head += b"".join(b"%s: %s\r\n" % kv for kv in headers)
            head += b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
            self.transport.write(head + body)
        if not drain:
            self._close()

    def abort(self) -> None:
        """Drop the connection at once (no flush): a crash, as the peer sees it."""
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def _close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


async def serve(app: App, host: str, port: int, max_body: int,
                sock: socket.socket | None = None,
                connections: set[HttpProtocol] | None = None) -> asyncio.Server:
    """Start serving `app`; the returned server's sockets tell the bound port. With
    `connections`, the open connections are kept in that set (to cut them all at once)."""
    loop = asyncio.get_running_loop()
    factory = lambda: HttpProtocol(app, max_body, connections)  # noqa: E731
    if sock is not None:
        return await loop.create_server(factory, sock=sock, backlog=1024)
    return await loop.create_server(factory, host, port, backlog=1024, reuse_address=True)


def bound_port(server: asyncio.Server) -> int:
    return server.sockets[0].getsockname()[1]
