"""The pipe between the engine front end and its core process: pickled messages, length-prefixed,
over one Unix stream socket pair.

A socket pair costs one system call per message on each side and wakes the reader directly. A
message queue library puts an I/O thread on each side of every hop; on a small CPU machine those
extra wake-ups were about a tenth of a millisecond per request, a large share of what the server
adds to a request. Both ends read without blocking (whatever whole frames have arrived) and write
through an `Outbox`: what the socket does not take now waits there, in order, until the socket is
writable. So the core never blocks on a slow front end, the front end's event loop never waits
for the core to finish a step and read (a long prompt is larger than the socket's buffer), and
the two can never wait on each other.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
from typing import Any

HEADER = struct.Struct("!I")
READ_CHUNK = 1 << 18   # read into one reused buffer: `recv(n)` allocates n bytes every call
SOCKET_BUFFER_BYTES = 4 << 20


def socket_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sock in (a, b):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    return a, b


def frame(msg: Any) -> bytes:
    payload = pickle.dumps(msg, protocol=5)
    return HEADER.pack(len(payload)) + payload


class PeerClosed(Exception):
    """The other end closed the pipe (its process exited)."""


class Inbox:
    """Whole messages out of a byte stream, read without blocking."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._ended = False
        self._chunk = bytearray(READ_CHUNK)
        self._view = memoryview(self._chunk)
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def wait(self, timeout_s: float) -> bool:
        """Block until there is something to read (or the peer closed), up to `timeout_s`."""
        return bool(self._poller.poll(timeout_s * 1000))

    def read(self) -> list[Any]:
        """Every whole message that has arrived; PeerClosed once the stream has ended and
        every message sent before the end has been returned."""
        while not self._ended:
            try:
                size = self.sock.recv_into(self._chunk, READ_CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:
                size = 0
            if not size:
                self._ended = True
                break
            self._buf += self._view[:size]
            if size < READ_CHUNK:
                break
        messages = self._messages()
        if self._ended and not messages:
            raise PeerClosed
        return messages

    def _messages(self) -> list[Any]:
        buf, pos, out = self._buf, 0, []
        while len(buf) - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            end = pos + HEADER.size + size
            if end > len(buf):
                break
            out.append(pickle.loads(buf[pos + HEADER.size:end]))
            pos = end
        del buf[:pos]
        return out


class Outbox:
    """Writes that never block: what the socket does not take now waits for `flush`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._pending = bytearray()

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def send(self, msg: Any) -> None:
        self.push(frame(msg))

    def push(self, data: bytes) -> None:
        """Queue an already framed message behind what is pending, and write what fits now."""
        self._pending += data
        self.flush()

    def flush(self) -> None:
        """Write as much as the socket takes now; raises PeerClosed if the reader is gone."""
        while self._pending:
            try:
                sent = self.sock.send(self._pending, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except (BrokenPipeError, ConnectionResetError):
                raise PeerClosed from None
            del self._pending[:sent]

    def drain(self, timeout_s: float | None) -> None:
        """Flush everything, waiting up to `timeout_s` (None: as long as it takes) each time for
        the reader to make room; raises PeerClosed if the reader is gone."""
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        wait_ms = None if timeout_s is None else timeout_s * 1000
        while self._pending and poller.poll(wait_ms):
            self.flush()

    def clear(self) -> None:
        self._pending.clear()
