"""Pooled keep-alive HTTP/1.1 connections to one worker, parsed with httptools.

`UpstreamPool.request` sends one request and returns as soon as the response *headers* are in;
the body is then read as the worker sends it (`read`: all that has arrived, never waiting for
more), so streams pass through with no buffering. What arrived and is not yet read is capped
(`BUFFER_HIGH_WATER`): past it the connection stops reading from the worker until the proxy
takes it, so a client that reads slowly holds back its worker instead of filling the gateway's
memory (the edge's writes already wait for such a client). A connection goes back to the pool
only after its response ended cleanly and the worker allowed keep-alive; anything else closes
it. TCP_NODELAY is set on every connection.

Every failure to talk to the worker is an `UpstreamError`; before the response headers it is
safe for the proxy to retry elsewhere. An interim answer (`103 Early Hints`) is skipped, as RFC
9110 asks of every client: the answer follows it. A status no answer to our requests has (a `101`
nobody asked for, `000`, `999`) is garbage, an `UpstreamError` too.
`give_up_waiting` fails the requests still waiting for headers from a worker the health checks
found hung (`WorkerHung`), so they are retried at once instead of waiting out
`first_byte_timeout`, and the answers it has gone silent on (a stream frozen with its worker,
which no reset ends), so they end now instead of at `total_timeout`. A pooled connection the
worker closed while idle is retried on a fresh one (that race is the ordinary end of a
keep-alive, not a worker failure). An answer that comes on a
new connection before the request is sent is the worker refusing that connection (a 503 when it
holds its connection limit): it is the answer, and the request is not sent; on a pooled
connection such an answer was meant for it idle, and a fresh connection is used instead.

Deadlines are one timer on the connection, not a task per request: `first_byte_timeout` until
the response headers, `total_timeout` until the last byte (the timer is set for the nearer and
moved on when it is due). Either one closing the connection makes the pending call raise
`UpstreamTimeout`, and the worker sees the close (and aborts the request). The response parser
lives as long as its keep-alive connection.
A call cancelled from outside (a health check's own timeout, a client that left) closes its
connection too: it never returns to the pool half-read, and it is never left open.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque

import httptools

from radixpool.listen import host_port

Headers = list[tuple[bytes, bytes]]
BUFFER_HIGH_WATER = 256 << 10   # bytes of a response held unread before reading pauses

# Not forwarded in either direction: hop-by-hop headers, framing the proxy redoes itself,
# `expect` (the gateway already answered the client's 100-continue and sends the body at once),
# and the proxy credentials and challenges meant for a proxy (RFC 9110 11.7), not a worker.
HOP_BY_HOP = frozenset((b"connection", b"keep-alive", b"transfer-encoding", b"content-length",
                        b"host", b"upgrade", b"proxy-connection", b"te", b"trailer", b"expect",
                        b"proxy-authorization", b"proxy-authenticate"))


class UpstreamError(ConnectionError):
    """The worker could not be reached, or the connection broke or spoke garbage."""


class UpstreamTimeout(UpstreamError):
    """The worker sent no response headers, or did not finish, within its deadline."""


class WorkerHung(UpstreamError):
    """The health checks found the worker hung while a request still waited for its response
    headers: given up, and safe to retry elsewhere (the client has had nothing from it)."""


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.status = 0
        self.headers: Headers = []
        self.chunks: deque[bytes] = deque()
        self._buffered = 0   # bytes in `chunks`
        self._paused = False   # reading from the worker, until `chunks` is taken
        self.done = False
        self.keep_alive = False
        self.got_bytes = False
        self.last_byte_at = 0.0   # time.monotonic() of the last bytes from the worker
        self.asked = False   # a request was sent and its answer has not ended
        self.answered_unasked = False   # an answer came with no request sent
        self._headers_ready: asyncio.Future | None = None
        self._waiter: asyncio.Future | None = None
        self._error: Exception | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._first_byte_timeout: float | None = None
        self._total_timeout: float | None = None
        self._first_byte_deadline = 0.0
        self._total_deadline = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done:
            self._fail(exc or ConnectionResetError("worker closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_byte_at = time.monotonic()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(exc)
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:   # interim (103 Early Hints): the answer follows
            self.headers = []
            return
        if not 200 <= status < 600:   # a switch of protocols nobody asked for, or no HTTP status
            self._fail(UpstreamError(f"the worker answered status {status}, which is no answer "
                                     "to an HTTP/1.1 request"))
            self.close()
            return
        self.status = status
        if not self.asked:
            self.answered_unasked = True
        if self._headers_ready is not None and not self._headers_ready.done():
            self._headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._buffered += len(body)
        if self._buffered > BUFFER_HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.status:   # the end of an interim answer, which has no body
            return
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        self.done = True
        self.asked = False
        self._disarm()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self._error is None:  # the first cause wins (a timeout, not the close it caused)
            self._error = exc
        exc = self._error
        if self._headers_ready is not None and not self._headers_ready.done():
            self._headers_ready.set_exception(exc)
        self._wake()

    def begin(self, data: bytes, first_byte_timeout: float | None,
              total_timeout: float | None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        self._headers_ready = loop.create_future()
        refused = self.answered_unasked   # before it was asked: that answer is the answer
        if refused:
            self.answered_unasked, self.asked = False, not self.done
            self._headers_ready.set_result(None)
            first_byte_timeout = None   # its status and headers are in
        else:
            self.status, self.headers, self.done, self.got_bytes = 0, [], False, False
            self.keep_alive = False
            self.asked = True
            self._take()
            self._error = None
        # one timer for both deadlines: set for the nearer, moved to the other when it is due
        self._first_byte_timeout, self._total_timeout = first_byte_timeout, total_timeout
        now = loop.time()
        self._first_byte_deadline = now + first_byte_timeout if first_byte_timeout else 0.0
        self._total_deadline = now + total_timeout if total_timeout else 0.0
        if not self.done:
            self._arm(loop)
        if not refused:
            assert self.transport is not None
            self.transport.write(data)
        return self._headers_ready

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        due = [d for d in (self._first_byte_deadline, self._total_deadline) if d]
        self._timer = loop.call_at(min(due), self._due) if due else None

    def _due(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        if self._first_byte_deadline and not self.status:
            if now >= self._first_byte_deadline:
                self._expire(f"no response headers within {self._first_byte_timeout:g} s")
                return
        else:
            self._first_byte_deadline = 0.0  # the headers are in: only the total deadline is left
        if self._total_deadline and now >= self._total_deadline:
            self._expire(f"response not finished within {self._total_timeout:g} s")
            return
        self._arm(asyncio.get_running_loop())

    def _expire(self, message: str) -> None:
        self._fail(UpstreamTimeout(message))
        self.close()

    def abandon(self, exc: UpstreamError) -> None:
        """Fail the pending call with `exc` and close the connection."""
        self._fail(exc)
        self.close()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def read(self) -> bytes | None:
        while not self.chunks:
            if self.done:
                return None
            if isinstance(self._error, UpstreamTimeout):
                raise UpstreamTimeout(str(self._error))  # fresh: no traceback kept on the conn
            if self._error is not None:
                raise UpstreamError(f"worker connection broke mid-response: {self._error}")
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._take()

    def _take(self) -> bytes:
        """What arrived, all together (one write onwards); reading resumes."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if not self.closed:
                self.transport.resume_reading()
        return data

    @property
    def reusable(self) -> bool:
        return self.done and self.keep_alive and not self.closed

    def close(self) -> None:
        self.closed = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()


def _abandon(opening: asyncio.Task) -> None:
    """Give up opening a connection: one that opens all the same is closed, not left open."""
    def close_if_opened(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            task.result()[1].close()

    opening.cancel()
    opening.add_done_callback(close_if_opened)


class UpstreamResponse:
    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, pool: UpstreamPool, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def read(self) -> bytes | None:
        """The next body chunk as it arrived, or None at the end (the connection is then
        returned to the pool). Any failure or cancellation closes the connection."""
        try:
            chunk = await self._conn.read()
        except BaseException:
            self.release()
            raise
        if chunk is None:
            self.release()
        return chunk

    async def body(self) -> bytes:
        parts = []
        while (chunk := await self.read()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Give the connection back (or close it if the response did not end cleanly)."""
        conn, self._conn = self._conn, _CLOSED
        if conn is _CLOSED:
            return
        self._pool.answering.discard(conn)
        if conn.reusable:
            self._pool.put_back(conn)
        else:
            conn.close()


_CLOSED = _Connection()
_CLOSED.done = True


class UpstreamPool:
    def __init__(self, host: str, port: int, connect_timeout: float, max_idle: int = 64) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._awaiting_headers: set[_Connection] = set()
        self.answering: set[_Connection] = set()   # headers in, body being read
        self._host_header = host_port(host, port).encode()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        # Not wait_for: before Python 3.12 it swallows a cancellation (the client left) that
        # comes as the connection opens, and the request would go out for nobody.
        opening = loop.create_task(loop.create_connection(_Connection, self.host, self.port))
        try:
            await asyncio.wait((opening,), timeout=self.connect_timeout)
        except asyncio.CancelledError:
            _abandon(opening)
            raise
        try:
            if not opening.done():   # past connect_timeout
                _abandon(opening)
                raise asyncio.TimeoutError()
            _, conn = opening.result()
        except (OSError, asyncio.TimeoutError, UnicodeError) as exc:
            # UnicodeError: a host name IDNA cannot encode (an empty or 64-character label)
            where = host_port(self.host, self.port)
            raise UpstreamError(f"cannot connect to {where}: {exc!r}") from exc
        return conn

    def put_back(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def give_up_waiting(self, reason: str, silent_for: float) -> int:
        """Fail every request still waiting for its response headers (`WorkerHung`), and every
        answer that has had nothing from the worker for `silent_for` seconds though the gateway
        was reading it (one paused for a slow client is left alone); returns how many. An
        answer still arriving is left to finish or to time out."""
        since = time.monotonic() - silent_for
        given_up = [conn for conn in self._awaiting_headers if not conn.status]
        given_up += [c for c in self.answering if not c._paused and c.last_byte_at <= since]
        for conn in given_up:
            conn.abandon(WorkerHung(reason))
        return len(given_up)

    def encode(self, method: str, path: str, headers: Headers, body: bytes) -> bytes:
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n"
                 % (method.encode(), path.encode(), self._host_header, len(body))]
        lines.extend(b"%s: %s\r\n" % kv for kv in headers)
        lines.append(b"\r\n")
        lines.append(body)
        return b"".join(lines)

    async def request(self, method: str, path: str, headers: Headers = (),
                      body: bytes = b"", first_byte_timeout: float | None = None,
                      total_timeout: float | None = None) -> UpstreamResponse:
        data = self.encode(method, path, list(headers), body)
        deadlines = first_byte_timeout, total_timeout
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or conn.answered_unasked:   # an idle one's answer is not ours
                conn.close()
                continue
            try:
                return await self._exchange(conn, data, *deadlines)
            except (UpstreamTimeout, WorkerHung):
                raise
            except UpstreamError as exc:
                if conn.got_bytes:  # the worker answered garbage: not an idle-close race
                    raise exc
                # The worker closed an idle connection as we used it, or dropped the request:
                # the other idle ones are as suspect. One more try, on a fresh connection (the
                # request must not reach a failing worker once per idle connection).
                self.close()
        return await self._exchange(await self._connect(), data, *deadlines)

    async def _exchange(self, conn: _Connection, data: bytes, first_byte_timeout: float | None,
                        total_timeout: float | None) -> UpstreamResponse:
        self._awaiting_headers.add(conn)
        try:
            if conn.closed and not conn.answered_unasked:
                raise ConnectionResetError("connection already closed")
            await conn.begin(data, first_byte_timeout, total_timeout)
        except (UpstreamTimeout, WorkerHung):
            conn.close()
            raise
        except (OSError, httptools.HttpParserError) as exc:
            conn.close()
            where = host_port(self.host, self.port)
            raise UpstreamError(f"no response from {where}: {exc!r}") from exc
        except BaseException:  # cancelled while waiting: the connection must not linger
            conn.close()
            raise
        finally:
            self._awaiting_headers.discard(conn)
        if not conn.done:
            self.answering.add(conn)
        return UpstreamResponse(self, conn)
