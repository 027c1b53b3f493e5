"""The worker's HTTP edge, attacked over raw sockets: a slow-loris head, oversized heads, a
malformed request pipelined behind a valid one. The `edge` worker reads heads, and bodies, for at
most 0.5 s each; heads are capped at the default 64 KiB."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time

import httpx

HEAD_CAP = 65536


def connect(worker) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", worker.port))
    sock.settimeout(30)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """What the worker sends, to its FIN. A reset fails the test: a worker that closes with a
    client's bytes unread resets the connection, and a client still sending loses its answer."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def split_responses(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each Content-Length response in `raw`, in order."""
    found = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(v) for k, _, v in (line.partition(b": ") for line in lines[1:])
                      if k.lower() == b"content-length")
        found.append((int(lines[0].split()[1]), rest[:length]))
        raw = rest[length:]
    return found


def completion_request(max_tokens: int, split: bool = False) -> bytes | tuple[bytes, bytes]:
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    return (head + body[:10], body[10:]) if split else head + body


def test_half_a_request_line_is_cut_at_the_header_timeout(edge):
    sock = connect(edge)
    sock.sendall(b"GET /health HT")
    start = time.monotonic()
    (status, body), = split_responses(read_until_closed(sock))
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 5


def test_a_head_dripped_byte_by_byte_is_cut_at_the_header_timeout(edge):
    sock = connect(edge)
    start = time.monotonic()
    sent = answer = b""
    for byte in b"GET /health HTTP/1.1\r\nHost: w\r\nX-Slow: " + b"a" * 100:
        sock.sendall(bytes([byte]))   # the worker reads (and drops) what comes after its 408
        sent += bytes([byte])
        if select.select([sock], [], [], 0.1)[0]:
            answer = sock.recv(65536)
            break
    assert time.monotonic() - start < 5, f"still reading the head after {len(sent)} bytes"
    assert b" 408 " in answer


def test_a_connection_that_sends_nothing_is_closed(edge):
    sock = connect(edge)
    start = time.monotonic()
    assert read_until_closed(sock) == b""
    assert time.monotonic() - start < 5


def test_oversized_heads_get_431_and_the_worker_keeps_serving(edge):
    one_header = b"X-Big: " + b"a" * (1 << 20) + b"\r\n"
    many_headers = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range((8 << 20) // 110))
    for extra in (one_header, many_headers):
        sock = connect(edge)
        # refused mid-send, the rest is read and dropped: the client's send ends well, and
        # it reads the 431 (the worker reset such a client, failing its send)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: w\r\n" + extra + b"\r\n")
        (status, body), = split_responses(read_until_closed(sock))
        assert status == 431
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert httpx.get(f"{edge.url}/health").status_code == 200


def test_a_head_under_the_cap_and_a_body_over_it_are_served(edge):
    padding = "a" * (HEAD_CAP - 1024)
    assert httpx.get(f"{edge.url}/health", headers={"X-Pad": padding}).status_code == 200
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}' + b" " * (4 * HEAD_CAP)
    r = httpx.post(f"{edge.url}/v1/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_many_small_pipelined_requests_are_not_taken_for_one_large_head(edge):
    count = 3000   # 99 kB of heads in a few reads, each head 33 bytes
    sock = connect(edge)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: w\r\n\r\n" * (count - 1)
                 + b"GET /health HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n")
    answers = split_responses(read_until_closed(sock))
    assert [status for status, _ in answers] == [200] * count


def test_a_malformed_request_pipelined_behind_a_valid_one_waits_its_turn(edge):
    sock = connect(edge)
    sock.sendall(completion_request(30) + b"NOT\x01HTTP AT ALL\r\n\r\n")
    (first, body), (second, error) = split_responses(read_until_closed(sock))
    assert first == 200
    choice, = json.loads(body)["choices"]
    assert choice["finish_reason"] == "length"
    assert second == 400 and json.loads(error)["error"]["code"] == "invalid_http_request"


def test_pipelined_requests_are_answered_whole_and_in_order(edge):
    sock = connect(edge)
    sock.sendall(completion_request(20) + completion_request(3)
                 + b"GET /health HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n")
    answers = split_responses(read_until_closed(sock))
    assert [status for status, _ in answers] == [200, 200, 200]
    tokens = [json.loads(body)["usage"]["completion_tokens"] for _, body in answers[:2]]
    assert tokens == [20, 3]
    assert json.loads(answers[2][1]) == {"status": "ok"}


def test_a_body_that_stops_arriving_gets_408_and_the_worker_keeps_serving(edge):
    sock = connect(edge)
    start = time.monotonic()
    sock.sendall(completion_request(5, split=True)[0])
    (status, body), = split_responses(read_until_closed(sock))
    assert status == 408 and "body" in json.loads(body)["error"]["message"]
    assert time.monotonic() - start < 5
    assert httpx.get(f"{edge.url}/health").status_code == 200


def test_a_declared_body_over_the_limit_gets_413_at_once_on_every_route(edge):
    """It waited for the body (a 408 at the body timeout: 30 s by default), and off the
    generation routes the framework's answer was plain text."""
    for path in ("/v1/chat/completions", "/generate", "/prefix_probe", "/flush_cache"):
        sock = connect(edge)
        start = time.monotonic()
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{" % (path.encode(), 100 << 20))
        (status, body), = split_responses(read_until_closed(sock))
        assert status == 413, (path, status, body)
        assert json.loads(body)["error"]["code"] == "request_too_large", path
        assert time.monotonic() - start < 0.4, path   # before the edge's 0.5 s body timeout
    assert httpx.get(f"{edge.url}/health").status_code == 200


def test_a_pipelined_body_that_stops_arriving_is_refused_after_the_answer_ahead(edge):
    start, _ = completion_request(3, split=True)
    sock = connect(edge)
    sock.sendall(completion_request(400) + start)   # the second body never ends
    (first, body), (second, error) = split_responses(read_until_closed(sock))
    assert first == 200 and json.loads(body)["usage"]["completion_tokens"] == 400
    assert second == 408 and json.loads(error)["error"]["code"] == "request_timeout"


def test_pipelined_heads_and_bodies_held_back_by_the_worker_are_not_timed_out(edge):
    """Once a request is being answered, the worker stops reading the connection at the next
    pipelined head until that answer is done (here a 1 s `/kv_events` long poll, longer than
    the 0.5 s read timeouts): that wait is the worker's, not the client's."""
    seq = httpx.get(f"{edge.url}/kv_events/snapshot").json()["seq"]
    long_poll = b"GET /kv_events?since=%d&timeout=1 HTTP/1.1\r\nHost: w\r\n\r\n" % seq
    start, rest = completion_request(3, split=True)
    held_body, held_head = connect(edge), connect(edge)
    for sock in (held_body, held_head):
        sock.sendall(long_poll)
    time.sleep(0.1)   # both are being answered
    held_body.sendall(start)   # a head, and a body that waits behind the answer
    held_head.sendall(completion_request(3) + b"GET /health HTTP/1.1\r\nHo")   # a head waits
    time.sleep(0.2)
    held_body.sendall(rest + b"GET /health HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n")
    held_head.sendall(b"st: w\r\nConnection: close\r\n\r\n")
    for sock in (held_body, held_head):
        answers = split_responses(read_until_closed(sock))
        assert [status for status, _ in answers] == [200, 200, 200]
        assert json.loads(answers[1][1])["usage"]["completion_tokens"] == 3


def test_a_body_whose_framing_breaks_gets_400_at_once_and_the_worker_keeps_serving(edge):
    # the head is whole, so the request has begun and its handler waits for the body; the
    # parser then fails on it: waiting for the body read timeout would hold the connection
    for framing in (b"Transfer-Encoding: gzip\r\n\r\n{}",
                    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n"):
        sock = connect(edge)
        sock.settimeout(0.4)   # under the 0.5 s body read timeout
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\n" + framing)
        (status, body), = split_responses(read_until_closed(sock))
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_http_request"
    assert httpx.get(f"{edge.url}/health").status_code == 200


def test_an_endless_trailer_section_gets_431_not_kept_until_the_body_timeout(edge):
    sock = connect(edge)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"2\r\n{}\r\n0\r\n")
    with contextlib.suppress(OSError):
        sock.sendall((b"X-Trailer: " + b"a" * 1000 + b"\r\n") * 2048)   # 2 MiB of trailers
    (status, body), = split_responses(read_until_closed(sock))
    assert status == 431 and "trailer" in json.loads(body)["error"]["message"]
    assert httpx.get(f"{edge.url}/health").status_code == 200


def test_an_http_1_0_stream_is_sent_unframed_and_ended_by_the_close(edge):
    # HTTP/1.0 has no chunked encoding: the chunk sizes were read as part of the event stream
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 4,
                       "ignore_eos": True, "stream": True}).encode()
    with connect(edge) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        head, _, stream = read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    events = [e for e in stream.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events), events[:2]
    choices = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    assert choices[-1]["finish_reason"] == "length"   # all 4 tokens came through


def test_a_client_that_reads_nothing_of_its_stream_is_dropped_and_its_request_aborted(edge):
    # A stream whose client stops reading used to run to its last token, holding its KV while
    # its output piled up in the worker (flow control only held back the writes). The `edge`
    # worker drops such a connection after 1 s of a full send buffer.
    def aborted() -> float:
        text = httpx.get(f"{edge.url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("radixpool_requests_total{") and 'finish_reason="abort"'
                   in line)

    before = aborted()
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 1500,
                       "ignore_eos": True, "stream": True, "n": 8, "logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connecting: no autotune
    sock.connect(("127.0.0.1", edge.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while aborted() < before + 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert aborted() == before + 8, "the worker kept generating for a client reading nothing"
        sock.settimeout(30)
        read_until_closed(sock)   # what was sent, then the close
    finally:
        sock.close()
    metrics = httpx.get(f"{edge.url}/metrics").text
    running = [line for line in metrics.splitlines()
               if line.startswith("radixpool_num_requests_running")]
    assert running and float(running[0].rsplit(" ", 1)[1]) == 0, running
    assert httpx.get(f"{edge.url}/health").status_code == 200
