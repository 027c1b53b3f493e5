"""The gateway's HTTP edge under clients that misbehave: slow-loris, huge headers and bodies,
pipelining, a huge prompt among small requests, and `/livez`. Raw sockets on loopback against a
real gateway, with simulated workers where a worker matters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httptools
import httpx
import pytest

from bench.simfleet import sim_tokenizer_files
from radixpool.gateway.config import GatewayConfig
from radixpool.gateway.server import GatewayServer
from radixpool.tokenization import PromptTokenizer
from tests.gateway.conftest import latencies_during, words


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket, seconds: float = 10.0) -> bytes:
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


class Responses:
    """Parses a byte stream of HTTP/1.1 responses (1xx included) into (status, body) pairs."""

    def __init__(self, data: bytes) -> None:
        self.messages: list[tuple[int, bytes]] = []
        self._body: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self._body = []

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.messages.append((self.parser.get_status_code(), b"".join(self._body)))


def completion(stream: bool = False, extra: bytes = b"") -> bytes:
    body = json.dumps({"prompt": words(0, 8), "max_tokens": 3, "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"%scontent-length: %d\r\n\r\n%s" % (extra, len(body), body))


def test_slow_loris_connections_are_closed_after_the_header_timeout(make_stack):
    stack = make_stack(1, header_read_timeout=1.0)
    conns = [connect(stack.url) for _ in range(30)]
    for c in conns:
        c.sendall(b"POST /v1/completions HT")   # half a request line, then nothing
    assert stack.client.get("/livez").status_code == 200  # others are still served
    started = time.monotonic()
    # each is answered 408 and closed (read_until_closed returns once the gateway closes it)
    closed = [read_until_closed(c, 10.0).startswith(b"HTTP/1.1 408 ") for c in conns]
    assert all(closed) and time.monotonic() - started < 8.0
    for c in conns:
        c.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(make_stack):
    stack = make_stack(1, keep_alive_timeout=1.0)
    with connect(stack.url) as c:
        c.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        started = time.monotonic()
        got = read_until_closed(c, 10.0)
    assert got.startswith(b"HTTP/1.1 200") and time.monotonic() - started < 8.0


def test_a_keep_alive_connection_idle_past_the_header_timeout_still_serves(make_stack):
    # An idle keep-alive connection closed after --header-read-timeout (10 s), while proxies in
    # front keep theirs to the gateway idle longer (AWS ALB and ingress-nginx 60 s): a request
    # such a proxy sent on one the gateway was closing failed, a 502 for its client (a POST is
    # not retried). The head's deadline is the header timeout; the wait for it is not.
    stack = make_stack(1, header_read_timeout=0.5)
    with connect(stack.url) as c:
        c.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        got = b""
        while not got.endswith(b'{"status":"ok"}'):
            got += c.recv(4096)
        time.sleep(2.0)   # 4 header timeouts
        c.sendall(b"GET /livez HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert Responses(read_until_closed(c)).messages == [(200, b'{"status":"ok"}')]


def test_a_1_mib_header_gets_431_and_never_reaches_a_worker(make_stack):
    stack = make_stack(1)
    with connect(stack.url) as c:
        head = completion().replace(b"host: x\r\n", b"host: x\r\nx-big: " + b"a" * (1 << 20)
                                    + b"\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            c.sendall(head)   # closed on us before we finished: also a refusal
        got = read_until_closed(c)
    assert got == b"" or got.startswith(b"HTTP/1.1 431")
    assert stack.fleet.workers[0].requests == 0


def test_the_header_limit_is_exact(make_stack):
    # a limit kept loosely (as hyper's read buffer of the same size did) lets heads up to ~1.75
    # times the limit through
    stack = make_stack(1, max_header_bytes=65536)
    for size, status in ((60_000, 200), (78_643, 431), (98_304, 431), (111_411, 431)):
        r = stack.client.post("/v1/completions", headers={"x-pad": "a" * size},
                              json={"prompt": words(0, 4), "max_tokens": 1})
        assert r.status_code == status, size
    assert stack.fleet.workers[0].requests == 1


def test_bodies_that_break_the_parser_are_400s_not_500s(make_stack):
    # Deep nesting raised RecursionError (on the loop, and off it for a large body),
    # a non-text part's "text" a TypeError, and a UTF-16 body passed unstreamed but had the
    # stream_options splice written into it in UTF-8 when streamed.
    stack = make_stack(1)
    nested = b"[" * 100_000
    cases = [
        ("/v1/completions", nested, "invalid_json"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 20_000, "invalid_json"),
        ("/v1/chat/completions", b'{"messages": ' + b'{"a":' * 50_000, "invalid_json"),
        ("/v1/completions", json.dumps({"prompt": "w1 w2", "stream": True}).encode("utf-16"),
         "invalid_json"),
        ("/v1/completions", json.dumps({"prompt": "w1 w2"}).encode("utf-16"), "invalid_json"),
    ]
    for path, body, code in cases:
        r = stack.client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text[:200])
        assert r.json()["error"]["code"] == code
    # a content part whose text is not a string: routed on the rest; the worker refuses it
    r = stack.client.post("/v1/chat/completions", json={
        "model": "sim-model", "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert r.status_code != 500
    assert stack.fleet.workers[0].requests <= 1
    assert stack.client.post("/workers", content=nested).status_code in (400, 401, 403)
    assert stack.client.get("/health").status_code == 200


def test_read_only_endpoints_refuse_other_methods(make_stack):
    stack = make_stack(1)
    for path in ("/health", "/livez", "/metrics", "/v1/models"):
        for method in ("POST", "DELETE", "PUT"):
            r = stack.client.request(method, path)
            assert r.status_code == 405, (method, path)
            assert "accepts GET" in r.json()["error"]["message"]
    assert stack.fleet.workers[0].requests == 0


def test_workers_answers_head_and_names_its_methods_in_a_405(make_stack):
    # /workers refused HEAD, which whatever takes GET takes (RFC 9110 9.3.2), and answered
    # every other method it does not take with a 405 without `Allow` or a code, unlike the rest
    stack = make_stack(1, admin_api_key="admin-key")
    head = stack.client.head("/workers")
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) > 0   # the length a GET's answer has
    r = stack.client.request("PUT", "/workers", headers={"authorization": "Bearer admin-key"})
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, POST, DELETE"
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_a_pipelined_expect_100_continue_stays_out_of_the_previous_stream(make_stack):
    stack = make_stack(1)
    with connect(stack.url) as c:
        c.sendall(completion(stream=True)
                  + completion(extra=b"expect: 100-continue\r\nconnection: close\r\n"))
        messages = Responses(read_until_closed(c)).messages
    statuses = [status for status, _ in messages]
    assert statuses in ([200, 100, 200], [200, 200])
    stream = messages[0][1]
    assert stream.endswith(b"data: [DONE]\n\n") and b"HTTP/1.1" not in stream
    assert json.loads(messages[-1][1])["choices"][0]["text"]


def test_a_pipelined_malformed_request_leaves_the_previous_answer_intact(make_stack):
    stack = make_stack(1)
    with connect(stack.url) as c:
        c.sendall(completion() + b"GARBAGE \x00\x01 NOT HTTP\r\n\r\n")
        messages = Responses(read_until_closed(c)).messages
    assert messages[0][0] == 200
    assert json.loads(messages[0][1])["usage"]["prompt_tokens"] == 8
    assert [status for status, _ in messages[1:]] in ([], [400])


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_many_pipelined_large_bodies_keep_memory_bounded(make_stack):
    stack = make_stack(1)
    body = json.dumps({"prompt": words(0, 8), "max_tokens": 1, "user": "u" * (1 << 20)}).encode()
    one = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
           % (len(body), body))
    count = 120
    baseline, peak = rss_bytes(), [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with connect(stack.url) as c:
        def send_all() -> None:
            for _ in range(count):
                c.sendall(one)

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        got, answered = b"", 0
        c.settimeout(60)
        while answered < count:
            chunk = c.recv(1 << 20)
            assert chunk, f"the gateway closed the connection after {answered}: {got[-300:]!r}"
            got += chunk
            answered = got.count(b"HTTP/1.1 200")
        sender.join(60)
    done.set()
    sampler.join()
    # 120 MiB went through; the old server buffered every pipelined request (+200 MiB for 200)
    assert peak[0] - baseline < 60 << 20


def test_a_huge_prompt_does_not_hold_up_small_requests(loop_thread):
    # the whole prompt is routed on (no cut), so its tokenization takes the gateway about a
    # second: long enough that small requests stuck behind it could not pass the bound below
    server = GatewayServer(GatewayConfig(host="127.0.0.1", port=0, max_route_prompt_chars=8 << 20),
                           PromptTokenizer(sim_tokenizer_files()))
    loop_thread.run(server.start())
    url = f"http://127.0.0.1:{server.port}"
    try:
        prompt = " ".join(f"w{i % 4096}" for i in range(700_000))   # ~4 MB, 700k tokens
        body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
        with httpx.Client(timeout=120) as c:
            latencies, big_latency, _ = latencies_during(
                url, lambda: c.post(url + "/v1/completions", content=body))
        # small requests kept flowing while the huge prompt was in the gateway; before, its
        # tokenization held the event loop, so a small request waited about as long as the big
        # one took (2-11 s here, with the load). A loose bound, relative to the big request:
        # the test process shares its GIL with the gateway.
        assert len(latencies) >= 5
        assert max(latencies) < 0.5 * big_latency, (max(latencies), big_latency)
    finally:
        loop_thread.run(server.stop())


def test_livez_is_200_without_workers_while_health_is_503(make_stack):
    stack = make_stack(0, api_key="secret")
    assert stack.client.get("/livez").status_code == 200   # no key needed: it is a probe
    assert stack.client.get("/health").status_code == 503


def test_an_oversized_chunked_body_gets_an_openai_style_413(make_stack):
    stack = make_stack(1, max_body_bytes=10_000)

    def chunks():
        for _ in range(10):
            yield b"x" * 4096

    r = stack.client.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert stack.fleet.workers[0].requests == 0


def test_edge_limits_are_validated_naming_the_field():
    for field, value in (("max_header_bytes", 100), ("header_read_timeout", 0),
                         ("upstream_timeout", -1), ("max_route_prompt_chars", 0)):
        with pytest.raises(ValueError, match=field):
            GatewayConfig(**{field: value})


@pytest.mark.parametrize("leave_after", [0.1, 0.8])
def test_a_client_that_leaves_before_or_after_the_watch_starts_cancels_its_handler(
        loop_thread, leave_after):
    # the edge watches a client only once its handler has run `disconnect_watch_after` (0.4 s
    # here): one that left before is seen as soon as the watch starts, one that leaves later at
    # once; either way the handler (and with it the worker's request) is cancelled

    from radixpool.gateway.http_edge import EdgeLimits, EdgeServer

    ended: list[tuple[str, float]] = []

    async def slow_app(request, respond) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            ended.append(("cancelled", time.monotonic()))
            raise
        await respond.send(200, [], b"late")

    server = EdgeServer(slow_app, "127.0.0.1", 0, EdgeLimits(disconnect_watch_after=0.4))
    loop_thread.run(server.start())
    try:
        sock = connect(f"http://127.0.0.1:{server.port}")
        sock.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(leave_after)
        sock.close()
        left = time.monotonic()
        deadline = left + 5
        while not ended and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ended and ended[0][0] == "cancelled"
        assert ended[0][1] - left < 1.0
    finally:
        loop_thread.run(server.stop())


def test_a_body_that_stops_arriving_gets_408_after_the_body_read_timeout(make_stack):
    stack = make_stack(1, body_read_timeout=0.5)
    sock = connect(stack.url)
    started = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 100\r\n\r\n{\"prompt\": ")
    sock.settimeout(10)
    got = sock.recv(65536)
    elapsed = time.monotonic() - started
    sock.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b"the request body did not arrive within 0.5 s" in got and b"request_timeout" in got
    assert 0.4 < elapsed < 5
    assert stack.fleet.workers[0].requests == 0
    assert stack.client.get("/livez").status_code == 200   # and the gateway serves on


def test_a_client_that_stops_reading_a_stream_holds_back_its_writer_and_loses_nothing(
        loop_thread):
    # 24 MiB streamed to a client that reads nothing for a second: the handler's writes wait
    # for it (a gateway would otherwise buffer the whole answer), and once it reads, every byte
    # arrives in order

    from radixpool.gateway.http_edge import EdgeLimits, EdgeServer

    chunk, chunks = bytes(range(256)) * 256, 384   # 64 KiB x 384: 24 MiB
    written = []

    async def big_stream(request, respond) -> None:
        await respond.start(200, [(b"content-type", b"application/octet-stream")])
        for _ in range(chunks):
            await respond.write(chunk)
            written.append(len(chunk))

    async def hello(request, respond) -> None:
        await respond.send(200, [], b"hi")

    async def app(request, respond) -> None:
        await (big_stream if request.path == "/big" else hello)(request, respond)

    server = EdgeServer(app, "127.0.0.1", 0, EdgeLimits())
    loop_thread.run(server.start())
    try:
        sock = connect(f"http://127.0.0.1:{server.port}")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(1.0)
        held_back_at = sum(written)
        assert held_back_at < 12 << 20, f"{held_back_at >> 20} MiB written to a client reading none"
        assert httpx.get(f"http://127.0.0.1:{server.port}/", timeout=5).text == "hi"
        parts = []
        sock.settimeout(10)
        while not (parts and parts[-1].endswith(b"\r\n0\r\n\r\n")) \
                and (more := sock.recv(1 << 20)):
            parts.append(more)
        sock.close()
        assert Responses(b"".join(parts)).messages == [(200, chunk * chunks)]
    finally:
        loop_thread.run(server.stop())


def reading_nothing(port: int, request: bytes) -> socket.socket:
    """A client with a 4 KiB receive buffer that sends `request` and reads none of the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def test_the_last_bytes_of_an_answer_its_client_never_reads_do_not_hold_it_forever(loop_thread):
    # An answer whose last bytes (under asyncio's 64 KiB high-water mark) wait on a client that
    # reads nothing never paused writing, so the write stall clock never ran: the connection,
    # closed after that answer, held its descriptor (and counted under the connection limit)
    # for as long as the client kept its socket
    from radixpool.gateway.http_edge import EdgeLimits, EdgeServer

    sndbuf_set = asyncio.Event()

    async def app(request, respond) -> None:
        await sndbuf_set.wait()
        await respond.send(200, [], b"x" * (48 << 10))   # over both kernel buffers, < 64 KiB

    server = EdgeServer(app, "127.0.0.1", 0, EdgeLimits(write_stall_timeout=0.5))
    loop_thread.run(server.start())
    state = server._state
    try:
        sock = reading_nothing(server.port,
                               b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        deadline = time.monotonic() + 5
        while not state.tasks and time.monotonic() < deadline:
            time.sleep(0.01)

        def small_send_buffer() -> None:
            connection, = state.connections
            connection.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sndbuf_set.set()

        loop_thread.call(small_send_buffer)
        deadline = time.monotonic() + 10   # 20 write stall timeouts
        while state.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not state.connections, "held by a client that reads nothing"
        sock.close()
    finally:
        loop_thread.run(server.stop())


def test_a_client_that_reads_nothing_for_the_write_stall_timeout_is_dropped(loop_thread):
    # flow control holds a stream's writer back for a client that does not read; one that reads
    # nothing at all for `write_stall_timeout` is dropped, which cancels its handler (the proxy
    # then closes its worker connection, aborting the request there), and others are served on
    from radixpool.gateway.http_edge import EdgeLimits, EdgeServer

    ended: list[str] = []

    async def endless(request, respond) -> None:
        if request.path != "/endless":
            await respond.send(200, [], b"hi")
            return
        await respond.start(200, [(b"content-type", b"text/event-stream")])
        try:
            while True:
                await respond.write(b"data: " + b"x" * 4096 + b"\n\n")
                await asyncio.sleep(0)
        except (asyncio.CancelledError, OSError):
            ended.append("stopped")
            raise

    server = EdgeServer(endless, "127.0.0.1", 0, EdgeLimits(write_stall_timeout=0.5))
    loop_thread.run(server.start())
    try:
        sock = reading_nothing(server.port, b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n")
        deadline = time.monotonic() + 20
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended == ["stopped"], "the handler kept writing to a client reading nothing"
        sock.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(1 << 20):
                pass   # what was sent, then the connection's end
        sock.close()
        assert httpx.get(f"http://127.0.0.1:{server.port}/", timeout=5).text == "hi"
    finally:
        loop_thread.run(server.stop())


LARGE_ANSWER = bytes(range(256)) * (64 << 10)   # 16 MiB


@contextlib.contextmanager
def large_answer_server(loop_thread):
    """An edge answering every request with LARGE_ANSWER in one write; write stalls of 1 s."""
    from radixpool.gateway.http_edge import EdgeLimits, EdgeServer

    async def large(request, respond) -> None:
        await respond.send(200, [], LARGE_ANSWER)

    server = EdgeServer(large, "127.0.0.1", 0, EdgeLimits(write_stall_timeout=1.0))
    loop_thread.run(server.start())
    try:
        yield server
    finally:
        loop_thread.run(server.stop())


def ask_for_it(server, receive_buffer: int) -> socket.socket:
    """A connection that has asked `server` for its answer (and closes after it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    sock.settimeout(10)
    return sock


def test_a_client_that_reads_a_large_answer_slowly_but_steadily_is_not_dropped(loop_thread):
    # The stall clock ran from the write that filled the send buffer to the one moment the
    # buffer was empty again: a 16 MiB answer to a client reading all the time, but taking
    # longer than `write_stall_timeout` to drain it, was dropped as if it read nothing
    with large_answer_server(loop_thread) as server:
        got = []
        with ask_for_it(server, 64 << 10) as sock, \
                contextlib.suppress(ConnectionResetError):
            while more := sock.recv(64 << 10):   # at most 64 KiB per 5 ms: 13 MB/s
                got.append(more)
                time.sleep(0.005)
        assert Responses(b"".join(got)).messages == [(200, LARGE_ANSWER)]


def test_a_client_that_takes_its_answer_a_trickle_at_a_time_is_dropped(loop_thread):
    # A client reading a little now and then counted as reading on: it held its answer (and
    # the worker's request, for a stream) in memory for as long as it liked.
    with large_answer_server(loop_thread) as server:
        reading = threading.Event()
        reading.set()

        def trickle() -> None:
            with ask_for_it(server, 4 << 10) as sock, contextlib.suppress(OSError):
                while reading.is_set() and sock.recv(2048):
                    time.sleep(0.25)   # 8 KiB a second: some of it leaves in every second

        client = threading.Thread(target=trickle)
        client.start()
        try:
            connections = server._state.connections
            deadline = time.monotonic() + 2
            while not connections and time.monotonic() < deadline:
                time.sleep(0.01)
            assert connections
            deadline = time.monotonic() + 5   # the trickle goes on past this
            while connections and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not connections, "a client taking 8 KiB a second held its answer"
        finally:
            reading.clear()
            client.join(15)


@pytest.mark.parametrize("broken", [b"zz\r\n", b"5\r\n{}"], ids=["bad-chunk-size", "cut-short"])
def test_a_chunked_body_whose_framing_breaks_after_a_whole_json_chunk_reaches_no_worker(
        make_stack, broken):
    # the first chunk alone is a valid request: taking the body as it stood when the framing
    # broke would send a request the client never finished
    stack = make_stack(1)
    whole = json.dumps({"prompt": words(0, 8), "max_tokens": 3}).encode()
    with connect(stack.url) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n%s" % (len(whole), whole,
                                                                          broken))
        cut_short = broken.startswith(b"5")
        if cut_short:
            c.shutdown(socket.SHUT_WR)   # the client goes before the last chunk
        started = time.monotonic()
        got = read_until_closed(c)
    # a broken chunk is answered at once, not left waiting for a body that cannot end
    assert (cut_short and got == b"") or got.startswith(b"HTTP/1.1 400"), got[:200]
    assert time.monotonic() - started < 5
    time.sleep(0.2)
    assert stack.fleet.workers[0].requests == 0
    assert stack.client.post("/v1/completions", content=whole).status_code == 200


def test_an_answers_head_leaves_with_what_follows_it_in_the_same_step(loop_thread):
    # uvicorn writes an answer's head and body apart (two segments, two wake-ups of the
    # client); the edge joins a head with the write after it in the same step of the event
    # loop, and sends a head with nothing after it alone at the next step

    import radixpool.http_edge as edge
    from radixpool.gateway.http_edge import EdgeLimits, EdgeServer

    writes: list[bytes] = []
    real = edge._HeadJoined

    class Recorded(real):   # records what reaches the connection's transport
        def __init__(self, cycle, transport, loop, close_after_answer) -> None:
            class Recording:
                def __getattr__(self, name):
                    return getattr(transport, name)

                def write(self, data: bytes) -> None:
                    writes.append(data)
                    transport.write(data)

            super().__init__(cycle, Recording(), loop, close_after_answer)

    async def app(request, respond) -> None:
        await asyncio.sleep(0)
        if request.path == "/stream":
            await respond.start(200, [(b"content-type", b"text/event-stream")])
            await respond.write(b"data: 1\n\n")
            await asyncio.sleep(0.05)
            await respond.write(b"data: 2\n\n")
        elif request.path == "/late":
            await respond.start(200, [(b"content-type", b"text/event-stream")])
            await asyncio.sleep(0.05)
            await respond.write(b"data: 1\n\n")
        else:
            await respond.send(200, [(b"content-type", b"text/plain")], b"whole answer")

    edge._HeadJoined = Recorded
    server = EdgeServer(app, "127.0.0.1", 0, EdgeLimits())
    loop_thread.run(server.start())
    try:
        url = f"http://127.0.0.1:{server.port}"
        r = httpx.get(url + "/", timeout=5)
        assert (r.status_code, r.text) == (200, "whole answer")
        assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 ") \
            and writes[0].endswith(b"\r\n\r\nwhole answer")
        writes.clear()
        head = httpx.head(url + "/", timeout=5)   # no body: the head goes out alone
        assert head.status_code == 200 and head.headers["content-length"] == "12"
        assert head.content == b"" and len(writes) == 1 and writes[0].endswith(b"\r\n\r\n")
        writes.clear()
        assert httpx.get(url + "/stream", timeout=5).text == "data: 1\n\ndata: 2\n\n"
        assert writes[0].startswith(b"HTTP/1.1 200 ") and writes[0].endswith(b"data: 1\n\n\r\n")
        writes.clear()
        assert httpx.get(url + "/late", timeout=5).text == "data: 1\n\n"
        assert writes[0].startswith(b"HTTP/1.1 200 ") and writes[0].endswith(b"\r\n\r\n")
    finally:
        edge._HeadJoined = real
        loop_thread.run(server.stop())
