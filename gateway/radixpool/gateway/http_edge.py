"""The gateway's HTTP edge: uvicorn's httptools protocol, hardened (`radixpool.http_edge`, the
workers run the same class), inside the gateway's own event loop.

Why uvicorn. Measured side by side (bench/results/gateway_overhead_2cpu.txt): the whole gateway
on this edge against the same gateway on Granian (Rust and hyper over RSGI, what it ran on
before), on the overhead benchmark at the same VM speed, added p50 334-348 us against 402-510 us
per non-streamed request, and the floor under it (edge + worker client, no routing) 196-199 us
against 313-407 us; interleaved with Granian (`bench/gateway_ab.py`), 416 against 459 us.
Granian hands every request and answer between hyper's thread and the event loop's; here parsing
and the application share one thread, and a response's head leaves in one write with its body.
What made Granian the choice at first (a header read timeout, an exact header cap, pipelining
done right) is now `EdgeProtocol`'s, tested on both servers; and a stream's writes wait for a
client that reads slowly (uvicorn's flow control), which Granian's RSGI sends did not.

This module adds what the application needs around the protocol: the body size limit (413 before
the body is read when Content-Length says so, else while it arrives; the connection then closes),
OpenAI-style error bodies, an `x-request-id` on every answer (the client's when it sent a usable
one, else a new one; the request passes it on to the worker, so both log the same id), and
cancellation of the handler when the client goes away (the proxy then closes its worker
connection, which aborts the request on the worker). Watching for the client's departure takes
a task per request, so the watch starts only once a handler has run `disconnect_watch_after` (a
request answered sooner never pays for it; a client that left earlier is seen the moment the
watch starts). The application sees a `Request` and a `Responder`:

    async def app(request: Request, respond: Responder) -> None

and may screen each request on its head alone, before the body is read (`Screen`: the gateway
checks keys there, so a client without one never has a body buffered, a `100 Continue` sent or
the large-body budget charged for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import uvicorn
from uvicorn.server import ServerState

from radixpool.http_edge import EdgeLimits as ProtocolLimits
from radixpool.http_edge import edge_protocol, error_document
from radixpool.listen import listen_socket

log = logging.getLogger("radixpool.gateway")

Headers = list[tuple[bytes, bytes]]
App = Callable[["Request", "Responder"], Awaitable[None]]
# (method, path, headers) -> an answer given before the body is read, or None to go on
Screen = Callable[[str, str, dict[bytes, bytes]], "tuple[int, Headers, bytes] | None"]

REQUEST_ID = b"x-request-id"
_USABLE_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,256}")   # printable ASCII, no spaces
_REQUEST_IDS = itertools.count()
_ID_PREFIX = uuid.uuid4().hex[:12].encode()
_FRAMING = (b"content-length", b"transfer-encoding")   # the edge frames what it sends
LARGE_BODY_BYTES = 1 << 20   # bodies up to this size never count against the budget
CLOSE_GRACE_S = 5.0   # how long stop() waits by default for connections still answering
DESCRIPTORS_PER_CONNECTION = 2   # a client being answered holds a connection to a worker too


def request_id(headers: dict[bytes, bytes]) -> bytes:
    """The client's `x-request-id` if it is short printable ASCII, else a new one."""
    given = headers.get(REQUEST_ID)
    if given is not None and _USABLE_REQUEST_ID.fullmatch(given):
        return given
    return b"%s-%x" % (_ID_PREFIX, next(_REQUEST_IDS))


def json_body(status: int, doc: object) -> tuple[int, Headers, bytes]:
    return status, [(b"content-type", b"application/json")], json.dumps(doc).encode()


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> tuple[int, Headers, bytes]:
    """An OpenAI-style error answer, shaped as the workers shape theirs (`error_document`)."""
    return status, [(b"content-type", b"application/json")], \
        error_document(status, message, code, param)


def method_not_allowed(message: str, allowed: str) -> tuple[int, Headers, bytes]:
    """A 405 as the workers answer it: code `method_not_allowed`, the methods in `Allow`."""
    status, headers, doc = error_body(405, message, "method_not_allowed")
    return status, [(b"allow", allowed.encode()), *headers], doc


@dataclass(frozen=True)
class EdgeLimits(ProtocolLimits):
    """The protocol's limits (`radixpool.http_edge`), and the edge's own."""

    # Longer than the idle timeouts of the proxies that keep connections to the gateway (AWS
    # ALB and ingress-nginx: 60 s): a connection closed as the proxy reuses it fails that
    # request (a 502), and the proxy does not retry a POST
    keep_alive_timeout: float = 75.0
    max_body_bytes: int = 32 << 20
    disconnect_watch_after: float = 0.05  # seconds a handler runs before its client is watched
    large_body_budget_bytes: int = 256 << 20   # bodies over LARGE_BODY_BYTES held at once


class Request:
    __slots__ = ("body", "headers", "method", "path", "query")

    def __init__(self, method: str, path: str, query: str, headers: dict[bytes, bytes],
                 body: bytes) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body


class Responder:
    """`send` answers in one piece (Content-Length); `start` then `write`s stream it (chunked,
    one chunk per write, flushed at once). A stream ends when the handler returns. A write to a
    client that reads slowly waits until it has read enough (flow control)."""

    __slots__ = ("_send", "closing", "disconnected", "finished", "request_id", "started",
                 "streaming")

    def __init__(self, send, request_id: bytes) -> None:
        self._send = send
        self.started = False
        self.streaming = False
        self.finished = False
        self.disconnected = False
        self.closing = False   # answer with `connection: close`
        self.request_id = request_id

    async def send(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = True
        wire = self._wire(headers)
        wire.append((b"content-length", b"%d" % len(body)))
        await self._send({"type": "http.response.start", "status": status, "headers": wire})
        await self._send({"type": "http.response.body", "body": body})
        self.finished = True

    async def send_error(self, status: int, message: str, code: str | None = None,
                         param: str | None = None) -> None:
        await self.send(*error_body(status, message, code, param))

    async def start(self, status: int, headers: Headers) -> None:
        self.started = self.streaming = True
        await self._send({"type": "http.response.start", "status": status,
                          "headers": self._wire(headers)})

    async def write(self, data: bytes) -> None:
        if data and not self.disconnected:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        """The last chunk of a stream (the edge sends it when the handler returns)."""
        if not self.finished:
            self.finished = True
            await self._send({"type": "http.response.body", "body": b""})

    def _wire(self, headers: Headers) -> Headers:
        # a worker's echo of the request id is the same id; the edge frames the body itself
        wire = [(k, v) for k, v in headers if k != REQUEST_ID and k not in _FRAMING]
        wire.append((REQUEST_ID, self.request_id))
        if self.closing:
            wire.append((b"connection", b"close"))
        return wire


class _Watch:
    """Once the handler has run `after` seconds, a task waits for the client to go away and then
    cancels the handler. A request answered sooner costs one timer."""

    __slots__ = ("_receive", "_respond", "_task", "_timer", "_watcher", "client_left")

    def __init__(self, receive, respond: Responder, task: asyncio.Task, after: float) -> None:
        self._receive = receive
        self._respond = respond
        self._task = task
        self._watcher: asyncio.Task | None = None
        self.client_left = False
        self._timer: asyncio.TimerHandle | None = task.get_loop().call_later(after, self._start)

    def _start(self) -> None:
        self._timer = None
        self._watcher = self._task.get_loop().create_task(self._watch())

    async def _watch(self) -> None:
        # uvicorn answers `http.disconnect` once the connection is lost or the answer is whole
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._respond.finished:
            self.client_left = True
            self._task.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


class EdgeServer:
    """Serve `app` on host:port (0: an ephemeral port, bound at once so `port` is known)."""

    def __init__(self, app: App, host: str, port: int, limits: EdgeLimits,
                 screen: Screen | None = None) -> None:
        self.app = app
        self.screen = screen
        self.host = host
        self.limits = limits
        self._socket = listen_socket(host, port)   # `::`: both families (radixpool.listen)
        self.port: int = self._socket.getsockname()[1]
        self._state = ServerState()
        self.large_bodies_held = 0   # bytes of bodies over LARGE_BODY_BYTES, all requests
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        config = uvicorn.Config(
            self._asgi, interface="asgi3", lifespan="off",
            http=edge_protocol(self.limits, DESCRIPTORS_PER_CONNECTION),
            ws="none", log_level="warning", access_log=False, proxy_headers=False,
            server_header=False, date_header=False,
            timeout_keep_alive=self.limits.keep_alive_timeout)
        config.load()
        protocol = config.http_protocol_class
        state = self._state
        self._server = await asyncio.get_running_loop().create_server(
            lambda: protocol(config=config, server_state=state, app_state={}),
            sock=self._socket, backlog=1024)

    async def stop(self, grace: float = CLOSE_GRACE_S) -> None:
        """Stop listening, close idle connections, let those answering finish (up to `grace`
        seconds), then close the rest; their handlers have ended when this returns."""
        if self._server is None:
            self._socket.close()
            return
        self._server.close()
        for connection in list(self._state.connections):
            connection.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._state.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self._state.connections):
            connection.transport.close()
        # A handler whose client is gone ends by itself, as for any client that leaves (through
        # the watch, once it has started); cancelling it from here instead would be an error.
        if tasks := list(self._state.tasks):
            _, left = await asyncio.wait(tasks, timeout=self.limits.disconnect_watch_after + 0.2)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left, timeout=1.0)
        self._server = None

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        headers[REQUEST_ID] = request_id(headers)
        respond = Responder(send, headers[REQUEST_ID])
        if self.screen is not None:
            refusal = self.screen(scope["method"], scope["path"], headers)
            if refusal is not None:
                respond.closing = _declares_body(headers)   # a body left unread ends it
                await respond.send(*refusal)
                return
        budget = _BodyBudget(self)
        try:
            body = await self._read_body(headers, receive, respond, budget)
            if body is not None:   # else refused (413, 503), or the client left or was cut
                await self._answer(scope, receive, respond, headers, body)
        finally:
            budget.release()

    async def _answer(self, scope, receive, respond: Responder, headers: dict[bytes, bytes],
                      body: bytes) -> None:
        task = asyncio.current_task()
        watch = _Watch(receive, respond, task, self.limits.disconnect_watch_after)
        request = Request(scope["method"], scope["path"],
                          scope["query_string"].decode("latin-1"), headers, body)
        try:
            await self.app(request, respond)
            if respond.streaming:
                await respond.end()
        except asyncio.CancelledError:
            if not watch.client_left:
                raise
            # the client left: the app released what it held (its worker connection) on the way
            # out, which is how the worker learns to abort
            if sys.version_info >= (3, 11):
                task.uncancel()
            respond.disconnected = True
        except Exception as exc:  # a bug must cost one request, never the server
            # %r: the path is percent-decoded, and a CR or LF in it would forge log lines
            log.exception("gateway handler failed on %s %r", request.method, request.path)
            if not respond.started:
                await respond.send_error(500, f"internal gateway error: {exc!r}")
            elif respond.streaming:
                with contextlib.suppress(Exception):
                    await respond.end()
        finally:
            watch.close()

    async def _read_body(self, headers: dict[bytes, bytes], receive, respond: Responder,
                         budget: _BodyBudget) -> bytes | None:
        """The whole body, or None once a 413 or 503 has been answered or the client has
        gone. A body over LARGE_BODY_BYTES takes its size from the budget first."""
        limit = self.limits.max_body_bytes
        length = headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared > limit:
            respond.closing = True   # the body is not read: the connection cannot go on
            await respond.send_error(413, f"request body of {declared} bytes exceeds the "
                                          f"limit of {limit} bytes", "request_too_large")
            return None
        if declared is not None and declared > LARGE_BODY_BYTES and not budget.take(declared):
            await self._over_budget(respond)
            return None
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                respond.closing = True
                await respond.send_error(413, f"request body exceeds the limit of {limit} "
                                              "bytes", "request_too_large")
                return None
            if declared is None and size > LARGE_BODY_BYTES \
                    and not budget.take(size - budget.taken):
                await self._over_budget(respond)
                return None
            parts.append(chunk)
            if not message.get("more_body"):
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _over_budget(self, respond: Responder) -> None:
        respond.closing = True   # the rest of the body is not read
        status, headers, doc = error_body(
            503, f"the gateway holds its limit of {self.limits.large_body_budget_bytes} bytes "
                 f"of request bodies over {LARGE_BODY_BYTES} bytes; retry", "bodies_over_budget")
        await respond.send(status, [(b"retry-after", b"1"), *headers], doc)


def _declares_body(headers: dict[bytes, bytes]) -> bool:
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") \
        .strip(b" \t0") != b""


class _BodyBudget:
    """One request's share of the edge's budget for large bodies: what it took is given back
    when the request ends (its body is held until then)."""

    __slots__ = ("_edge", "taken")

    def __init__(self, edge: EdgeServer) -> None:
        self._edge = edge
        self.taken = 0

    def take(self, size: int) -> bool:
        edge = self._edge
        if edge.large_bodies_held + size > edge.limits.large_body_budget_bytes:
            return False
        edge.large_bodies_held += size
        self.taken += size
        return True

    def release(self) -> None:
        self._edge.large_bodies_held -= self.taken
        self.taken = 0
