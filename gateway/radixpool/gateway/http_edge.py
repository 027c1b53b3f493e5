"""The gateway's HTTP edge: Granian (Rust, hyper) serves our app over RSGI inside our event loop.

Why Granian. Measured side by side (`python bench/http_servers.py`: the same hello answer and a
10-event stream, one client process, 2-vCPU VM loaded by teammates; p50 sequential / stream first
byte / req/s at concurrency 32): the old hand-written asyncio+httptools server 164 / 360 us /
4,305; Granian RSGI 339 / 464 us / 6,907; aiohttp 302 / 388 us / 5,965; uvicorn+httptools
225 / 377 us / 6,617. All clear the budgets on their own; they differ in what the edge needs.
Granian's HTTP/1 core (hyper) is the only one that enforces by itself: a header read timeout
that also closes idle keep-alive connections (slow-loris), a header size cap answered with 431
(hyper's buffer lets heads up to ~1.75 times its size through: the exact cap is checked here),
pipelining done right (answers in order, `100 Continue` sent only when the body is read, a
malformed request after a valid one answered 400 after the valid answer) and TCP_NODELAY. Its
RSGI stream sends do not wait for a slow client (docs/gateway.md, Limits). uvicorn's httptools
protocol has no header read timeout nor header cap and writes its 400 into a pipelined response
in flight; aiohttp has neither a header timeout nor a 431. The
price is ~150-200 us per request against the hand-written server (a hop between hyper's thread
and the event loop); where the gateway stands against its budgets:
bench/results/gateway_overhead_2cpu.txt.

Granian runs embedded (`granian.server.embed`): one Rust thread for the sockets, our handlers on
the running asyncio loop, so the gateway keeps one process and its state in memory. This module
adds only what hyper does not know: the body size limit (413 before the body is read when
Content-Length says so, else while it arrives), a body read timeout, OpenAI-style error bodies,
and cancellation of the handler when the client goes away (the proxy then closes its worker
connection, which aborts the request on the worker). Watching for the client's departure costs
Granian ~30 us of event-loop time per request, so the watch starts only once a handler has run
for `disconnect_watch_after` (a request answered sooner never pays for it; a client that left
earlier is seen the moment the watch starts). That delay and the body read deadline share one
timer per request (`_Deadlines`). Every answer carries the request's `x-request-id` (the
client's when it sent a usable one, else a new one; the request passes it on to the worker, so
both log the same id). The application sees a `Request` and a `Responder`:

    async def app(request: Request, respond: Responder) -> None
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.rsgi import ProtocolClosed
from granian.server.embed import Server as _EmbeddedGranian

log = logging.getLogger("radixpool.gateway")

Headers = list[tuple[bytes, bytes]]
App = Callable[["Request", "Responder"], Awaitable[None]]

REQUEST_ID = b"x-request-id"
_USABLE_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,256}")   # printable ASCII, no spaces
_REQUEST_IDS = itertools.count()
_ID_PREFIX = uuid.uuid4().hex[:12].encode()


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
    """An OpenAI-style error document, shaped as the workers shape theirs: `param` names the
    field at fault, `code` is a machine-readable reason or null."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_body(status, {"error": {"message": message, "type": kind, "param": param,
                                        "code": code}})


@dataclass(frozen=True)
class EdgeLimits:
    header_read_timeout: float = 10.0   # seconds; hyper also closes idle keep-alives after it
    max_header_bytes: int = 65536       # larger request heads (line + headers) get 431
    max_body_bytes: int = 32 << 20
    body_read_timeout: float = 30.0
    disconnect_watch_after: float = 0.05  # seconds a handler runs before its client is watched


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
    one chunk per write, flushed at once). A stream ends when the handler returns."""

    __slots__ = ("_proto", "_stream", "disconnected", "request_id", "started")

    def __init__(self, proto, request_id: bytes) -> None:
        self._proto = proto
        self._stream = None
        self.started = False
        self.disconnected = False
        self.request_id = request_id

    async def send(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = True
        self._proto.response_bytes(status, self._wire(headers), body)

    async def send_error(self, status: int, message: str, code: str | None = None,
                         param: str | None = None) -> None:
        await self.send(*error_body(status, message, code, param))

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self._stream = self._proto.response_stream(status, self._wire(headers))

    def _wire(self, headers: Headers) -> list[tuple[str, str]]:
        wire = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                if k != REQUEST_ID]   # a worker's echo of the id is the same id
        wire.append(("x-request-id", self.request_id.decode()))
        return wire

    async def write(self, data: bytes) -> None:
        if data and not self.disconnected:
            try:
                await self._stream.send_bytes(data)
            except ProtocolClosed:
                self.disconnected = True


class _Deadlines:
    """One timer per request for two jobs: the body read deadline (the task is cancelled and
    `body_expired` set), and, once the handler has run `watch_after`, the watch that cancels the
    task when the client goes away. A request answered within `watch_after` costs one timer."""

    __slots__ = ("_body_deadline", "_gone", "_proto", "_reading", "_task", "_timer",
                 "_waits_for_body", "body_expired")

    def __init__(self, proto, task: asyncio.Task, limits: EdgeLimits) -> None:
        self._proto = proto
        self._task = task
        self._gone = None
        self._reading = True
        self._waits_for_body = False  # the timer is set for the body deadline
        self.body_expired = False
        loop = task.get_loop()
        self._body_deadline = loop.time() + limits.body_read_timeout
        self._timer: asyncio.TimerHandle | None = loop.call_later(
            min(limits.disconnect_watch_after, limits.body_read_timeout), self._due)

    def body_read(self) -> None:
        self._reading = False
        if self._waits_for_body:  # past `watch_after` already: watch from now on
            self._timer.cancel()
            self._watch()

    def _due(self) -> None:
        self._timer = None
        if not self._reading:
            self._watch()
        elif self._task.get_loop().time() >= self._body_deadline:
            self.body_expired = True
            self._task.cancel()
        else:
            self._waits_for_body = True
            self._timer = self._task.get_loop().call_at(self._body_deadline, self._due)

    def _watch(self) -> None:
        self._timer = None
        self._waits_for_body = False
        self._gone = self._proto.client_disconnect()
        self._gone.add_done_callback(self._left)

    def _left(self, gone) -> None:
        if not gone.cancelled():
            self._task.cancel()

    @property
    def client_left(self) -> bool:
        return self._gone is not None and self._gone.done() and not self._gone.cancelled()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._gone is not None:
            self._gone.cancel()


class _Granian(_EmbeddedGranian):
    def startup(self, spawn_target, target_loader) -> None:
        super().startup(spawn_target, target_loader)
        self.listening.set()


class EdgeServer:
    """Serve `app` on host:port (0: an ephemeral port, reserved before Granian binds it)."""

    def __init__(self, app: App, host: str, port: int, limits: EdgeLimits) -> None:
        self.app = app
        self.host = host
        self.limits = limits
        # SO_REUSEPORT lets Granian bind the port this socket reserves; it never listens, so it
        # receives no connection, and holding it keeps an ephemeral port ours until stop().
        self._reserved = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._reserved.bind((host, port))
        self.port: int = self._reserved.getsockname()[1]
        self._server: _Granian | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._server = _Granian(
            self._handle, self.host, self.port, interface=Interfaces.RSGI, http=HTTPModes.http1,
            websockets=False, backlog=1024, log_enabled=False,
            http1_settings=HTTP1Settings(
                header_read_timeout=max(1, int(self.limits.header_read_timeout * 1000)),
                keep_alive=True, max_buffer_size=self.limits.max_header_bytes))
        self._server.listening = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._server.serve())
        waiter = asyncio.ensure_future(self._server.listening.wait())
        await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():  # the bind failed: raise its error here
            waiter.cancel()
            self._reserved.close()
            self._task.result()

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.stop()
            with contextlib.suppress(Exception):
                await self._task
        self._reserved.close()

    async def _handle(self, scope, proto) -> None:
        if scope.proto != "http":
            return
        # A body of a length within the limit is asked for first: hyper's thread gathers it
        # (a round trip between threads) while this one converts the headers and sets timers.
        length = scope.headers.get("content-length")
        early = proto() if (length and length.isdigit() and length != "0"
                            and int(length) <= self.limits.max_body_bytes) else None
        headers = {k.encode("latin-1"): v.encode("latin-1") for k, v in scope.headers.items()}
        headers[REQUEST_ID] = request_id(headers)
        respond = Responder(proto, headers[REQUEST_ID])
        if (sum(map(len, headers)) + sum(map(len, headers.values())) + 4 * len(headers)
                + len(scope.path) + len(scope.query_string) > self.limits.max_header_bytes):
            # hyper's read buffer (the same size) lets heads up to ~1.75 times through
            if early is not None:
                with contextlib.suppress(Exception):
                    await early
            await respond.send_error(431, f"request head exceeds {self.limits.max_header_bytes}"
                                          " bytes", "request_header_fields_too_large")
            return
        task = asyncio.current_task()
        deadlines = _Deadlines(proto, task, self.limits)
        try:
            try:
                body = await (early if early is not None
                              else self._read_body(headers, proto, respond))
            except asyncio.CancelledError:
                if not deadlines.body_expired:
                    raise
                if sys.version_info >= (3, 11):
                    task.uncancel()
                await respond.send_error(408, f"request body not received within "
                                              f"{self.limits.body_read_timeout:g} s")
                return
            if body is None:
                return
            deadlines.body_read()
            await self._run_app(Request(scope.method, scope.path, scope.query_string, headers,
                                        body), respond, deadlines, task)
        finally:
            deadlines.close()
            # Granian ends a stream when its transport object is released, not when the handler
            # returns: drop it here, whatever still refers to the Responder (a traceback, ...)
            respond._stream = None

    async def _run_app(self, request: Request, respond: Responder, deadlines: _Deadlines,
                       task: asyncio.Task) -> None:
        try:
            await self.app(request, respond)
        except asyncio.CancelledError:
            if not deadlines.client_left:
                raise
            # the client left: the app released what it held (its worker connection) on the way
            # out, which is how the worker learns to abort
            if sys.version_info >= (3, 11):
                task.uncancel()
            respond.disconnected = True
        except Exception as exc:  # a bug must cost one request, never the server
            log.exception("gateway handler failed on %s %s", request.method, request.path)
            if not respond.started:
                await respond.send_error(500, f"internal gateway error: {exc!r}")

    async def _read_body(self, headers: dict[bytes, bytes], proto,
                         respond: Responder) -> bytes | None:
        """The whole body, or None once a 413 has been answered."""
        limit = self.limits.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > limit:
                await respond.send_error(413, f"request body of {int(length)} bytes exceeds the "
                                              f"limit of {limit} bytes", "request_too_large")
                return None
            if length == b"0":
                return b""
            return await proto()
        return await self._read_chunks(proto, respond)

    async def _read_chunks(self, proto, respond: Responder) -> bytes | None:
        limit = self.limits.max_body_bytes
        parts, size = [], 0
        async for chunk in proto:
            size += len(chunk)
            if size > limit:
                await respond.send_error(413, f"request body exceeds the limit of {limit} bytes",
                                         "request_too_large")
                return None
            parts.append(chunk)
        return b"".join(parts)

