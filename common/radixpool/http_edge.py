"""The HTTP/1 edge of the gateway and the workers: uvicorn's httptools protocol, with the limits
it lacks.

Both serve clients that may misbehave (in a cluster any pod can reach a worker's Service), so
both run this one protocol class. uvicorn's httptools protocol, left to itself, waits forever for
a request head sent a byte at a time (its keep-alive timer restarts on every byte), takes request
heads of any size (an 8 MiB header is buffered and answered 200), and answers a malformed request
pipelined behind a valid one with an immediate 400 that closes the connection under the valid
request's response (whose request is then aborted). `EdgeProtocol`:

- a request head must arrive whole within `header_read_timeout` of its first byte (of the
  connection's opening, for the first request): else 408 and the connection closes. While an
  earlier request on the connection is still being answered, the clock waits for it;
- a head over `max_header_bytes` (request line and headers) is answered 431, and so is a body
  that sends more than that between two pieces of its data (a chunked body's trailer section, a
  chunk extension): uvicorn would keep every trailer field, without limit, until the body read
  timeout. Trailer fields are dropped: uvicorn appended them to the request's headers;
- a request body must arrive whole within `body_read_timeout` of the head's end (time the
  server itself holds reading back, for flow control or a pipelined turn, does not count): else
  408 (or, once an answer has begun, a closed connection) and the request is aborted; a body
  whose framing breaks (a bad chunk, a Transfer-Encoding that does not end in chunked) is
  refused 400 the same way, at once;
- a malformed or oversized request pipelined behind others is answered, and the connection
  closed, only after the earlier requests' responses are complete.

- at most `max_connections` connections are open at once (fewer when the open-file limit leaves
  less room: `edge_protocol` raises the soft limit to the hard one, and keeps `FD_RESERVE`
  descriptors for the server's own connections to workers, files and children; a proxy's
  share is halved, each client it answers holding a connection to a worker too). One more
  closes the oldest connection that has no request being answered (idle, or still sending a
  head), as nginx reuses its keep-alive connections, and the next oldest for a 64th of the
  limit with it (finding them looks at every connection); when every one is answering, the
  new one gets 503. Without it a client holding a thousand idle sockets took the process to its
  descriptor limit: it then accepted and dropped every connection, and could open none to its
  workers;
- a response that waits `write_stall_timeout` on a client that reads (almost) none of it
  (less than `STALL_PROGRESS_BYTES` of what waits for it leaves in all that time) ends: the
  connection is dropped, so the handler sees a disconnect and the request is aborted. Flow
  control alone kept such a stream's request running to its last token, holding its KV, while
  the output piled up in the server. A client that reads a large answer slowly, its buffer
  taking longer than that to empty, reads on;
- a client that leaves (or half-closes) with a request pipelined behind the one being answered
  has that one told it left: uvicorn told only the newest request, so the one being answered ran
  on to its end (holding its worker) and then failed writing to the closed connection;
- an HTTP/1.0 request's streamed answer is sent as it is, ended by closing the connection:
  uvicorn framed it in chunked encoding, which HTTP/1.0 has not (RFC 9112 §6.1), so an HTTP/1.0
  client read the chunk sizes as part of its event stream; and its `Expect: 100-continue` is
  ignored (RFC 9110 §10.1.1): uvicorn's `100 Continue` was read as the answer;
- a connection that ends after a whole answer (a refusal, a 413 before the body, `connection:
  close`) is closed the way RFC 9112 §9.6 asks: the answer and then a FIN go out, and what the
  client still sends is read and dropped until it closes too (or `LINGER_IDLE_S` passes without
  a byte, or `LINGER_MAX_S` in all). Closed outright, with the rest of the client's request
  unread, the kernel answered that request with a reset: a client still writing its body (a
  large prompt, a request at the connection limit) saw a connection error on its write, and
  never read the 413 or 503 waiting for it. A connection lingering so is the first one closed
  when another needs its room; once the server stops, none lingers (stop waits for no client).

What uvicorn already does right is kept: pipelined requests answered in order, one at a time;
`100 Continue` sent only when the application asks for the body; a response body written to a
client that does not read waits for it (flow control, up to `write_stall_timeout`), so a slow
reader holds back its own answer instead of filling the server's memory; TCP_NODELAY (the event
loop sets it). Errors have the OpenAI-style body both servers use. Idle keep-alive connections
close after uvicorn's `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import resource
import struct
import termios
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)


@dataclass(frozen=True)
class EdgeLimits:
    """What the HTTP edge takes from a client before the application sees a request."""

    header_read_timeout: float = 10.0   # seconds from a request head's first byte to its end
    max_header_bytes: int = 65536       # request line + headers; larger heads get 431
    body_read_timeout: float = 30.0     # seconds from a head's end to its body's end
    max_connections: int = 4096         # open at once; past it idle ones close, else 503
    write_stall_timeout: float = 60.0   # seconds a response may wait on a client reading none

    def __post_init__(self) -> None:
        if not self.header_read_timeout > 0:
            raise ValueError("header_read_timeout must be > 0 seconds, "
                             f"got {self.header_read_timeout}")
        if not self.body_read_timeout > 0:
            raise ValueError(f"body_read_timeout must be > 0 seconds, got {self.body_read_timeout}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be ≥ 1024, got {self.max_header_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be ≥ 1, got {self.max_connections}")
        if not self.write_stall_timeout > 0:
            raise ValueError("write_stall_timeout must be > 0 seconds, "
                             f"got {self.write_stall_timeout}")


FD_RESERVE = 256   # descriptors kept from clients: worker connections, files, child processes
LINGER_IDLE_S = 2.0    # a closing connection waits this long for each more byte of its client
LINGER_MAX_S = 10.0    # ... and this long in all, for the client to close its side too
STOP_LINGER_S = 0.2     # ... once the server stops (its last answers' clients, briefly)
ROOM_SHARE = 64   # past the connection limit, room is made for this share of it at once
# Past the limit with every connection being answered: new ones are refused without another look
# at them all for this long (a pass costs 4.5 ms at 4096; clients retrying at overload would
# spend the loop on passes that find nothing).
FULL_RECHECK_S = 0.05
# A client reading its answer on must take this much of it (or all that waits) in every
# `write_stall_timeout`: 16 KiB a minute is 270 bytes a second, far below any real link.
STALL_PROGRESS_BYTES = 16 << 10


def open_file_room() -> int:
    """Raise this process's soft open-file limit to its hard limit (many containers start at
    1024 soft); returns how many descriptors clients' connections may have."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(1, soft - FD_RESERVE)


def edge_protocol(limits: EdgeLimits, descriptors_per_connection: int = 1
                  ) -> type[HttpToolsProtocol]:
    """The protocol class to give `uvicorn.Config(http=...)` (raises the open-file limit).
    `descriptors_per_connection`: what one client connection being answered holds (2 for a
    proxy: its connection to the upstream too)."""
    room = max(1, open_file_room() // descriptors_per_connection)
    return type("EdgeProtocol", (EdgeProtocol,), {
        "limits": limits, "max_connections": min(limits.max_connections, room)})


def error_type(status: int) -> str:
    """The OpenAI error `type` of an answer with this status, the same from a worker and from
    the gateway (the SDKs expose it as `APIStatusError.type`)."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 503:
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_document(status: int, message: str, code: str | None = None,
                   param: str | None = None) -> bytes:
    """An OpenAI-style error body: `param` names the field at fault, `code` is a
    machine-readable reason or null."""
    return json.dumps({"error": {"message": message, "type": error_type(status),
                                 "param": param, "code": code}}).encode()


def _error_response(status: int, message: str, code: str) -> bytes:
    body = error_document(status, message, code)
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


class EdgeProtocol(HttpToolsProtocol):
    limits = EdgeLimits()
    max_connections = EdgeLimits.max_connections

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        # Any byte the kernel cannot take yet waits on the client and runs the stall clock: at
        # asyncio's 64 KiB high-water mark, the last bytes of an answer to a client that reads
        # nothing never paused writing, and held the connection's descriptor for good.
        transport.set_write_buffer_limits(high=0)
        self._opened_at = self.loop.time()
        self._in_head = True      # the next bytes belong to a request head
        self._head_started = False   # ... and some of them have arrived
        self._head_bytes = 0      # of the head being read, counted from the read it began in
        self._heads_read = 0
        self._body_pieces = 0     # of the body being read, as the parser hands them on
        self._framing_bytes = 0   # read in the body since its last piece of data
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stall_unsent = 0    # bytes waiting on the client when the stall clock started
        self._running = None   # the request being answered (uvicorn's `cycle` is the newest)
        self._refusal: bytes | None = None   # sent once the responses ahead of it are complete
        self._joined: _HeadJoined | None = None   # the newest request's writer
        self._lingering = False   # answered for the last time: reading the client out
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_ends = 0.0
        self._stopping = False   # the server stops: a last answer lingers STOP_LINGER_S at most
        self._arm_head_timer()
        if len(self.server_state.connections) > self.max_connections:
            self._make_room()

    def _make_room(self) -> None:
        """Too many connections: close the oldest that only wait out their client after their
        last answer, then the oldest idle ones, and refuse this one if that is not room enough.
        One with an answer still to send, closed or not, keeps its descriptor until its client
        reads it (or `write_stall_timeout`): it counts, and closing it makes no room.
        Each pass looks at every connection (4.5 ms for 4096), so room is made for the next
        `1 / ROOM_SHARE` of the limit at once: a pass per new connection let a flood of them
        at the limit take the event loop, and hold up everyone else's requests. A pass that
        finds no room refuses the new connections of the next `FULL_RECHECK_S` without one."""
        state = self.server_state
        if self.loop.time() < getattr(state, "radixpool_full_until", 0.0):
            self._refuse_full()   # a pass just now found no room: none is likely yet
            return
        connections = state.connections
        held = [c for c in connections
                if not c.transport.is_closing() or c.transport.get_write_buffer_size()]
        excess = len(held) - self.max_connections
        if excess <= 0:
            return
        others = sorted((c for c in held if c is not self and not c.transport.is_closing()
                         and not c.transport.get_write_buffer_size()), key=lambda c: c._opened_at)
        spare = ([c for c in others if c._lingering]
                 + [c for c in others if not c._lingering and not c._answering()])
        for connection in spare[:excess + self.max_connections // ROOM_SHARE]:
            connection.transport.close()
            # nothing left to send: gone now, not at the loop's next turn, so the connections
            # accepted meanwhile find the room made and pass no one over again
            connections.discard(connection)
        if excess > len(spare):
            state.radixpool_full_until = self.loop.time() + FULL_RECHECK_S
            self._refuse_full()

    def _refuse_full(self) -> None:
        self._refuse(503, f"the server holds its limit of {self.max_connections} open "
                          "connections, all of them being answered; retry",
                     "too_many_connections")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        self._cancel_stall_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        running = self._running
        if running is not None and running is not self.cycle and not running.response_complete:
            # uvicorn tells only the newest request (`cycle`), here one pipelined behind the one
            # being answered: that one must learn its client left too, or it runs on to its end
            running.disconnected = True
            running.message_event.set()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._arm_stall_timer()

    def resume_writing(self) -> None:
        self._cancel_stall_timer()   # the client read: a slow reader is not a stalled one
        super().resume_writing()

    def _arm_stall_timer(self) -> None:
        self._stall_unsent = self._unsent()
        self._stall_timer = self.loop.call_later(self.limits.write_stall_timeout,
                                                 self._write_stalled)

    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _write_stalled(self) -> None:
        self._stall_timer = None
        if not self.flow.write_paused:
            return
        if self._stall_unsent - self._unsent() >= min(STALL_PROGRESS_BYTES, self._stall_unsent):
            # the client read on: a large answer to a slow reader drains for longer than the
            # timeout, and that reader is not a stalled one either (one taking a byte now and
            # then, to hold its answer in memory for good, is)
            self._arm_stall_timer()
            return
        self.logger.warning("dropped a connection whose client read less than %d bytes of its "
                            "answer in %g s", STALL_PROGRESS_BYTES, self.limits.write_stall_timeout)
        # abort, not close: close would wait for the unread buffer to drain, that is forever
        self.transport.abort()

    def _unsent(self) -> int:
        """Bytes of the answers not yet taken by the client: those waiting here, and those in
        the kernel's send queue (the kernel wakes a writer only once much of a large send
        buffer is free: a slow reader's progress shows there first)."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None and hasattr(termios, "TIOCOUTQ"):   # Linux
            with contextlib.suppress(OSError):
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
                unsent += struct.unpack("i", queued)[0]
        return unsent

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._linger()   # read, and dropped: it is not answered
            return
        if self._refusal is not None:
            return   # the parser stopped at the bad request; what follows it is not read
        while self._in_head and data:
            # Feed a head at most one byte past the cap, so the cap is exact within this read.
            room = self.limits.max_header_bytes - self._head_bytes + 1
            piece, data = data[:room], data[room:]
            heads_read = self._heads_read
            if not self._feed(piece):
                return
            # A piece that ended one head and began the next is not counted: it is bounded.
            if self._in_head and self._heads_read == heads_read:
                self._head_bytes += len(piece)
                if self._head_bytes > self.limits.max_header_bytes:
                    self._refuse(431, f"the request head is over the limit of "
                                      f"{self.limits.max_header_bytes} bytes",
                                 "request_header_fields_too_large")
                    return
        # A head that begins inside this (bounded) read is capped from the next read on.
        if data:
            body_pieces = self._body_pieces
            if not self._feed(data):
                return
            if not self._in_head:   # framing is counted over whole reads: bounded, not exact
                self._framing_bytes = (self._framing_bytes + len(data)
                                       if self._body_pieces == body_pieces else 0)
                if self._framing_bytes > self.limits.max_header_bytes:
                    self._abort_body(431, f"the request body sent over "
                                          f"{self.limits.max_header_bytes} bytes of chunk "
                                          f"extensions or trailer fields",
                                     "request_header_fields_too_large")
                    return
        # Deadlines only for what this read left unfinished: a request that arrives whole in
        # one read (the common case) costs no timer.
        if self._in_head:
            if self._head_started and self._head_timer is None:
                self._arm_head_timer()
        elif self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_read_timeout,
                                                    self._body_timed_out)

    def _feed(self, data: bytes) -> bool:
        self._unset_keepalive_if_required()
        rest = memoryview(data)
        while rest:
            try:
                self.parser.feed_data(rest)
                return True
            except httptools.HttpParserError as exc:
                message = f"malformed HTTP request: {exc}"
                if self._in_head:
                    self._refuse(400, message, "invalid_http_request")
                else:   # the framing of a body broke: its request, begun, can never be finished
                    self._abort_body(400, message, "invalid_http_request")
                return False
            except httptools.HttpParserUpgrade as switch:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                    return False
                if self._declares_body():
                    # the parser took what follows the head for the new protocol: the request
                    # is complete to the application, with its body lost
                    self.cycle.disconnected = True
                    self._abort_body(400, "this server does not switch protocols: send the "
                                          "request without `Upgrade`", "upgrade_not_supported")
                    return False
                # served as is, over HTTP/1.1 (as uvicorn does): what follows the head is the
                # next request, which uvicorn dropped
                rest = rest[switch.args[0]:]
        return True

    def _declares_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length"
                                                and value.strip(b" \t0")):
                return True
        return False

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn warns twice per such request (once telling to install a WebSocket library):
        # any client could fill the log with them
        self.logger.debug("answered a request with an Upgrade header over HTTP/1.1")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = self._head_started = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:   # not a trailer field, which uvicorn would merge into the headers
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        # First, while the head is still the one being read: uvicorn raises on a request target
        # its URL parser refuses (`CONNECT host:port`), and `_feed` then refuses the head. (With
        # the head marked read, the error went to a body that did not exist: no answer, and a
        # traceback in the log for every such request.)
        super().on_headers_complete()
        self._in_head = self._head_started = False
        self._head_bytes = self._framing_bytes = 0
        self._heads_read += 1
        self._cancel_head_timer()
        cycle = self.cycle
        self._joined = cycle.transport = _HeadJoined(cycle, self.transport, self.loop,
                                                     self._close_after_answer)
        if self.scope.get("http_version") == "1.0":
            cycle.__class__ = _CloseDelimited
            # nor a `100 Continue`, which it would take for its answer (RFC 9110 10.1.1)
            cycle.waiting_for_100_continue = False

    def on_body(self, body: bytes) -> None:
        self._body_pieces += 1
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        super().on_message_complete()
        self._in_head = True

    def on_response_complete(self) -> None:
        if self._lingering:   # that answer was the last: nothing pipelined after it is started
            self.server_state.total_requests += 1
            self.pipeline.clear()
            return
        super().on_response_complete()
        if self._refusal is not None and not self._answering():
            self._send_refusal()

    def shutdown(self) -> None:
        self._stopping = True   # the server stops: it waits for no client's leftovers
        if self._lingering:
            self.transport.close()
        else:
            super().shutdown()

    def _close_after_answer(self) -> None:
        """End the connection once its last answer is written: a FIN after the answer, then
        read the client out (RFC 9112 §9.6), so the rest of its request is not answered with a
        reset that could overtake the answer, or fail the client's write before it reads it."""
        transport = self.transport
        if transport.is_closing() or self._lingering:
            return
        if not transport.can_write_eof():
            transport.close()
            return
        self._lingering = True
        self._cancel_head_timer()
        self._cancel_body_timer()
        self._unset_keepalive_if_required()
        transport.write_eof()
        # stopping, a moment only: the client reads its answer before a reset can overtake it
        self._linger_ends = self.loop.time() + (STOP_LINGER_S if self._stopping else LINGER_MAX_S)
        self.flow.resume_reading()
        self._linger()

    def _linger(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        wait = min(LINGER_IDLE_S, self._linger_ends - self.loop.time())
        self._linger_timer = self.loop.call_later(max(0.0, wait), self.transport.close)

    def _start_asgi_task(self, cycle, app) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def _answering(self) -> bool:
        return bool(self.pipeline) or (self._running is not None
                                       and not self._running.response_complete)

    def _refuse(self, status: int, message: str, code: str) -> None:
        self.logger.warning("refused a request: %s", message)
        self._cancel_head_timer()
        self._refusal = _error_response(status, message, code)
        if self._answering():
            self.flow.pause_reading()   # the answers ahead of it go first, whole
        else:
            self._send_refusal()

    def _send_refusal(self) -> None:
        if self._joined is not None:
            self._joined.flush()   # a head answered before it goes first
        if not self.transport.is_closing():
            self.transport.write(self._refusal)
            self._close_after_answer()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_read_timeout,
                                                self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:   # the server holds the body back, not the client
            self._body_timer = self.loop.call_later(self.limits.body_read_timeout,
                                                    self._body_timed_out)
            return
        self._abort_body(408, f"the request body did not arrive within "
                              f"{self.limits.body_read_timeout:g} s", "request_timeout")

    def _abort_body(self, status: int, message: str, code: str) -> None:
        """Refuse the request whose body is being read, which will never be whole."""
        cycle = self.cycle
        queued = next((entry for entry in self.pipeline if entry[0] is cycle), None)
        if queued is not None:   # never started: refused after the answers ahead of it
            self.pipeline.remove(queued)
            self._refuse(status, message, code)
            return
        if self.transport.is_closing():   # answered already (a 413), and closing
            return
        self.logger.warning("refused a request: %s", message)
        self._cancel_head_timer()
        if cycle.response_started and not cycle.response_complete:
            self.transport.close()   # the answer is cut: its handler sees a disconnect
            return
        self.transport.write(_error_response(status, message, code))
        self._close_after_answer()
        if not cycle.response_complete:   # a handler waiting on the body sees a disconnect
            cycle.disconnected = True
            # and asks for no `100 Continue`: a write after the answer's FIN raises in it
            cycle.waiting_for_100_continue = False
            cycle.message_event.set()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._answering():   # reading is ours to resume: the client is not the one late
            self._arm_head_timer()
            return
        if self._head_bytes == 0 and self.cycle is None:
            self.transport.close()   # a connection that never sent a byte
            return
        self._refuse(408, f"the request head did not arrive within "
                          f"{self.limits.header_read_timeout:g} s", "request_timeout")


class _CloseDelimited(RequestResponseCycle):
    """An HTTP/1.0 request's response cycle: a body of unknown length (no Content-Length) goes
    out unframed and the connection's close ends it (uvicorn would frame it in chunks)."""

    _unframed = False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            if not any(name.lower() == b"content-length" for name, _ in message.get("headers", ())):
                # (uvicorn closes an HTTP/1.0 connection after each answer already)
                self._unframed, self.keep_alive, self.chunked_encoding = True, False, False
        elif self._unframed and message["type"] == "http.response.body":
            # uvicorn counts down a Content-Length: give it what this write completes
            more = message.get("more_body", False)
            self.expected_content_length = 1 << 62 if more else len(message.get("body", b""))
        await super().send(message)


class _HeadJoined:
    """A request's transport as its response cycle sees it. uvicorn writes a response's head and
    body apart: two segments, and two wake-ups of the client for every whole answer. Here the
    head waits for the write after it in the same step of the event loop (the body, for a whole
    answer, or a stream's first chunk) and both leave as one; a head with nothing after it (a
    HEAD answer, a stream whose first chunk is not ready) goes out alone at the next step."""

    __slots__ = ("_close_after_answer", "_cycle", "_done", "_head", "_loop", "_transport")

    def __init__(self, cycle, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 close_after_answer) -> None:
        self._cycle = cycle
        self._transport = transport
        self._loop = loop
        self._close_after_answer = close_after_answer
        self._head: bytes | None = None
        self._done = False   # the head has been held once: later writes go straight out

    def write(self, data: bytes) -> None:
        if self._head is not None:
            data, self._head = self._head + data, None
        elif not self._done and self._cycle.response_started:
            self._done = True   # (a `100 Continue` comes before the response starts)
            self._head = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        if self._cycle.response_complete:   # the last answer, whole (`connection: close`)
            self._close_after_answer()
        else:
            self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
